"""How the one-host mesh (``_mesh``) frames its messages: on a socket, a 24-byte header
(meta length, data length, number), the pickled meta ``(tag, dtype, shape)`` (with a
fourth item, a ``_shm_channel`` reference, when the bytes are in the sender's shared
memory) and the array's raw bytes; in a ring record, the same less the data length, the
bytes 16-aligned (synk's XLA target, csrc/jax_ffi.cc, writes and reads such records too).
A header with meta length 0 is a wake-up.
"""
from __future__ import annotations

import collections
import math
import pickle
import socket
import struct
import threading
from typing import Any

import numpy as np

from .mailbox import bytes_of
from .shm_channel import Parcel

HEADER = struct.Struct("<QQQ")  # meta length (0: a wake-up), data length, number
RECORD = struct.Struct("<QQ")  # a ring record's head: number, meta length

_COALESCE = 64 << 10  # a message up to this size goes out as one buffer: one system call


class Send:
    __slots__ = ("chunks", "done", "error")

    def __init__(self, chunks: list) -> None:
        if sum(len(c) for c in chunks) <= _COALESCE:
            chunks = [b"".join(chunks)]
        self.chunks = collections.deque(memoryview(c).cast("B") for c in chunks if len(c))
        self.done = threading.Event()
        self.error: BaseException | None = None


class Reader:
    """Reassembles one peer's byte stream into (tag, array) messages. Reads go into a
    buffer, so that many small messages cost one system call; the bulk of a large array is
    received straight into the array."""

    def __init__(self) -> None:
        self.buf = bytearray(256 << 10)
        self.start = self.end = 0  # unparsed bytes: buf[start:end]
        self.array: np.ndarray | None = None  # the array being filled, past the buffer
        self.got = 0
        self.tag = self.number = None

    def feed(self, sock: socket.socket, deliver) -> bool:
        """Read what is available; False when the peer closed the connection."""
        while True:
            if self.array is not None:  # the rest of a large array, straight into it
                view = bytes_of(self.array).data[self.got:]  # (a memoryview)
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
        while self.end - self.start >= HEADER.size:
            meta_len, data_len, number = HEADER.unpack_from(buf, self.start)
            if not meta_len:  # a wake-up
                self.start += HEADER.size
                deliver(None, None, None)
                continue
            head = HEADER.size + meta_len
            if self.end - self.start < head:
                return
            meta = pickle.loads(buf[self.start + HEADER.size:self.start + head])
            if len(meta) == 4:  # the bytes are in the sender's shared memory
                self.start += head
                deliver(number, meta[0], Parcel(meta[3], meta[1], meta[2]))
                continue
            tag, dtype, shape = meta
            have = min(data_len, self.end - self.start - head)
            array = np.empty(shape, dtype)
            flat = bytes_of(array)
            flat[:have] = np.frombuffer(buf, np.uint8, have, self.start + head)
            self.start += head + have
            if have == data_len:
                deliver(number, tag, array)
                continue
            # the rest comes by recv_into
            self.array, self.got, self.tag, self.number = array, have, tag, number
            return

    def _done(self, deliver) -> None:
        array, self.array = self.array, None
        deliver(self.number, self.tag, array)


def unpack_record(data: bytes) -> tuple[int, tuple, Any]:
    """(number, tag, item) of a ring record (see ``ring_post``)."""
    number, meta_len = RECORD.unpack_from(data)
    meta = pickle.loads(memoryview(data)[RECORD.size:RECORD.size + meta_len])
    if len(meta) == 4:
        return number, meta[0], Parcel(meta[3], meta[1], meta[2])
    tag, dtype, shape = meta
    start = RECORD.size + meta_len
    start += -start % 16
    count = math.prod(shape)
    if not count:
        return number, tag, np.empty(shape, dtype)
    return number, tag, np.frombuffer(data, dtype, count, start).reshape(shape)


class _Posted:
    """What ``post`` returns for a message already out (copied into the ring)."""

    __slots__ = ()
    error = None

    class done:  # noqa: N801  (an Event that is set)
        @staticmethod
        def wait(timeout=None) -> bool:
            return True

        @staticmethod
        def is_set() -> bool:
            return True


POSTED = _Posted()
Sending = Send | _Posted  # what a mesh's ``post`` returns: a send, or ``POSTED``


def ring_post(ring, number: int, meta: bytes, data) -> bool:
    """Put a message in ``ring``; False when it does not fit now."""
    pad = -(RECORD.size + len(meta)) % 16  # the array's bytes start 16-aligned
    if RECORD.size + len(meta) + pad + len(data) > ring.out.max_payload:
        return False
    head = RECORD.pack(number, len(meta))
    return ring.out.put((head, meta, bytes(pad), data) if len(data) else (head, meta))
