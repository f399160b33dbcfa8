"""``synk.comm``'s rooted collectives (reduce, gather, scatter) and its object forms, written
once for every communicator.

Every rank first tells the others, over the host communicator, what it passes (shape,
dtype, weight), so that a mismatch raises the same error on every rank (not a hang on NCCL,
nor an error on the root alone) and every communicator knows the sizes it moves; then the
communicator of the array moves the data. Python objects are pickled and travel as bytes
over the host communicator (mpi4py's lowercase API).
"""
from __future__ import annotations

import pickle

import numpy as np

from ... import _reduction
from ..._wire.arrays import dtype_token, dumps
from .. import context as _context, route as _route
from ..handle import Handle
from ..host.host_collectives import check_root
from . import fused as _fused, loc as _loc


def _shapes_listing(shapes: dict) -> str:
    return ", ".join(f"rank {r}: {s}" for r, s in sorted(shapes.items()))


def reduce(x, op: str, root: int, weight, wait: bool = True):
    """``x`` combined over every rank with ``op`` on rank ``root`` (None elsewhere)."""
    comm = _route.numbers(x, "reduce", op)
    host = _route.host("reduce")
    if op in _reduction.LOC_OPS:
        return _loc.locate(comm, host, x, op, root, wait)
    kind = _reduction.kind_of(x)
    x = comm.xp.asarray(x)
    heads = host.allgather_objects((tuple(x.shape), x.dtype.str, weight), "reduce")
    check_root(root, len(heads))
    shapes = {r: h[0] for r, h in enumerate(heads)}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"synk.comm.reduce: the ranks passed arrays of different shapes "
                         f"({_shapes_listing(shapes)}); op {op!r} needs the same shape on "
                         "every rank")
    weights = _fused.agreed_weights([h[2] for h in heads], "reduce")
    x = x.astype(np.result_type(*[np.dtype(h[1]) for h in heads]), copy=False)

    def finish(result):
        return None if result is None else _reduction.restore_kind(result, kind)

    if wait:
        return finish(comm.reduce(x, op, root, weights=weights))
    handle = comm.ireduce(x, op, root, weights=weights)
    return Handle(lambda: finish(handle.wait()))


def gather(x, root: int, wait: bool = True):
    """Every rank's ``x`` joined along axis 0 in rank order on rank ``root`` (None
    elsewhere); lengths may differ, a 0-d value is one row."""
    comm = _route.for_array(x, "gather")
    host = _route.host("gather")
    x = comm.xp.asarray(x)
    if x.ndim == 0:
        x = x.reshape(1)
    heads = host.allgather_objects((len(x), tuple(x.shape[1:]), dtype_token(x.dtype)),
                                   "gather")
    check_root(root, len(heads))
    tails = {r: h[1] for r, h in enumerate(heads)}
    if len(set(tails.values())) > 1:
        raise ValueError("synk.comm.gather joins along axis 0, so the other dimensions must "
                         f"agree; got {_shapes_listing(tails)}")
    dtype = np.result_type(*[np.dtype(h[2]) for h in heads])
    counts, tail = [h[0] for h in heads], tails[0]
    x = x.astype(dtype, copy=False)
    if wait:
        return comm.gather(x, counts, root, tail=tail, dtype=dtype)
    return comm.igather(x, counts, root, tail=tail, dtype=dtype)


def scatter(chunks, root: int, wait: bool = True):
    """Rank ``root``'s ``chunks[r]`` (one array per rank; None elsewhere) on each rank r: a
    device array where the root's chunks are device arrays."""
    c = _context.collective("scatter")
    host = _route.host("scatter")
    check_root(root, c.size)
    header = None
    if c.rank == root:
        if not isinstance(chunks, (list, tuple)) or len(chunks) != c.size:
            got = (f"{len(chunks)} of them" if isinstance(chunks, (list, tuple))
                   else type(chunks).__name__)
            raise ValueError(f"synk.comm.scatter: the root passes a list of one array per "
                             f"rank ({c.size}); got {got}")
        for part in chunks:
            _route.check_carried(part, "scatter")
        comm = _route.for_arrays(list(chunks), "scatter")
        chunks = [comm.xp.asarray(part) for part in chunks]
        header = (comm is not host, [(tuple(p.shape), dtype_token(p.dtype)) for p in chunks])
    on_device, specs = broadcast_object(header, root, "scatter")
    comm = _route.device("scatter") if on_device else host
    shape, dtype = specs[c.rank]
    parts = chunks if c.rank == root else None
    if wait:
        return comm.scatter(parts, root, shape, np.dtype(dtype))
    return comm.iscatter(parts, root, shape, np.dtype(dtype))


# ---------------------------------------------------------------- Python objects
def _pickled(obj, what: str) -> np.ndarray:
    """``obj`` pickled as every object synk sends to another rank (by cloudpickle where
    pickle cannot: a class or function of the user's script, a lambda)."""
    return np.frombuffer(dumps(obj, f"synk.comm.{what}'s object"), np.uint8)


def _unpickled(data: np.ndarray):
    return pickle.loads(np.ascontiguousarray(data).tobytes())


def broadcast_object(obj, root: int, what: str = "broadcast_object"):
    """Rank ``root``'s ``obj`` on every rank (pickled)."""
    c = _context.collective(what)
    check_root(root, c.size)
    data = _pickled(obj, what) if c.rank == root else None
    return _unpickled(_route.host(what).broadcast(data, root))


def allgather_object(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    return _route.host("allgather_object").allgather_objects(obj, "allgather_object")


def gather_object(obj, root: int):
    """Every rank's ``obj``, in rank order, on rank ``root`` (None elsewhere)."""
    c = _context.collective("gather_object")
    check_root(root, c.size)
    host = _route.host("gather_object")
    data = _pickled(obj, "gather_object")
    counts = [int(h[0]) for h in host.allgather_heads(np.array([data.size], np.int64))]
    joined = host.gather(data, counts, root, tail=(), dtype=np.uint8)
    if joined is None:
        return None
    starts = np.cumsum([0, *counts])
    return [_unpickled(joined[starts[r]:starts[r + 1]]) for r in range(c.size)]


def scatter_object(objs, root: int):
    """Rank ``root``'s ``objs[r]`` (one object per rank; None elsewhere) on each rank r."""
    c = _context.collective("scatter_object")
    check_root(root, c.size)
    parts = None
    if c.rank == root:
        if not isinstance(objs, (list, tuple)) or len(objs) != c.size:
            raise ValueError(f"synk.comm.scatter_object: the root passes a list of one object "
                             f"per rank ({c.size})")
        parts = [_pickled(o, "scatter_object") for o in objs]
    host = _route.host("scatter_object")
    return _unpickled(host.scatter(parts, root, None, np.uint8))
