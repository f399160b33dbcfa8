"""The harness of call sequences: what the ranks run, the one-process model of what every
call, future and master-side operation must give, and the state machine that draws the
sequences (Hypothesis's stateful testing; ``test_call_sequences`` runs it).

A sequence is what a user's loop does to a group: calls of one function, plain, bound,
submitted, or many steps in one call, whose function may raise, exit or stall on one rank
before or after it changes its state; workers killed from outside; futures read in any
order, waited for, or left to complete on their own; the ``Data`` and the shared variables
changed between calls by master-side operations, and the cores each rank runs on read (a
replaced rank's are those of the rank it replaces); the group itself forked again. Every
step is logged as it happens (``Log``); ``replay`` walks the log against a model of every
rank's state and checks what each step gave: a value (its bits), or an error of the type
documented for it.

The function, on every rank (``body``)::

    x  this rank's rows of the Data (all rows: rank r gets the same rows at every call)
    s  a shared variable, one replica per rank (replicated, or per rank after
       set_value(rank=) or an all-reduce of unequal replicas)
    t  a shared variable with one number per row, split as the rows are (shared_scatter):
       state that stays on each rank
    i  the step's number

    [plan: before]  g = allreduce(x summed over rows);  s += g + i;  t += x[:, 0] + i
                    (at odd i, the allreduce is of WIDE items, the sum and zeros: large
                    messages, through shared-memory segments; a plain one, a persistent
                    one, a sub-group's of every rank, or, where JAX is installed, on CPU
                    ranks, one inside ``jax.jit`` or a ring of sendrecvs inside it, which
                    adds every rank's in rank order: ``via``)
    [plan: after]   returns  x summed * i -> "sum",  s -> None (every rank's),  t -> "gather"

A plan makes one rank raise ``Planned`` (a ValueError), exit (once: it takes a token file
first, so that the call run again on a new group does not exit again) or stall past the
call's timeout, before the allreduce (no rank changes its state: the others' allreduce
fails) or after the updates (every rank changed its state).

What a real group leaves open, the model leaves open too, and what was seen settles it:
when the group breaks (a rank exits or stalls, a worker is killed), the calls outstanding
then give values up to one of them and the group's error from there on; with a restart
left, the calls submitted once the group was replaced give values again, computed on the
state every rank had before the first call that failed (undone).
"""
from __future__ import annotations

import concurrent.futures
import importlib.util
import itertools
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context, note as _note
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import synk
from synk.errors import CallTimeoutError, EarlierCallFailedError, GroupBrokenError

ROWS = 7  # rows of the Data: uneven shares on 2 and 3 ranks
STALL_S = 30.0  # how long a stalled rank sleeps (far past a stalling call's timeout)
TIMEOUT_S = 1.5  # a stalling call's timeout
CALL_TIMEOUT_S = 40.0  # every other call's: a hang fails the sequence, it is not waited for
WAIT_S = 20.0  # the longest a future may take to complete on its own


TRACE: list = []  # the running sequence's steps, for a failure Hypothesis cannot replay
MACHINE = sorted(os.sched_getaffinity(0))  # the cores this process may run on, no group up


def cores_of_rank() -> list:
    return sorted(os.sched_getaffinity(0))


def rank_cores(log) -> list:
    """Each rank's cores: CPU ranks that synk started and that go round the cores on cores
    of their own, in rank order (as ``mpiexec`` binds them); else any."""
    n = log.n
    k = len(MACHINE) // n
    if (log.backend != "cpu" or not log.forked or k == 0
            or os.environ.get("SYNK_BIND_CORES") == "0"):
        return [MACHINE] * n
    return [MACHINE[r * k:(r + 1) * k] for r in range(n)]


def note(text: str) -> None:
    """Note a step for Hypothesis's report (a sequence replayed by hand notes nothing),
    and in ``TRACE``."""
    TRACE.append(text)
    if currently_in_test_context():
        _note(text)


def traced(error: AssertionError) -> AssertionError:
    """``error`` with the running sequence's steps and the threads' stacks added."""
    import faulthandler
    import sys

    faulthandler.dump_traceback(sys.stderr)
    return type(error)(f"{error}\nthe sequence:\n  " + "\n  ".join(TRACE))


def forget_frames(error) -> None:
    """Drop the tracebacks of ``error`` and of the errors chained to it: rank 0's frames
    hold views of the group's memory, which must not outlive ``close()``."""
    seen: set = set()
    todo = [error]
    while todo:
        error = todo.pop()
        if isinstance(error, BaseException) and id(error) not in seen:
            seen.add(id(error))
            error.__traceback__ = None
            todo += [error.__context__, error.__cause__]


