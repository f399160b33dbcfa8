"""A call's inputs: its arguments bound to the function's parameters, staged and encoded for
rank 0 and the workers (a bound step's plain values once, ``bound_values``)::

    bind (Parameters) -> each argument by its kind (_Stager, _WAYS): a Data by name, a small
    array in the message, a large one staged, another pickled -> plan (rows) -> Prepared
"""
from __future__ import annotations

import functools
import inspect
import operator
import types
from typing import Any

import numpy as np

from .. import _arrays, _tree
from .._process import PROCESS
from .._wire import arrays as _wire
from .._wire.arrays import InlineArray, SharedArray, SharedData, read_only, wrap
from . import replica_tensors
from .bound_values import BoundArguments, Kept
from .frames import native_input
from .kept import ReplicaRef, Replicated, Resident, ResidentRef, install
from .port import Port
from .rows import Plan, local_positions, named_option, rows_chosen, split_bounds
from .staging import Staging, upkeep

_P = inspect.Parameter


class Parameters:
    """A function's parameters as a call binds its arguments to them: (name, kind, whether
    it is scattered, whether it is passed as a keyword) of each (``specs``); the names
    where all are positional-or-keyword (bound without ``inspect``), else None (``plain``);
    whether a call may pass nothing (``optional``)."""

    __slots__ = ("label", "signature", "specs", "plain", "optional")

    def __init__(self, label: str, signature: inspect.Signature, scattered) -> None:
        params = signature.parameters.values()
        self.label, self.signature = label, signature
        self.specs = tuple((p.name, p.kind, p.name in scattered,
                            p.kind in (_P.KEYWORD_ONLY, _P.VAR_KEYWORD)) for p in params)
        self.plain = tuple(p.name for p in params) if all(
            p.kind is _P.POSITIONAL_OR_KEYWORD for p in params) else None
        self.optional = all(p.default is not _P.empty or p.kind in (_P.VAR_POSITIONAL,
                                                                     _P.VAR_KEYWORD)
                            for p in params)

    def bind(self, args, kwargs) -> dict:
        """The parameters' values in a call (``inspect``'s ``arguments``)."""
        plain = self.plain
        if plain is not None and not kwargs and len(args) == len(plain):
            return dict(zip(plain, args))
        try:
            return self.signature.bind(*args, **kwargs).arguments
        except TypeError as err:
            raise TypeError(f"{self.label}{self.signature}: {err}") from None


class Prepared:
    """One call's arguments for rank 0 (``args``...) and for workers (``wargs``...)."""

    __slots__ = ("args", "kwargs", "wargs", "wkwargs", "spos", "skeys", "plan", "wplan", "kept",
                 "frames", "bound", "places", "replicas")
    args: list
    kwargs: dict
    wargs: list
    wkwargs: dict
    spos: tuple
    skeys: tuple
    plan: Plan
    wplan: Plan
    kept: dict  # under MPI with other hosts: block name -> (key, version) of each Data input
    # the frames of the torch tensors and JAX arrays (``frames``) among the arguments:
    # ({position: frame}, {keyword: frame}), a frame a structure of them for a broadcast list,
    # tuple or dict (``_arrays.natives``); None where there are none
    frames: tuple | None
    bound: BoundArguments | None  # a bound step's kept values, where it has some
    places: tuple  # (in kwargs, where, label) of each of them among the workers' arguments
    replicas: list  # the shared variables among the arguments


def prepare(fn_obj, port: Port | None, args, kwargs, batch, num_slices,
            local_batch=None, bound: BoundArguments | None = None) -> Prepared:
    """Bind, stage and plan one call of ``fn_obj`` (a Function) on the group behind
    ``port``; with ``port`` None, for rank 0 alone (``Function.local``): nothing is staged,
    installed or sent. ``bound``: the kept values of the bound step the call is made from,
    prepared once; the workers get them from what they keep (``places``)."""
    whole = None  # a bound step's call passing nothing more (the same call every time)
    if port is not None and batch is None and local_batch is None and _one_slice(num_slices):
        if not args and not kwargs and fn_obj.parameters.optional:
            return _nothing_passed(fn_obj, port)
        whole = _whole_call(port, bound, args, kwargs)
        if whole is not None and whole.whole is not None:
            _nothing_passed(fn_obj, port)  # (only the upkeep any call does)
            return whole.whole
    arguments = fn_obj.parameters.bind(args, kwargs)
    if port is None or port.hosts.spans:  # (alone, or other hosts copy the inputs: no
        bound = None  # keeping)
    elif bound is not None:
        bound.prepared_in(port.generation)
    builder = _Arguments(fn_obj, port, bound)
    if port is not None and PROCESS.dropped:  # (the workers drop collected variables first)
        install(port, _shared_in(arguments))
    _add_arguments(builder, fn_obj.parameters.specs, arguments)
    out = builder.finish(batch, num_slices, local_batch)
    if whole is not None and out.bound is whole:
        whole.whole = out
    return out


