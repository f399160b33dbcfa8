"""Collectives over the point-to-point transport, for one call's ranks.

Each takes the transport, this rank and the group size, and a tag that every rank derived
in the same way, so the ranks' messages match whatever order they arrive in. allreduce is a
reduce-scatter then an allgather: every rank sends and receives (n - 1) / n of the array in
each phase, the least any algorithm moves.
"""
from __future__ import annotations

import numpy as np

from .. import _ops
from .._runner import split_bounds

OPS = ("sum", "prod", "max", "min", "mean")


def check_op(op, what: str = "synk.comm") -> str:
    """The op's canonical name ("avg" is "mean"), or a ValueError listing the ops."""
    name = op.lower() if isinstance(op, str) else op
    name = "mean" if name == "avg" else name
    if name not in OPS:
        raise ValueError(f"unknown op {op!r} for {what}: use one of {list(OPS)}")
    return name


def _combine(op: str, chunks: list, rank_of: list) -> np.ndarray:
    shapes = {r: c.shape for r, c in zip(rank_of, chunks)}
    if len(set(shapes.values())) > 1:
        listing = ", ".join(f"rank {r}: {s}" for r, s in sorted(shapes.items()))
        raise ValueError(f"the ranks passed arrays of different shapes ({listing}); "
                         f"op {op!r} needs the same shape on every rank")
    return np.asarray(_ops.combine(op, [(1, c) for c in chunks]))


SMALL = 64 << 10  # an allreduce this small exchanges whole arrays: one round, not two


def _everyones(mesh, rank: int, size: int, tag: tuple, x: np.ndarray) -> list:
    """Every rank's ``x``, in rank order."""
    sends = [mesh.post(p, tag, x) for p in range(size) if p != rank]
    parts = [x if r == rank else mesh.take(r, tag) for r in range(size)]
    for s in sends:
        mesh.wait_sent(s)
    return parts


def allgather(mesh, rank: int, size: int, tag: tuple, x) -> np.ndarray:
    x = np.asarray(x)
    if size == 1:
        return np.atleast_1d(x).copy()
    parts = [np.atleast_1d(p) for p in _everyones(mesh, rank, size, tag, x)]
    tails = {tuple(p.shape[1:]) for p in parts}
    if len(tails) > 1:
        listing = ", ".join(f"rank {r}: {p.shape}" for r, p in enumerate(parts))
        raise ValueError(f"allgather joins along axis 0, so the other dimensions must agree; "
                         f"got {listing}")
    return np.concatenate(parts, axis=0)


def broadcast(mesh, rank: int, size: int, tag: tuple, x, root: int):
    if not 0 <= root < size:
        raise ValueError(f"root must be a rank, 0..{size - 1}; got {root}")
    if rank == root:
        x = np.asarray(x)
        for s in [mesh.post(p, tag, x) for p in range(size) if p != rank]:
            mesh.wait_sent(s)
        return x
    return mesh.take(root, tag)


def reduce_scatter(mesh, rank: int, size: int, tag: tuple, x, op: str) -> np.ndarray:
    """Split ``x`` along axis 0 into ``size`` parts (as synk splits rows); rank r gets part r
    combined over every rank with ``op``."""
    x = np.asarray(x)
    if x.ndim == 0:
        raise ValueError("reduce_scatter splits along axis 0, so x needs at least 1 dimension")
    bounds = split_bounds(len(x), size)
    sends = [mesh.post(p, tag, x[bounds[p]:bounds[p + 1]]) for p in range(size) if p != rank]
    mine = [x[bounds[rank]:bounds[rank + 1]] if r == rank else mesh.take(r, tag)
            for r in range(size)]
    for s in sends:
        mesh.wait_sent(s)
    return _combine(op, mine, list(range(size)))


def allreduce(mesh, rank: int, size: int, tag: tuple, x, op: str) -> np.ndarray:
    x = np.asarray(x)
    if size == 1:
        return _combine(op, [x], [0])
    if x.nbytes <= SMALL:  # combined in rank order everywhere: the same bits on every rank
        return _combine(op, _everyones(mesh, rank, size, tag, x), list(range(size)))
    flat = np.ascontiguousarray(x).reshape(-1)  # unequal sizes show as unequal chunks
    chunk = reduce_scatter(mesh, rank, size, tag + ("rs",), flat, op)
    return allgather(mesh, rank, size, tag + ("ag",), chunk).reshape(x.shape)
