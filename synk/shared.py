"""Shared variables: an array replicated on every rank, and the master's collectives on them.

Every process keeps its replicas in ``REPLICAS`` (id -> array). The master installs a
variable on the workers (a SHARED message) before its first use in a group, and again after
``set_value``. A ``Shared`` passed to a synk function pickles as its id, so each rank's
function gets that rank's own replica: updates made in place stay there, and no bytes move
from call to call.

The collectives are synk functions themselves, run on every rank. Each one does one
``synk.comm`` collective per dtype over all the variables it is given, fused into one flat
buffer.
"""
from __future__ import annotations

import itertools
import pickle
import weakref

import numpy as np
from numpy.typing import ArrayLike

from . import comm
from ._call.runner import split_bounds
from ._engine import protocol as P, state as _state
from .comm._collectives import check_op
from .errors import unpack_exception

REPLICAS: dict[int, np.ndarray] = {}  # this process's replica of each shared variable
_ids = itertools.count(1)
_dropped: list[int] = []  # ids of collected variables, for the workers to drop


def _replica(sid: int) -> np.ndarray:
    """What a pickled ``Shared`` becomes on a rank: that rank's replica."""
    return REPLICAS[sid]


class Shared:
    """An array replicated on every rank, made by ``synk.shared``.

    ``repr(v)`` looks like ``synk.Shared(W1, shape=(64, 512), dtype=float64)``.

    Attributes:
        name: the given name, or ``sharedN``.
    """

    def __init__(self, value, name: str | None = None) -> None:
        self.id = next(_ids)
        self.name = name or f"shared{self.id}"
        REPLICAS[self.id] = _as_replica(value, self.name)
        self._installed = -1  # the group generation it was last installed in
        weakref.finalize(self, _forget, self.id)

    def __repr__(self) -> str:
        v = REPLICAS[self.id]
        return f"synk.Shared({self.name}, shape={v.shape}, dtype={v.dtype})"

    def __reduce__(self):
        return _replica, (self.id,)

    @property
    def value(self) -> np.ndarray:
        """The master's (rank 0's) replica itself, not a copy."""
        return REPLICAS[self.id]

    @property
    def shape(self) -> tuple:
        """The shape of the master's replica."""
        return REPLICAS[self.id].shape

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the master's replica."""
        return REPLICAS[self.id].dtype

    def get_value(self, rank: int = 0) -> np.ndarray:
        """A copy of ``rank``'s replica.

        Raises:
            ValueError: ``rank`` is not a rank of the running group.
            NotForkedError: ``rank`` is not 0 and no group is running.
        """
        if rank == 0:
            return REPLICAS[self.id].copy()
        group = _state.require_group()
        if not (isinstance(rank, int) and 0 <= rank < group.size):
            raise ValueError(f"rank must be 0..{group.size - 1}, got {rank!r}")
        return _run("get", [self], rank)[rank]

    def set_value(self, value) -> None:
        """Replace the value on every rank; the shape and dtype may change.

        Raises:
            TypeError: ``value`` has an object dtype.
        """
        REPLICAS[self.id] = _as_replica(value, self.name)
        self._installed = -1
        if _state.group is not None and not _state.group.closed:
            install(_state.group, [self])


def _as_replica(value, name: str) -> np.ndarray:
    arr = np.array(value, copy=True)
    if arr.dtype.hasobject:
        raise TypeError(f"shared variable {name!r} must hold numbers, not dtype object")
    return arr


def _forget(sid: int) -> None:
    REPLICAS.pop(sid, None)
    _dropped.append(sid)


def shared(value: ArrayLike, *, name: str | None = None) -> Shared:
    """An array replicated on every rank (host memory on CPU ranks).

    Pass it to a synk function as an argument (any parameter; it is never split): it
    arrives on each rank as that rank's own replica, a numpy array. The function may update
    it in place, and the update persists across calls with no transfer. Pass shared
    variables as arguments rather than capturing them in a closure. ``get_value`` and
    ``set_value`` read and write it from the master, and the
    [master-side collectives](api.md#master-side-collectives) combine the ranks' replicas.

    It needs no running group: it is installed on a group's workers before its first use
    there, and again after ``set_value``.

    Args:
        value: the initial value, copied.
        name: a name for messages; default ``sharedN``.

    Returns:
        The new ``Shared``.

    Raises:
        TypeError: ``value`` has an object dtype.
    """
    return Shared(value, name)


def install(group, variables) -> None:
    """Send the variables not yet on this group's workers (and the ids to drop)."""
    todo = [v for v in variables if v._installed != _state.generation]
    if not todo and not _dropped:
        return
    if group.size > 1:
        drop = tuple(_dropped)
        items = [(v.id, REPLICAS[v.id]) for v in todo]
        group.send(group.workers, pickle.dumps((P.SHARED, items, drop), protocol=5),
                   "while installing shared variables")
        for rank, reply in sorted(group.recv(group.workers, "while installing shared "
                                             "variables").items()):
            if reply[0] == P.ERR:
                raise unpack_exception(reply[1], reply[2], rank)
        del _dropped[:len(drop)]
    for v in todo:
        v._installed = _state.generation


def apply(items, drop) -> None:
    """On a worker: take the master's new values and forget collected variables."""
    for sid in drop:
        REPLICAS.pop(sid, None)
    for sid, value in items:
        REPLICAS[sid] = np.array(value, copy=True)  # aligned and owned (unpickled: neither)


