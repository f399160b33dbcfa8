"""``Function``: a plain Python function run data-parallel on every rank, and shipping it."""
from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import itertools
import math
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from numpy.typing import ArrayLike

from . import _settings
from ._call import inputs as _inputs, ops as _ops, share as _share, shipping
from ._call.bound_values import BoundArguments, snapshot
from ._call.collect import Combiner
from ._call.kept import reinstall
from ._call.master import MAX_OUTSTANDING, CallFuture, MasterCall
from ._call.profile import Profile
from ._call.records import ShareTask
from ._process import PROCESS
from .errors import (
    DeviceFailedError,
    GroupBrokenError,
    RankReplacedWarning,
    StepClosedError,
    WorkerDiedError,
    outside_synk,
)

_ids = itertools.count(1)


def _collected(fid: int) -> None:
    """A Function's finalizer (it may run in any thread, at any time: only list appends):
    the workers drop it with the next message, its staging blocks go before the next call."""
    PROCESS.forgotten.append(fid)
    PROCESS.staging_dropped.append(fid)


_DEFAULT: Any = object()  # the call's timeout is the function's
_RESERVED = ("batch", "num_slices", "timeout", "local_batch")


def check_timeout(timeout) -> float | None:
    """``timeout`` as a float number of seconds, or None for no limit."""
    if timeout is None:
        return None
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(timeout, bool) or not seconds > 0:  # also refuses nan
        raise ValueError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    return None if math.isinf(seconds) else seconds


def _names(value, what: str) -> frozenset:
    if isinstance(value, str):
        return frozenset([value])
    try:
        names = frozenset(value)
    except TypeError:
        raise TypeError(
            f"{what} must be a parameter name or a list of names, not {value!r}") from None
    if not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{what} must hold parameter names (strings), got {sorted(map(repr, names))}")
    return names


def _scattered(name: str, params, inputs, bcast_inputs) -> frozenset:
    """The names of the scattered parameters of ``name`` (its ``params``): ``inputs``,
    or where None, every parameter but ``bcast_inputs``."""
    bcast = _names(bcast_inputs, "bcast_inputs")
    scattered = None if inputs is None else _names(inputs, "inputs")
    for what, names in (("bcast_inputs", bcast), ("inputs", scattered or frozenset())):
        unknown = sorted(names - set(params))
        if unknown:
            raise ValueError(
                f"{what} names {unknown} that are not parameters of {name}; "
                f"its parameters are {list(params)}"
            )
    both = sorted(bcast & (scattered or frozenset()))
    if both:
        raise ValueError(f"{both} are named in both inputs and bcast_inputs; pick one")
    return frozenset(params) - bcast if scattered is None else scattered


