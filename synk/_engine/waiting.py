"""How a rank waits for a message: poll shared memory, then yield the core, then sleep.

Polling a word in shared memory sees a message within a fraction of a microsecond, while a
process asleep on a socket takes tens of microseconds to wake. But polling only pays when
the rank it waits for has a core of its own and answers within the polling budget: a
poller keeps its core busy, so a peer that is waiting for a core (the machine runs more
busy processes than it has cores) cannot be woken onto it, and takes a scheduler time
slice, milliseconds, to answer instead of tens of microseconds. So ``Waiter`` adapts, from
how its recent waits went:

* **poll** for up to ``spin_s`` (``SYNK_SPIN_US``, default 200 us when the ranks have a
  core each, else 0: polling off), then **yield** the core between looks for as long
  again (``os.sched_yield``: a process that is ready to run on this core runs first), then
  **sleep** on the socket, woken by the writer.
* A wait that did not end while polling is a *miss*: polling was wasted on it. So is a
  wait during which the process lost its core: a gap between two looks far longer than a
  look takes (``GAP_S``), while polling or yielding, means another process ran here.
  After ``MISSES`` misses in a row (or one gap, when recent waits had them too: a running
  share above ``LOST``), polling pauses: waits sleep at once, as with polling off.
* While paused, after a back-off (``BACKOFF_S``, doubling up to ``BACKOFF_MAX_S`` while
  the probes keep missing), one wait polls again as a probe: if its message arrives while
  polling, polling resumes.

So on a quiet machine a small call's waits end while polling; with a busy process beside
the ranks, or a peer whose work takes longer than the budget, they sleep, and cost what
they cost with polling off. Each ``Waiter`` is used by one thread; it holds only numbers.
"""
from __future__ import annotations

import os
import time

GAP_S = 50e-6  # a look-to-look gap this long: another process ran on this core meanwhile
MISSES = 4  # waits in a row that did not end while polling, after which polling pauses
WEIGHT = 0.25  # of the latest wait in the running share of waits that lost the core
LOST = 0.3  # that share, above which a wait that loses the core pauses polling
BACKOFF_S = 0.01  # first pause of polling
BACKOFF_MAX_S = 1.0

_clock = time.perf_counter
_yield = os.sched_yield


class Waiter:
    """The adaptive poll-yield-sleep policy of one waiting thread (see the module)."""

    __slots__ = ("limit", "polling", "misses", "resume_at", "backoff", "lost", "stats")

    def __init__(self, spin_s: float) -> None:
        self.limit = max(0.0, spin_s)  # how long it polls (and, after it, yields)
        self.polling = self.limit > 0  # False while paused
        self.misses = 0  # waits in a row that did not end while polling
        self.resume_at = 0.0  # while paused: when to probe
        self.backoff = BACKOFF_S
        self.lost = 0.0  # running share of recent waits that lost the core
        self.stats = [0, 0, 0, 0]  # waits that ended polling, yielding, asleep; pauses

    def poll(self, ready) -> bool:
        """Poll, then yield, calling ``ready()`` (cheap: no system call) until it returns
        true or the budget is spent; True when it did. The caller sleeps after a False."""
        if not self.polling:
            if not self.limit:
                return False
            if _clock() < self.resume_at:
                return False
            self.polling = True  # probe: one miss pauses again
            self.misses = MISSES - 1
        budget = self.limit
        last = _clock()
        end = last + budget
        lost = False
        while True:
            if ready():
                self.stats[0] += 1
                self._won(lost)
                return True
            now = _clock()
            if now - last > GAP_S:
                lost = True
            last = now
            if now >= end:
                break
        end = now + budget
        while True:  # yield the core between looks
            _yield()
            if ready():
                self.stats[1] += 1
                self._missed(lost or _clock() - last > GAP_S)
                return True
            now = _clock()
            if now - last > GAP_S:
                lost = True  # the yield let another process run: the core is wanted
            last = now
            if now >= end:
                break
        self._missed(lost)
        return False

    def slept(self) -> None:
        """The caller's sleep ended with the message (for ``stats``)."""
        self.stats[2] += 1

    def _won(self, lost: bool) -> None:
        self.misses = 0
        self.backoff = BACKOFF_S
        self.lost += WEIGHT * ((1.0 if lost else 0.0) - self.lost)

    def _missed(self, lost: bool) -> None:
        self.misses += 1
        self.lost += WEIGHT * ((1.0 if lost else 0.0) - self.lost)
        if self.misses >= MISSES or (lost and self.lost > LOST):
            self.polling = False
            self.stats[3] += 1
            self.resume_at = _clock() + self.backoff
            self.backoff = min(BACKOFF_MAX_S, self.backoff * 2)
