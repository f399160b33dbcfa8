"""The master's end of a worker's control socket: messages framed as
``multiprocessing.connection`` frames them (so the worker reads them with a plain
``Connection``), but no send or receive here ever blocks: a frozen worker that stops reading
(or stops half-way through a reply) cannot hold the master past a call's deadline.

A send writes what the socket takes at once and returns the rest for ``Group`` to push as the
socket drains (waiting on it, the worker's death and the deadline in one poll); a receive
reads what has arrived and returns a message once one is complete.
"""
from __future__ import annotations

import socket
import struct

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_COALESCE = 64 << 10  # a message up to this size goes out as one buffer


def frame(*parts: bytes) -> list:
    """One message made of ``parts``, with its length header, as the buffers to write."""
    n = sum(len(p) for p in parts)
    head = _SHORT.pack(-1) + _LONG.pack(n) if n > 0x7FFFFFFF else _SHORT.pack(n)
    if n <= _COALESCE:
        return [b"".join((head, *parts))]
    return [head, *parts]


class Channel:
    """One worker's control socket, non-blocking, owned by the master."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._fd = sock.fileno()
        self._buf = bytearray()
        self._size: int | None = None  # length of the message being read, once known
        self.closed = False

    def fileno(self) -> int:
        return self._fd

    # -- sending ------------------------------------------------------------------------
    def write(self, buffers: list) -> list:
        """Write as much of ``buffers`` as the socket takes now; returns what is left (an
        empty list when all of it went out). Raises OSError when the peer is gone."""
        if len(buffers) == 1:  # the usual case: a small message, out in one go
            try:
                n = self.sock.send(buffers[0])
            except BlockingIOError:
                n = 0
            if n == len(buffers[0]):
                return []
            buffers = [memoryview(buffers[0]).cast("B")[n:]]
        buffers = [memoryview(b).cast("B") for b in buffers if len(b)]
        while buffers:
            try:
                n = self.sock.send(buffers[0])
            except BlockingIOError:
                return buffers
            if n < len(buffers[0]):
                buffers[0] = buffers[0][n:]
            else:
                buffers.pop(0)
        return buffers

    # -- receiving ----------------------------------------------------------------------
    def read(self, limit: int | None = None) -> bytes | None:
        """A complete message if one has arrived (reading what is available), else None.
        Raises EOFError when the peer closed its end, ValueError past ``limit`` bytes."""
        if not self._buf:  # the usual case: one whole small message arrives at once
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                return None
            except ConnectionResetError:
                raise EOFError from None
            if not chunk:
                raise EOFError
            if len(chunk) >= 4:
                (size,) = _SHORT.unpack_from(chunk)
                if size == len(chunk) - 4 and (limit is None or size <= limit):
                    return chunk[4:]
            self._buf += chunk
        while True:
            message = self._complete(limit)
            if message is not None:
                return message
            want = self._wanted()
            try:
                chunk = self.sock.recv(want)
            except BlockingIOError:
                return None
            except ConnectionResetError:
                raise EOFError from None
            if not chunk:
                raise EOFError
            self._buf += chunk

    def _wanted(self) -> int:
        if self._size is None:
            return max(4096, 12 - len(self._buf))
        return max(4096, min(self._size - len(self._buf), 64 << 20))

    def _complete(self, limit: int | None) -> bytes | None:
        buf = self._buf
        if self._size is None:
            if len(buf) < 4:
                return None
            (size,) = _SHORT.unpack_from(buf)
            head = 4
            if size == -1:
                if len(buf) < 12:
                    return None
                (size,) = _LONG.unpack_from(buf, 4)
                head = 12
            if limit is not None and size > limit:
                raise ValueError(f"a message of {size} bytes, more than the {limit} expected")
            del buf[:head]
            self._size = size
        if len(buf) < self._size:
            return None
        message = bytes(buf[:self._size])
        del buf[:self._size]
        self._size = None
        return message

    def close(self) -> None:
        """Close the socket (idempotent: the descriptor is closed once)."""
        if not self.closed:
            self.closed = True
            self.sock.close()
