"""``Function``: a plain Python function run data-parallel on every rank, and shipping it."""
from __future__ import annotations

import inspect
import itertools
import math
import os
import pickle
import time
import weakref
from collections.abc import Callable, Iterable

import cloudpickle

from ._call import args as _args, collect as _collect, ops as _ops, runner as _runner
from ._call.profile import COLLECTIVES, COMPUTE, INPUT, OUTPUT, Profile
from ._engine import protocol as P, state as _state
from ._engine.watchdog import Interrupted
from .comm import _context as comm_context
from .data import restore_updates, take_updates
from .errors import DistributeError, first_failure, unpack_exception

_ids = itertools.count(1)
_DEFAULT = object()  # the call's timeout is the function's
_RESERVED = ("batch", "num_slices", "timeout")


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


class Function:
    """A function built in the master with ``synk.function``; call it like ``fn``.

    Calling it runs ``fn`` on every rank over that rank's rows of the scattered inputs and
    returns the outputs combined with their reduce ops. Extra call options: ``batch=``
    (an int, a slice or an index array choosing rows before the split), ``num_slices=``
    (run each rank's share in that many pieces, combined with the reduce ops) and
    ``timeout=`` (seconds; overrides the function's default).

    ``profile``: a ``Profile`` of every call so far when built with ``profile=True`` (or
    with the environment variable ``SYNK_PROFILE=1``), else None; ``print(f.profile)``.
    """

    def __init__(self, fn: Callable, *, inputs=None, bcast_inputs=(), reduce="mean",
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
        bcast = _names(bcast_inputs, "bcast_inputs")
        scattered = None if inputs is None else _names(inputs, "inputs")
        for what, names in (("bcast_inputs", bcast), ("inputs", scattered or frozenset())):
            unknown = sorted(names - set(params))
            if unknown:
                raise ValueError(
                    f"{what} names {unknown} that are not parameters of {self.name}; "
                    f"its parameters are {list(params)}"
                )
        both = sorted(bcast & (scattered or frozenset()))
        if both:
            raise ValueError(f"{both} are named in both inputs and bcast_inputs; pick one")
        self.scattered = frozenset(params) - bcast if scattered is None else scattered
        self.reduce = _ops.check_reduce(reduce)
        self.timeout = check_timeout(timeout)
        if profile is None:
            profile = os.environ.get("SYNK_PROFILE", "") not in ("", "0")
        self.profile: Profile | None = Profile(self.name) if profile else None
        self.fid = next(_ids)
        self.shipped_generation = -1
        self.ship_error: Exception | None = None  # why shipping failed; retried on call
        _state.functions[self.fid] = self
        weakref.finalize(self, _state.forgotten.append, self.fid)

    def __repr__(self) -> str:
        return (
            f"synk.Function({self.name}, scattered={sorted(self.scattered)}, "
            f"reduce={self.reduce!r})"
        )

    def __call__(self, *args, batch=None, num_slices: int = 1, timeout=_DEFAULT, **kwargs):
        group = _state.require_group()
        timeout = self.timeout if timeout is _DEFAULT else check_timeout(timeout)
        with group.lock:
            group.check_usable()
            group.begin_call(timeout)
            marks = None if self.profile is None else [time.perf_counter()]
            try:
                if self.shipped_generation != _state.generation:
                    _ship(group, [self])
                prep = _args.prepare(self, group, args, kwargs, batch, num_slices)
                during = f"during a call of {self.name}"
                if group.size > 1:
                    self._send(group, prep, during)
                return self._finish(group, prep, during, marks)
            except Exception:
                raise
            except BaseException:  # KeyboardInterrupt etc.: the ranks may be out of step
                group.kill()
                raise
            finally:
                group.end_call()

    def _send(self, group, prep, during) -> None:
        released, moved = take_updates()
        updates = (released + tuple(group.retired), moved)
        call = (  # a P.Call as a plain tuple: it pickles several times faster
            self.fid, tuple(prep.wargs), prep.wkwargs, prep.spos, prep.skeys,
            tuple(prep.wplan), updates, self.profile is not None, group.calls,
        )
        try:
            payload = _dumps((P.CALL, call), f"the arguments of {self.name}")
        except BaseException:
            restore_updates(released, moved)  # the ranks still need to hear of them
            raise
        group.retired.clear()
        group.send(group.workers, payload, during)

    def _finish(self, group, prep, during, marks):
        failures, shares, times = [], {}, []
        reason = self._run_master_share(group, prep, shares, failures, marks)
        if reason is not None:
            if reason[0] == "died":
                group.died(reason[1], during)
            raise group.timed_out([0, *group.unfinished(group.workers)], during)
        if shares.get(0) is not None and group.size > 1:
            shares[0] = _collect.export_master(group, self.name, self.reduce, shares[0])
        for rank, reply in sorted(group.recv(group.workers, during).items()):
            if reply[0] == P.ERR:
                failures.append((reply[3], rank, unpack_exception(reply[1], reply[2], rank)))
                continue
            share, retired, *timing = reply[1]
            shares[rank] = None if share is None else _runner.Share(*share)
            _collect.retire(group, retired)
            if timing:
                times.append((rank, timing[0]))
        if failures:
            raise first_failure(failures)
        if marks is None:
            return _collect.collect(group, self.name, self.reduce, shares)
        marks.append(time.perf_counter())
        result = _collect.collect(group, self.name, self.reduce, shares, self.profile)
        marks.append(time.perf_counter())
        self._record(marks, times)
        return result

    def _record(self, marks, times) -> None:
        start, _, taken, done, replied, end = marks
        profile = self.profile
        assert profile is not None  # only profiled calls are recorded
        for rank, seconds in ((0, (taken - start, done - taken, replied - done)), *times):
            for part, s in zip((INPUT, COMPUTE, OUTPUT), seconds):
                profile.add(rank, part, s)
        profile.add(0, COLLECTIVES, end - replied)
        profile.add_call(end - start)

    def _run_master_share(self, group, prep, shares, failures, marks) -> tuple | None:
        """Rank 0's share, under the watchdog; why it was interrupted, or None."""
        watchdog = group.watchdog
        try:
            try:
                if watchdog.enter(group.deadline) is None:
                    comm_context.enter(group.mesh, group.calls, 0, group.size)
                    shares[0] = _runner.run_share(
                        self.fn, self.name, self.reduce, prep.args, prep.kwargs, prep.spos,
                        prep.skeys, prep.plan, 0, marks,
                    )
            except Exception as exc:
                failures.append((time.monotonic(), 0, exc))
                comm_context.fail(exc)
            finally:
                comm_context.leave()
                reason = watchdog.leave()
        except Interrupted:
            reason = watchdog.leave()
        return reason


def _dumps(obj, what: str) -> bytes:
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in data:
            return data
        # it refers to something of the user's script by name, which the workers (whose
        # __main__ is synk's) cannot look up: cloudpickle sends such things by value
    except Exception:
        pass
    try:
        return cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:
        raise TypeError(f"{what} cannot be pickled to send to the ranks: {err}") from err


def function(fn: Callable, *, inputs: Iterable[str] | None = None,
             bcast_inputs: Iterable[str] = (), reduce="mean",
             timeout: float | None = None, profile: bool | None = None) -> Function:
    """Wrap ``fn`` to run data-parallel on every rank.

    inputs: names of the parameters split along axis 0 (default: all not in bcast_inputs).
    bcast_inputs: names of the parameters sent whole to every rank.
    reduce: how outputs are combined: ``"mean"`` (``"avg"``), ``"sum"``, ``"prod"``,
        ``"max"``, ``"min"``, ``"gather"`` or None; one op for all outputs or one per output.
    timeout: default limit in seconds for each call (None: none); a call that takes longer
        raises ``CallTimeoutError`` (a ``TimeoutError``) naming the late ranks and stops the
        group.
    profile: record where each call's time goes, per rank (``print(f.profile)``). Default:
        on when the environment variable ``SYNK_PROFILE`` is set to 1. Off, calls do no
        timing at all.
    """
    return Function(fn, inputs=inputs, bcast_inputs=bcast_inputs, reduce=reduce,
                    timeout=timeout, profile=profile)


def distribute(timeout: float | None = None) -> None:
    """Ship every function built so far (and not yet shipped) to the workers. With
    ``timeout`` (seconds), ranks that have not unpickled them by then raise
    ``CallTimeoutError`` and the group is stopped."""
    timeout = check_timeout(timeout)
    group = _state.require_group()
    with group.lock:
        group.check_usable()
        pending = [f for f in list(_state.functions.values())
                   if f.shipped_generation != _state.generation and f.ship_error is None]
        if pending:
            group.limit = timeout
            group.deadline = None if timeout is None else time.monotonic() + timeout
            try:
                _ship(group, pending)
            except Exception:
                raise
            except BaseException:  # KeyboardInterrupt etc.: replies may be in flight
                group.kill()
                raise
            finally:
                group.end_call()


def _ship(group, functions: list) -> None:
    """Send ``functions`` to the workers in one pickle; on failure ship them one by one, so
    that the good ones arrive and the error names the ones that cannot."""
    try:
        _try_ship(group, functions)
        return
    except (TypeError, DistributeError) as err:
        if len(functions) == 1:
            functions[0].ship_error = err
            raise
    errors = []
    for f in functions:
        try:
            _try_ship(group, [f])
        except (TypeError, DistributeError) as err:
            f.ship_error = err
            errors.append(err)
    if errors:
        raise errors[0]


def _try_ship(group, functions: list) -> None:
    entries = {f.fid: (f.fn, f.name, f.reduce) for f in functions}
    names = ", ".join(f.name for f in functions)
    try:
        blob = cloudpickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:
        raise TypeError(f"cannot pickle {names} to ship it to the workers: {err}") from err
    forget = tuple(_state.forgotten)
    del _state.forgotten[:]
    if group.size > 1:
        group.send(group.workers, pickle.dumps((P.SHIP, blob, forget)), "while shipping functions")
        replies = group.recv(group.workers, "while shipping functions")
        for rank, reply in sorted(replies.items()):
            if reply[0] == P.ERR:
                exc = unpack_exception(reply[1], reply[2], rank)
                raise DistributeError(
                    f"could not ship {names} to the workers: rank {rank} failed to unpickle "
                    f"it: {exc}. A function must only use modules that the workers can "
                    "import too (same Python, same sys.path)"
                ) from exc
    for f in functions:
        f.shipped_generation = _state.generation
        f.ship_error = None
