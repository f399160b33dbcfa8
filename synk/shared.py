"""Shared variables: an array replicated on every rank (``Shared``), and the master's
collectives on them (``shared_broadcast``, ``shared_all_reduce`` and the others).
"""
from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
import weakref
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import _arrays
from ._call import replica_tensors
from ._call.frames import store as _store
from ._call.kept import (
    Replicated,
    host_copy,
    install,
    on_device as _on_device,
    on_rank,
    send_values,
)
from ._call.master import MasterCall
from ._process import PROCESS
from ._reduction import ARITHMETIC, canonical
from .comm import context as _context
from .errors import SynkError
from .function import Function, on_group, replaceable

_ids = itertools.count(1)


class Shared(Replicated):
    """An array replicated on every rank, made by ``synk.shared``.

    ``repr(v)`` looks like ``synk.Shared(W1, shape=(64, 512), dtype=float64)``.

    Attributes:
        name: the given name, or ``sharedN``.
    """

    def __init__(self, value, name: str | None = None) -> None:
        self.id = next(_ids)
        self.name = name or f"shared{self.id}"
        value = self._native(value)
        PROCESS.replicas[self.id] = _as_replica(value, self.name)
        PROCESS.variables[self.id] = self
        # The master installs a variable on the workers (a SHARED message) before its first
        # use in a group, and again after ``set_value``. Passed to a synk function, it travels
        # as its id (a ``ReplicaRef``), so each rank's function gets that rank's own replica:
        # updates made in place stay there, and no bytes move from call to call.
        self._installed = -1  # the group generation it was last installed in
        weakref.finalize(self, _forget, self.id)

    def _native(self, value):
        """``value`` as numpy; a torch tensor or a JAX array makes this variable give that
        framework back (``frame``)."""
        value, frame = _arrays.native(value)
        if frame is not None:
            self.frame = frame.replace(grad=False)
            value = _arrays.host(value)
        return value

    def __repr__(self) -> str:
        v = PROCESS.replicas[self.id]
        return f"synk.Shared({self.name}, shape={v.shape}, dtype={v.dtype})"

    def __reduce__(self):
        raise TypeError(
            f"shared variable {self.name!r} cannot be sent as part of another object: pass "
            "it to synk functions directly as an argument (not captured in the function's "
            "closure or globals, nor inside a list, a dict or another argument), so that "
            "each rank's function gets that rank's own replica as it is at each call"
        )

    @property
    def value(self) -> np.ndarray:
        """The master's (rank 0's) replica itself, not a copy."""
        return PROCESS.replicas[self.id]

    @property
    def shape(self) -> tuple:
        """The shape of the master's replica."""
        return PROCESS.replicas[self.id].shape

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the master's replica."""
        return PROCESS.replicas[self.id].dtype

    def get_value(self, rank: int = 0):
        """A copy of ``rank``'s replica: a numpy array, or a torch tensor (on the CPU) or a
        JAX array when the variable was made from one.

        Raises:
            ValueError: ``rank`` is not a rank of the running group.
            NotForkedError: ``rank`` is not 0 and no group is running.
        """
        if rank == 0:
            group = PROCESS.group
            if group is not None and (group.outstanding() or replaceable(group)):
                value = on_group(f"{self.name}.get_value()",  # (the submitted calls read
                                 lambda g, a: _host_copy(PROCESS.replicas[self.id]))  # first)
            else:
                value = _host_copy(PROCESS.replicas[self.id])
        else:
            _check_rank(PROCESS.require_group(), rank, "rank")
            value = _run("get", [self], rank)[rank]
        return _arrays.restore(value, self.frame)

    def set_value(self, value, rank: int | None = None) -> None:
        """Replace the value on every rank (shape and dtype may change), or with ``rank``
        only that rank's replica (rank 0: the master's).

        A per-rank value keeps the variable's dtype (numpy ``same_kind`` casting) and may
        have its own shape.

        Raises:
            TypeError: ``value`` has an object dtype, or a per-rank value cannot be cast.
            ValueError: ``rank`` is not a rank of the running group.
            NotForkedError: ``rank`` is not 0 and no group is running.
            ReentrantCallError: called from inside a running call.
        """
        value = self._native(value)
        if rank is None:
            value = _as_replica(value, self.name)
            group = _running()
            if group is None:  # installed at the next fork()
                PROCESS.replicas[self.id], self._installed = value, -1
                return

            def set_everywhere(group, attempt) -> None:
                PROCESS.replicas[self.id], self._installed = value, -1
                install(group, [self])

            on_group(f"{self.name}.set_value()", set_everywhere)
            return
        group = _running()
        if group is None and isinstance(rank, int) and rank > 0:
            PROCESS.require_group()  # NotForkedError: no rank but 0 exists
        _check_rank(group, rank, "rank")
        value = _as_replica(value, self.name, dtype=self.dtype)
        if group is None:  # rank 0 is every rank there is
            PROCESS.replicas[self.id] = value
            return

        def set_one(group, attempt) -> None:
            install(group, [self])  # every rank holds it before one rank's replica changes
            if rank == 0:
                PROCESS.replicas[self.id] = _on_device(group.device, value)
            else:
                send_values(group, [rank], [(self.id, value)], ())

        on_group(f"{self.name}.set_value(rank={rank})", set_one)

    def shapes(self) -> list:
        """The shape of every rank's replica, in rank order. Only the shapes travel (a
        tiny collective); without a running group, ``[self.shape]``."""
        if _running() is None:
            return [self.shape]
        return [tuple(shape) for shape in _run("shape", [self])]