class Function:
    """A function that runs data-parallel on every rank; call it like ``fn``.

    ``synk.Function(...)`` is the same as ``synk.function(...)``, which documents the
    parameters. No running group is needed to build one; it is shipped to the workers on
    its first call in each group, or by ``synk.distribute()``. ``repr(f)`` looks like
    ``synk.Function(loss, scattered=['x'], reduce='mean')``.
    ``f.local(...)`` runs ``fn`` in the master alone over all the rows, to check a call
    against one process.

    Attributes:
        fn: the wrapped callable.
        name: ``fn.__qualname__`` (or ``repr(fn)``), used in messages.
        signature: ``inspect.signature(fn)``.
        scattered: frozenset of the names of the scattered parameters.
        reduce: the reduce ops in canonical form: one op name or None, or a tuple of them
            (``"avg"`` becomes ``"mean"``).
        timeout: the default timeout of a call in seconds, or None.
        profile: a ``synk.Profile`` of every call so far when built with profiling on,
            else None; ``print(f.profile)`` shows it.
    """

    def __init__(self, fn: Callable, *, inputs: Iterable[str] | None = None,
                 bcast_inputs: Iterable[str] = (),
                 reduce: str | None | Sequence[str | None] = "mean",
                 timeout: float | None = None, profile: bool | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"synk.function needs a callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = getattr(fn, "__qualname__", None) or repr(fn)
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError) as err:
            raise TypeError(f"cannot read the parameters of {self.name}: {err}") from None
        params = self.signature.parameters
        clash = [p for p in _RESERVED if p in params]
        if clash:
            raise ValueError(
                f"{self.name} has a parameter named {clash[0]!r}, which synk uses as a call "
                "option; rename that parameter"
            )
        self.scattered = _scattered(self.name, params, inputs, bcast_inputs)
        self.parameters = _inputs.Parameters(self.name, self.signature, self.scattered)
        self.reduce = _ops.check_reduce(reduce)
        self.timeout = check_timeout(timeout)
        if profile is None:
            profile = _settings.profile_default()
        self.profile: Profile | None = Profile(self.name) if profile else None
        self.fid = next(_ids)
        self._during = f"during a call of {self.name}"
        self.shipped_generation = -1
        self.captures = None  # what fn captured when shipped (_call.captures)
        self.ship_error: Exception | None = None  # why shipping failed; retried on call
        PROCESS.functions[self.fid] = self
        weakref.finalize(self, _collected, self.fid)

    def __repr__(self) -> str:
        return (
            f"synk.Function({self.name}, scattered={sorted(self.scattered)}, "
            f"reduce={self.reduce!r})"
        )

    def __call__(self, *args: Any, batch: int | slice | ArrayLike | None = None,
                 num_slices: int = 1, timeout: float | None = _DEFAULT,
                 local_batch: Any = None, **kwargs: Any) -> Any:
        """Run ``fn`` on every rank's share of the scattered inputs and combine the outputs.

        ``args`` and ``kwargs`` are bound to ``fn``'s signature as in a plain call;
        parameters left out are not sent, and each rank uses ``fn``'s default. What inputs
        may be, which ranks run ``fn``, the reduce ops and every error are described under
        [Calling a Function](api/calls.md#calling-a-function).

        Args:
            batch: the rows of the scattered inputs to use, chosen before the split:
                None (all rows); an int ``n`` (the first ``n`` rows, ``0 <= n <= len``);
                a ``slice`` with a positive step; a 1-d integer index array or sequence
                (those rows in that order, repeats and negative indices allowed; rank
                ``r`` gets a consecutive run of it); or a 1-d boolean mask with one entry
                per row.
            num_slices: each rank cuts its share into up to this many consecutive,
                non-empty pieces and runs ``fn`` on them one after another; the pieces'
                results are combined with the same reduce ops, so only the size of
                ``fn``'s intermediate arrays changes. Ignored when nothing is scattered.
            timeout: seconds, or None for no limit; overrides the function's ``timeout``
                for this call. See [Timeouts](api/calls.md#timeouts).
            local_batch: the rows each rank uses out of its own share, chosen after the
                split (Synkhronos's ``batch_s``): None (all of them); an int ``n`` (its
                first ``n``); a ``slice`` with a positive step; a numpy index array or
                boolean mask of positions within the share; or a list with one such entry
                per rank. With ``batch=`` it picks within each rank's share of the batch.
                The way to pick rows of a ``Data`` resident in shard mode.

        Returns:
            The combined output, or a tuple of them when ``fn`` returns a tuple (only a
                tuple counts as several outputs). An output that is a list or dict of
                arrays (nested too) is combined leaf by leaf and keeps its structure.
        """
        return self._run(args, kwargs, batch, num_slices, local_batch, timeout)

    def _run(self, args: tuple, kwargs: dict, batch, num_slices, local_batch, timeout,
             bound: BoundArguments | None = None, steps: list | None = None) -> Any:
        timeout = self.timeout if timeout is _DEFAULT else check_timeout(timeout)
        while True:
            group = _held(self.name)
            call = MasterCall(group, self)
            try:
                try:
                    return call.run(args, kwargs, batch, num_slices, local_batch, timeout,
                                    bound=bound, steps=steps)
                finally:
                    group.release()
            except Exception:
                if not _replaced(group, f"during a call of {self.name}", call):
                    raise

    def steps(self, batches: Iterable, *args: Any, timeout: float | None = _DEFAULT,
              **kwargs: Any) -> list:
        """Many steps in one call: every rank runs ``fn`` once per entry of ``batches``, in
        order, each time on the rows that ``f(*args, batch=b, **kwargs)`` would give it; the
        list of what each of those calls would return, bit for bit.

        A training loop's steps run on the ranks, the master handing them over once per
        call rather than once per step (as Keras's ``steps_per_execution``). Shared
        variables, replicas and ``Data`` are live: each step sees the previous step's
        updates, and every rank's replicas end as a loop of calls leaves them.
        ``synk.comm`` inside ``fn`` works as in a call (a ``mean``'s weight of each step's
        rows included); each step's outputs are combined by the function's ``reduce`` as
        a call's are. See [Many steps in one call](api/calls.md#many-steps-in-one-call).

        Args:
            batches: one entry per step, each what ``batch=`` takes (an index array, a
                slice, an int, a boolean mask) over the scattered inputs' rows.
            timeout: seconds for the whole call, or None; overrides the function's.

        Returns:
            A list with one entry per step.

        Raises:
            ValueError: no input is scattered, ``batches`` is empty, or a batch is bad
                (the message names its step).
            Exception: the error of the step that failed (its note names the step): the
                steps before it took effect, the later ones did not run.
        """
        return self._run(args, kwargs, None, 1, None, timeout, steps=list(batches))

    def submit(self, *args: Any, batch: int | slice | ArrayLike | None = None,
               num_slices: int = 1, timeout: float | None = _DEFAULT,
               local_batch: Any = None, **kwargs: Any) -> concurrent.futures.Future:
        """Start a call and return at once: a ``concurrent.futures.Future`` whose
        ``result()`` gives what the call returns (or raises its error).

        Arguments and options are a call's. Rank 0's share runs before ``submit`` returns,
        in the caller's thread; the workers run theirs meanwhile and after, and the next
        submitted call is sent without waiting for this one's replies: the ranks run the
        calls back to back, in the order submitted. The future completes as the replies
        arrive (``concurrent.futures.wait``, ``as_completed`` and done-callbacks work), or
        when its result is asked for. Errors in the arguments raise here; every error of
        the call, the group's included, raises from ``result()``. A call submitted after
        one that failed, before that failure was read, fails with
        ``synk.EarlierCallFailedError``. ``timeout`` counts from the submit. See [Calls
        that do not wait](api/calls.md#calls-that-do-not-wait).
        """
        return self._submit(args, kwargs, batch, num_slices, local_batch, timeout)

    def _submit(self, args: tuple, kwargs: dict, batch, num_slices, local_batch, timeout,
                bound: BoundArguments | None = None) -> concurrent.futures.Future:
        """A submitted call on the running group. Errors of its arguments raise here;
        everything else that fails it fails its future. A group broken before the call was
        sent is replaced first, as ``_held`` decides; a call that breaks once sent is not
        run again (its future raises)."""
        timeout = self.timeout if timeout is _DEFAULT else check_timeout(timeout)
        while True:
            try:
                group = _held(self.name, settle=False)
            except GroupBrokenError as exc:
                return _failed(exc)
            call = MasterCall(group, self)
            try:
                try:
                    return _submit_on(group, call, args, kwargs, batch, num_slices,
                                      local_batch, timeout, bound)
                finally:
                    group.release()
            except GroupBrokenError as exc:  # (before the call was sent)
                broke = group.outstanding().broke  # (the break failed the calls outstanding)
                if broke is not None:
                    return _failed(broke)
                if not _replaced(group, f"before a call of {self.name}"):
                    return _failed(exc)

    def bind(self, *args: Any, **kwargs: Any) -> Step:
        """A bound step: ``fn`` with these arguments fixed, for a loop that calls it again
        and again (``functools.partial``'s rules: ``step(*more, **more_kw)`` calls
        ``fn(*args, *more, **{**kwargs, **more_kw})``).

        A ``Data`` or a shared variable is a live reference: each call sees its current
        contents. Every other value is taken by value now (arrays and tensors copied, lists,
        tuples and dicts item by item, other objects, subclasses of those included,
        deep-copied), so changing it later does not change the step; pass it per call, or
        ``step.rebind(...)``, to change it. A shared torch module cannot be bound
        (``TypeError``): the function that captures it has it. A step belongs to the group
        it was bound in; ``step.close()`` ends it. See [Bound steps](api/calls.md#bound-steps).
        """
        return Step(self, args, kwargs)

    def local(self, *args, batch=None, num_slices: int = 1, **kwargs):
        """Run ``fn`` in this process alone over all the rows, for checking and debugging.

        Arguments are handled as in a call (scattered and broadcast inputs, ``Data`` or
        arrays, ``batch=``, ``num_slices=``; a ``Shared`` gives the master's replica), but
        the selected rows are not split: the result is what ``fn`` returns for all of them
        (its ``num_slices`` pieces combined with the reduce ops), so ``f(x)`` and
        ``f.local(x)`` agree wherever combining the ranks' results gives ``fn`` over all
        rows. Outputs with reduce op None are ``fn``'s value itself, not a list. Needs no
        running group; in a GPU group it runs on rank 0's device, as rank 0's share does,
        and gives its results on the host. Inside ``fn``, ``synk.comm`` sees a single rank.
        """
        group = PROCESS.group
        hold: contextlib.AbstractContextManager = contextlib.nullcontext()
        env = _share.ALONE
        if group is not None and group.broken is None and not group.closed:
            hold = group.exclusive(f"{self.name}.local()")
            if group.device is not None and not group.device.is_host:
                env = env._replace(device=group.device)
        with hold:
            prep = _inputs.prepare(self, None, args, kwargs, batch, num_slices)
            task = ShareTask(self.fid, prep.args, prep.kwargs, prep.spos, prep.skeys,
                             prep.plan, 0, False, prep.frames)
            share = _share.run(env, self, task).share
        return Combiner(0, self.name, self.reduce, {0: share}).result()


