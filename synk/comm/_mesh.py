"""The CPU transport: every pair of ranks joined by an AF_UNIX socketpair.

A message goes out from the calling thread when the socket takes it at once (small ones
always do); what does not fit is queued for the rank's progress thread, which writes it as
the peer reads. Arriving messages are read into per-(source, tag) mailboxes, by the thread
that waits for one (busy-polling briefly, as the engine does, since waking a sleeping
thread costs tens of microseconds) or else by the progress thread. So two ranks that send
to each other at the same moment never deadlock, and non-blocking sends progress while
the caller computes.

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
import time

import numpy as np

from ..errors import SynkError

_HEADER = struct.Struct("<QQ")
_WAIT_SLICE = 0.02  # waits wake this often, so that an interrupt of the master lands
ABORT = "abort"


class CommError(SynkError):
    """A message could not be exchanged: a peer rank is gone."""


class CommAborted(CommError):
    """Another rank of this call failed, so the message waited for will not come."""


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """The raw bytes of a C-contiguous array, as a flat uint8 view (any dtype, any ndim)."""
    return array.reshape(-1).view(np.uint8)


_COALESCE = 64 << 10  # a message up to this size goes out as one buffer: one system call


class _Send:
    __slots__ = ("chunks", "done", "error")

    def __init__(self, chunks: list) -> None:
        if sum(len(c) for c in chunks) <= _COALESCE:
            chunks = [b"".join(chunks)]
        self.chunks = collections.deque(memoryview(c).cast("B") for c in chunks if len(c))
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Reader:
    """Reassembles one peer's byte stream into (tag, array) messages. Reads go into a
    buffer, so that many small messages cost one system call; the bulk of a large array is
    received straight into the array."""

    def __init__(self) -> None:
        self.buf = bytearray(256 << 10)
        self.start = self.end = 0  # unparsed bytes: buf[start:end]
        self.array = None  # the array being filled, past the buffer
        self.got = 0
        self.tag = None

    def feed(self, sock: socket.socket, deliver) -> bool:
        """Read what is available; False when the peer closed the connection."""
        while True:
            if self.array is not None:  # the rest of a large array, straight into it
                view = memoryview(_bytes_of(self.array))[self.got:]
                try:
                    n = sock.recv_into(view)
                except BlockingIOError:
                    return True
                if n == 0:
                    return False
                self.got += n
                if self.got == self.array.nbytes:
                    self._done(deliver)
                continue
            if self.start == self.end:
                self.start = self.end = 0
            elif self.end == len(self.buf):  # make room: move the partial message down
                self.buf[:self.end - self.start] = self.buf[self.start:self.end]
                self.end -= self.start
                self.start = 0
            try:
                n = sock.recv_into(memoryview(self.buf)[self.end:])
            except BlockingIOError:
                return True
            if n == 0:
                return False
            self.end += n
            self._parse(deliver)

    def _parse(self, deliver) -> None:
        buf = self.buf
        while self.end - self.start >= _HEADER.size:
            meta_len, data_len = _HEADER.unpack_from(buf, self.start)
            head = _HEADER.size + meta_len
            if self.end - self.start < head:
                return
            tag, dtype, shape = pickle.loads(buf[self.start + _HEADER.size:self.start + head])
            have = min(data_len, self.end - self.start - head)
            array = np.empty(shape, dtype)
            flat = _bytes_of(array)
            flat[:have] = np.frombuffer(buf, np.uint8, have, self.start + head)
            self.start += head + have
            if have == data_len:
                deliver(tag, array)
                continue
            self.array, self.got, self.tag = array, have, tag  # the rest comes by recv_into
            return

    def _done(self, deliver) -> None:
        array, self.array = self.array, None
        deliver(self.tag, array)


class Mesh:
    """This rank's ends of the socketpairs to every other rank, and its progress thread."""

    def __init__(self, rank: int, size: int, socks: dict, spin_s: float = 0.0) -> None:
        self.rank, self.size, self.spin_s = rank, size, spin_s
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
        self._send_locks = {p: threading.RLock() for p in socks}
        self._skipping = False  # the progress thread left a socket to a waiting caller
        self._read_locks = {p: threading.Lock() for p in socks}  # one reader per socket
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
            if not (self._mail or self._aborted):
                return  # the usual case: nothing left over
            for key in [k for k in self._mail if k[1][0] < call_id]:
                del self._mail[key]
            for old in [c for c in self._aborted if c < call_id]:
                del self._aborted[old]

    def post(self, dest: int, tag: tuple, array: np.ndarray) -> _Send:
        """Queue ``array`` for ``dest``; the returned send's ``done`` is set once it is out."""
        if dest not in self._socks:
            raise ValueError(f"no rank {dest} to send to: ranks are 0..{self.size - 1}, "
                             f"and this is rank {self.rank}")
        array = np.asarray(array, order="C")  # (ascontiguousarray would make 0-d 1-d)
        if array.dtype.hasobject:
            raise TypeError("synk.comm sends numeric arrays; this one has dtype object")
        meta = pickle.dumps((tag, array.dtype.str, array.shape), pickle.HIGHEST_PROTOCOL)
        send = _Send([_HEADER.pack(len(meta), array.nbytes), meta, _bytes_of(array)])
        if dest in self._gone:
            raise CommError(f"rank {dest} is gone ({self._gone[dest]})")
        with self._send_locks[dest]:
            queue = self._out[dest]
            if not queue:  # nothing ahead of it: write what the socket takes now
                self._push(dest, send)
            if send.done.is_set():
                return send
            queue.append(send)
        self._wake()  # the progress thread writes the rest
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
        spin_until = time.perf_counter() + self.spin_s
        while True:
            with self._cond:
                box = self._mail.get(key)
                if box:
                    array = box.popleft()
                    if not box:
                        del self._mail[key]
                    return array
                why = self._aborted.get(tag[0])
                if why is not None:
                    raise CommAborted(f"rank {self.rank} stopped waiting for rank {source}: {why}")
                if source in self._gone:
                    raise CommError(f"rank {source} is gone ({self._gone[source]}); "
                                    f"rank {self.rank} was waiting for its message")
            lock = self._read_locks[source]
            if not lock.acquire(blocking=False):  # the progress thread is reading it
                with self._cond:
                    if not self._mail.get(key):
                        self._cond.wait(_WAIT_SLICE)
                continue
            try:
                spin = time.perf_counter() < spin_until
                if select.select([self._socks[source]], [], [], 0 if spin else _WAIT_SLICE)[0]:
                    self._read(source)
            finally:
                lock.release()
                if self._skipping:
                    self._wake()  # the progress thread left this socket to us: take it back

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

    def _read(self, peer: int) -> None:
        """Read what ``peer`` has sent (the caller holds its read lock)."""
        try:
            alive = self._readers[peer].feed(
                self._socks[peer], lambda tag, arr: self._deliver(peer, tag, arr))
        except OSError as err:
            self._lose(peer, f"connection error: {err}")
            return
        if not alive:
            self._lose(peer, "it closed its connection")

    def _push(self, peer: int, send: _Send) -> bool:
        """Write as much of ``send`` as the socket takes (the caller holds the peer's send
        lock); True when all of it is out."""
        sock = self._socks[peer]
        while send.chunks:
            chunk = send.chunks[0]
            try:
                n = sock.send(chunk)
            except BlockingIOError:
                return False
            except OSError as err:
                send.error = CommError(f"rank {peer} is gone (connection error: {err})")
                send.done.set()
                self._lose(peer, f"connection error: {err}")
                return True
            if n < len(chunk):
                send.chunks[0] = chunk[n:]
                return False
            send.chunks.popleft()
        send.done.set()
        return True

    def _lose(self, peer: int, why: str) -> None:
        with self._send_locks[peer], self._cond:
            self._gone.setdefault(peer, why)
            for send in self._out[peer]:
                send.error = CommError(f"rank {peer} is gone ({why})")
                send.done.set()
            self._out[peer].clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while not self._stopping:
            poller = select.poll()
            self._skipping = False
            for peer, sock in self._socks.items():
                if peer in self._gone:
                    continue
                reading = not self._read_locks[peer].locked()  # else a waiting caller reads
                self._skipping = self._skipping or not reading
                mask = (select.POLLIN if reading else 0) | (select.POLLOUT if self._out[peer] else 0)
                if mask:
                    poller.register(sock.fileno(), mask)
            poller.register(self._wake_r, select.POLLIN)
            for fd, events in poller.poll():
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                peer = self._peer_of[fd]
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    lock = self._read_locks[peer]
                    if lock.acquire(blocking=False):
                        try:
                            self._read(peer)
                        finally:
                            lock.release()
                if events & select.POLLOUT and peer not in self._gone:
                    self._write(peer)

    def _write(self, peer: int) -> None:
        with self._send_locks[peer]:
            queue = self._out[peer]
            while queue and self._push(peer, queue[0]):
                queue.popleft()
