"""A worker's end of its control channel: messages through its shared-memory ring when it
has one (and they fit), else on its socket (a ``multiprocessing.connection.Connection``)."""
from __future__ import annotations

import collections
import select
import time
from collections.abc import Callable

from .._wire.ring import DATA, SLEEP_SLICE, SOCKET
from .._wire.waiting import Idle, Waiter


class Link:
    """The worker's control channel, by ``channel.Channel``'s rules (``SOCKET`` records,
    wake-ups). Unlike the master, a worker may block on its socket: it has nothing else to do,
    and it exits when the master goes."""

    def __init__(self, conn, ring, spin_s: float,
                 progress: Callable[[], None] | None = None) -> None:
        """``progress``: under MPI, called now and then while this rank sleeps (see
        ``MpiMesh.progress``)."""
        self.conn, self.ring = conn, ring
        self.waiter = Waiter(spin_s)
        self._idle = None if progress is None else Idle(progress)
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)
        self._big: collections.deque = collections.deque()  # socket messages read ahead
        self._on_socket = 0  # SOCKET records taken whose message is still to be read

    def recv(self) -> bytes:
        """The next message, waiting for it. Raises EOFError when the master is gone."""
        ring = self.ring
        if ring is None:
            if not self.waiter.poll(lambda: bool(self._poller.poll(0))):
                self._sleep_on_socket()
            return self.conn.recv_bytes()
        start = 0.0
        while True:
            if self._on_socket:
                self._on_socket -= 1
                return self._socket_message()
            record = ring.inbox.get()
            if record is not None:
                if record[0] == DATA:
                    return record[1]
                self._on_socket += 1
                continue
            start = start or time.perf_counter()
            if not self.waiter.poll(ring.inbox.pending):
                self._sleep(start)

    def _sleep(self, start: float) -> None:
        lane = self.ring.inbox
        lane.set_sleeping(True)
        idle = self._idle
        if idle is not None:
            idle.begin()
        try:
            while not lane.pending():
                wait = SLEEP_SLICE if idle is None else idle.bound(SLEEP_SLICE)
                if self._poller.poll(wait * 1000):
                    self._drain()
                    self.waiter.slept(time.perf_counter() - start)
                    return
                if idle is not None:
                    idle.nothing()
        finally:
            lane.set_sleeping(False)

    def _sleep_on_socket(self) -> None:
        """Without a ring: until the socket has something (``recv_bytes`` then blocks),
        poking ``progress`` meanwhile."""
        idle = self._idle
        if idle is None:
            return
        idle.begin()
        while not self._poller.poll(idle.bound(None) * 1000):
            idle.nothing()

    def _drain(self) -> None:
        """Read the frame the socket has (the poll said so): a wake-up is dropped, a
        message kept. One frame: another shows as readable at the next poll."""
        message = self.conn.recv_bytes()
        if message:
            self._big.append(message)

    def _socket_message(self) -> bytes:
        while not self._big:
            message = self.conn.recv_bytes()
            if message:
                return message
        return self._big.popleft()

    def send(self, data: bytes) -> None:
        """Send one message (blocking while the master does not read)."""
        ring = self.ring
        if ring is None:
            self.conn.send_bytes(data)
            return
        lane = ring.out
        if len(data) <= lane.max_payload:
            while not lane.put((data,)):
                self._wait_room()
        else:
            while not lane.put((), SOCKET):
                self._wait_room()
            self.conn.send_bytes(data)
            return
        if lane.reader_sleeping():
            self.conn.send_bytes(b"")

    def _wait_room(self) -> None:
        """The master has not read its ring yet (it does before its next request)."""
        time.sleep(1e-4)
