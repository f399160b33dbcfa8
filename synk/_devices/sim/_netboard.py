"""The board of a simulated NCCL communicator whose ranks meet over TCP (see ``_net``): the
shared-memory board's words and layout (``_board``), of which each rank keeps its own copy."""
from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading

import numpy as np

from . import _core
from ._board import CONNECTED, DONE, GEN, HEADER, INIT, PAIR, POSTED, SLOT, STATE, Words
from ._net import HEAD, send

WORDS, PART, MESSAGE = 10, 11, 12
_FLAGS = [POSTED, DONE, INIT, CONNECTED, STATE]  # written last: they announce the others
_DATA = [i for i in range(SLOT) if i not in _FLAGS]
_MESSAGE_HEAD = struct.Struct("<qqq")  # number, count, datatype


class NetBoard(Words):
    """This rank's copy of a communicator's board, kept in step over its connections. Each word
    has one writer (``owned``: a rank's slot; of a pair's counts, the sender's and the
    receiver's), which sends its words to every peer after writing them (``publish``). A part
    or a message travels ahead of the words that announce it, on the same connection. A peer
    whose connection ends has died, unless its last words said that it destroyed or aborted the
    communicator. One thread per communicator receives."""

    network = True

    def __init__(self, prefix: str, nranks: int, rank: int, peers: dict) -> None:
        self.prefix, self.nranks, self.rank = prefix, nranks, rank
        self.words = np.zeros(HEADER + SLOT * nranks + PAIR * nranks * nranks, np.int64)
        self._peers = peers
        self._dead: set = set()
        self._parts: dict = {}  # rank -> (generation, bytes) of its collective's part
        self._messages: dict = {}  # (sender, number) -> (count, datatype, bytes)
        self._send_lock = threading.Lock()
        self._pending: np.ndarray | None = None  # my part, sent before my next words
        self._closed = False
        for sock in peers.values():
            sock.settimeout(None)  # read only when the selector says it is readable
        self._selector = selectors.DefaultSelector()
        for peer, sock in peers.items():
            self._selector.register(sock, selectors.EVENT_READ, (peer, bytearray()))
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._receive, daemon=True,
                                        name=f"synk-sim-nccl-net-r{rank}")
        self._thread.start()

    # ------------------------------------------------------------ this rank's side
    def owned(self, rank: int) -> np.ndarray:
        """The words ``rank`` writes: its slot, its messages sent and first send/receive
        reached with each peer, and its messages received from each peer."""
        n = self.nranks
        sent = [self.pair(rank, dst) for dst in range(n)]
        received = [self.pair(src, rank)[1] for src in range(n)]
        return np.concatenate([self.slot(rank), [p[0] for p in sent], [p[2] for p in sent],
                               received]).astype(np.int64)

    def publish(self) -> None:
        """Send this rank's words (after its part, if it posted one) to every peer."""
        with _core.LOCK, self._send_lock:  # (the part is written under _core.LOCK; the
            # sends block: the peer's thread always reads)
            part, self._pending = self._pending, None
            words = self.owned(self.rank).tobytes()
            for peer, sock in self._peers.items():
                if peer in self._dead:
                    continue
                try:
                    if part is not None:
                        send(sock, PART, int(self.slot(self.rank)[GEN]), part)
                    send(sock, WORDS, self.rank, words)
                except OSError:
                    self._dead.add(peer)

    def put_message(self, name: str, peer: int, number: int, datatype: int,
                    data: np.ndarray) -> None:
        """Send message ``number`` to ``peer`` (before the words that count it)."""
        head = _MESSAGE_HEAD.pack(number, data.size, datatype)
        with self._send_lock:
            if peer in self._dead:
                return  # its liveness check reports it
            try:
                send(self._peers[peer], MESSAGE, self.rank,
                     head + data.reshape(-1).view(np.uint8).tobytes())
            except OSError:
                self._dead.add(peer)

    def take_message(self, name: str, peer: int, number: int) -> tuple:
        """(count, datatype, bytes) of message ``number`` from ``peer``; FileNotFoundError
        if it is not here (its sender is gone)."""
        found = self._messages.pop((peer, number), None)
        if found is None:
            raise FileNotFoundError(name)
        return found

    def peer_part(self, rank: int, generation: int, nbytes: int) -> np.ndarray:
        found = self._parts.get(rank)
        if found is None or found[0] != generation or len(found[1]) < nbytes:
            raise FileNotFoundError(f"the part of rank {rank}")
        return np.frombuffer(found[1], np.uint8, nbytes)

    def alive(self, rank: int) -> bool:
        return rank == self.rank or rank not in self._dead

    def check_switch(self) -> None:
        pass

    def sweep_dead(self) -> None:
        pass  # nothing of a peer lives in this host's shared memory

    def unlink(self) -> None:
        pass

    def close(self) -> None:
        """Send this rank's last words, then close every connection."""
        if self._closed:
            return
        self.publish()
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(5)
        with self._send_lock:
            for sock in self._peers.values():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        self._wake_w.close()

    # ------------------------------------------------------------ the receiving thread
    def _receive(self) -> None:
        try:
            while not self._closed:
                for key, _ in self._selector.select():
                    if key.data is None:
                        if self._closed:
                            return
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                        continue
                    self._read(key)
        finally:
            self._selector.close()
            self._wake_r.close()

    def _read(self, key) -> None:
        peer, buffer = key.data
        try:
            chunk = key.fileobj.recv(1 << 20)
        except InterruptedError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._selector.unregister(key.fileobj)
            self._dead.add(peer)
            return
        buffer += chunk
        while len(buffer) >= HEAD.size:
            kind, number, size = HEAD.unpack_from(buffer)
            if len(buffer) < HEAD.size + size:
                break
            payload = bytes(buffer[HEAD.size:HEAD.size + size])
            del buffer[:HEAD.size + size]
            self._take(peer, kind, number, payload)

    def _take(self, peer: int, kind: int, number: int, payload: bytes) -> None:
        if kind == PART:
            self._parts[peer] = (number, payload)
        elif kind == MESSAGE:
            message, count, datatype = _MESSAGE_HEAD.unpack_from(payload)
            self._messages[(peer, message)] = (count, datatype, payload[_MESSAGE_HEAD.size:])
        elif kind == WORDS:
            self._apply(peer, np.frombuffer(payload, np.int64))

    def _apply(self, rank: int, words: np.ndarray) -> None:
        """A peer's words into this copy, the ones that announce the others last."""
        # (never under _core.LOCK: a sender may hold it while it waits for this thread to
        # read, and the readers need no lock, as with the shared board's writers)
        n = self.nranks
        slot = self.slot(rank)
        slot[_DATA] = words[_DATA]
        for src in range(n):
            self.pair(src, rank)[1] = words[SLOT + 2 * n + src]
        for dst in range(n):
            pair = self.pair(rank, dst)
            pair[2] = words[SLOT + n + dst]
            pair[0] = words[SLOT + dst]
        slot[_FLAGS] = words[_FLAGS]


class NetScratch:
    """A rank's part of the collective under way, sent with its next words (``publish``):
    a fresh buffer each time, so a part still being sent is never overwritten."""

    def __init__(self, board: NetBoard) -> None:
        self.board, self.gen = board, 0

    def ensure(self, nbytes: int) -> np.ndarray:
        self.gen += 1
        buffer = np.empty(nbytes, np.uint8)
        self.board._pending = buffer
        return buffer

    def destroy(self) -> None:
        pass