def _add_arguments(builder: _Arguments, param_specs: tuple, arguments: dict) -> None:
    """Each of ``arguments`` added to ``builder``, parameter by parameter; after a
    positional-or-keyword parameter left out, the rest go as keywords."""
    keyword = False
    for name, kind, scatter, keyword_only in param_specs:
        if name not in arguments:
            keyword = keyword or kind is _P.POSITIONAL_OR_KEYWORD
            continue
        for label, item in _items(name, kind, arguments[name]):
            builder.add(label, item, scatter, keyword or keyword_only)


def _whole_call(port: Port, bound: BoundArguments | None, args, kwargs
                ) -> BoundArguments | None:
    """``bound`` where this call is its step's call passing nothing more (the same call
    every time: its ``whole`` preparation, once made, serves it), else None."""
    if bound is None or not bound.plain or port.hosts.spans or \
            not bound.passes_nothing_more(args, kwargs):
        return None
    bound.prepared_in(port.generation)
    return bound


def _items(name: str, kind, value) -> list:
    """(label, value) of each argument a parameter takes (``*args``' and ``**kwargs``' each)."""
    if kind is _P.VAR_POSITIONAL:
        return [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    if kind is _P.VAR_KEYWORD:
        return list(value.items())
    return [(name, value)]


class _Arguments:
    """One call's arguments as ``prepare`` takes them, one by one (``add``), into a
    ``Prepared`` (``finish``)."""

    def __init__(self, fn_obj, port: Port | None, bound: BoundArguments | None) -> None:
        self.fn_obj, self.port, self.bound = fn_obj, port, bound
        self.generation = -1 if port is None else port.generation
        self.out = out = Prepared()
        out.args, out.kwargs, out.wargs, out.wkwargs = [], {}, [], {}
        out.replicas = []
        self.spos: list = []
        self.skeys: list = []
        self.places: list = []  # (in kwargs, where, label) of the bound step's kept values
        self.lengths: dict = {}
        self.stager = _Stager(port, fn_obj)
        self.frames: tuple = ({}, {})  # (as ``Prepared.frames``, indexed by ``to_kwargs``)

    def add(self, label: str, item, scatter: bool, to_kwargs: bool) -> None:
        """The argument ``label``: its value ``item`` for rank 0 and the workers."""
        out = self.out
        where = label if to_kwargs else len(out.args)  # (its place among the arguments)
        kept = None if self.bound is None else self.bound.kept(label, item)
        if kept is not None:  # a bound step's plain value, prepared already
            local, remote, frame = kept.local, None, kept.frame
            split = kept.rows is not None
            if split:
                self.lengths[label] = kept.rows
            self.places.append((to_kwargs, where, label))
        else:
            local, remote, frame, split = self._staged(label, item, scatter, to_kwargs, where)
        if frame is not None:
            self.frames[to_kwargs][where] = frame
        if to_kwargs:
            out.kwargs[label], out.wkwargs[label] = local, remote
            if split:
                self.skeys.append(label)
        else:
            if split:
                self.spos.append(len(out.args))
            out.args.append(local)
            out.wargs.append(remote)

    def _staged(self, label: str, item, scatter: bool, to_kwargs: bool, where) -> tuple:
        """(rank 0's value, the workers', its frame, whether it is split) of an argument
        not kept: a shared variable's replica (each rank's own, never split), or a value
        scattered or broadcast by the way of its kind (``_WAYS``); a bound step's own plain
        value staged in the step's block and kept (``Kept``)."""
        stager, bound, source = self.stager, self.bound, item
        remote: Any  # (the workers' wire form; None where they keep it)
        if type(item) is np.ndarray:
            frame = None
        elif isinstance(item, (Replicated, SharedData)):
            frame = item.frame  # (a Data or a Shared made from a tensor: given back as one)
        else:
            item, frame = native_input(item, label)
        owned = bound if bound is not None and bound.owns(source) else None
        if owned is not None:  # (a bound plain value: staged in the step's own block)
            stager.owner = -owned.number
        if isinstance(item, Replicated):  # each rank's own replica, never split
            if self.port is not None and item._installed != self.generation:
                install(self.port, [item])  # (first: rank 0's replica where the call uses it)
            local, remote, split = PROCESS.replicas[item.id], ReplicaRef(item), False
            self.out.replicas.append(item)
        elif scatter:
            local, remote = stager.scatter(label, item)
            self.lengths[label] = len(local)
            split = True
        else:
            local, remote = stager.bcast(label, item)
            split = False
        if owned is not None:
            stager.owner = self.fn_obj.fid
            owned.keep(label, Kept(source, local, remote, frame,
                                   self.lengths[label] if split else None))
            self.places.append((to_kwargs, where, label))
            remote = None  # (the workers take it from what they keep)
        return local, remote, frame, split

    def finish(self, batch, num_slices, local_batch) -> Prepared:
        """The call's ``Prepared``: its rows planned, its staging ended."""
        out, stager = self.out, self.stager
        out.spos, out.skeys = tuple(self.spos), tuple(self.skeys)
        _plan(out, self.fn_obj, stager, self.lengths, batch, num_slices, local_batch)
        out.kept = stager.kept
        out.frames = self.frames if self.frames[0] or self.frames[1] else None
        out.bound, out.places = (self.bound, tuple(self.places)) if self.places else (None, ())
        stager.finish()
        return out


def _nothing_passed(fn_obj, port: Port) -> Prepared:
    """A call that passes nothing (every parameter takes its default on each rank): no
    binding, staging or plan of rows; only the upkeep any call does (collected shared
    variables dropped on the workers, the staging blocks')."""
    if PROCESS.dropped:
        install(port, [])
    upkeep(port.blocks, fn_obj.fid)
    return _NOTHING


_RAGGED_INPUT = (
    "a scattered input is split along axis 0 as one array. Pass an array of one shape (pad "
    "the rows to one length), or list the input in bcast_inputs to send it whole to every "
    "rank as it is")
_NO_ROWS = Plan(None, None, 1)  # nothing scattered, one slice
_NOTHING = Prepared()  # what a call that passes nothing prepares (never changed)
_NOTHING.args, _NOTHING.kwargs, _NOTHING.wargs, _NOTHING.wkwargs = [], {}, [], {}
_NOTHING.spos = _NOTHING.skeys = ()
_NOTHING.plan = _NOTHING.wplan = _NO_ROWS
_NOTHING.kept, _NOTHING.frames, _NOTHING.bound, _NOTHING.places = {}, None, None, ()
_NOTHING.replicas = []


def _one_slice(num_slices) -> bool:
    """Whether ``num_slices`` is the default, 1 (an int: ``_plan`` checks any other)."""
    return type(num_slices) is int and num_slices == 1


def _shared_in(arguments) -> list:
    """The shared variables among a call's arguments (those in ``*args`` and ``**kwargs`` too)."""
    found = []
    for value in arguments.values():
        values = value if isinstance(value, tuple) else (
            value.values() if isinstance(value, dict) else (value,))
        found += [v for v in values if isinstance(v, Replicated)]
    return found


def _plan(out, fn_obj, stager, lengths, batch, num_slices, local_batch) -> None:
    try:
        num_slices = operator.index(num_slices)
    except TypeError:
        raise TypeError(f"num_slices must be an int >= 1, not {num_slices!r}") from None
    if num_slices < 1:
        raise ValueError(f"num_slices must be >= 1, got {num_slices}")
    if not lengths:
        if batch is not None or local_batch is not None:
            name = "batch" if batch is not None else "local_batch"
            raise ValueError(
                f"{name}= was given but no input of {fn_obj.name} is scattered in this call"
            )
        out.plan = out.wplan = Plan(None, None, num_slices)
        return
    if len(set(lengths.values())) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in lengths.items())
        raise ValueError(
            f"scattered inputs of {fn_obj.name} must have the same length along axis 0, "
            f"got {listing}; broadcast the ones that should go whole to every rank "
            "(bcast_inputs=[...])"
        )
    sharded = [label for label, mode in stager.resident.items() if mode == "shard"]
    if sharded and batch is not None and stager.port is not None:  # (local(): one rank)
        raise ValueError(
            f"{sharded[0]!r} is resident on the devices in shard mode: each rank holds only "
            "its own rows, so batch= (which picks rows before they are split) cannot be used. "
            "Pick rows within each rank's share with local_batch=, or use "
            "to_device('replicate')"
        )
    n_rows = next(iter(lengths.values()))
    selection, wselection, n_sel = select(batch, n_rows, stager)
    bounds = split_bounds(n_sel, stager.size)
    local = None if local_batch is None else local_positions(local_batch, bounds)
    total = n_sel if local is None else sum(_count(entry) for entry in local)
    out.plan = Plan(selection, bounds, num_slices, local, total)
    out.wplan = Plan(wselection, bounds, num_slices, local, total)