def _running():
    """The running group (one a rank's death broke too, while it can be replaced), or
    None."""
    group = PROCESS.group
    return None if group is None or group.closed and not replaceable(group) else group


def _check_rank(group, rank, what: str) -> None:
    """``rank`` must name a rank of ``group`` (None: only rank 0 exists)."""
    size = 1 if group is None else group.size
    if isinstance(rank, bool) or not (isinstance(rank, int) and 0 <= rank < size):
        raise ValueError(f"{what} must be 0..{size - 1}, got {rank!r}")


def _as_replica(value, name: str, dtype=None) -> np.ndarray:
    """A copy of ``value``; with ``dtype``, cast to it if numpy's ``same_kind`` rule allows."""
    arr = np.array(_arrays.as_array(value, f"the value of shared variable {name!r}",
                                    _arrays.RAGGED_IN_MEMORY), copy=True)
    if arr.dtype.hasobject:
        raise TypeError(f"shared variable {name!r} must hold numbers, not dtype object")
    if dtype is not None and arr.dtype != dtype:
        if not np.can_cast(arr.dtype, dtype, "same_kind"):
            raise TypeError(
                f"a value for one rank of shared variable {name!r} must keep its dtype "
                f"{dtype}, and {arr.dtype} does not cast to it safely; call set_value(value) "
                "without rank to change the dtype on every rank"
            )
        arr = arr.astype(dtype)
    return arr


def _forget(sid: int) -> None:
    PROCESS.replicas.pop(sid, None)
    PROCESS.replica_arrays.pop(sid, None)
    PROCESS.dropped.append(sid)


def assign(replica, value) -> None:
    """Inside a synk function: store ``value`` in this rank's replica of a shared variable,
    ``replica`` being what the function received for it (JAX arrays are immutable, so this
    is how a JAX function updates its replicas; for a numpy array or a torch tensor it is
    ``replica[...] = value``, in place).

        def step(x, y, w):                          # w: this rank's replica of a synk.Shared
            g = synk.comm.allreduce(jax.grad(loss)(w, x, y), "mean", weight=len(x))
            synk.assign(w, w - 0.1 * g)            # the replica keeps it for the next call

    The function's own ``replica`` keeps the old value (a JAX array cannot change); the
    next call gets the new one (and so does the call's next piece, with ``num_slices=``).

    Raises:
        SynkError: called outside a running synk function.
        TypeError: ``replica`` is a JAX array the function did not receive for a
            ``synk.Shared``.
    """
    context = _context.current
    if not context.active:
        raise SynkError("synk.assign stores a value in this rank's replica of a shared "
                        "variable: call it inside a synk function, on what the function "
                        "received for a synk.Shared")
    found = PROCESS.replica_views.get(id(replica))
    if found is not None:
        _store(found[0], value, context.device)
        return
    if type(replica).__module__.startswith(("jax", "jaxlib")):
        raise TypeError("synk.assign: this JAX array is not a replica the function received "
                        "for a synk.Shared (pass the shared variable itself as an argument, "
                        "and assign to what the function got for it)")
    native = _arrays.native(value)[0]
    replica[...] = native if _arrays.adapter_of(replica) is None else _arrays.restore(
        native, _arrays.native(replica)[1])