class Step:
    """A function with some arguments bound (``Function.bind``); call it, or ``submit`` it,
    with the rest."""

    __slots__ = ("function", "args", "kwargs", "_generation", "_bound", "__weakref__")

    def __init__(self, function: Function, args: tuple, kwargs: dict) -> None:
        self.function = function
        self._generation: int | None = None  # its group's lineage (None: closed)
        self._bound: BoundArguments | None = None
        self._bind(args, kwargs)

    def _bind(self, args: tuple, kwargs: dict) -> None:
        clash = sorted(set(kwargs) & set(_RESERVED))
        if clash:
            raise TypeError(f"{clash} are options of each call, not arguments to bind; pass "
                            "them when calling the step")
        group = PROCESS.require_group()
        self.args = tuple(snapshot(v) for v in args)
        self.kwargs = {k: snapshot(v) for k, v in kwargs.items()}
        self._generation = group.lineage
        number = next(_steps)
        self._bound = BoundArguments(number, self.args, self.kwargs)
        weakref.finalize(self._bound, _step_ended, number)

    def rebind(self, *args: Any, **kwargs: Any) -> Step:
        """Bind these arguments in place of the step's (by value, as ``bind``); the step."""
        self._check()
        self._bind(args, kwargs)
        return self

    def _check(self) -> None:
        """``StepClosedError`` unless the step is open and its group is running."""
        if self._generation is None:
            raise StepClosedError(f"this step of {self.function.name} was closed; bind it "
                                  "again (f.bind(...))")
        group = PROCESS.group
        if group is None or group.lineage != self._generation:
            raise StepClosedError(
                f"this step of {self.function.name} was bound in another group, which has "
                "ended; bind it again in this one (f.bind(...))")

    def _with(self, more: tuple, more_kwargs: dict) -> tuple[tuple, dict]:
        """(args, kwargs) of a call of the open step with ``more`` of them."""
        self._check()
        return ((*self.args, *more) if more else self.args,
                {**self.kwargs, **more_kwargs} if more_kwargs else self.kwargs)

    def __call__(self, *more: Any, batch: int | slice | ArrayLike | None = None,
                 num_slices: int = 1, timeout: float | None = _DEFAULT,
                 local_batch: Any = None, **more_kwargs: Any) -> Any:
        """Run the step: ``fn(*args, *more, **{**kwargs, **more_kwargs})``, as a call of its
        function with these options."""
        return self.function._run(*self._with(more, more_kwargs), batch, num_slices,
                                  local_batch, timeout, self._bound)

    def steps(self, batches: Iterable, *more: Any, timeout: float | None = _DEFAULT,
              **more_kwargs: Any) -> list:
        """``Function.steps`` of the step: many steps in one call, one per batch, each on
        the rows ``step(*more, batch=b, **more_kwargs)`` would take; their results."""
        return self.function._run(*self._with(more, more_kwargs), None, 1, None, timeout,
                                  self._bound, steps=list(batches))

    def submit(self, *more: Any, batch: int | slice | ArrayLike | None = None,
               num_slices: int = 1, timeout: float | None = _DEFAULT,
               local_batch: Any = None, **more_kwargs: Any) -> concurrent.futures.Future:
        """``Function.submit`` of the step: its call started, a future of its result."""
        return self.function._submit(*self._with(more, more_kwargs), batch, num_slices,
                                     local_batch, timeout, self._bound)

    def close(self) -> None:
        """End the step: its bound values are let go, and calling it raises."""
        self._generation = self._bound = None  # (its values go: ``_step_ended``)
        self.args, self.kwargs = (), {}

    def __enter__(self) -> Step:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._generation is None else f"{len(self.args)} args, " \
            f"{sorted(self.kwargs)}"
        return f"synk.Step({self.function.name}, {state})"


