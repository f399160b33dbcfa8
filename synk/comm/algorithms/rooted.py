"""``synk.comm``'s rooted collectives (reduce, gather, scatter) and its object forms, written
once for every communicator.

::

    x --over the host: what every rank passes (checked alike on every rank)
      --the array's communicator: reduce, gather or scatter--> the result
    an object --pickled: bytes over the host communicator--> unpickled on the receivers
"""
from __future__ import annotations

import pickle

import numpy as np

from ... import _reduction
from ..._wire.arrays import dtype_token, dumps
from ...errors import CommAborted, add_note
from .. import context as _context, route as _route
from ..handle import then
from ..host.host_collectives import check_root
from . import fused as _fused, loc as _loc


# Every rank first tells the others, over the host communicator, what it passes (shape,
# dtype, weight), so that a mismatch raises the same error on every rank (not a hang on NCCL,
# nor an error on the root alone) and every communicator knows the sizes it moves; then the
# communicator of the array moves the data.
def reduce(x, op: str, root: int, weight, wait: bool = True):
    """``x`` combined over every rank with ``op`` on rank ``root`` (None elsewhere)."""
    numbers = None if op in _reduction.LOC_OPS else _fused.python_ints(x)
    if numbers is not None:
        x = _fused.past_ints_as_zero(x, numbers)
    comm = _route.numbers(x, "reduce", op)
    host = _route.host("reduce")
    if op in _reduction.LOC_OPS:
        return _loc.locate(comm, host, x, op, root, wait)
    kind = _reduction.kind_of(x)
    x = comm.xp.asarray(_route.as_array(x, "reduce"))
    heads = host.allgather_objects((tuple(x.shape), x.dtype.str, weight, op, root, numbers),
                                   "reduce")
    check_root(root, len(heads))
    _agreed("reduce", {r: (h[3], h[4]) for r, h in enumerate(heads)})
    _reduction.check_same(op, {r: (h[0], h[1]) for r, h in enumerate(heads)})
    _fused.check_python_ints([h[5] for h in heads], op, "reduce")
    weights = _fused.agreed_weights([h[2] for h in heads], "reduce")

    def finish(result):
        return None if result is None else _reduction.restore_kind(result, kind)

    return then((comm.reduce if wait else comm.ireduce)(x, op, root, weights=weights), finish,
                wait)


def _agreed(what: str, said: dict) -> None:
    """Every rank passed the same (op, root) to a rooted collective (``said``: rank ->
    them), else ``ValueError`` on every rank, naming each rank's."""
    if len(set(said.values())) > 1:
        listing = ", ".join(f"rank {r}: " + ", ".join(
            f"{name} {value!r}" for name, value in zip(("op", "root"), pair) if value is not None)
            for r, pair in sorted(said.items()))
        raise ValueError(f"synk.comm.{what}: the ranks passed different ops or roots "
                         f"({listing}); every rank must pass the same")


def gather(x, root: int, wait: bool = True):
    """Every rank's ``x`` joined along axis 0 in rank order on rank ``root`` (None
    elsewhere); lengths may differ, a 0-d value is one row."""
    comm = _route.for_array(x, "gather")
    host = _route.host("gather")
    x = comm.xp.asarray(x)
    if x.ndim == 0:
        x = x.reshape(1)
    heads = host.allgather_objects((len(x), tuple(x.shape[1:]), dtype_token(x.dtype), root),
                                   "gather")
    check_root(root, len(heads))
    _agreed("gather", {r: (None, h[3]) for r, h in enumerate(heads)})
    tails = {r: (h[1], np.dtype(h[2])) for r, h in enumerate(heads)}
    if len(set(tails.values())) > 1:
        listing = ", ".join(f"rank {r}: {t} {d}" for r, (t, d) in tails.items())
        raise ValueError("synk.comm.gather joins along axis 0, so the other dimensions must "
                         f"agree, and the dtypes; got {listing}")
    counts, (tail, dtype) = [h[0] for h in heads], tails[0]
    return (comm.gather if wait else comm.igather)(x, counts, root, tail=tail, dtype=dtype)


def scatter(chunks, root: int, wait: bool = True):
    """Rank ``root``'s ``chunks[r]`` (one array per rank; None elsewhere) on each rank r: a
    device array where the root's chunks are device arrays."""
    c = _context.collective("scatter")
    host = _route.host("scatter")
    check_root(root, c.size)
    header: tuple | _Failed | None = None
    refused = None
    if c.rank == root:
        try:
            if not isinstance(chunks, (list, tuple)) or len(chunks) != c.size:
                got = (f"{len(chunks)} of them" if isinstance(chunks, (list, tuple))
                       else type(chunks).__name__)
                raise ValueError(f"synk.comm.scatter: the root passes a list of one array "
                                 f"per rank ({c.size}); got {got}")
            for r, part in enumerate(chunks):
                _route.check_carried(part, "scatter", f"chunks[{r}]")
            comm = _route.for_arrays(list(chunks), "scatter")
            chunks = [comm.xp.asarray(part) for part in chunks]
            header = (comm is not host,
                      [(tuple(p.shape), dtype_token(p.dtype)) for p in chunks])
        except (TypeError, ValueError) as exc:  # (in the header's place: every rank raises
            refused = exc  # it, none waits for chunks that never come)
            header = _Failed(c.rank, exc, "checking its chunks")
    try:
        on_device, specs = broadcast_object(header, root, "scatter")
    except Exception:
        if refused is not None:
            add_note(refused, "synk: every other rank of synk.comm.scatter raises it too")
            raise refused from None
        raise
    comm = _route.device("scatter") if on_device else host
    shape, dtype = specs[c.rank]
    parts = chunks if c.rank == root else None
    return (comm.scatter if wait else comm.iscatter)(parts, root, shape, np.dtype(dtype))