def shared(value: ArrayLike, *, name: str | None = None) -> Any:
    """An array replicated on every rank (host memory on CPU ranks), or a torch module whose
    parameters and buffers are.

    Pass it to a synk function as an argument (any parameter; it is never split): it
    arrives on each rank as that rank's own replica, a numpy array (a torch tensor over the
    replica's memory, or a JAX array, when ``value`` is one: see ``synk.assign``). The
    function may update it in place, and the update persists across calls with no
    transfer. Pass shared variables as arguments: one captured in a closure or nested in
    another argument is refused. ``get_value``, ``set_value`` (every rank's replica or one)
    and ``shapes()`` read, write and inspect it from the master, and the
    [master-side collectives](api/shared.md#master-side-collectives) combine the ranks' replicas.

    It needs no running group: it is installed on a group's workers before its first use
    there, and again after ``set_value``.

    A ``torch.nn.Module`` is made shared in place: each of its parameters and buffers
    becomes a shared variable, the tensor itself now over the master's replica, and the
    module is returned. A function that captures the module (in its closure or globals,
    inside an object, through a bound method's ``self`` or an optimizer) gets on each rank
    a copy of it whose parameters and buffers are that rank's replicas: the rank's
    optimizer steps update them in place, and they persist across calls. See
    [Modules as shared variables](api/shared.md#modules-as-shared-variables).

    Args:
        value: the initial value, copied; or a torch module, changed in place.
        name: a name for messages; default ``sharedN`` (for a module, the prefix of its
            variables' names, which follow its ``named_parameters``).

    Returns:
        The new ``Shared``; for a module, the module.

    Raises:
        TypeError: ``value`` has an object dtype.
    """
    if _is_module(value):
        return _shared_module(value, name)
    return Shared(value, name)


def _is_module(value) -> bool:
    """Whether ``value`` is a torch module (none can be before torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def _shared_module(module, name: str | None):
    """``shared`` of a torch module (see there)."""
    prefix = f"{name}." if name else ""
    seen: set = set()
    tensors = [*module.named_parameters(remove_duplicate=False),
               *module.named_buffers(remove_duplicate=False)]
    for label, tensor in tensors:
        if id(tensor) in seen or replica_tensors.is_registered(tensor):
            continue  # (a tied parameter: one variable)
        seen.add(id(tensor))
        variable = Shared(tensor.detach(), f"{prefix}{label}")
        replica_tensors.register(tensor, variable, variable.frame)
    return module


def _host_copy(value) -> np.ndarray:
    """A numpy copy of a master's replica."""
    group = PROCESS.group
    return host_copy(value, None if group is None else group.device)


def _master_scope():
    """The master's device and stream current (GPU groups), for its work on replicas."""
    group = PROCESS.group
    if group is None or group.device is None or group.device.is_host:
        return contextlib.nullcontext()
    return group.device.scope()


def replicas_to_host() -> None:
    """Bring the master's device replicas back to numpy (its group is ending), so that a
    variable outlives its group. On GPU ranks the replicas are device arrays, the master's
    included while its group runs (the values travel between processes as numpy arrays)."""
    for sid, value in PROCESS.replicas.copy().items():  # (a finalizer may drop one)
        if not isinstance(value, np.ndarray):
            try:
                PROCESS.replicas[sid] = _host_copy(value)
            except Exception:  # the device is unusable: the variable keeps its last value
                pass


_collective_fn = None


def _run(kind: str, variables: list, extra=None):
    """Run the collective ``kind`` on ``variables`` as a synk function on every rank, whose
    body is ``_call.kept.on_rank`` (one communicator collective per dtype, fused)."""
    global _collective_fn
    PROCESS.require_group()
    if _collective_fn is None:
        _collective_fn = Function(on_rank, bcast_inputs=["arg"], reduce=None)
    args = (([kind, [v.id for v in variables], extra]),)

    def run(group, attempt):
        install(group, variables)
        call = attempt.call = MasterCall(group, _collective_fn)
        if group.restarts_left:  # (rank 0's values, given back if a rank dies in it)
            call.kept_values = [(v, _host_copy(PROCESS.replicas[v.id])) for v in variables]
        return call.run(args, {}, None, 1, None, None)

    return on_group(f"synk.shared_{kind}" if kind != "get" else "Shared.get_value()", run)


def _variables(vars_, what: str) -> list:
    if _is_module(vars_):  # (a shared module: its variables)
        vars_ = replica_tensors.variables_of(vars_)
        if not vars_:
            raise TypeError(f"synk.{what} got a torch module that is not shared: make it "
                            "shared first (synk.shared(module))")
    items = list(vars_) if _many(vars_) else [vars_]
    for v in items:
        if not isinstance(v, Shared):
            raise TypeError(f"synk.{what} takes shared variables (synk.shared), got "
                            f"{type(v).__name__}")
    if len({v.id for v in items}) != len(items):
        raise ValueError(f"synk.{what} got the same shared variable twice")
    return items


def _many(vars_) -> bool:
    """Whether ``vars_`` names several variables (a list, a tuple, a shared module)."""
    return isinstance(vars_, (list, tuple)) or _is_module(vars_)


def _op(op) -> str:
    return canonical(op, ARITHMETIC, what="shared-variable collectives")