def _held(name: str, settle: bool = True):
    """The running group, held for a call of ``name``; a group that broke because a rank
    died is replaced first, while ``fork(restarts=N)`` allows (``_replaced``), but for a
    submitted call (``settle=False``) while a submitted call the break failed has not been
    read (``Outstanding.broke``: its error is this one's)."""
    while True:
        group = PROCESS.require_group()
        try:
            group.hold(name, settle=settle)
            return group
        except GroupBrokenError:
            broke = group.outstanding().broke
            if not settle and broke is not None:
                raise broke from None
            if not _replaced(group, f"before a call of {name}"):
                raise


def on_group(what: str, work: Callable[[Any, Any], Any]) -> Any:
    """``work(group, attempt)`` with the running group held, for a master-side operation
    (``what``): a master-side operation is a call too, so a group that a rank's death
    broke is replaced first, and again if a rank dies during it, while ``fork(restarts=N)``
    allows; then it runs from its start. ``attempt.call``: the ``MasterCall`` the try runs,
    if any, whose shared variables a replacement gives back their values at its start."""
    while True:
        group = _held(what)
        attempt = types.SimpleNamespace(call=None)
        try:
            try:
                return work(group, attempt)
            finally:
                group.release()
        except Exception:
            if not _replaced(group, f"during {what}", attempt.call):
                raise


