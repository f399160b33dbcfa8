"""How a rank waits for a message, adapted by each ``Waiter`` from how long its recent waits
took::

    poll shared memory (the budget) -> yield the core between looks (up to SPIN_S)
      -> sleep on the socket, woken by the writer
"""
from __future__ import annotations

import os
import time

SPIN_S = 200e-6  # polled before yielding (and the least budget)
GAP_S = 50e-6  # a look-to-look gap this long: another process ran on this core meanwhile
YIELD_GAP_S = 10e-6  # a yield this long: another process was ready to run on this core
MISSES = 4  # waits in a row that did not end within the budget, after which polling pauses
CLEAN = 16  # waits in a row that ended while polling, after which back-offs start short again
WEIGHT = 0.25  # of the latest wait in the running averages
LOST = 0.3  # running share of waits that lost the core, above which one more pauses polling
BACKOFF_S = 0.01  # first pause of polling
BACKOFF_MAX_S = 1.0

_clock = time.perf_counter
_yield = os.sched_yield


class Waiter:
    """The adaptive poll-yield-sleep policy of one waiting thread; it holds only numbers.

    Polling sees a message in under a microsecond where a sleeper takes tens to wake, but only
    pays when the peer has a core of its own (else it waits a time slice, milliseconds):

    * A wait polls for the budget (twice the waits' running average, between ``SPIN_S`` and
      ``SYNK_SPIN_US``; 0 turns polling off), yields the core between looks for up to
      ``SPIN_S`` more, then the caller sleeps.
    * A *miss*: a wait that did not end while polling, or lost the core (``GAP_S``,
      ``YIELD_GAP_S``). After ``MISSES`` in a row, or one lost core while their share is above
      ``LOST``, polling pauses: waits sleep at once.
    * While paused, after a back-off (``BACKOFF_S`` doubling to ``BACKOFF_MAX_S``, short again
      after ``CLEAN`` paid waits in a row), one wait polls as a probe; if in time, polling
      resumes."""

    __slots__ = ("limit", "polling", "typical", "misses", "clean", "resume_at", "backoff",
                 "lost", "stats")

    def __init__(self, limit_s: float) -> None:
        self.limit = max(0.0, limit_s)  # the most one wait polls and yields
        self.polling = self.limit > 0  # False while paused
        self.typical = 0.0  # running average of how long waits took (s)
        self.misses = 0  # waits in a row that did not end within the budget
        self.clean = 0  # waits in a row that ended while polling, keeping the core
        self.resume_at = 0.0  # while paused: when to probe
        self.backoff = BACKOFF_S
        self.lost = 0.0  # running share of recent waits that lost the core
        self.stats = [0, 0, 0, 0]  # waits that ended polling, yielding, asleep; pauses

    @property
    def budget(self) -> float:
        """How long the next wait polls and yields before the caller sleeps."""
        return min(self.limit, max(SPIN_S, 2.0 * self.typical))

    def poll(self, ready) -> bool:
        """Poll, then yield, calling ``ready()`` (cheap: no system call) until it returns
        true or the budget is spent; True when it did. The caller sleeps after a False,
        and calls ``slept(seconds)`` when its sleep ends."""
        if not self._polls():
            return False
        start = last = _clock()
        end = start + self.budget
        lost = False
        while True:
            if ready():
                self.stats[0] += 1
                self._ended(_clock() - start, lost)
                return True
            now = _clock()
            if now - last > GAP_S:
                lost = True
            last = now
            if now >= end:
                break
        end = now + min(self.limit, SPIN_S)
        while now < end:  # then yield the core between looks, a little longer
            _yield()
            found = ready()
            now = _clock()
            if now - last > YIELD_GAP_S:
                lost = True  # the yield let another process run: the core is wanted
            last = now
            if found:  # in time only because this process gave its core up: a miss
                self.stats[1] += 1
                self._missed(now - start, lost)
                return True
        self._missed(now - start, lost)
        return False

    def _polls(self) -> bool:
        """Whether the next wait polls (while paused, a probe's once the back-off is over)."""
        if not self.polling:
            if not self.limit or _clock() < self.resume_at:
                return False
            self.polling = True  # probe: one miss pauses again
            self.misses = MISSES - 1
        return True

    def outside(self) -> float:
        """The budget of a wait that polls outside Python (synk's XLA target; 0: none),
        whose end it tells ``polled``."""
        return self.budget if self._polls() else 0.0

    def polled(self, seconds: float, ended: bool) -> None:
        """A wait outside Python ended within its budget, after ``seconds``, or did not."""
        (self._ended if ended else self._missed)(seconds, False)

    def slept(self, seconds: float = 0.0) -> None:
        """The caller's sleep ended with the message, ``seconds`` after the wait began."""
        self.stats[2] += 1
        if seconds:
            self.typical += WEIGHT * (seconds - self.typical)

    def _ended(self, seconds: float, lost: bool) -> None:
        self.misses = 0
        self.clean = 0 if lost else self.clean + 1
        if self.clean >= CLEAN:  # polling has paid for a while: back to short back-offs
            self.backoff = BACKOFF_S
        self.typical += WEIGHT * (seconds - self.typical)
        self.lost += WEIGHT * ((1.0 if lost else 0.0) - self.lost)
        if lost and self.lost > LOST:
            self._pause()

    def _missed(self, seconds: float, lost: bool) -> None:
        self.misses += 1
        self.clean = 0
        self.typical += WEIGHT * (seconds - self.typical)
        self.lost += WEIGHT * ((1.0 if lost else 0.0) - self.lost)
        if self.misses >= MISSES or (lost and self.lost > LOST):
            self._pause()

    def _pause(self) -> None:
        self.polling = False
        self.stats[3] += 1
        self.resume_at = _clock() + self.backoff
        self.backoff = min(BACKOFF_MAX_S, self.backoff * 2)


IDLE_FIRST_S = 1e-3  # a sleeping waiter's first slice between pokes
IDLE_MAX_S = 0.05


class Idle:
    """A sleeping waiter's pokes of something that moves only while it is called (MPI's
    progress, for a rank of an MPI job waiting on its control socket): the sleep is cut
    into slices, from ``IDLE_FIRST_S`` doubling to ``IDLE_MAX_S``, with a ``poke`` after
    each that ended with nothing. ``begin`` starts a wait."""

    __slots__ = ("poke", "slice")

    def __init__(self, poke) -> None:
        self.poke = poke
        self.slice = IDLE_FIRST_S

    def begin(self) -> None:
        self.slice = IDLE_FIRST_S

    def bound(self, wait: float | None) -> float:
        """The next slice of a sleep of ``wait`` seconds (None: no end)."""
        return self.slice if wait is None else min(wait, self.slice)

    def nothing(self) -> None:
        """A slice ended with nothing: poke, and sleep longer next time."""
        self.poke()
        self.slice = min(self.slice * 2, IDLE_MAX_S)
