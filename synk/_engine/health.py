"""A group's health: the one way a group breaks or closes."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import NoReturn

from .. import _interrupts
from ..errors import CallTimeoutError, GroupBrokenError
from .clock import CallClock


class Health:
    """A group is usable, broken (``broken`` says why: a death, a timeout, a device failure, the
    ranks out of step, closed during a call), or closed. Everything fails it through here;
    ``kill`` stops the workers and releases everything (``teardown``), once, whichever thread
    gets there first. ``death``: the error for a worker's death; ``unfinished(ranks)``: those
    with no reply waiting; ``clock``: the group's (a timeout's error names its limit)."""

    def __init__(self, teardown: Callable[[], None],
                 death: Callable[[int, str], BaseException],
                 unfinished: Callable[[Iterable[int]], list], clock: CallClock) -> None:
        self._teardown, self._death, self._unfinished = teardown, death, unfinished
        self._clock = clock
        self.explain: Callable[[list], str] | None = None  # where the ranks are, for a
        # timeout's error (``whereabouts``), once the group has started
        self.broken: BaseException | None = None
        self.closed = False
        self.comms_stale = False  # a failed call may have aborted some ranks' communicators
        self._lock = threading.RLock()

    def check_usable(self) -> None:
        if self.broken is not None:
            raise GroupBrokenError(
                f"this group of ranks is broken ({self.broken}); call synk.fork() again"
            ) from self.broken
        if self.closed:
            raise GroupBrokenError("this group of ranks was closed; call synk.fork() again")

    def mark_broken(self, error: BaseException) -> BaseException:
        """Mark the group broken with ``error`` (unless it broke already) without stopping it yet (a
        close from another thread lets the running call end first); the error it broke with."""
        if self.broken is None:
            self.broken = error
        return self.broken

    def break_with(self, error: BaseException) -> BaseException:
        """Break the group with ``error`` (unless it broke already) and stop it; the error
        it broke with."""
        broken = self.mark_broken(error)
        self.kill()
        return broken

    def died(self, rank: int, during: str) -> NoReturn:
        """Rank ``rank`` died: stop the group and raise why it broke."""
        if self.broken is None:  # else stopped already (closed, timed out, another death)
            self.broken = self._death(rank, during)
        self.kill()
        raise self.broken

    def timed_out(self, ranks: Iterable[int], during: str) -> BaseException:
        """Stop the group because ``ranks`` did not finish in time; the error to raise."""
        ranks = sorted(ranks)
        if self.broken is not None:
            return self.broken
        where = ""
        if self.explain is not None:
            try:
                where = self.explain(ranks)
            except Exception as err:  # (the report must not hide the timeout)
                where = f"(where the ranks were is not known: {type(err).__name__}: {err})"
        return self.break_with(CallTimeoutError(
            f"rank(s) {ranks} did not finish {during} within {self._clock.limit:g} s; the "
            "group was stopped. Look for an endless loop or a rank waiting on the others, "
            "give the call a longer timeout, and call synk.fork() to start a new group."
            + (f"\n{where}" if where else ""), tuple(ranks)))

    def unfinished(self, ranks: Iterable[int]) -> list[int]:
        return self._unfinished(ranks)

    def device_failed(self, error: BaseException) -> None:
        """A rank's CUDA context is unusable (a sticky error): so is the group."""
        self.break_with(error)

    def comms_failed(self) -> None:
        """A call failed: some ranks may have aborted their device communicators, which
        are made anew before the next call (``Group.hold``)."""
        self.comms_stale = True

    def kill(self) -> None:
        """Stop every worker now and release everything the group holds (once)."""
        with self._lock, _interrupts.deferred():  # (stopped half way, nothing would release
            if self.closed:  # the rest: a later kill() finds the group closed)
                return
            self.closed = True
            self._teardown()