class Planned(ValueError):
    """The error a plan makes a rank raise."""


def act(plan: dict | None, when: str, step: int) -> None:
    """Carry out this rank's part of ``plan`` (None, or {"rank", "what", "when", "step",
    "token"}) where it is due ``when`` ("before" or "after") of step ``step`` (the
    plan's, in a call of many steps; any, in a call of one)."""
    if plan is None or plan["when"] != when or synk.comm.rank() != plan["rank"] or \
            plan.get("step", step) != step:
        return
    what = plan["what"]
    if what == "raise":
        raise Planned(f"planned failure on rank {plan['rank']} {when} the update")
    if what == "exit":
        try:
            os.unlink(plan["token"])  # (once: the call run again finds no token)
        except FileNotFoundError:
            return
        os._exit(7)
    if what == "stall":
        stop = time.monotonic() + STALL_S
        while time.monotonic() < stop:  # (short sleeps: rank 0's share is interrupted
            time.sleep(0.05)  # between two of them)


NUMBERS = itertools.count()  # the calls' numbers, never the same twice in a process (the
# ranks of a group that serves several sequences keep what they noted of each call)
STEPS: dict = {}  # (call number, group) -> the steps this process has run of it
HANDLES: dict = {}  # (call number, group) -> this rank's persistent allreduce made in it


WIDE = 50_000  # float64 items: 400 KB, past the board's slots and the rings' messages


def _widened(xp, summed, i):
    """``summed``, or at odd ``i`` ``summed`` then zeros, ``WIDE`` items in all."""
    if i % 2 == 0:
        return summed
    wide = xp.zeros(WIDE)
    wide[:len(summed)] = summed
    return wide


def body(x, s, t, i, plan=None, via="plain"):
    """One step of the sequence's function on this rank (see the module): ``via``
    "persistent", its allreduce is a persistent one, made at the call's first step and
    used at every one; "group", it is a sub-group's of every rank (``split``, made at each
    step: a collective numbered in the call, the allreduce in the group's own numbering)."""
    key = (i, synk.restarts_left())  # (on the master, a call run again is in a new group)
    step = STEPS[key] = STEPS.get(key, -1) + 1
    act(plan, "before", step)
    if via == "persistent":
        xp = synk.xp(s)
        if key not in HANDLES:
            summed = xp.zeros(2)
            HANDLES[key] = (summed, synk.comm.allreduce_init(summed))
        summed, p = HANDLES[key]
        summed[...] = x.sum(axis=0)
        g = p()
    elif via == "group":
        g = synk.comm.split(0).allreduce(_widened(synk.xp(s), x.sum(axis=0), i))[:2]
    elif via in ("jit", "jit ring") and synk.xp(s) is np:
        g = _jitted(via, _widened(np, x.sum(axis=0), i))[:2]
    else:
        g = synk.comm.allreduce(_widened(synk.xp(s), x.sum(axis=0), i))[:2]
    s += g + i
    t[:len(x)] += x[:, 0] + i  # (this rank's rows: each step's first ones)
    act(plan, "after", step)
    return x.sum(axis=0) * i, s.copy(), t.copy()


def _ring_sum(v, r, n):
    """Every rank's ``v`` by sendrecvs twice round the ring of ``n`` ranks (this one ``r``;
    the second time on the lanes the first lent synk's XLA target), added in rank order (as
    numpy's fold of an allreduce adds them); then an
    allreduce whose result is unused (kept: an ordered effect), so that a rank that raises
    after its ring does so once every rank has taken its messages (a failure ends the
    others' waits for messages, not for a collective that the failed rank finished)."""
    parts, passed = {r: v}, v
    for k in range(1, 2 * n - 1):
        passed = synk.comm.sendrecv(passed, (r + 1) % n, (r - 1) % n, tag=7)
        parts[(r - k) % n] = passed
    total = parts[0]
    for q in range(1, n):
        total = total + parts[q]
    synk.comm.allreduce(total[:1])
    return total


JITTED: dict = {}  # via -> jax.jit of its function, once made (the ring's rank and size
# static: JAX keeps its traces by function, so that a group of another size traces again)


def _jitted(via: str, v: np.ndarray) -> np.ndarray:
    """The allreduce of ``v`` inside ``jax.jit`` ("jit"), or the ring of sendrecvs ("jit
    ring"), in float64 (JAX's x64 mode, for this call only): the compiled paths for the
    small ``v`` (the board's allreduce, the rings' messages), Python's for a wide one."""
    import jax

    if not JITTED:
        JITTED["jit"] = jax.jit(lambda v, r, n: synk.comm.allreduce(v), static_argnums=(1, 2))
        JITTED["jit ring"] = jax.jit(_ring_sum, static_argnums=(1, 2))
    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        return np.asarray(JITTED[via](v, synk.comm.rank(), synk.comm.size()))
    finally:
        jax.config.update("jax_enable_x64", was)