def step_plans(prep: Prepared, batches, size: int, name: str) -> tuple:
    """Each step's plan of rows in a call of many steps (``Function.steps``), one per
    entry of ``batches`` (each what ``batch=`` takes), as a call with that ``batch=``
    plans them: the same for every rank (an index array travels in the message)."""
    if prep.plan.bounds is None:
        raise ValueError(f"steps() picks each step's rows as batch= does, but no input of "
                         f"{name} is scattered; scatter the rows the steps take")
    n_rows = prep.plan.total
    plans = []
    for j, batch in enumerate(batches):
        if batch is None:  # (every row, as a call without batch= takes them)
            plans.append(Plan(None, split_bounds(n_rows, size), 1, None, n_rows))
            continue
        chosen = rows_chosen(batch, n_rows, functools.partial(_step_batch, j, batch, n_rows))
        selection, count = (chosen[:2], chosen[2]) if isinstance(chosen, tuple) else (
            chosen, len(chosen))
        plans.append(Plan(selection, split_bounds(count, size), 1, None, count))
    if not plans:
        raise ValueError("steps() needs at least one batch (one step)")
    return tuple(plans)


def _step_batch(j: int, batch, n_rows: int) -> str:
    return f"step {j}'s {named_option('batch', batch)} (the inputs have {n_rows} rows)"