# -- the collectives, run on every rank -------------------------------------------------------
def _fused(ids) -> list:
    """[(dtype, [ids])]: one flat buffer per dtype."""
    groups: dict = {}
    for sid in ids:
        groups.setdefault(REPLICAS[sid].dtype, []).append(sid)
    return list(groups.items())


def _flatten(ids) -> np.ndarray:
    return np.concatenate([REPLICAS[s].reshape(-1) for s in ids]) if ids else np.empty(0)


def _unflatten(ids, flat) -> None:
    pos = 0
    for sid in ids:
        dest = REPLICAS[sid]
        dest[...] = flat[pos:pos + dest.size].reshape(dest.shape)
        pos += dest.size


def _on_rank(arg):
    """The body of every shared-variable collective; ``arg`` says which and on what."""
    kind, ids, extra = arg
    r, n = comm.rank(), comm.size()
    if kind == "get":
        return REPLICAS[ids[0]].copy() if r == extra else None
    if kind == "gather":
        return [REPLICAS[s].copy() for s in ids]
    if kind == "all_gather":
        for sid in ids:
            REPLICAS[sid] = comm.allgather(REPLICAS[sid])
        return None
    if kind == "scatter":
        for sid, values in zip(ids, extra):
            bounds = split_bounds(len(values), n)
            REPLICAS[sid] = np.array(values[bounds[r]:bounds[r + 1]], copy=True)
        return None
    for _dtype, group in _fused(ids):
        flat = _flatten(group)
        if kind == "broadcast":
            flat = comm.broadcast(flat, root=0)
        else:  # all_reduce, reduce
            op, root = extra
            flat = comm.allreduce(flat, op)
            if kind == "reduce" and r != root:
                continue
        _unflatten(group, flat)
    return None


_collective_fn = None


def _run(kind: str, variables: list, extra=None):
    global _collective_fn
    from .function import Function

    group = _state.require_group()
    with group.lock:
        install(group, variables)
        if _collective_fn is None:
            _collective_fn = Function(_on_rank, bcast_inputs=["arg"], reduce=None)
        return _collective_fn([kind, [v.id for v in variables], extra])


def _variables(vars_, what: str) -> list:
    items = list(vars_) if isinstance(vars_, (list, tuple)) else [vars_]
    for v in items:
        if not isinstance(v, Shared):
            raise TypeError(f"synk.{what} takes shared variables (synk.shared), got "
                            f"{type(v).__name__}")
    if len({v.id for v in items}) != len(items):
        raise ValueError(f"synk.{what} got the same shared variable twice")
    return items


def _op(op) -> str:
    return check_op(op, "shared-variable collectives")


def broadcast(vars_, values=None) -> None:
    """Copy the master's replicas to every rank, after setting the master's to ``values``
    (one per variable) when they are given."""
    items = _variables(vars_, "broadcast")
    if values is not None:
        values = list(values) if isinstance(vars_, (list, tuple)) else [values]
        if len(values) != len(items):
            raise ValueError(f"broadcast got {len(items)} variables but {len(values)} values")
        for v, value in zip(items, values):
            REPLICAS[v.id][...] = value
    _run("broadcast", items)


def all_reduce(vars_, op: str = "mean") -> None:
    """Set every replica to all the ranks' replicas combined with ``op`` (cast back to the
    variable's dtype)."""
    _run("all_reduce", _variables(vars_, "all_reduce"), (_op(op), 0))


def reduce(vars_, op: str = "mean", root: int = 0) -> None:
    """Set rank ``root``'s replica to the ranks' replicas combined with ``op``; the other
    replicas are unchanged."""
    group = _state.require_group()
    if not (isinstance(root, int) and 0 <= root < group.size):
        raise ValueError(f"root must be 0..{group.size - 1}, got {root!r}")
    _run("reduce", _variables(vars_, "reduce"), (_op(op), root))


def gather(vars_, concat: bool = True) -> np.ndarray | list:
    """Every rank's replica, in rank order: joined along axis 0 (``concat``) or as a list.

    Returns:
        One result per variable, or the result alone when one variable was given.
    """
    items = _variables(vars_, "gather")
    per_rank = _run("gather", items)
    out = []
    for i in range(len(items)):
        values = [np.asarray(rank_values[i]) for rank_values in per_rank]
        out.append(np.concatenate([np.atleast_1d(v) for v in values]) if concat else values)
    return out if isinstance(vars_, (list, tuple)) else out[0]


def all_gather(vars_) -> None:
    """Set every rank's replica to all the ranks' replicas joined along axis 0."""
    _run("all_gather", _variables(vars_, "all_gather"))


def scatter(vars_, values) -> None:
    """Split each of ``values`` along axis 0 (as synk splits rows) and set rank r's replica
    to part r."""
    items = _variables(vars_, "scatter")
    values = list(values) if isinstance(vars_, (list, tuple)) else [values]
    if len(values) != len(items):
        raise ValueError(f"scatter got {len(items)} variables but {len(values)} values")
    values = [np.asarray(v) for v in values]
    for v in values:
        if v.ndim == 0:
            raise ValueError("scatter splits values along axis 0; got a 0-d value")
    _run("scatter", items, values)