# ---------------------------------------------------------------- Python objects
# Objects are pickled and travel as bytes over the host communicator (mpi4py's lowercase
# API). An object that cannot be pickled still takes part: its rank sends a ``_Failed``
# carrying the exception, and every rank raises it (``_raise``), so that none waits for the
# bytes, even where the failing rank catches it and goes on. That rank raises the exception
# itself (``dumps``: a ``TypeError`` where pickle refuses); the others a copy (or
# ``CommAborted``, naming it, where it does not pickle).
class _Failed:
    """Stands in for an object that rank ``rank`` could not pickle (or, ``doing`` says, a
    value it refused: a scatter's chunks): the exception, pickled (None where it cannot
    be), and its type and text."""

    def __init__(self, rank: int, exc: BaseException, doing: str = "pickling its object"
                 ) -> None:
        self.rank, self.text, self.doing = rank, f"{type(exc).__name__}: {exc}", doing
        try:
            self.error: bytes | None = dumps(exc, "the exception")
        except Exception:
            self.error = None

    def exception(self, what: str, rank: int) -> BaseException:
        """The exception, on rank ``rank`` (which had no part in it), noted as such."""
        try:
            exc = pickle.loads(self.error) if self.error is not None else None
        except Exception:
            exc = None
        if not isinstance(exc, BaseException):
            return CommAborted(f"synk.comm.{what}: rank {self.rank} could not pickle its "
                               f"object ({self.text}), so rank {rank} raises too")
        add_note(exc, f"synk: rank {self.rank} raised this while {self.doing} for "
                      f"synk.comm.{what}; every rank of the collective raises it")
        return exc


def _pickled(obj, what: str, rank: int) -> tuple:
    """``(bytes, None)``: ``obj`` pickled as every object synk sends to another rank (by
    cloudpickle where pickle cannot: a class or function of the user's script, a lambda);
    or ``(bytes of a _Failed, the exception)`` where it cannot be."""
    try:
        return np.frombuffer(dumps(obj, f"synk.comm.{what}'s object"), np.uint8), None
    except Exception as exc:
        return np.frombuffer(pickle.dumps(_Failed(rank, exc)), np.uint8), exc


def _unpickled(data: np.ndarray):
    return pickle.loads(np.ascontiguousarray(data).tobytes())


def _raise(what: str, rank: int, mine, got) -> None:
    """Raise, where this rank could not pickle its object (``mine``: the exception) or it
    got a ``_Failed`` from another rank (``got``: what it received)."""
    if mine is not None:
        add_note(mine, f"synk: every other rank of synk.comm.{what} raises it too")
        raise mine
    failed = next((g for g in got if type(g) is _Failed), None)
    if failed is not None:
        raise failed.exception(what, rank)


def broadcast_object(obj, root: int, what: str = "broadcast_object"):
    """Rank ``root``'s ``obj`` on every rank (pickled)."""
    c = _context.collective(what)
    check_root(root, c.size)
    data, mine = _pickled(obj, what, c.rank) if c.rank == root else (None, None)
    got = _unpickled(_route.host(what).broadcast(data, root))
    _raise(what, c.rank, mine, [got])
    return got


def allgather_object(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    c = _context.collective("allgather_object")
    data, mine = _pickled(obj, "allgather_object", c.rank)
    parts = _route.host("allgather_object").allgather_objects(data.tobytes(),
                                                              "allgather_object")
    got = [obj if r == c.rank and mine is None else pickle.loads(part)
           for r, part in enumerate(parts)]
    _raise("allgather_object", c.rank, mine, got)
    return got


def gather_object(obj, root: int):
    """Every rank's ``obj``, in rank order, on rank ``root`` (None elsewhere). A rank that
    cannot pickle its object says so with its size (negative), and every rank raises."""
    c = _context.collective("gather_object")
    check_root(root, c.size)
    host = _route.host("gather_object")
    data, mine = _pickled(obj, "gather_object", c.rank)
    said = np.array([data.size if mine is None else -data.size], np.int64)
    counts = [int(h[0]) for h in host.allgather_heads(said)]
    if any(n < 0 for n in counts):  # (every rank: the failures' _Failed, then raise)
        failures = host.allgather_objects(None if mine is None else data.tobytes(),
                                          "gather_object")
        _raise("gather_object", c.rank, mine,
               [pickle.loads(b) for b in failures if b is not None])
    joined = host.gather(data, counts, root, tail=(), dtype=np.uint8)
    if joined is None:
        return None
    starts = np.cumsum([0, *counts])
    return [_unpickled(joined[starts[r]:starts[r + 1]]) for r in range(c.size)]


def scatter_object(objs, root: int):
    """Rank ``root``'s ``objs[r]`` (one object per rank; None elsewhere) on each rank r."""
    c = _context.collective("scatter_object")
    check_root(root, c.size)
    parts, mine = None, None
    if c.rank == root and (not isinstance(objs, (list, tuple)) or len(objs) != c.size):
        mine = ValueError(f"synk.comm.scatter_object: the root passes a list of one object "
                          f"per rank ({c.size})")
        refusal = _Failed(c.rank, mine, "checking its objects")  # (every rank raises it)
        parts = [np.frombuffer(pickle.dumps(refusal), np.uint8)] * c.size
    elif c.rank == root:
        parts = []
        for o in objs:
            data, mine = _pickled(o, "scatter_object", c.rank)
            if mine is not None:  # (every rank gets the _Failed)
                parts = [data] * c.size
                break
            parts.append(data)
    host = _route.host("scatter_object")
    got = _unpickled(host.scatter(parts, root, None, np.uint8))
    _raise("scatter_object", c.rank, mine, [got])
    return got
