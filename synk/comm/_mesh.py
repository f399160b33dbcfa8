"""The CPU transport: every pair of ranks joined by an AF_UNIX socketpair.

One progress thread per rank does all socket work. It writes queued messages as the peers'
sockets accept them, and it reads everything that arrives, at once, into per-(source, tag)
mailboxes. So two ranks that send to each other at the same moment never deadlock, and
non-blocking sends progress while the caller computes.

A message is a 16-byte header (meta length, data length), the pickled meta
``(tag, dtype, shape)``, and the array's raw bytes. A tag starts with the id of the call it
belongs to; a message of an older call is dropped, so a failed call cannot confuse the next.
An ``ABORT`` message tells the peers that a rank of this call failed: their waits for this
call then raise ``CommAborted`` instead of waiting for a message that will not come.
"""
from __future__ import annotations

import collections
import os
import pickle
import select
import socket
import struct
import threading

import numpy as np

from ..errors import SynkError

_HEADER = struct.Struct("<QQ")
_WAIT_SLICE = 0.05  # waits wake this often, so that an interrupt of the master lands
ABORT = "abort"


class CommError(SynkError):
    """A message could not be exchanged: a peer rank is gone."""


class CommAborted(CommError):
    """Another rank of this call failed, so the message waited for will not come."""


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """The raw bytes of a C-contiguous array, as a flat uint8 view (any dtype, any ndim)."""
    return array.reshape(-1).view(np.uint8)


class _Send:
    __slots__ = ("chunks", "done", "error")

    def __init__(self, chunks: list) -> None:
        self.chunks = collections.deque(memoryview(c).cast("B") for c in chunks if len(c))
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Reader:
    """Reassembles one peer's byte stream into (tag, array) messages."""

    def __init__(self) -> None:
        self.stage, self.need, self.buf, self.meta = "header", _HEADER.size, bytearray(), None
        self.data_len = 0

    def feed(self, sock: socket.socket, deliver) -> bool:
        """Read what is available; False when the peer closed the connection."""
        while True:
            if self.stage == "data":
                view = memoryview(_bytes_of(self.array))[self.got:]
                try:
                    n = sock.recv_into(view) if len(view) else 0
                except BlockingIOError:
                    return True
                if len(view) and n == 0:
                    return False
                self.got += n
                if self.got == self.data_len:
                    deliver(self.meta[0], self.array)
                    self.stage, self.need, self.buf = "header", _HEADER.size, bytearray()
                continue
            try:
                chunk = sock.recv(self.need - len(self.buf))
            except BlockingIOError:
                return True
            if not chunk:
                return False
            self.buf += chunk
            if len(self.buf) < self.need:
                continue
            if self.stage == "header":
                meta_len, self.data_len = _HEADER.unpack(self.buf)
                self.stage, self.need, self.buf = "meta", meta_len, bytearray()
            else:
                self.meta = pickle.loads(bytes(self.buf))
                tag, dtype, shape = self.meta
                self.array = np.empty(shape, dtype)
                self.got = 0
                self.stage = "data"


