"""One call of a synk function from the master (``MasterCall``), waited for or submitted
(``Outstanding``); its steps are drawn in the package's docstring. Rank 0's share runs under
the watchdog; the call's error is the first failure in time.
"""
from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from .._process import PROCESS
from .._wire import protocol as P
from .._wire.data_updates import restore_updates, take_updates
from ..errors import (
    POISONED,
    DeviceFailedError,
    EarlierCallFailedError,
    GroupBrokenError,
    add_note,
    failed_at,
    first_failure,
)
from . import (
    collect as _collect,
    inputs as _inputs,
    rank_copies,
    replica_tensors,
    share,
    shipping,
)
from .collect import OwnOutputs
from .kept import host_copy
from .port import Port
from .profile import COLLECTIVES, COMPUTE, INPUT, OUTPUT, Profile
from .records import Marks, Share, ShareResult, ShareTask, bound_wire, encoded

# -- the master's call -----------------------------------------------------------------------------

class CalledFunction(Protocol):
    """What a call reads of the ``Function`` it runs (``synk.function``)."""

    fid: int
    fn: Callable
    name: str
    _during: str  # "during a call of <name>", for messages
    reduce: Any
    profile: Profile | None
    shipped_generation: int
    ship_error: Exception | None
    captures: Any


class MasterCall:
    """One call of ``function`` on the group behind ``port`` (see the module); ``run`` it
    once, with the group held."""

    __slots__ = ("port", "function", "during", "marks", "moved", "failures", "shares",
                 "timings", "mine", "device_comm", "sink", "bound", "call_id", "future",
                 "deadline", "taken", "kept_values", "seq", "steps", "step_results")

    def __init__(self, port: Port, function: CalledFunction) -> None:
        self.port, self.function = port, function
        self.during = function._during
        self.marks: Marks | None = None
        self.moved: dict | None = None  # rank 0's device transfer counts at the start
        self.failures: list = []  # (when, rank, exception) of each rank that failed
        self.shares: dict[int, Any] = {}  # rank -> its Share, None, or a list (steps)
        self.timings: list = []  # (rank, its Marks.record) of the workers, when profiled
        self.mine = ShareResult(None, None, 0.0)  # rank 0's
        self.device_comm: Any = None  # rank 0's device communicator, if any
        self.sink: Any = None  # where rank 0's share ended (``share.OutputSink``)
        self.bound: Any = None  # the bound step's kept values the call was prepared with
        self.call_id = 0  # the call's number on every rank: its CALL's request id (0: not
        # sent yet)
        self.future: Any = None  # a submitted call's (``CallFuture``)
        self.seq = 0  # a submitted call's number among the lineage's submitted calls
        self.steps: tuple | None = None  # a call of many steps: each step's plan of rows
        self.step_results: list = []  # rank 0's ``ShareResult`` of each step
        self.deadline: tuple | None = None  # a submitted call's (limit, deadline)
        self.taken: Any = None  # what rank 0's share left its captures as
        # (variable, rank 0's value at the call's start) of its shared variables, kept while
        # the group may be replaced (``restore``)
        self.kept_values: list = []

    def run(self, args: tuple, kwargs: dict, batch, num_slices: int, local_batch,
            timeout: float | None, future: Any = None, bound: Any = None,
            steps: list | None = None):
        """The call's result; with ``future`` (``CallFuture``): None once rank 0's share has run.
        ``bound``: a bound step's kept values; ``steps``: one batch per step, the result a list."""
        port = self.port
        port.clock.begin(timeout)
        if self.function.profile is not None:
            self.marks = Marks()
            self.moved = port.device.transfer_counts()
        self.future = future
        try:
            prep = self.prepare(args, kwargs, batch, num_slices, local_batch, bound)
            if steps is not None:
                self.steps = _inputs.step_plans(prep, steps, port.size, self.function.name)
            if port.restarts_left and prep.replicas:
                self.kept_values = [(v, host_copy(PROCESS.replicas[v.id], port.device))
                                    for v in prep.replicas]
            env = port.env()
            if future is not None or steps is not None:  # (its outputs must outlive the
                env = env._replace(outputs=OwnOutputs)  # next call's, or step's, share)
            self.sink, self.device_comm = env.outputs, env.device_comm
            port.check_alive(self.during)  # (a dead worker would not hear the CALL)
            self.call_id = port.clock.next_round()
            if port.size > 1:
                self.send(prep)
            self.own_share(prep, env)
            captures = self.function.captures
            # what rank 0's share left its captures as, read while the workers still run
            self.taken = captures.take() if captures is not None and not self.failures \
                else None
            if future is not None:
                self.deadline = (port.clock.limit, port.clock.deadline)
                port.outstanding().add(self)
                return None
            return self.finish()
        except Exception as exc:
            self.failed()
            if future is None or self.call_id == 0:  # (not sent: its arguments' error, or
                raise  # the group's, the caller's to say)
            port.outstanding().complete(self, error=exc)
            return None
        except BaseException:  # KeyboardInterrupt etc.: the ranks may be out of step
            port.health.kill()
            raise
        finally:
            port.clock.end()

    def settle(self):
        """A submitted call's result, its replies read now (within its own deadline)."""
        clock = self.port.clock
        running = clock.limit, clock.deadline  # (settled inside another request's wait)
        clock.limit, clock.deadline = self.deadline or (None, None)
        try:
            return self.finish()
        except Exception:
            self.failed()
            raise
        except BaseException:
            self.port.health.kill()
            raise
        finally:
            clock.limit, clock.deadline = running

    def restore(self) -> None:
        """Rank 0's shared variables of this call back to their values at its start (its
        group is being replaced; the new group's ranks get them from rank 0). A call keeps
        those values (``kept_values``) while the group may be replaced
        (``fork(restarts=N)``): it restores nothing where no restart was left at its start."""
        for variable, value in self.kept_values:
            PROCESS.replicas[variable.id] = value

    def finish(self):
        """The replies, then the outputs combined."""
        self.replies()
        captures = self.function.captures
        if captures is not None:  # every rank ran it: its own changes are each rank's
            captures.settle(self.taken)
        return self.combine()

    def failed(self) -> None:
        """The call failed: a submitted call that was sent is undone by a replacement where
        the group broke (its own share may have run, in part)."""
        if self.bound is not None:  # (a worker may not have kept them: sent again)
            self.bound.forgotten()
        self.port.hosts.call_failed()
        if self.future is not None and self.call_id and self.port.health.broken is not None:
            self.port.outstanding().undo(self)

    # -- prepare -> send ------------------------------------------------------------------
    def prepare(self, args, kwargs, batch, num_slices, local_batch,
                bound=None) -> _inputs.Prepared:
        function = self.function
        if PROCESS.replica_tensors:  # (the master's changes to copies: in its replicas)
            replica_tensors.check_followed()
            replica_tensors.write_back(replica_tensors.copies_held(), self.port.device)
        if function.shipped_generation != PROCESS.generation or shipping.stale(function):
            shipping.ship(self.port, [function])
        shipping.send_settings(self.port)
        return _inputs.prepare(function, self.port, args, kwargs, batch, num_slices,
                             local_batch, bound)

    def send(self, prep: _inputs.Prepared) -> None:
        """The CALL to every worker; under MPI first the rows other hosts read."""
        port, function = self.port, self.function
        released, moved, left = take_updates()
        blocks = port.blocks
        if blocks.retired:
            released += tuple(blocks.retired)
        clock = port.clock
        if released or moved or left:  # the workers drop the values they keep
            clock.dropped = clock.calls
        plan = None
        if self.sink.collective:  # across hosts: the last plan of the outputs' collectives
            plan = self.sink.planned(function.fid, self.call_id)
        bound = self.bound = prep.bound
        whole = bound is not None and prep is bound.whole and self.steps is None  # (the
        dropped = tuple(PROCESS.steps_dropped)  # step's call, nothing more)
        wire = self.task_wire(prep, whole, dropped)
        try:
            payload = P.call(f"the arguments of {function.name}", wire,
                             (released, moved, left), plan, rank_copies.keep_for(port))
        except BaseException:
            restore_updates(released, moved, left)  # the ranks still need to hear of them
            raise
        del PROCESS.steps_dropped[:len(dropped)]
        blocks.retired.clear()
        rid = self.call_id
        hosts = port.hosts
        if hosts.spans:
            sent = hosts.send_inputs(port, prep, released, self.during, rid,
                                     whole=self.steps is not None)
            if function.profile is not None:
                for leader, nbytes in sent.items():
                    function.profile.add_sent(leader, nbytes)
        port.send(port.workers, payload, self.during, rid)
        if bound is not None:
            bound.held = clock.calls  # (the workers keep its values, as of this call)
            if whole:
                bound.whole_held = clock.calls
        if hosts.spans:
            hosts.inputs_sent(port, self.during)

    def task_wire(self, prep: _inputs.Prepared, whole: bool, dropped: tuple):
        """The workers' ``ShareTask`` of the call as it goes in the CALL: a bound step's
        call (``whole``) that the workers hold by its number alone, else with the step's
        kept values and the ``dropped`` steps, if any."""
        function, bound, clock = self.function, prep.bound, self.port.clock
        task = ShareTask(function.fid, prep.wargs, prep.wkwargs, prep.spos, prep.skeys,
                         prep.wplan, self.call_id, function.profile is not None, prep.frames,
                         inline_outputs=self.future is not None or self.steps is not None,
                         steps=self.steps)
        if bound is not None and whole and bound.whole_is_held(clock):  # the workers hold
            return task.wire_held(bound.number, dropped)  # its task: its number alone
        if bound is None and not dropped:
            return task.wire()
        values = None if bound is None else bound.wire(clock)
        if values is not None:
            values = (values[0], encoded(values[1]))
        return task.wire(bound_wire(number=0 if bound is None else bound.number,
                                    values=values, places=prep.places, dropped=dropped,
                                    whole=whole))

    # -- own share ------------------------------------------------------------------------
    def own_share(self, prep: _inputs.Prepared, env) -> None:
        """Rank 0's share, under the watchdog (``env``: where it runs)."""
        port, function = self.port, self.function
        task = ShareTask(function.fid, prep.args, prep.kwargs, prep.spos, prep.skeys,
                         prep.plan, self.call_id, function.profile is not None, prep.frames,
                         steps=self.steps)

        def work() -> None:
            try:
                result = share.run(env, function, task, self.marks)
            except Exception as exc:
                self.failures.append((failed_at(exc), 0, exc))
                return
            if self.steps is None:
                self.mine = result
            else:
                self.step_results = result

        self.watched(work, lambda: [0, *port.health.unfinished(port.workers)])
        self.shares[0] = self.mine.share if self.steps is None else [
            r.share for r in self.step_results]

    def watched(self, work: Callable[[], None], late: Callable[[], list],
                blocking: bool = False) -> None:
        """Run ``work`` (which catches its own errors) under the watchdog: a worker's death
        or the deadline breaks the group (``late()``: the ranks the timeout names;
        ``blocking``: ``work`` waits inside MPI, see ``Port.watched``)."""
        reason = self.port.watched(work, blocking)
        health = self.port.health
        if health.broken is not None:  # closed from another thread (whatever the share
            health.kill()  # raised meanwhile: e.g. a peer gone from under synk.comm)
            raise health.broken
        if reason is not None:
            if reason[0] == "died":
                health.died(reason[1], self.during)
            raise health.timed_out(late(), self.during)

    # -- replies -> combine ---------------------------------------------------------------
    def replies(self) -> None:
        """Every worker's reply. Raises the call's error (the first failure in time) once
        every reply is in."""
        port = self.port
        device_comm = self.device_comm
        aborted, poisoned, ended = self.read_replies()
        deadline = port.clock.deadline
        late = [r for r, t in ended.items() if deadline is not None and t > deadline]
        if late and not port.hosts.spans:  # (ended past it, however late read; across
            raise port.health.timed_out(late, self.during)  # hosts the clocks differ)
        port.clock.settled = max(port.clock.settled, self.call_id)
        if self.sink.collective:  # across hosts: large outputs by MPI's collectives
            self.combine_by_mpi()
        # the communicators are renewed only when a rank aborted its own (a peer's aborted
        # one fails every rank's next operation), also after a call that succeeded (a check
        # of synk.comm's aborted it, and fn caught the error); else they are kept
        if aborted or (device_comm is not None and device_comm.aborted):
            port.health.comms_failed()
        if self.failures:
            raise self.call_error(poisoned)

    def read_replies(self) -> tuple:
        """(whether some rank's device communicator was aborted, the ranks whose processes
        are poisoned, {rank: when its share ended}) of the workers' replies, their shares
        and failures noted."""
        port = self.port
        device_comm = self.device_comm
        aborted = False
        poisoned = [0] if device_comm is not None and device_comm.poisoned else []
        ended = {}
        for rank, reply in sorted(port.recv(port.workers, self.during,
                                            rid=self.call_id).items()):
            if P.failed(reply):
                ended[rank] = P.failed_at(reply)
                self.failures.append((ended[rank], rank, P.failure(reply, rank)))
                aborted = aborted or P.comm_aborted(reply)
                if P.comm_poisoned(reply):
                    poisoned.append(rank)
                continue
            share, retired, timing, comm, ended[rank] = P.call_reply_fields(P.payload(reply))
            aborted = aborted or bool(comm)
            if self.steps is not None:  # (each step's share)
                self.shares[rank] = [None if s is None else Share.from_wire(s)
                                     for s in share or ()]
            else:
                self.shares[rank] = None if share is None else Share.from_wire(share)
            if retired:
                port.blocks.retire(retired)
            if timing is not None:
                self.timings.append((rank, timing))
        return aborted, poisoned, ended

    def call_error(self, poisoned: list) -> BaseException:
        """The call's error: the first failure in time; the group broken where a device
        failed or a process is ``poisoned``."""
        health = self.port.health
        for dead in [e for _, _, e in self.failures if isinstance(e, DeviceFailedError)]:
            health.device_failed(dead)  # its CUDA context is unusable: so is the group
            break
        first = first_failure(self.failures)
        if poisoned and health.broken is None:  # those processes must not be reused
            broken = health.break_with(GroupBrokenError(
                f"rank(s) {poisoned}: {POISONED}; the group was stopped. Call "
                "synk.fork() to start a new group (fresh worker processes; for rank 0, "
                "a fresh process is safest)"))
            add_note(first, f"synk: {broken}")
        return first

    def combine_by_mpi(self) -> None:
        """Under MPI across hosts, with every reply in: the collectives of the call's large
        outputs (``mpi_collect``). A call that came with a plan runs it (every rank does,
        whatever its share did); if some rank's share did not match it, or the call came
        with none, the plan made from the replies goes to every worker and runs now."""
        port, function, sink = self.port, self.function, self.sink
        began = time.perf_counter()
        if sink.expected is not None:
            combined = self.collectives(sink.settle)
            if not self.failures and sink.valid(self.shares):
                self.combined(combined, began)
                return
        if self.failures:
            return
        plan = sink.plan(self.shares, function.reduce, function.name, function.fid,
                         self.call_id)
        if plan is not None:
            port.send(port.workers, P.request(P.COMBINE, plan), self.during)
            self.combined(self.collectives(lambda: sink.combine(plan)), began)

    def collectives(self, run: Callable[[], dict]) -> dict:
        """Rank 0's part of the outputs' collectives, ``run()``, under the watchdog. A
        failure inside them breaks the group: the other ranks may wait in them."""
        port = self.port
        combined: dict = {}
        errors: list[Exception] = []

        def work() -> None:
            try:
                combined.update(run())
            except Exception as exc:
                errors.append(exc)

        self.watched(work, lambda: list(range(port.size)), blocking=True)
        if errors:
            raise port.health.break_with(errors[0])
        return combined

    def combined(self, combined: dict, began: float) -> None:
        self.mine = self.mine._replace(combined=combined, combining=(
            self.mine.combining + time.perf_counter() - began))

    def combine(self):
        """The call's result from every rank's share (a call of many steps: the list of
        each step's)."""
        port, function = self.port, self.function
        own = self.shares.get(0)
        if self.future is not None and own is not None and not port.device.is_host:
            self.shares[0] = share.on_host(port.device, own)  # (left on rank 0's device)
        if self.steps is not None:
            return [_collect.Combiner(
                port.size, function.name, function.reduce,
                {rank: shares[j] for rank, shares in self.shares.items()},
                self.step_results[j].combined, port.size + 1).result()
                for j in range(len(self.steps))]
        marks = self.marks
        if marks is not None:
            marks.replied = time.perf_counter()
        combiner = _collect.Combiner(
            port.size, function.name, function.reduce, self.shares, self.mine.combined,
            port.parallel_reduce_ranks if self.future is None else port.size + 1)
        if combiner.parallel:
            self.reduce_in_parallel(combiner)
        result = combiner.result()
        if marks is not None:
            marks.combined = time.perf_counter()
            self.record()
        return result

    def reduce_in_parallel(self, combiner: _collect.Combiner) -> None:
        """The second round: every rank combines a chunk of each large output."""
        port = self.port
        tasks = combiner.parallel_tasks(port.blocks)
        during = "while combining outputs"
        rid = port.clock.next_round()
        for rank in port.workers:
            port.send((rank,), P.request(P.REDUCE, tasks[rank]), during, rid)
        error = None
        try:
            _collect.run_tasks(tasks[0])
        except Exception as exc:
            error = exc
        replies = port.recv(port.workers, during)
        if error is not None:
            raise error
        for rank, reply in sorted(replies.items()):
            failed = P.failure(reply, rank)
            if failed is not None:
                raise failed
            if self.function.profile is not None:
                self.function.profile.add(rank, COLLECTIVES, P.payload(reply))

    def record(self) -> None:
        """Add the call to the function's profile: every rank's parts and bytes."""
        profile, marks = self.function.profile, self.marks
        assert profile is not None and marks is not None and self.moved is not None
        combining = self.mine.combining  # (inside rank 0's output part so far)
        mine = marks.record(marks.replied, combining, self.moved,
                            self.port.device.transfer_counts())
        for rank, record in ((0, mine), *self.timings):
            for part, seconds in zip((INPUT, COMPUTE, OUTPUT), record[:3]):
                profile.add(rank, part, seconds)
            if rank and record[3]:
                profile.add(rank, COLLECTIVES, record[3])
            profile.add_bytes(rank, record[4], record[5])
        profile.add(0, COLLECTIVES, marks.combined - marks.replied + combining)
        profile.add_call(marks.combined - marks.begin)