def _count(entry) -> int:
    return entry[2] if isinstance(entry, tuple) else len(entry)


def select(batch, n_rows: int, stager):
    """(selection for rank 0, selection for workers, rows selected) for ``batch``."""
    if batch is None:
        return None, None, n_rows
    chosen = rows_chosen(batch, n_rows,
                         lambda: f"{named_option('batch', batch)} (the inputs have {n_rows} rows)")
    if isinstance(chosen, tuple):
        return chosen[:2], chosen[:2], chosen[2]
    return chosen, stager.bcast("batch", chosen)[1], len(chosen)  # each rank takes its run


def _check_movable(label: str, value, depth: int = 0) -> None:
    """On GPU ranks, broadcast arrays move to the device, nested in lists, tuples and dicts
    too (``share``), but not inside other objects: refuse those at the call, saying
    what to do, rather than let CuPy refuse the host arrays deep inside the function."""
    if depth > _DEEPEST:
        return
    if isinstance(value, (list, tuple)):
        for v in value:
            _check_movable(label, v, depth + 1)
    elif isinstance(value, dict):
        for v in value.values():
            _check_movable(label, v, depth + 1)
    elif not _passes_as_is(value):
        where = _array_inside(value, 0, set(), [_SEARCHED])
        if where is not None:
            raise TypeError(
                f"broadcast input {label!r} holds numpy arrays in a {type(value).__name__} "
                f"object (attribute {where!r}): on GPU ranks synk moves broadcast arrays to "
                "the device, also inside lists, tuples and dicts, but not inside other "
                "objects, where the function would get host arrays that CuPy refuses. Pass "
                "the arrays themselves (in a list or dict) or synk.shared variables, and "
                "build the object inside the function")


_DEEPEST = 32  # levels of nesting searched for arrays to move or refuse
_SEARCHED = 10_000  # values looked at inside one object, at most, to find an array


def _passes_as_is(value) -> bool:
    """Whether ``value`` holds no host array that could reach a GPU rank: numbers, strings,
    arrays themselves, synk's objects (a Data, a shared variable: by reference), classes,
    modules and functions."""
    return isinstance(value, (np.ndarray, np.generic, str, bytes, int, float, complex,
                              type, types.ModuleType, types.FunctionType,
                              types.BuiltinFunctionType, types.MethodType)) \
        or type(value).__module__.split(".")[0] == "synk"


def _attributes(value) -> list:
    """(name, value) of an object's attributes: its ``__dict__`` and its ``__slots__``."""
    found = list(getattr(value, "__dict__", {}).items())
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                found.append((name, getattr(value, name)))
    return found


