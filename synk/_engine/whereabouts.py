"""Naming the ranks a call waits for, with their Python stacks, without stopping anything::

    every rank  writes its place in its call into its row of the group's segment
    Reporter    reads the rows: unchanged for SYNK_STUCK_REPORT s, ranks not all at one
                place --> StuckRanksWarning: where every rank is, the late ranks' stacks
    a timeout   the same report, in its CallTimeoutError (``Whereabouts.timeout_report``)
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable

import numpy as np

from .._wire import shm as _shm
from ..comm import context as _context
from ..errors import StuckRanksWarning

STACK_SIGNAL = signal.SIGUSR1
_C = _context
_DUMP_WAIT = 2.0  # seconds a worker has to write its stacks


class Whereabouts:
    """The group's segment of places, one row a rank (the master's side). In its row,
    every rank keeps its place in its call (``comm.context``: the call, the collectives its
    share entered and the last one's name, or the end of its share). Ranks on another host
    (MPI) have no row here: a report names them as unknown."""

    def __init__(self, prefix: str, size: int) -> None:
        self.size = size
        self.shm = _shm.create(prefix + "where", size * _C.FIELDS * 8,
                               "the ranks' places in their calls")
        self.rows: np.ndarray | None = np.ndarray((size, _C.FIELDS), np.int64, self.shm.buf)
        self.rows[:] = 0
        self.rows[:, _C.STACKS] = -1
        self.rows[0, _C.PID] = os.getpid()
        self.name = self.shm.name
        _context.track(self.rows[0], self.rows)

    def places(self) -> np.ndarray | None:
        rows = self.rows
        return None if rows is None else rows.copy()

    def close(self) -> None:
        """Let go of the segment (the group's owner removes its name)."""
        _context.track(None)
        self.rows = None
        _shm.release(self.shm)

    # -- the report -----------------------------------------------------------------------
    def _latest(self, places: np.ndarray) -> tuple[list[int], int]:
        """(the ranks with a row, the latest call among them: 0 for none)."""
        known = [r for r in range(self.size) if places[r, _C.PID]]
        return known, int(max((places[r, _C.CALL] for r in known), default=0))

    def late(self, places: np.ndarray) -> tuple[int, list[int]] | None:
        """``(call, the ranks furthest behind in it)`` when the ranks with a row are not all
        at the same place of the latest call, else None."""
        known, call = self._latest(places)
        if not call:
            return None
        at = {r: min(_position(places[r], call), _C.DONE) for r in known}  # (ended: DONE)
        lowest = min(at.values())
        if lowest == max(at.values()) or lowest == _C.DONE:
            return None
        return call, [r for r in known if at[r] == lowest]

    def report(self, places: np.ndarray, call: int, late: list[int], header: str) -> str:
        """``header``, where every rank is in call ``call``, and the ``late`` ranks' stacks."""
        lines = [header]
        for r in range(self.size):
            lines.append(f"  rank {r}: {_describe(places[r], call)}")
        for r in late:
            lines.append(f"rank {r}'s Python stack:")
            lines += ["  " + line for line in self.stack(r, places[r]).splitlines()]
        return "\n".join(lines)

    def stack(self, rank: int, place: np.ndarray) -> str:
        """Rank ``rank``'s Python stacks, as ``faulthandler`` prints them (or why not). A worker
        dumps every thread's into a ``memfd`` from its ``STACK_SIGNAL`` handler (so a rank blocked
        in C is dumped too), which the master reads through ``/proc``. Rank 0: its thread's
        frames."""
        pid, fd = int(place[_C.PID]), int(place[_C.STACKS])
        if pid == 0:
            return "(not known: the rank runs on another host)"
        if pid == os.getpid():
            return _master_stacks(int(place[_C.THREAD]))
        if fd < 0:
            return "(not known: the rank keeps no dump of its stacks)"
        try:
            with open(f"/proc/{pid}/fd/{fd}", "rb") as dump:
                start = os.fstat(dump.fileno()).st_size
                os.kill(pid, STACK_SIGNAL)
                size, deadline = start, time.monotonic() + _DUMP_WAIT
                while time.monotonic() < deadline:  # (until it stops growing)
                    time.sleep(0.05)
                    now = os.fstat(dump.fileno()).st_size
                    if now > start and now == size:
                        break
                    size = now
                dump.seek(start)
                text = dump.read().decode(errors="replace").rstrip()
        except OSError as err:
            return f"(not known: {err})"
        return text or "(not known: the rank wrote no stacks)"

    def timeout_report(self, ranks: list[int]) -> str:
        """For a ``CallTimeoutError`` naming ``ranks``: where every rank is, and the stacks
        of those of ``ranks`` furthest behind ("" without rows)."""
        places = self.places()
        if places is None:
            return ""
        known, call = self._latest(places)
        if not known:
            return ""
        found = self.late(places)
        behind = found[1] if found is not None else [
            r for r in known if _position(places[r], call) < _C.DONE]
        late = [r for r in ranks if r in behind and _position(places[r], call) < _C.DONE]
        return self.report(places, call, late, "Where every rank was:")


def _master_stacks(share: int) -> str:
    """The master's threads that take part in the call, as ``faulthandler`` lists a
    process's: the one running its share (``share``), and synk.comm's operations'."""
    names = {t.ident: t.name for t in threading.enumerate()}
    lines = []
    for ident, frame in sys._current_frames().items():
        if ident != share and names.get(ident) != "synk-comm-op":
            continue
        lines.append(f"{'Current thread' if ident == share else 'Thread'} {ident:#018x} "
                     "(most recent call first):")
        for entry in reversed(traceback.extract_stack(frame)):
            lines.append(f'  File "{entry.filename}", line {entry.lineno} in {entry.name}')
        lines.append("")
    return "\n".join(lines).rstrip() or "(not known: the master's share has ended)"


def _position(place: np.ndarray, call: int) -> int:
    """A rank's place in ``call``: -1 before it began it, the collectives its share entered
    there (times 64, with the last one's name in the low bits), or DONE."""
    if int(place[_C.CALL]) != call:
        return -1
    return int(place[_C.POSITION])


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _describe(place: np.ndarray, call: int) -> str:
    if not place[_C.PID]:
        return "not known (it runs on another host)"
    position = _position(place, call)
    if position < 0:
        return f"has not begun call {call}"
    if position == _C.DONE:
        return f"finished its share of call {call}"
    if position == _C.FAILED:
        return f"its share of call {call} ended by an error or an interrupt"
    entered, code = position >> 6, position & 63
    if entered == 0:
        return f"runs its function in call {call}; no synk.comm collective yet"
    name = _C.NAMES[code] if code < len(_C.NAMES) and code else "an operation"
    return (f"in or past synk.comm.{name}, the {_ordinal(entered)} collective of its "
            f"share of call {call}")


class Reporter:
    """The master's thread that says, once a call, which ranks the others have waited for
    ``limit`` seconds (``SYNK_STUCK_REPORT``): when the rows have not changed for that long and
    the ranks are not all at one place, a ``StuckRanksWarning`` with where every rank is and the
    stacks of those furthest behind."""

    def __init__(self, where: Whereabouts, limit: float, name: Callable[[], str]) -> None:
        self.where, self.limit, self._name = where, limit, name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="synk-stuck-report",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        tick = min(0.5, self.limit / 4)
        last: bytes | None = None
        since = time.monotonic()
        reported: set[int] = set()
        while not self._stop.wait(tick):
            places = self.where.places()
            if places is None:
                return
            state = places[:, (_C.CALL, _C.POSITION)].tobytes()
            now = time.monotonic()
            if state != last:
                last, since = state, now
                continue
            if now - since < self.limit:
                continue
            found = self.where.late(places)
            if found is None or found[0] in reported:
                continue
            call, late = found
            reported.add(call)
            header = (f"synk: the ranks of call {call} ({self._name()}) have waited "
                      f"{now - since:.0f} s for rank(s) {late}; nothing was stopped "
                      "(SYNK_STUCK_REPORT sets when this is said; a timeout= stops a call)")
            try:
                text = self.where.report(places, call, late, header)
            except Exception as err:  # (a report must never break the group)
                text = f"{header}\n  (the report failed: {type(err).__name__}: {err})"
            warnings.warn(StuckRanksWarning(text), stacklevel=1)


# -- a worker's side -----------------------------------------------------------------------
def attach(name: str | None, rank: int) -> object | None:
    """A worker's row in segment ``name`` (tracked by ``synk.comm``, with its pid and the memory
    file its stacks go to on ``STACK_SIGNAL``); returns the segment, to keep while the rank
    lives. With ``name`` None (an MPI rank off the master's host) a row of its own, which peers
    read by asking it (``MpiMesh``); returns None."""
    if name is None:
        _context.track(np.zeros(_context.FIELDS, np.int64))
        return None
    segment = _shm.attach(name)
    buf = segment.buf
    assert buf is not None
    rows = np.ndarray((len(buf) // (_context.FIELDS * 8), _context.FIELDS), np.int64, buf)
    row = rows[rank]
    try:
        dump = os.memfd_create("synk-stacks", os.MFD_CLOEXEC)
        faulthandler.register(STACK_SIGNAL, file=dump, all_threads=True)
    except (AttributeError, OSError, RuntimeError):  # (no memfd here: no stacks)
        dump = -1
    row[_context.STACKS] = dump
    row[_context.PID] = os.getpid()
    _context.track(row, rows)
    return segment