# -- calls that do not wait ------------------------------------------------------------------------

MAX_OUTSTANDING = 8  # submitted calls whose replies may wait unread; one more settles the
# oldest


class CallFuture(concurrent.futures.Future):
    """The result of a submitted call, completed as its replies arrive (the settler thread) or
    when asked for: ``result()`` reads the replies of the outstanding calls up to this one. It
    cannot be cancelled: its CALL was sent when it was made."""

    def __init__(self, settle: Callable[[CallFuture], None], outstanding: Outstanding) -> None:
        super().__init__()
        self._settle = settle  # reads the outstanding calls' replies up to this one's
        self._outstanding = outstanding
        self.set_running_or_notify_cancel()

    def result(self, timeout: float | None = None) -> Any:
        return self._read(super().result, timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._read(super().exception, timeout)

    def _read(self, get, timeout: float | None):
        """``get(timeout)`` of the future, its call's replies read first if they are not."""
        if not self.done():
            self._settle(self)
        try:
            return get(timeout)
        finally:
            self._outstanding.read(self)


class Gate:
    """The first failure among submitted calls that the caller has not read: a call submitted after
    it (``seq``), until its future's ``result()`` or ``exception()`` is read (``lifted``: the number
    of the first call submitted after that), fails with ``EarlierCallFailedError``."""

    __slots__ = ("seq", "error", "future", "lifted")

    def __init__(self, seq: int, error: BaseException, future: CallFuture) -> None:
        self.seq, self.error, self.future = seq, error, future
        self.lifted: int | None = None


def _later(error: BaseException) -> EarlierCallFailedError:
    """The error of a call submitted after one that failed with ``error``."""
    later = EarlierCallFailedError(
        "this call was submitted after a call that failed (the cause below), before that "
        "failure was read, and ran on what that call left (on GPU ranks, where the failure "
        "aborted the NCCL communicators, it may have stopped part way); its result is not "
        "given and its changes to shared variables are not undone. Read the failed call's "
        "error (its future's result()) to submit calls whose results count again")
    later.__cause__ = error
    return later


class Outstanding:
    """A lineage's submitted calls whose replies are still to be read, oldest first (each a
    ``MasterCall``), and the ``Gate`` of the first failure the caller has not read. Replies are read
    (``settle``) when a future is asked, at ``MAX_OUTSTANDING``, and before anything else the group
    does (``Group.hold``); the ranks may run call k+1 first because a submitted call's outputs ride
    its replies and no scratch block holds them. Outcomes are delivered (``deliver``) once the group
    is let go. ``undone``: calls failed by a broken group; a replacement restores the shared
    variables from before the first of them (so resubmitting gives the uninterrupted bits), and
    until one is read (``broke``) a submit fails with the group's error. A replacement takes over
    the gate and numbering (``carry``)."""

    def __init__(self) -> None:
        self.calls: deque = deque()
        self.reading = None  # the call whose replies ``settle`` reads (taken off ``calls``)
        self.gate: Gate | None = None
        self.broke: BaseException | None = None  # the group's error of a submitted call
        # that failed because the group broke, not read yet
        self.submitted = [0]  # the lineage's last submitted call's number (one counter,
        # shared with the groups that replace this one: ``carry``)
        self.undone: list = []
        self.outcomes: deque = deque()  # (future, result, error) to deliver
        self.added: Callable[[], None] | None = None  # told of each call added (the
        # settler thread, which completes the futures as their replies arrive)

    def __bool__(self) -> bool:
        """Whether a call's replies are unread, or being read: a look without the group's
        lock (``Shared.get_value``) must not find none while the last one is read."""
        return bool(self.calls) or self.reading is not None

    def number(self) -> int:
        """The number of the call about to be submitted."""
        self.submitted[0] += 1
        return self.submitted[0]

    def carry(self, old: Outstanding) -> None:
        """Go on from ``old``, the outstanding calls of the group this one replaces."""
        self.gate, self.submitted = old.gate, old.submitted

    def add(self, call) -> None:
        self.calls.append(call)
        if self.added is not None:
            self.added()

    def settle(self, upto=None, ready: Callable[[Any], bool] | None = None) -> None:
        """Read the replies of the outstanding calls, oldest first (to ``upto`` included, else all;
        with ``ready``, while it says the oldest one's are in) and give each future its outcome.
        Ctrl-C and other BaseExceptions go up (the group is then stopped: ``fail_all``)."""
        while self.calls:
            call = self.calls[0]
            if ready is not None and not ready(call):
                return
            outer, self.reading = self.reading, call  # (outer: the call this settle
            self.calls.popleft()  # runs inside the reading of, if any)
            try:
                result = call.settle()
            except Exception as exc:
                self.complete(call, error=exc)
            except BaseException as exc:  # (Ctrl-C: the group was stopped; this future,
                self.outcomes.append((call.future, None, GroupBrokenError(  # off the queue,
                    "the group was stopped while this submitted call's replies were read "
                    f"({type(exc).__name__}); call synk.fork() again")))  # is ended here)
                raise
            else:
                self.complete(call, result)
            finally:
                self.reading = outer
            if call is upto:
                break

    def complete(self, call, result: Any = None, error: BaseException | None = None) -> None:
        """Give ``call``'s future its outcome (see the class). Behind a failure not read,
        a call's value or error is ``EarlierCallFailedError``, also where the group broke
        after it ran; only the group's own error (it broke under the call) stays."""
        group_error = isinstance(error, GroupBrokenError) and \
            call.port.health.broken is not None
        gate = None if group_error else self._behind(call)
        if gate is not None:
            result, error = None, _later(gate.error)
        elif group_error:
            self.broke = self.broke or error
        elif error is not None:
            self.gate = Gate(call.seq, error, call.future)
        self.outcomes.append((call.future, result, error))

    def _behind(self, call) -> Gate | None:
        """The gate ``call`` was submitted behind, if any (a gate lifted before the calls
        behind it were all settled goes once the first call after it is)."""
        gate = self.gate
        if gate is None or call.seq <= gate.seq:
            return None
        if gate.lifted is not None and call.seq >= gate.lifted:
            self.gate = None
            return None
        return gate

    def deliver(self) -> None:
        """Set the futures' outcomes that ``complete`` gave (their callbacks run here)."""
        outcomes = self.outcomes
        while outcomes:
            try:
                future, result, error = outcomes.popleft()
            except IndexError:  # (another thread delivered it)
                return
            if future.done():
                continue
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def read(self, future: CallFuture) -> None:
        """A caller read ``future``: where it is the gate's, the calls submitted from now
        on count again; where it failed because the group broke, calls may be submitted
        again (to the group that replaces it)."""
        gate = self.gate
        if gate is not None and gate.future is future and gate.lifted is None:
            gate.lifted = self.submitted[0] + 1
        if self.broke is not None and isinstance(
                concurrent.futures.Future.exception(future, 0), GroupBrokenError):
            self.broke = None

    def undo(self, call) -> None:
        """``call`` failed because the group broke: a replacement undoes it."""
        if call not in self.undone:
            self.undone.append(call)

    def fail_all(self, error: BaseException) -> None:
        """The group stopped: every outstanding call fails with ``error`` (and is undone
        where a replacement follows)."""
        while self.calls:
            call = self.calls.popleft()
            self.undo(call)
            self.outcomes.append((call.future, None, error))
            self.broke = self.broke or error
        self.deliver()