class Mesh:
    """This rank's ends of the socketpairs to every other rank, and its progress thread."""

    def __init__(self, rank: int, size: int, socks: dict) -> None:
        self.rank, self.size = rank, size
        self._socks = socks  # peer rank -> socket
        self._peer_of = {s.fileno(): p for p, s in socks.items()}
        for s in socks.values():
            s.setblocking(False)
        self._cond = threading.Condition()
        self._mail: dict = collections.defaultdict(collections.deque)  # (src, tag) -> arrays
        self._aborted: dict = {}  # call id -> why
        self._gone: dict = {}  # peer -> why
        self._out = {p: collections.deque() for p in socks}
        self._readers = {p: _Reader() for p in socks}
        self.call_id = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="synk-comm", daemon=True)
        self._thread.start()

    # -- the caller's side ----------------------------------------------------------------
    def begin(self, call_id: int) -> None:
        """Start call ``call_id``: drop what is left of earlier calls."""
        with self._cond:
            self.call_id = call_id
            for key in [k for k in self._mail if k[1][0] < call_id]:
                del self._mail[key]
            for old in [c for c in self._aborted if c < call_id]:
                del self._aborted[old]

    def post(self, dest: int, tag: tuple, array: np.ndarray) -> _Send:
        """Queue ``array`` for ``dest``; the returned send's ``done`` is set once it is out."""
        if dest not in self._socks:
            raise ValueError(f"no rank {dest} to send to: ranks are 0..{self.size - 1}, "
                             f"and this is rank {self.rank}")
        array = np.ascontiguousarray(array)
        if array.dtype.hasobject:
            raise TypeError("synk.comm sends numeric arrays; this one has dtype object")
        meta = pickle.dumps((tag, array.dtype.str, array.shape), pickle.HIGHEST_PROTOCOL)
        send = _Send([_HEADER.pack(len(meta), array.nbytes), meta, _bytes_of(array)])
        with self._cond:
            if dest in self._gone:
                raise CommError(f"rank {dest} is gone ({self._gone[dest]})")
            self._out[dest].append(send)
        self._wake()
        return send

    def wait_sent(self, send: _Send) -> None:
        while not send.done.wait(_WAIT_SLICE):
            pass
        if send.error is not None:
            raise send.error

    def take(self, source: int, tag: tuple) -> np.ndarray:
        """The next message from ``source`` with ``tag``, waiting for it."""
        if source not in self._socks:
            raise ValueError(f"no rank {source} to receive from: ranks are 0..{self.size - 1}, "
                             f"and this is rank {self.rank}")
        key = (source, tag)
        with self._cond:
            while not self._mail[key]:
                why = self._aborted.get(tag[0])
                if why is not None:
                    raise CommAborted(f"rank {self.rank} stopped waiting for rank {source}: {why}")
                if source in self._gone:
                    raise CommError(f"rank {source} is gone ({self._gone[source]}); "
                                    f"rank {self.rank} was waiting for its message")
                self._cond.wait(_WAIT_SLICE)
            box = self._mail[key]
            array = box.popleft()
            if not box:
                del self._mail[key]
            return array

    def abort(self, call_id: int, why: str) -> None:
        """Tell every peer that this rank failed in call ``call_id``."""
        note = np.frombuffer(why.encode()[:2000], np.uint8)
        for peer in self._socks:
            try:
                self.post(peer, (call_id, ABORT), note)
            except CommError:
                pass

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wake()
        self._thread.join(timeout=5)
        self._thread = None
        for s in self._socks.values():
            s.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the progress thread --------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass

    def _deliver(self, source: int, tag: tuple, array: np.ndarray) -> None:
        with self._cond:
            if tag[0] < self.call_id:
                return  # from a call that is over
            if len(tag) == 2 and tag[1] == ABORT:
                self._aborted[tag[0]] = f"rank {source} failed: {array.tobytes().decode()}"
            else:
                self._mail[(source, tag)].append(array)
            self._cond.notify_all()

    def _lose(self, peer: int, why: str) -> None:
        with self._cond:
            self._gone.setdefault(peer, why)
            for send in self._out[peer]:
                send.error = CommError(f"rank {peer} is gone ({why})")
                send.done.set()
            self._out[peer].clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while not self._stopping:
            poller = select.poll()
            for peer, sock in self._socks.items():
                if peer in self._gone:
                    continue
                mask = select.POLLIN | (select.POLLOUT if self._out[peer] else 0)
                poller.register(sock.fileno(), mask)
            poller.register(self._wake_r, select.POLLIN)
            for fd, events in poller.poll():
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                peer = self._peer_of[fd]
                sock = self._socks[peer]
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    try:
                        alive = self._readers[peer].feed(
                            sock, lambda tag, arr, p=peer: self._deliver(p, tag, arr))
                    except OSError as err:
                        alive = False
                        self._lose(peer, f"connection error: {err}")
                    if not alive:
                        self._lose(peer, "it closed its connection")
                        continue
                if events & select.POLLOUT:
                    self._write(peer, sock)

    def _write(self, peer: int, sock: socket.socket) -> None:
        queue = self._out[peer]
        while queue:
            send = queue[0]
            while send.chunks:
                chunk = send.chunks[0]
                try:
                    n = sock.send(chunk)
                except BlockingIOError:
                    return
                except OSError as err:
                    self._lose(peer, f"connection error: {err}")
                    return
                if n < len(chunk):
                    send.chunks[0] = chunk[n:]
                    return
                send.chunks.popleft()
            with self._cond:
                queue.popleft()
            send.done.set()