def replaceable(group) -> bool:
    """Whether ``group`` broke in a way ``fork(restarts=N)`` replaces it from: a worker's
    death or its GPU's failure (not a timeout, ``close()`` or Ctrl-C), restarts left."""
    broken = group.health.broken
    return bool(group.restarts_left) and group.replacement is not None and (
        isinstance(broken, WorkerDiedError) or
        isinstance(broken, DeviceFailedError) and broken.rank != 0)


def _replaced(group, when: str, call: MasterCall | None = None) -> bool:
    """Whether ``group``, broken, was replaced by a new group (``replaceable``): every
    rank's shared variables are given back their values at ``call``'s start (or those
    before the submitted calls the death failed, or after the last call) first, and
    ``RankReplacedWarning`` says what happened."""
    if not replaceable(group):
        return False
    broken = group.health.broken
    began = time.monotonic()
    undone = group.outstanding().undone  # (submitted calls the death failed: see Outstanding)
    failed = [c for c in (call, *undone) if c is not None]
    for each in sorted(failed, key=lambda c: c.call_id or math.inf, reverse=True):
        each.restore()  # (the oldest last: each variable as before the first that had it)
    before = min((c.call_id for c in failed if c.call_id), default=None)
    submitted = bool(undone)
    undone.clear()
    group.replacement()
    new = PROCESS.group
    with new.exclusive("giving the new group's ranks their replicas back"):
        reinstall(new, group.generation, before)
    left = new.restarts_left
    cause = str(broken).split("; the other ranks were stopped")[0]  # (what died, and how)
    if when not in cause:
        cause += f" ({when})"
    warnings.warn(RankReplacedWarning(
        f"synk: {cause}; a new group of {group.size} ranks was started in "
        f"{time.monotonic() - began:.2f} s and " + (
            "the call runs again from its start (its shared variables as they were then; "
            "a Data it wrote in place before the failure keeps those writes)"
            if call is not None else "the call runs on it")
        + ("; the submitted calls that failed were undone (the shared variables as they were "
           "before the first of them): submit them again" if submitted else "")
        + f"; {left} restart{'s' if left != 1 else ''} left"), stacklevel=outside_synk())
    return True


