"""The master's end of a worker's control socket: ``multiprocessing.connection`` frames (the
worker reads a plain ``Connection``), through the worker's ring where it has one. No send or
receive here blocks, so a frozen worker cannot hold the master past a call's deadline."""
from __future__ import annotations

import collections
import socket
import struct

from .._wire.ring import DATA, SOCKET, Ring

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_COALESCE = 64 << 10  # a message up to this size goes out as one buffer
WAKE = [_SHORT.pack(0)]  # an empty frame: wakes a reader asleep on the socket


def frame(*parts: bytes) -> list:
    """One message made of ``parts``, with its length header, as the buffers to write."""
    n = sum(len(p) for p in parts)
    head = _SHORT.pack(-1) + _LONG.pack(n) if n > 0x7FFFFFFF else _SHORT.pack(n)
    if n <= _COALESCE:
        return [b"".join((head, *parts))]
    return [head, *parts]


class Channel:
    """One worker's control socket, non-blocking, owned by the master. With a shared-memory
    ``Ring`` (a worker on this host) a message that fits goes through the ring; the socket
    carries wake-ups (empty frames, to a reader that said it sleeps) and messages too large for
    the ring, which leave a ``SOCKET`` record there so that the reader keeps their order."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self._fd = sock.fileno()
        self._buf = bytearray()
        self._size: int | None = None  # length of the message being read, once known
        self.closed = False
        self.ring: Ring | None = None  # the worker's ring, once it uses it (see ``use_ring``)
        self._big: collections.deque = collections.deque()  # socket messages read ahead
        self._on_socket = 0  # SOCKET records taken whose message is still to be read
        self.eof = False  # the socket reached its end (the worker closed it, or died)
        self.lost: OSError | None = None  # the error that ended the connection, if one did

    def fileno(self) -> int:
        return self._fd

    def use_ring(self, ring: Ring) -> None:
        """From now on, messages that fit go through ``ring`` (a ``ring.Ring``)."""
        self.ring = ring

    # -- messages, through the ring where there is one ------------------------------------
    def send(self, parts) -> list | None:
        """Send one message made of ``parts``; returns what is left to write on the socket (for
        ``Messaging`` to push as it drains), or None when the ring has no room even for a
        ``SOCKET`` record (the worker is not reading: wait and try again)."""
        ring = self.ring
        if ring is None:
            return self.write(frame(*parts))
        lane = ring.out
        if sum(map(len, parts)) <= lane.max_payload:
            if not lane.put(parts):
                return None
            return self.write(WAKE) if lane.reader_sleeping() else []
        if not lane.put((), SOCKET):
            return None
        return self.write(frame(*parts))

    def pending(self) -> bool:
        """Whether a message may be waiting (a look at the ring; no system call)."""
        ring = self.ring
        return ring is not None and (ring.inbox.pending() or bool(self._big))

    def receive(self, limit: int | None = None) -> bytes | None:
        """The next message if one has arrived (from the ring, or the socket), else None.
        Raises EOFError when the socket ended and no message is left."""
        ring = self.ring
        if ring is None:
            return self.read(limit)
        while True:
            if self._on_socket:
                if not self._big and not self.eof:
                    self.drain(limit)
                if not self._big:
                    if self.eof:
                        raise EOFError
                    return None
                self._on_socket -= 1
                return self._big.popleft()
            record = ring.inbox.get()
            if record is None:
                if self.eof:
                    raise EOFError
                return None
            if record[0] == DATA:
                return record[1]
            self._on_socket += 1

    def drain(self, limit: int | None = None) -> None:
        """Read the next frame the socket has, if any (a wake-up is dropped, a message kept for
        ``receive``); at its end, set ``eof``. One frame, not all: the rest shows at the next poll,
        and reading until empty costs a system call per wake-up. Without a ring, ``receive``
        reads the socket itself."""
        if self.ring is None or self.eof:
            return
        try:
            message = self.read(limit)
        except EOFError:
            self.eof = True
            return
        if message:
            self._big.append(message)

    # -- sending ------------------------------------------------------------------------
    def write(self, buffers: list) -> list:
        """Write as much of ``buffers`` as the socket takes now; returns what is left (an empty list
        when all of it went out). Raises OSError when the peer is gone (kept in ``lost``)."""
        try:
            return self._write(buffers)
        except OSError as err:  # (not BlockingIOError: _write keeps what the socket refused)
            self.lost = err
            raise

    def _write(self, buffers: list) -> list:
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
        Raises EOFError when the peer closed its end or the connection failed (``lost``
        says how), ValueError past ``limit`` bytes."""
        # the usual case: one whole small message arrives at once (not where a header
        # read before awaits its body)
        if not self._buf and self._size is None:
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                return None
            except OSError as err:  # reset, or timed out (TCP_USER_TIMEOUT: a host gone)
                self.lost = err
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
            except OSError as err:  # reset, or timed out (TCP_USER_TIMEOUT: a host gone)
                self.lost = err
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