REDUCE = ("sum", None, "gather")


# -- the log --------------------------------------------------------------------------------
@dataclass
class Call:
    """A call of the sequence: ``form`` is plain, bound, submitted, bound submitted,
    steps or bound steps; ``plan`` None or a dict (``act``); ``batch``, its ``batch=``
    (``batches``: a call of many steps' ones); ``outcome``, the value or error it gave (a
    submitted call's: its future's, taken without reading it)."""

    index: int
    form: str
    number: int
    plan: dict | None
    batch: object = None
    batches: list | None = None
    future: concurrent.futures.Future | None = None
    outcome: object = None
    seen: bool = False
    fired: int = 0  # how many times its future's done-callback ran

    @property
    def submitted(self) -> bool:
        return self.future is not None

    def see(self, outcome) -> None:
        self.outcome, self.seen = outcome, True
        forget_frames(outcome)

    def breaks(self) -> bool:
        """Its plan breaks the group (a rank exits or stalls)."""
        return self.plan is not None and self.plan["what"] in ("exit", "stall")

    def take(self, wait: float = WAIT_S) -> None:
        """A submitted call's outcome from its future, waiting for it to complete on its
        own (without ``result()``, which reads it)."""
        if self.seen:
            return
        base = concurrent.futures.Future
        try:
            error = base.exception(self.future, timeout=wait)
        except concurrent.futures.TimeoutError:
            raise Mismatch(f"call {self.index} ({self.form}): its future did not complete "
                           f"within {wait:g} s without being read") from None
        self.see(error if error is not None else base.result(self.future, 0))


@dataclass
class Read:
    """The sequence read call ``index``'s future (``result()`` or ``exception()``)."""

    index: int


@dataclass
class Op:
    """A master-side operation and what it gave: get (rank), set (value, rank),
    all_reduce, broadcast, gather, set_data (rows), distribute, restarts."""

    kind: str
    args: tuple = ()
    outcome: object = None


@dataclass
class Kill:
    """A worker killed from outside (SIGKILL), between two steps of the sequence."""

    rank: int


@dataclass
class Log:
    """Everything one lineage of groups did, in order (from ``fork`` to ``close``)."""

    n: int
    restarts: int
    data: np.ndarray
    backend: str = "cpu"
    forked: bool = True  # by synk.fork (else: the MPI job's group)
    entries: list = field(default_factory=list)


# -- the model --------------------------------------------------------------------------------
class Mismatch(AssertionError):
    """A step of the sequence gave what the model says it must not."""


def _group_error(outcome) -> bool:
    return isinstance(outcome, GroupBrokenError)