def _array_inside(value, depth: int, seen: set, budget: list) -> str | None:
    """Where a numpy array lies inside the object ``value`` (``"w"``, ``"params['w']"``,
    ``"layers[0].w"``), searched through its attributes and the lists, tuples, dicts, sets
    and objects they hold; None if there is none (or the search ran out of ``budget``)."""
    if depth > _DEEPEST or id(value) in seen or budget[0] <= 0:
        return None
    seen.add(id(value))
    if isinstance(value, dict):
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    elif isinstance(value, (set, frozenset)):
        items = [(" (an item)", v) for v in value]
    else:
        items = [(("." if depth else "") + k, v) for k, v in _attributes(value)]
    for step, v in items:
        budget[0] -= 1
        if isinstance(v, np.ndarray):
            return step
        if budget[0] > 0 and not _passes_as_is(v):
            below = _array_inside(v, depth + 1, seen, budget)
            if below is not None:
                return step + below
    return None


_SCALARS = frozenset({float, int, bool, complex, str, bytes, type(None)})


def _holds_arrays(value, depth: int = 0) -> bool:
    """Whether the list, tuple or dict ``value`` holds a numpy array, nested too (a quick
    look: a list of numbers costs a few ns per item)."""
    if depth > _DEEPEST:
        return False
    for v in value.values() if isinstance(value, dict) else value:
        if type(v) in _SCALARS:
            continue
        if isinstance(v, np.ndarray):
            return True
        if isinstance(v, (list, tuple, dict)) and _holds_arrays(v, depth + 1):
            return True
    return False


def _read_only_nested(value):
    """A broadcast list, tuple or dict with the numpy arrays in it, nested too, as read-only views
    (in new containers of the same kinds: the caller's are not changed); ``value`` itself when it
    holds none. Workers get them read-only too: a read-only array pickles as one."""
    if not _holds_arrays(value):
        return value
    return _tree.map_leaves(
        value, lambda v: read_only(v) if type(v) is np.ndarray else v, _DEEPEST)