def _values(vars_, items: list, values, what: str) -> list:
    """One value per variable. A variable given alone takes ``values`` as its value, and
    also ``[value]``: one variable with a one-element list means the same in every
    collective as ``([var], [value])``."""
    if _many(vars_):
        values = list(values) if isinstance(values, (list, tuple)) else None
        if values is None or len(values) != len(items):
            got = "a single value" if values is None else f"{len(values)} values"
            raise ValueError(f"synk.{what} got {len(items)} variables but {got}; give a list "
                             "with one value per variable")
        return values
    if isinstance(values, (list, tuple)) and len(values) == 1:
        return [values[0]]
    return [values]


def shared_broadcast(vars_, values=None) -> None:
    """Copy the master's replicas to every rank, after setting the master's to ``values``
    (one per variable) when they are given; with one variable, ``values`` is its value or
    ``[value]``."""
    items = _variables(vars_, "shared_broadcast")
    if values is not None:
        values = [np.asarray(v) for v in _values(vars_, items, values, "shared_broadcast")]
        for v, value in zip(items, values):
            replica = PROCESS.replicas[v.id]
            try:
                fits = np.broadcast_shapes(value.shape, replica.shape) == replica.shape
            except ValueError:
                fits = False
            if not fits:
                raise ValueError(
                    f"synk.shared_broadcast: a value of shape {value.shape} does not fit shared "
                    f"variable {v.name!r} of shape {replica.shape}; use {v.name}.set_value() "
                    "to change its shape"
                )
        with _master_scope():  # the replica copy: on the master's stream, not the null one
            for v, value in zip(items, values):
                replica = PROCESS.replicas[v.id]
                replica[...] = value if isinstance(replica, np.ndarray) else _on_device(
                    PROCESS.group.device,
                    np.broadcast_to(value, replica.shape).astype(replica.dtype))
    _run("broadcast", items)


def shared_all_reduce(vars_, op: str = "mean") -> None:
    """Set every replica to all the ranks' replicas combined with ``op`` (cast back to the
    variable's dtype)."""
    _run("all_reduce", _variables(vars_, "shared_all_reduce"), (_op(op), 0))


def shared_reduce(vars_, op: str = "mean", root: int = 0) -> None:
    """Set rank ``root``'s replica to the ranks' replicas combined with ``op``; the other
    replicas are unchanged."""
    _check_rank(PROCESS.require_group(), root, "root")
    _run("reduce", _variables(vars_, "shared_reduce"), (_op(op), root))


def shared_gather(vars_, concat: bool = True) -> np.ndarray | list:
    """Every rank's replica, in rank order: joined along axis 0 (``concat``) or as a list.

    Returns:
        One result per variable, or the result alone when one variable was given.
    """
    items = _variables(vars_, "shared_gather")
    by_variable = _run("gather", items)[0]["fused"]
    out = []
    for values in by_variable:
        values = [np.asarray(v) for v in values]
        out.append(np.concatenate([np.atleast_1d(v) for v in values]) if concat else values)
    return out if _many(vars_) else out[0]


def shared_all_gather(vars_) -> None:
    """Set every rank's replica to all the ranks' replicas joined along axis 0."""
    _run("all_gather", _variables(vars_, "shared_all_gather"))


def shared_scatter(vars_, values) -> None:
    """Split each of ``values`` along axis 0 (as synk splits rows) and set rank r's replica
    to part r (with one variable, ``values`` is its value or ``[value]``)."""
    items = _variables(vars_, "shared_scatter")
    values = [np.asarray(v) for v in _values(vars_, items, values, "shared_scatter")]
    for v in values:
        if v.ndim == 0:
            raise ValueError("scatter splits values along axis 0; got a 0-d value")
        if v.dtype.hasobject:
            raise TypeError("synk.shared_scatter: values must hold numbers, not dtype object")
    # The workers get only the shapes: the master sends each rank its part itself.
    extra = [(v.shape, v.dtype.str) for v in values]
    PROCESS.scattering[:] = values
    try:
        _run("scatter", items, extra)
    finally:
        PROCESS.scattering.clear()


def _deprecated(name: str, new):
    def alias(*args, **kwargs):
        warnings.warn(f"synk.{name} is deprecated: it is synk.{new.__name__} now (a master-side "
                      "collective on shared variables, not synk.comm's collectives on arrays "
                      "inside functions); the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return new(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = name
    alias.__doc__ = f"Deprecated: use ``synk.{new.__name__}``."
    return alias


#: The names of synk 0.1 (Synkhronos's) for the collectives on shared variables, kept for one
#: release: they warn (DeprecationWarning) and call the new ones.
DEPRECATED = {old: _deprecated(old, new) for old, new in (
    ("broadcast", shared_broadcast), ("all_reduce", shared_all_reduce),
    ("reduce", shared_reduce), ("gather", shared_gather),
    ("all_gather", shared_all_gather), ("scatter", shared_scatter))}