def split(count: int, n: int) -> list:
    """Where each of ``n`` ranks' share of ``count`` rows starts, and the end: the first
    ``count % n`` ranks one row more (numpy's ``array_split``)."""
    return [r * (count // n) + min(r, count % n) for r in range(n + 1)]


def rows_of(batch, total: int) -> np.ndarray:
    """The rows ``batch=`` picks (None: all)."""
    return np.arange(total)[slice(None) if batch is None else batch]


class State:
    """Every rank's state in the model: ``s`` per rank, ``t`` per row (rank r's part: its
    rows of all of them, as ``shared_scatter`` split it), the Data's rows."""

    def __init__(self, n: int, data: np.ndarray) -> None:
        self.n, self.data = n, data.copy()
        self.s = [np.zeros(2) for _ in range(n)]
        self.t = np.zeros(len(data))

    def step(self, i: int, plan: dict | None, batch=None, step: int = 0):
        """``body`` on every rank, on ``batch``'s rows: its value, or ``Planned`` (the
        update made or not, as the plan says)."""
        due = plan is not None and plan["what"] == "raise" and plan.get("step", step) == step
        if due and plan["when"] == "before":
            return Planned
        rows = rows_of(batch, len(self.data))
        total = self.data[rows].sum(axis=0)
        self.s = [v + total + i for v in self.s]
        mine, theirs = split(len(self.data), self.n), split(len(rows), self.n)
        for r in range(self.n):
            part = rows[theirs[r]:theirs[r + 1]]
            self.t[mine[r]:mine[r] + len(part)] += self.data[part, 0] + i
        if due:
            return Planned
        return total * i, [v.copy() for v in self.s], self.t.copy()

    def steps(self, i: int, plan: dict | None, batches: list):
        """A call of many steps: the list of their values, or ``Planned`` (the steps
        before the planned one made, it as its plan says, none after it)."""
        values = []
        for j, batch in enumerate(batches):
            value = self.step(i, plan, batch, j)
            if value is Planned:
                return Planned
            values.append(value)
        return values


def shown(outcome) -> str:
    """``outcome`` for a failure's message: an error with the traceback it carries from its
    rank (its cause)."""
    if not isinstance(outcome, BaseException):
        return repr(outcome)
    cause = outcome.__cause__
    return repr(outcome) + ("" if cause is None else f" (its cause: {cause})")


def same_values(got, want: list) -> bool:
    """Whether ``got`` (a call of many steps' value) has the bits of every step's."""
    return isinstance(got, list) and len(got) == len(want) and all(
        same_value(g, w) for g, w in zip(got, want))


def same_value(got, want) -> bool:
    """Whether ``got`` (a call's value) has the bits of ``want`` (the model's)."""
    total, s, t = want
    return (isinstance(got, tuple) and len(got) == 3 and np.array_equal(got[0], total)
            and len(got[1]) == len(s)
            and all(np.array_equal(np.asarray(a), b) for a, b in zip(got[1], s))
            and np.array_equal(got[2], t))


class Replay:
    """Walks a ``Log`` in order, checking what each step gave (``run``).

    ``down``: the group broke and was not replaced yet: None; "ahead" (a call failed with
    the group's error before the event that broke it: a kill or a plan later in the same
    window of submitted calls); "replaceable" (a restart is left); "dead".

    ``failing``: a submitted call failed with the group's error and no such failure was read
    since: a call submitted then fails with it too (it is not run), until a failure is
    read or a blocking step replaces the group.

    ``known``: whether the model knows the ranks' state. A call submitted behind a failure
    not yet read ran on what the failure left: on CPU ranks to its end, as the model runs
    it; on GPU ranks a failure that left a peer inside NCCL aborted the communicators, and
    the calls then in flight fail part way (their errors are EarlierCallFailedError all
    the same): the state is the model's again once the sequence resets it."""

    def __init__(self, log: Log) -> None:
        self.log = log
        self.calls = {e.index: e for e in log.entries if isinstance(e, Call)}
        self.state = State(log.n, log.data)
        self.known = True
        self.gate: int | None = None  # a submitted call whose failure is not read yet
        self.down: str | None = None
        self.failing = False
        self.replacements = 0
        self.at = 0  # the entry being checked

    def run(self) -> State:
        entries = self.log.entries
        for self.at, entry in enumerate(entries):
            if isinstance(entry, Call):
                self.call(entry)
            elif isinstance(entry, Read):
                if self.gate == entry.index:
                    self.gate = None
                if _group_error(self.calls[entry.index].outcome):
                    self.failing = False
            elif isinstance(entry, Kill):
                self.broke()
            else:
                self.op(entry)
        return self.state

    # -- the group --------------------------------------------------------------------
    def broke(self, replaceable: bool = True) -> None:
        """Something broke the group (a death, or a stall: ``replaceable=False``)."""
        if self.down in ("replaceable", "dead"):
            return
        left = self.log.restarts - self.replacements
        self.down = "replaceable" if replaceable and left > 0 else "dead"

    def replaced(self) -> None:
        self.replacements += 1
        self.down = None

    def sync(self) -> None:
        """A blocking step: every call before it has ended, and a group that can be
        replaced is, before it runs."""
        if self.down == "ahead":
            raise Mismatch(f"entry {self.at}: a call failed with the group's error, and "
                           "nothing broke the group")
        if self.down == "replaceable":
            self.replaced()
        self.failing = False

    def event_ahead(self) -> bool:
        """Whether something breaks the group later in this window of submitted calls
        (before the next blocking step)."""
        for entry in self.log.entries[self.at + 1:]:
            if isinstance(entry, Kill):
                return True
            if isinstance(entry, Op) or isinstance(entry, Call) and not entry.submitted:
                return False
            if isinstance(entry, Call) and entry.breaks():
                return True
        return False

    # -- calls ------------------------------------------------------------------------
    def call(self, c: Call) -> None:
        if not c.seen:
            raise Mismatch(f"call {c.index} ({c.form}) never ended")
        if not c.submitted:
            self.sync()
        if self.down == "dead":
            return self.expect_group_error(c)
        if c.submitted and self.down is not None:
            if _group_error(c.outcome):
                if self.down == "ahead" and c.breaks():  # (the event the failures came of)
                    self.down = None
                    self.broke(replaceable=c.plan["what"] == "exit")
                self.failing = True
                return None  # (failed with the group, and undone)
            if self.down == "ahead" or self.failing:
                raise Mismatch(f"call {c.index} ({c.form}) gave {shown(c.outcome)} after an "
                               "earlier call failed with the group's error and before that "
                               "failure was read" + (", before anything broke the group"
                                                     if self.down == "ahead" else ""))
            self.replaced()  # (it ran on the new group)
        elif c.submitted and _group_error(c.outcome) and not c.breaks():
            if not self.event_ahead():
                raise Mismatch(f"call {c.index} ({c.form}) failed with the group's error "
                               f"and nothing broke the group: {c.outcome!r}")
            self.down, self.failing = "ahead", True
            return None
        return self.check(c)

    def expect_group_error(self, c: Call) -> None:
        if not _group_error(c.outcome):
            raise Mismatch(f"call {c.index} ({c.form}) on a broken group gave "
                           f"{c.outcome!r}, not the group's error")

    def check(self, c: Call) -> None:
        """A call that ran: its outcome against the model, the model's state advanced."""
        got, plan = c.outcome, c.plan
        what = None if plan is None else plan["what"]
        if c.submitted and self.gate is not None and self.log.backend != "cpu" and \
                what is not None and plan["when"] == "after" and \
                isinstance(got, EarlierCallFailedError):
            # (on GPU ranks the failure not read yet aborted the NCCL communicators, which
            # are made anew once it is read: the call's allreduce may fail before the plan)
            self.known = False
            return
        if what == "stall":
            if not isinstance(got, CallTimeoutError):
                raise Mismatch(f"call {c.index} ({c.form}) stalled on rank {plan['rank']} "
                               f"past its timeout but gave {got!r}")
            self.down = "dead"  # (never run again, whatever the restarts)
            return
        if what == "exit":
            if c.submitted or self.log.restarts - self.replacements <= 0:
                if not _group_error(got):
                    raise Mismatch(f"call {c.index} ({c.form}), whose rank {plan['rank']} "
                                   f"exited, gave {got!r}, not the group's error")
                self.down = None if self.down == "ahead" else self.down
                self.broke()
                self.failing = c.submitted
                return
            self.replaced()  # (a blocking call runs again on a new group)
            plan = None
        want = self.state.step(c.number, plan, c.batch) if c.batches is None else \
            self.state.steps(c.number, plan, c.batches)
        if c.submitted and self.gate is not None:
            if not isinstance(got, EarlierCallFailedError):
                raise Mismatch(f"call {c.index} ({c.form}), submitted after call "
                               f"{self.gate} failed and before that failure was read, gave "
                               f"{shown(got)}, not EarlierCallFailedError")
            self.known = self.known and self.log.backend == "cpu"
        elif want is Planned:
            if not isinstance(got, Planned):
                raise Mismatch(f"call {c.index} ({c.form}) must raise the planned error; "
                               f"it gave {shown(got)}")
            if c.submitted:
                self.gate = c.index
        elif isinstance(got, BaseException) or self.known and not (
                same_value(got, want) if c.batches is None else same_values(got, want)):
            raise Mismatch(f"call {c.index} ({c.form}) gave {shown(got)}; the model says "
                           f"{want!r}")

    # -- master-side operations -----------------------------------------------------
    def op(self, op: Op) -> None:
        got = op.outcome
        if op.kind == "set_data":  # (the master's own memory: no rank takes part)
            self.apply(op)
            return
        self.sync()
        if self.down == "dead":  # (it may raise the group's error, or run on rank 0 alone)
            return
        if isinstance(got, BaseException):
            raise Mismatch(f"{op.kind}{op.args} raised {shown(got)}")
        want = self.apply(op)
        if want is not None and (self.known or op.kind == "cores") and not np.array_equal(
                got, want):
            raise Mismatch(f"{op.kind}{op.args} gave {got!r}; the model says {want!r}")

    def apply(self, op: Op):
        """``op`` on the model's state; what it gives, where it gives something."""
        state = self.state
        if op.kind == "get":
            return state.s[op.args[0]]
        if op.kind == "gather":
            return state.t
        if op.kind == "restarts":
            return self.log.restarts - self.replacements
        if op.kind == "cores":  # (a replaced rank's too)
            return rank_cores(self.log)
        if op.kind == "set":
            value, rank = op.args
            for r in range(state.n) if rank is None else [rank]:
                state.s[r] = np.array(value, dtype=np.float64)
        elif op.kind == "all_reduce":
            total = sum(state.s[1:], state.s[0])
            state.s = [total.copy() for _ in range(state.n)]
        elif op.kind == "broadcast":
            state.s = [state.s[0].copy() for _ in range(state.n)]
        elif op.kind == "set_data":
            state.data = np.array(op.args[0])
        elif op.kind == "reset":
            state.s = [np.zeros(2) for _ in range(state.n)]
            state.t = np.zeros(len(state.t))
            self.known = True
        return None


def replay(log: Log) -> State:
    """Check every step of ``log`` against the model (``Mismatch`` at the first that
    differs); the model's state at the end."""
    return Replay(log).run()


# -- the sequences ----------------------------------------------------------------------------
_FORMS = ("plain", "bound", "submitted", "submitted", "bound submitted", "bound submitted")
_VIAS = st.sampled_from(["plain", "persistent", "group"] + (  # how body's allreduce runs
    ["jit", "jit ring"] if importlib.util.find_spec("jax") else []))
_PLANS = st.one_of(
    st.none(), st.none(), st.none(), st.none(),
    st.fixed_dictionaries({"what": st.sampled_from(["raise", "raise", "exit", "stall"]),
                           "when": st.sampled_from(["before", "after"]),
                           "rank": st.integers(0, 2), "step": st.integers(0, 5)}))


@st.composite
def _batches(draw, least: int = 3):
    """A ``batch=``: None, a slice or an index array (rows in any order), of at least
    ``least`` rows, so that every rank has some (a rank without rows runs its function
    quietly: a planned error there would not be the call's)."""
    kind = draw(st.sampled_from(["none", "slice", "index"]))
    if kind == "none":
        return None
    count = draw(st.integers(least, ROWS))
    if kind == "slice":
        start = draw(st.integers(0, ROWS - count))
        return slice(start, start + count)
    return np.array(draw(st.permutations(range(ROWS)))[:count])


class CallSequences(RuleBasedStateMachine):
    """Draws call sequences on a group (``configure`` first: ranks, back end, what may
    happen) and checks them with ``replay`` at every blocking step and at the end."""

    n = 2
    backend = "cpu"
    deaths = True  # workers may exit or be killed (not under MPI: the job ends)
    stalls = True  # a rank may stall past a timeout
    forks = True  # each sequence forks a group of its own (under MPI: the job's one group)
    tally: dict = {}  # what ran, by kind, over every sequence (for the soak's report)

    def __init__(self) -> None:
        super().__init__()
        self.log: Log | None = None
        self.calls: list[Call] = []
        self.tokens = tempfile.mkdtemp(prefix="synk-sequence-")
        self.breaking = False  # a death or stall since the last blocking step
        self.left = 0  # restarts the model has left
        self.dead = False
        self.quiet = 0  # calls since the last kill

    # -- the lineage --------------------------------------------------------------------
    @initialize(restarts=st.sampled_from([0, 2]))
    def start(self, restarts: int) -> None:
        TRACE.clear()
        note(f"fork {self.n} ranks, restarts={restarts}")
        self.fork(restarts)

    def fork(self, restarts: int) -> None:
        STEPS.clear()
        HANDLES.clear()
        if not self.deaths:
            restarts = 0
        if self.forks:
            synk.close()
            synk.fork(self.n, backend=self.backend, restarts=restarts)
        rng = np.random.default_rng(len(self.calls))
        data = rng.integers(-4, 5, (ROWS, 2)).astype(np.float64)
        self.log = Log(self.n, restarts, data, self.backend, self.forks)
        self.left, self.breaking, self.dead = restarts, False, False
        self.d = synk.data(data)
        self.s = synk.shared(np.zeros(2))
        self.t = synk.shared(np.zeros(0))
        synk.shared_scatter(self.t, np.zeros(ROWS))
        self.f = synk.function(body, inputs=["x"], reduce=REDUCE, timeout=CALL_TIMEOUT_S)
        self.cores = synk.function(cores_of_rank, reduce=None, timeout=CALL_TIMEOUT_S)
        self.step = self.f.bind(self.d, self.s, self.t)
        self.count("forks")

    def count(self, kind: str) -> None:
        self.tally[kind] = self.tally.get(kind, 0) + 1

    def end(self) -> None:
        """Close the lineage and check everything it did (a group that serves the next
        sequence too has its failures read, so that none holds that sequence's calls)."""
        if self.forks:
            synk.close()
        self.check()
        if not self.forks:
            for c in self.calls:
                if c.submitted:
                    c.future.exception()
        for c in self.calls:
            if c.submitted and c.fired != 1:
                raise Mismatch(f"call {c.index}'s done-callback ran {c.fired} times")
        self.calls = []

    def check(self) -> None:
        try:
            for c in self.calls:
                if c.submitted:
                    c.take()
            replay(self.log)
        except Mismatch as error:
            raise traced(error) from None

    def teardown(self) -> None:
        try:
            if self.log is not None:
                self.end()
        finally:
            if self.forks:
                synk.close()
            for name in os.listdir(self.tokens):
                os.unlink(os.path.join(self.tokens, name))
            os.rmdir(self.tokens)

    @precondition(lambda self: self.dead)
    @rule(restarts=st.sampled_from([0, 2]))
    def fork_again(self, restarts: int) -> None:
        note(f"fork again, restarts={restarts}")
        self.end()
        self.fork(restarts)

    # -- calls --------------------------------------------------------------------------
    def _plan(self, plan: dict | None, one: bool = False) -> dict | None:
        """``plan`` as this group takes it (``one``: of a call of one step, at any)."""
        if plan is None:
            return None
        plan = dict(plan, rank=plan["rank"] % self.n)
        if one:
            del plan["step"]
        if plan["what"] == "exit":
            if not self.deaths or self.breaking or plan["rank"] == 0:
                return None
            token = os.path.join(self.tokens, f"exit-{len(self.calls)}")
            open(token, "w").close()
            plan["token"] = token
        if plan["what"] == "stall" and not self.stalls:
            return None
        return plan

    @precondition(lambda self: not self.dead)
    @rule(form=st.sampled_from(_FORMS), plan=_PLANS, batch=_batches(),
          via=_VIAS)
    def call(self, form: str, plan: dict | None, batch, via: str) -> None:
        self.make_call(form, self._plan(plan, one=True), batch=batch, via=via)

    @precondition(lambda self: not self.dead)
    @rule(bound=st.booleans(), plan=_PLANS, batches=st.lists(_batches(), min_size=1,
                                                             max_size=6),
          via=_VIAS)
    def steps(self, bound: bool, plan: dict | None, batches: list, via: str) -> None:
        """A call of many steps, its plan at one of them."""
        plan = self._plan(plan)
        if plan is not None:
            plan["step"] %= len(batches)
        self.make_call("bound steps" if bound else "steps", plan, batches=batches,
                       via=via)

    @precondition(lambda self: not self.dead)
    @rule(count=st.integers(2, 12), bound=st.booleans(), at=st.integers(0, 11), plan=_PLANS)
    def burst(self, count: int, bound: bool, at: int, plan: dict | None) -> None:
        """``count`` calls submitted in a row (past the bound on outstanding calls), the
        ``at``-th with ``plan``."""
        form = "bound submitted" if bound else "submitted"
        for k in range(count):
            self.make_call(form, self._plan(plan, one=True) if k == at % count else None)
            if self.dead:
                break

    def make_call(self, form: str, plan: dict | None, batch=None, batches=None,
                  via: str = "plain") -> None:
        index = len(self.calls)
        c = Call(index, form, next(NUMBERS), plan, batch, batches)
        note(f"call {index}: {form}, plan {plan}, " + (
            f"batch {batch!r}" if batches is None else f"batches {batches!r}") +
            ("" if via == "plain" else f", a {via} allreduce"))
        self.calls.append(c)
        self.log.entries.append(c)
        self.count(form + ("" if plan is None else f" ({plan['what']})"))
        if via != "plain":
            self.count(f"{via} allreduce")
        kwargs = {"i": c.number, "plan": plan, "via": via,
                  "timeout": TIMEOUT_S if plan and plan["what"] == "stall" else CALL_TIMEOUT_S}
        run = self.step if form.startswith("bound") else self.f
        args = () if form.startswith("bound") else (self.d, self.s, self.t)
        if "submitted" in form:
            try:
                c.future = run.submit(*args, batch=batch, **kwargs)
            except Exception as err:  # (only its arguments' errors may raise there)
                text = "".join(traceback.format_exception(err))
                forget_frames(err)
                print(f"call {index}: submit raised\n{text}", file=sys.stderr, flush=True)
                raise traced(Mismatch(f"call {index}: submit raised {text}")) from None
            c.future.add_done_callback(lambda _, c=c: setattr(c, "fired", c.fired + 1))
        else:
            try:
                c.see(run(*args, batch=batch, **kwargs) if batches is None else
                      run.steps(batches, *args, **kwargs))
            except Exception as err:
                c.see(err)
            self.blocking_step()
        self.planned(plan, c.submitted)
        self.quiet += 1

    def planned(self, plan: dict | None, submitted: bool) -> None:
        """The runtime side of the model: whether the group is breaking, or gone."""
        if plan is None or plan["what"] == "raise":
            return
        if plan["what"] == "stall":
            self.dead = True
        elif submitted or self.left == 0:
            self.breaking = True
            self.dead = self.dead or self.left == 0
        else:
            self.left -= 1  # (a blocking call replaced the group and ran again)

    def blocking_step(self) -> None:
        if self.breaking and not self.dead:
            self.left -= 1
        self.breaking = False
        if not self.dead:
            self.check()

    @precondition(lambda self: any(c.submitted for c in self.calls))
    @rule(pick=st.integers(0, 1000), how=st.sampled_from(["result", "exception"]))
    def read(self, pick: int, how: str) -> None:
        submitted = [c for c in self.calls if c.submitted]
        c = submitted[pick % len(submitted)]
        note(f"read call {c.index} ({how})")
        try:
            if how == "result":
                outcome = c.future.result(timeout=WAIT_S)
            else:
                outcome = c.future.exception(timeout=WAIT_S)
                if outcome is None:
                    outcome = c.future.result(timeout=0)
        except Exception as err:  # (a CallTimeoutError is a TimeoutError too)
            if isinstance(err, TimeoutError) and not isinstance(err, GroupBrokenError):
                raise Mismatch(f"call {c.index}'s {how}() waited {WAIT_S:g} s") from None
            outcome = err
        c.see(outcome)
        self.log.entries.append(Read(c.index))
        self.count("reads")

    @precondition(lambda self: any(c.submitted for c in self.calls))
    @rule(how=st.sampled_from(["wait", "as_completed"]))
    def wait(self, how: str) -> None:
        futures = [c.future for c in self.calls if c.submitted]
        note(f"{how} for {len(futures)} futures")
        if how == "wait":
            done, pending = concurrent.futures.wait(futures, timeout=WAIT_S)
            if pending:
                raise Mismatch(f"concurrent.futures.wait: {len(pending)} of {len(futures)} "
                               f"futures did not complete within {WAIT_S:g} s")
        else:
            try:
                got = list(concurrent.futures.as_completed(futures, timeout=WAIT_S))
            except concurrent.futures.TimeoutError:
                raise Mismatch("as_completed did not yield every future") from None
            assert len(got) == len(futures)
        self.count(how)

    # -- outside the calls ------------------------------------------------------------
    @precondition(lambda self: self.deaths and not self.dead and not self.breaking
                  and self.quiet >= 3)
    @rule(rank=st.integers(1, 2))
    def kill(self, rank: int) -> None:
        from synk import _testing

        rank = 1 + (rank - 1) % (self.n - 1)
        note(f"kill rank {rank}")
        try:
            os.kill(_testing.worker_process(rank).pid, signal.SIGKILL)
        except ProcessLookupError:  # (gone already: its death breaks the group all the same)
            pass
        _testing.seen_dead(rank)  # (so that the next step of the group's notices it)
        self.log.entries.append(Kill(rank))
        self.quiet = 0
        self.breaking = True
        self.dead = self.left == 0
        self.count("kills")

    @precondition(lambda self: not self.dead)
    @rule(kind=st.sampled_from(["get", "set", "set one", "all_reduce", "broadcast", "gather",
                                "set_data", "distribute", "restarts", "reset", "cores"]),
          rank=st.integers(0, 2), value=st.integers(-3, 3))
    def op(self, kind: str, rank: int, value: int) -> None:
        rank %= self.n
        note(f"op {kind} rank {rank} value {value}")
        op = Op(kind)
        try:
            op.outcome = self.run_op(op, kind, rank, value)
        except Exception as err:
            forget_frames(err)
            op.outcome = err
        self.log.entries.append(op)
        self.count(f"op {kind}")
        if kind != "set_data":
            self.blocking_step()

    def run_op(self, op: Op, kind: str, rank: int, value: int):
        if kind == "get":
            op.args = (rank,)
            return self.s.get_value(rank)
        if kind in ("set", "set one"):
            v = np.array([value, -value], dtype=np.float64)
            op.kind, op.args = "set", (v, rank if kind == "set one" else None)
            return self.s.set_value(v, rank=op.args[1])
        if kind == "all_reduce":
            return synk.shared_all_reduce(self.s, "sum")
        if kind == "broadcast":
            return synk.shared_broadcast(self.s)
        if kind == "gather":
            return synk.shared_gather(self.t)
        if kind == "set_data":
            rows = np.roll(self.log.data, value, axis=0) + value
            op.args = (rows,)
            return self.d.set_value(rows)
        if kind == "distribute":
            return synk.distribute()
        if kind == "reset":
            self.s.set_value(np.zeros(2))
            return synk.shared_scatter(self.t, np.zeros(ROWS))
        if kind == "cores":
            return self.cores()
        self.s.get_value(self.n - 1)  # (every rank answers: a death is seen, and the
        return synk.restarts_left()  # group replaced)

    @invariant()
    def no_stray_entries(self) -> None:
        assert self.log is None or len(self.log.entries) >= len(self.calls)