class _Stager:
    """Gets one call's inputs into shared memory, reusing the function's staging blocks:
    a plain array larger than ``INLINE_BYTES`` is staged (``staging``), a smaller one
    travels inside the call's message. Plain numpy inputs reach the function read-only on
    every rank, as the ranks share them; a ``Data`` stays writable, but across hosts."""

    def __init__(self, port: Port | None, fn_obj) -> None:
        self.port, self.fname = port, fn_obj.name
        self.owner = fn_obj.fid  # whose staging blocks: the function's, or a bound step's
        # (``-number``: kept until the step is closed)
        self.size = 1 if port is None else port.size  # 1: no worker to send anything to
        # GPU ranks copy from page-locked memory: rank 0 reads its rows of a plain array
        # from the staging block (page-locked once) rather than from the array itself
        self.gpu = port is not None and not port.device.is_host
        self.resident: dict = {}  # label -> residency mode of the resident Data among inputs
        # Under MPI with other hosts, a Data is kept on them between calls (see
        # ``_call.across_hosts``): read-only on every rank, and the master writes it only by routes
        # that count its version.
        self.remote = port is not None and port.hosts.spans
        self.kept: dict = {}
        self.used = 0
        self.staging: Staging | None = None
        if port is not None:
            blocks = port.blocks
            self.staging = blocks.scratch.get("in")
            if self.staging is None:
                self.staging = blocks.scratch["in"] = Staging(blocks.prefix)
            self.staging.forget_collected(blocks.retired)

    def scatter(self, label: str, value):
        """(rank 0's value, the workers') of an argument split by rows."""
        return _WAYS[_kind(value), True](self, label, value)

    def bcast(self, label: str, value):
        """(rank 0's value, the workers') of an argument every rank gets whole."""
        return _WAYS[_kind(value), False](self, label, value)

    def _resident_rows(self, label: str, value: SharedData):
        self._not_scalar(label, value)  # (each rank gets its rows as a copy of its own)
        self.resident[label] = value.on_device
        return self._resident(value)

    def _resident_whole(self, label: str, value: SharedData):
        if value.on_device == "shard":
            raise ValueError(
                f"input {label!r} is resident on the devices in shard mode (each rank "
                "holds only its rows), so it cannot be broadcast whole; scatter it, or "
                "use to_device('replicate')")
        return self._resident(value)

    def _data_rows(self, label: str, value: SharedData):
        local, remote = self._data(label, value)
        if not local.ndim:
            self._not_scalar(label, local)
        return local, remote

    def _array_rows(self, label: str, value):
        arr = _arrays.as_array(value, f"input {label!r}", _RAGGED_INPUT)
        self._not_scalar(label, arr)
        if self.size == 1:
            return read_only(arr), None  # no worker to send it to
        if arr.nbytes <= _wire.INLINE_BYTES and not arr.dtype.hasobject:
            return read_only(arr), InlineArray(arr)  # inside the message: no staging
        return self._staged(label, arr)

    def _array_whole(self, label: str, value: np.ndarray):
        if self.size == 1:
            return read_only(value), None
        if value.nbytes > _wire.INLINE_BYTES and not value.dtype.hasobject:
            return self._staged(label, value)
        return read_only(value), wrap(value)

    def _object_whole(self, label: str, value):
        if PROCESS.replica_tensors and replica_tensors.in_module(value):
            raise replica_tensors.passed_module(f"input {label!r}")
        if self.gpu:
            _check_movable(label, value)
        if isinstance(value, (list, tuple, dict)):  # arrays in it read-only, as top-level
            value = _read_only_nested(value)  # ones are (rank 0's are the caller's)
        return value, (None if self.size == 1 else wrap(value))

    @staticmethod
    def _not_scalar(label: str, value) -> None:
        if not value.ndim:
            raise ValueError(
                f"input {label!r} is scattered along axis 0 but is a scalar; list it in "
                "bcast_inputs to send it whole to every rank"
            )

    def _data(self, label: str, value: SharedData) -> tuple:
        """(rank 0's view, the workers' reference) of a ``Data`` input, whole: the same
        memory, writable, on one host; read-only on every rank when other hosts keep copies."""
        if not self.remote:
            return value.array, value._shared_array_ref()
        value._keep_on_hosts()
        key, name, shape, dtype = value.ref()
        self.kept[name] = (key, value.version)
        return value.array, SharedArray(name, shape, dtype, 0, False)

    def _resident(self, value: SharedData) -> tuple:
        """(rank 0's, the workers') stand-in for a Data resident on the devices."""
        key, name, shape, dtype = value.ref()
        mode = value.on_device
        assert mode is not None  # (called for a resident Data)
        local = Resident(key, value.version, mode, name, value.array)
        remote = None if self.size == 1 else ResidentRef(key, value.version, mode,
                                                         name, shape, dtype)
        return local, remote

    def _staged(self, label: str, arr: np.ndarray) -> tuple:
        """(what rank 0 uses, what the workers are sent) for a plain array staged for them."""
        if arr.dtype.hasobject:
            raise TypeError(
                f"scattered input {label!r} has dtype object, which cannot live in shared "
                "memory; use a numeric array, or broadcast it (bcast_inputs) to pickle it"
            )
        port, staging = self.port, self.staging
        assert port is not None and staging is not None  # (staged for workers only)
        if port.outstanding():  # (their workers may still read the staging blocks)
            port.settle()
        self.used += 1
        ref, view = staging.stage(self.owner, label, arr, f"argument {label!r} of {self.fname}",
                                  port.blocks.retired)
        return read_only(view if self.gpu else arr), ref

    def finish(self) -> None:
        """Give up the function's staging blocks beyond its limit (see ``Staging``)."""
        if self.staging is not None and self.port is not None:  # (made with the port)
            self.staging.trim(self.owner, self.used, self.port.blocks.retired)


def _kind(value) -> str:
    """The kind of an argument (a shared variable's replica aside), which says how it
    reaches the ranks (``_WAYS``)."""
    if type(value) is np.ndarray:
        return "array"
    if isinstance(value, SharedData):
        return "data" if value.on_device is None else "resident"
    return "object"


#: how each kind of argument reaches the ranks, split by rows or whole: a ``Data`` by name
#: (resident on the devices: by reference to the ranks' copies), a small array inside the
#: call's message, a large one staged in the function's block, another object pickled
#: (split by rows: made an array first)
_WAYS = {
    ("resident", True): _Stager._resident_rows, ("resident", False): _Stager._resident_whole,
    ("data", True): _Stager._data_rows, ("data", False): _Stager._data,
    ("array", True): _Stager._array_rows, ("array", False): _Stager._array_whole,
    ("object", True): _Stager._array_rows, ("object", False): _Stager._object_whole,
}