def _step_ended(number: int) -> None:
    """A bound step's values were let go (it was closed, bound again, or collected; any
    thread, any time: only list appends): the workers forget theirs with the next call, its
    staging blocks go before it."""
    PROCESS.steps_dropped.append(number)
    PROCESS.staging_dropped.append(-number)


_steps = itertools.count(1)  # bound steps' numbers


def _submit_on(group, call: MasterCall, args: tuple, kwargs: dict, batch, num_slices,
               local_batch, timeout, bound) -> CallFuture:
    """``Function._submit`` on the held ``group``: ``call`` sent, its future."""
    outstanding = group.outstanding()

    def settle(future: CallFuture) -> None:
        try:
            group.hold(f"the result of a submitted call of {call.function.name}",
                       settle=False)
        except Exception as exc:  # (the group broke: its error is this call's)
            if not future.done():
                future.set_exception(exc)
            return
        try:
            if call in outstanding.calls:
                outstanding.settle(upto=call)
        finally:
            group.release()

    future = CallFuture(settle, outstanding)
    if len(outstanding.calls) >= MAX_OUTSTANDING:
        outstanding.settle(upto=outstanding.calls[0])
    call.seq = outstanding.number()
    if not group.hosts.spans:
        call.run(args, kwargs, batch, num_slices, local_batch, timeout, future=future,
                 bound=bound)
        return future
    # across hosts the outputs' collectives follow the replies at once: it runs to its end
    result = error = None
    try:
        result = call.run(args, kwargs, batch, num_slices, local_batch, timeout, bound=bound)
    except Exception as exc:
        if call.call_id == 0:
            raise
        error = exc
    call.future = future
    outstanding.complete(call, result, error)
    return future


