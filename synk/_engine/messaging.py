"""The master's side of the control channels: requests out to the workers, their replies
back, every wait bounded by the running call's deadline and cut short by a worker's death."""
from __future__ import annotations

import collections
import select
import time

from .._wire import protocol as P, ring as _ring
from .._wire.waiting import Idle, Waiter
from ..errors import GroupBrokenError, RemoteError
from .channel import frame
from .clock import CallClock
from .health import Health
from .workers import Workers


class Messaging:
    """Sending requests to the workers and reading their replies, within the ``CallClock``'s
    deadlines; a death, a timeout or ranks out of step break the group through ``Health``."""

    def __init__(self, size: int, workers: Workers, clock: CallClock, health: Health,
                 waiter: Waiter) -> None:
        self.workers = range(1, size)
        self.channels, self.death_fds = workers.channels, workers.death_fds
        self.clock, self.health, self.waiter = clock, health, waiter
        self._replies: tuple | None = None  # (poller, socket fds, death fds), once made
        # rank -> its replies read ahead of their request: a submitted call's, read as the
        # worker's socket woke ``recv`` while it waited for other ranks' replies to an
        # earlier one: what its channel would hold still. ``_receive`` hands them out first,
        # in the order they came.
        self._ahead: dict[int, collections.deque] = {}
        self.idle: Idle | None = None  # under MPI: MPI's progress, poked while asleep

    def send(self, ranks, payload: bytes, during: str, rid: int | None = None,
             deadline: float | None = None) -> None:
        """Send ``payload`` (a pickled request) to each of ``ranks`` as request ``rid``
        (default: the current round), by ``deadline`` (default: the call's)."""
        parts = (P.RID.pack(self.clock.round if rid is None else rid), payload)
        deadline = self.clock.deadline if deadline is None else deadline
        left = {}
        for rank in ranks:
            rest = self._send_now(rank, parts, during, deadline)
            if rest:
                left[rank] = rest
        if left:
            self._flush(left, deadline, during)

    def _send_now(self, rank: int, parts, during: str, deadline: float | None) -> list:
        """Send a message through the rank's ring or socket; what is left to write on the
        socket. A full ring (a worker not reading) is waited on until ``deadline``."""
        channel = self.channels[rank]
        while True:
            try:
                rest = channel.send(parts)
            except OSError:  # it exited (BrokenPipeError, ConnectionResetError), or was closed
                self.health.died(rank, during)
            if rest is not None:
                return rest
            poller, _, deaths = self._poller([rank], 0)
            if deadline is not None and time.monotonic() >= deadline:
                self._late([rank], during)
            if poller.poll(1):
                self.health.died(rank, during)

    def _write_now(self, rank: int, buffers: list, during: str) -> list:
        try:
            return self.channels[rank].write(buffers)
        except OSError:  # it exited (BrokenPipeError, ConnectionResetError), or was closed
            self.health.died(rank, during)

    def _flush(self, left: dict, deadline: float | None, during: str) -> None:
        """Push the rest of messages to ranks that are not reading (yet), waiting on their
        sockets, their deaths and ``deadline`` together."""
        poller, socks, deaths = self._poller(left, select.POLLOUT)
        while left:
            timeout = None if deadline is None else deadline - time.monotonic()
            events = poller.poll(None if timeout is None else max(0.0, timeout) * 1000)
            if not events:
                self._late(left, during)
            for fd, _ in events:
                if fd in deaths:
                    self.health.died(deaths[fd], during)
                rank = socks[fd]
                left[rank] = self._write_now(rank, left[rank], during)
                if not left[rank]:
                    del left[rank]
                    self._forget(poller, rank)

    def unfinished(self, ranks) -> list:
        """Those of ``ranks`` with no reply (nor EOF) waiting to be read."""
        poller = select.poll()
        fds = {self.channels[r].fileno(): r for r in ranks}
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = set()
        for fd, _ in poller.poll(0):
            channel = self.channels[fds[fd]]
            channel.drain()  # with a ring: wake-ups are not replies
            if channel.ring is None or channel.eof:
                ready.add(fds[fd])
        return [r for r in ranks if r not in ready and not self.channels[r].pending()]

    def _poller(self, ranks, events: int):
        """A poller over the sockets of ``ranks`` (for ``events``) and their deaths."""
        poller, socks, deaths = select.poll(), {}, {}
        for rank in ranks:
            fd = self.channels[rank].fileno()
            socks[fd] = rank
            poller.register(fd, events)  # a death shows as POLLHUP too, unless inherited
            death = self.death_fds.get(rank)
            if death is not None:
                deaths[death] = rank
                poller.register(death, select.POLLIN)
        return poller, socks, deaths

    def _forget(self, poller, rank: int) -> None:
        poller.unregister(self.channels[rank].fileno())
        death = self.death_fds.get(rank)
        if death is not None:
            poller.unregister(death)

    def _late(self, ranks, during: str):
        if self.clock.limit is None:  # only start-up waits without a call's timeout
            self.health.kill()
            raise TimeoutError(f"ranks {sorted(ranks)} did not answer {during}")
        raise self.health.timed_out(ranks, during)

    def _read(self, rank: int, during: str, limit: int | None = None) -> bytes | None:
        try:
            return self.channels[rank].read(limit)
        except (EOFError, OSError):
            self.health.died(rank, during)

    def raw_io(self, rank: int, deadline: float, during: str, limit: int) -> tuple:
        """(send, receive) of raw frames with ``rank`` before it is started (its
        authentication), within ``deadline``; a receive takes at most ``limit`` bytes."""
        def send(data: bytes) -> None:
            rest = self._write_now(rank, frame(data), during)
            if rest:
                self._flush({rank: rest}, deadline, during)

        def receive() -> bytes:
            """The next raw message from ``rank``, waiting until ``deadline``."""
            poller, _, deaths = self._poller([rank], select.POLLIN)
            while True:
                message = self._read(rank, during, limit)
                if message is not None:
                    return message
                events = poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
                if not events:
                    self._late([rank], during)
                if any(fd in deaths for fd, _ in events):
                    message = self._read(rank, during, limit)
                    if message is None:
                        self.health.died(rank, during)
                    return message

        return send, receive

    def _receive(self, rank: int, during: str) -> bytes | None:
        """``rank``'s next message: one read ahead, else one that has arrived, else None."""
        ahead = self._ahead.get(rank)
        if ahead:
            return ahead.popleft()
        return self._from_channel(rank, during)

    def _from_channel(self, rank: int, during: str) -> bytes | None:
        try:
            return self.channels[rank].receive()
        except (EOFError, OSError):
            self.health.died(rank, during)

    def recv(self, ranks, during: str, deadline: float | None = None,
             rid: int | None = None) -> dict:
        """One reply from each of ``ranks`` to request ``rid`` (default: the current round),
        waiting on all of them and on every worker's death until ``deadline`` (default: the
        running call's). Every reply is read before any is unpickled, so one that cannot be
        unpickled leaves none unread."""
        deadline = self.clock.deadline if deadline is None else deadline
        rid = self.clock.round if rid is None else rid
        raw, left = self._arrived(ranks, during)
        if not left:
            return self.read_replies(raw, rid, during)
        channels = self.channels
        if self._replies is None:  # (one poller over every worker's socket and death)
            self._replies = self._poller(self.workers, select.POLLIN)
        poller, socks, deaths = self._replies
        ready, alone, ringless = self._readiness(left, poller)
        start = time.perf_counter()
        while left:
            if self.waiter.poll(ready):
                for rank in alone or [r for r in left if channels[r].pending()]:  # ring replies
                    message = self._receive(rank, during)
                    if message is not None:
                        raw[rank] = message
                        left.discard(rank)
                if not ringless:
                    continue
                events = poller.poll(0)
            else:
                events = self._sleep(left, poller, deadline, during, start)
            for fd, polled in events:
                rank = socks.get(fd)
                if rank is None:  # a worker exited: with its reply sent, or not
                    rank = deaths[fd]
                    message = self._reply_before_exit(rank, left, during)
                else:
                    if polled:  # (0: a message in its ring)
                        channels[rank].drain()
                    message = (self._receive(rank, during) if rank in left
                               else self._from_channel(rank, during))
                    if message is None:
                        continue
                if rank not in left:  # (its reply to a later request: kept for it, where
                    # its request id is checked; a stray one fails that request)
                    self._ahead.setdefault(rank, collections.deque()).append(message)
                    continue
                raw[rank] = message
                left.discard(rank)
        return self.read_replies(raw, rid, during)

    def _arrived(self, ranks, during: str) -> tuple[dict, set]:
        """The replies of ``ranks`` already in (rank -> raw message), and the ranks left."""
        left = set(ranks)
        raw = {}
        for rank in ranks:
            message = self._receive(rank, during)
            if message is not None:
                raw[rank] = message
                left.discard(rank)
        return raw, left

    def _inboxes(self, ranks) -> list:
        """The inboxes of the rings of ``ranks`` that have one."""
        return [ring.inbox for r in ranks if (ring := self.channels[r].ring) is not None]

    def _readiness(self, left: set, poller) -> tuple:
        """How ``recv`` looks for replies from ``left`` without sleeping: (the test, (the one
        rank) where its ring is the one place to look else (), whether a rank has no ring)."""
        channels = self.channels
        lanes = self._inboxes(left)
        ringless = len(lanes) < len(left)  # (a worker's ring comes into use after start-up)
        if len(lanes) == 1 and len(left) == 1 and not ringless:
            # (the usual case on 2 ranks: one look, no loop)
            return lanes[0].pending, tuple(left), ringless

        def ready() -> bool:
            return any(channels[r].pending() for r in left) or (
                ringless and bool(poller.poll(0)))
        return ready, (), ringless

    def _reply_before_exit(self, rank: int, left: set, during: str) -> bytes:
        """The reply ``rank`` sent before its worker exited; raises that it died if none."""
        self.channels[rank].drain()
        message = self._receive(rank, during) if rank in left else None
        if message is None:
            self.health.died(rank, during)
        return message

    def _sleep(self, left: set, poller, deadline: float | None, during: str,
               start: float) -> list:
        """Sleep until a reply, a socket event or a death, telling the ranks' rings that a wake-up
        is needed; the events (the rings' as their sockets'). Raises past ``deadline``."""
        lanes = self._inboxes(left)
        for lane in lanes:
            lane.set_sleeping(True)
        idle = self.idle
        if idle is not None:
            idle.begin()
        try:
            while True:
                ready = [(self.channels[r].fileno(), 0) for r in left
                         if self.channels[r].pending()]
                if ready:
                    return ready
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    self._late(left, during)
                wait = _ring.SLEEP_SLICE if lanes else timeout
                if timeout is not None and wait is not None:
                    wait = min(wait, timeout)
                if idle is not None:
                    wait = idle.bound(wait)
                events = poller.poll(None if wait is None else max(0.0, wait) * 1000)
                if events:
                    self.waiter.slept(time.perf_counter() - start)
                    return events
                if idle is not None:
                    idle.nothing()
        finally:
            if not self.health.closed:  # (a stop on the way unmapped the rings)
                for lane in lanes:
                    lane.set_sleeping(False)

    def may_have_replied(self, ranks) -> bool:
        """Whether each of ``ranks`` may have a message waiting, or may have died: a look
        at the rings and a poll of the sockets and death descriptors, changing nothing
        (safe from a thread that does not hold the group)."""
        for rank in ranks:
            channel = self.channels[rank]
            if self._ahead.get(rank) or channel.pending():
                continue
            fds = [channel.fileno(), self.death_fds.get(rank)]
            poller = select.poll()
            for fd in fds:
                if fd is not None:
                    poller.register(fd, select.POLLIN)
            if not poller.poll(0):
                return False
        return True

    def replied(self, ranks) -> bool:
        """Whether each of ``ranks`` has a whole message waiting, or has ended (what arrived
        on a socket is kept for ``recv``)."""
        for rank in ranks:
            if self._ahead.get(rank):
                continue
            channel = self.channels[rank]
            if channel.ring is None:
                try:
                    message = channel.receive()
                except (EOFError, OSError):
                    continue  # (ended: ``recv`` says so)
                if message is None:
                    return False
                self._ahead.setdefault(rank, collections.deque()).append(message)
                continue
            channel.drain()
            if not (channel.pending() or channel.eof):
                return False
        return True

    def reply_fds(self) -> list:
        """The workers' sockets and death descriptors."""
        fds = [self.channels[r].fileno() for r in self.workers]
        return fds + [fd for r in self.workers if (fd := self.death_fds.get(r)) is not None]

    def take_waiting(self, rank: int, during: str) -> bytes | None:
        """The next raw message from ``rank`` if one has arrived, without waiting."""
        self.channels[rank].drain()
        return self._receive(rank, during)

    def read_replies(self, raw: dict, rid: int, during: str) -> dict:
        """Raw replies (rank -> message: ``recv``'s, or taken with ``take_waiting``) checked
        against request ``rid`` and unpickled."""
        replies, failed, stray = {}, [], {}
        for rank, message in raw.items():
            got = P.rid_of(message)
            if got != rid:
                stray[rank] = got
                continue
            try:
                replies[rank] = P.read(message)
            except Exception as err:
                failed.append((rank, err))
        if stray:
            raise self.health.break_with(GroupBrokenError(
                f"ranks answered the wrong requests {during} ({stray} instead of {rid}); the "
                "ranks were out of step with the master and were stopped. Call synk.fork() "
                "to start a new group."
            ))
        if failed:
            failed.sort()
            listing = "; ".join(f"rank {r}: {err!r}" for r, err in failed)
            raise RemoteError(
                f"the master could not unpickle the reply of rank(s) {[r for r, _ in failed]} "
                f"{during} ({listing}). Every rank's reply was read, so the group is still "
                "usable. Return numpy arrays or plain Python values, or objects whose class "
                "the master can import and rebuild."
            ) from failed[0][1]
        return replies