def _failed(error: BaseException) -> concurrent.futures.Future:
    """A future that fails with ``error`` (a submitted call the group could not run)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(error)
    return future


def function(fn: Callable, *, inputs: Iterable[str] | None = None,
             bcast_inputs: Iterable[str] = (),
             reduce: str | None | Sequence[str | None] = "mean",
             timeout: float | None = None, profile: bool | None = None) -> Function:
    """Wrap ``fn`` to run data-parallel on every rank.

    Calling the result runs ``fn`` on every rank over that rank's rows of the scattered
    inputs and returns the outputs combined with their reduce ops. A single string is
    taken as one name in ``inputs`` and ``bcast_inputs``. A ``*args`` or ``**kwargs``
    parameter is named by its parameter name, and the choice applies to every item it
    collects. ``fn`` may not have a parameter called ``batch``, ``num_slices``,
    ``timeout`` or ``local_batch``: these are call options.

    Args:
        fn: any callable whose signature ``inspect.signature`` can read. It must be
            picklable with cloudpickle, and any module it uses by reference must be
            importable by the workers.
        inputs: the parameters to scatter (split along axis 0). Default: every parameter
            not named in ``bcast_inputs``. When given, the parameters named in neither list
            are broadcast.
        bcast_inputs: the parameters sent whole to every rank.
        reduce: how each output is combined across ranks: one op for every output, or a
            list or tuple with one op per output. Ops: ``"mean"`` (alias ``"avg"``;
            ``"exact_mean"``: accumulated in float64, the same bits on every back end),
            ``"sum"``, ``"prod"``, ``"max"``, ``"min"``, ``"gather"``, None; names are
            case-insensitive. See [Reduce ops](api/calls.md#reduce-ops). None gives a list of
            every rank's value; each output has its own list, so several outputs under
            None give a tuple of lists (one per output), not one tuple per rank:
            ``list(zip(*f(x)))`` gives those.
        timeout: the default time limit of each call in seconds (None: no limit); a call's
            own ``timeout=`` overrides it. See [Timeouts](api/calls.md#timeouts).
        profile: record where each call's time goes, per rank, in ``f.profile``. Default:
            on when the environment variable ``SYNK_PROFILE`` is ``1`` (``true``, ``yes``,
            ``on``). Off, calls read no clock. See [Profiling](api/calls.md#profiling).

    Returns:
        The ``Function``.

    Raises:
        TypeError: ``fn`` is not callable, or its signature cannot be read; ``inputs`` or
            ``bcast_inputs`` is neither a string nor an iterable of strings.
        ValueError: ``fn`` has a parameter named ``batch``, ``num_slices``, ``timeout`` or
            ``local_batch``;
            ``inputs`` or ``bcast_inputs`` names something that is not a parameter of
            ``fn`` (the message lists its parameters); a name is in both lists; an unknown
            reduce op, or an empty list of ops; ``timeout`` is not a positive number or
            None.
    """
    return Function(fn, inputs=inputs, bcast_inputs=bcast_inputs, reduce=reduce,
                    timeout=timeout, profile=profile)


def distribute(timeout: float | None = None) -> None:
    """Ship every function built so far (and still referenced) to the running group's
    workers, in one message.

    Optional: a function not yet shipped is shipped on its first call (under that call's
    ``timeout``). Use it to pay the shipping cost, and see any error, before the first
    call. When shipping all pending functions together fails, they are shipped one by
    one: the good ones arrive, the first failure is raised, and the functions that failed
    are skipped by later ``distribute()`` calls (calling such a function tries to ship it
    again, and raises again).

    Args:
        timeout: seconds the workers have to unpickle the functions (None: no limit).

    Raises:
        NotForkedError: no group is running.
        GroupBrokenError: the group is broken.
        TypeError: a pending function cannot be pickled in the master ("cannot pickle
            NAME to ship it to the workers: ...").
        DistributeError: a worker could not unpickle a function, typically because it uses
            a module the workers cannot import. The message names the function and the
            rank; ``__cause__`` is the worker's error.
        WorkerDiedError: a worker died while functions were being shipped.
        CallTimeoutError: with ``timeout``, some workers had not unpickled the functions
            in time; ``.ranks`` names them and the group is stopped.
        ValueError: ``timeout`` is not a positive number or None.
    """
    timeout = check_timeout(timeout)
    PROCESS.require_group()

    def work(group, attempt) -> None:
        pending = [f for f in list(PROCESS.functions.values())
                   if f.shipped_generation != PROCESS.generation and f.ship_error is None]
        if pending:
            group.clock.begin(timeout)
            try:
                shipping.ship(group, pending)
            except Exception:
                raise
            except BaseException:  # KeyboardInterrupt etc.: replies may be in flight
                group.health.kill()
                raise
            finally:
                group.clock.end()

    on_group("synk.distribute()", work)
