"""``alltoall``: rank r's part for rank p, on rank p, for every r and p."""
from __future__ import annotations

import numpy as np

from ..._shares import split_bounds
from .. import autograd, context as _context
from ..algorithms import alltoall as _alltoall
from ..autograd.rules import Rule, register
from ..context import rank, size
from ..handle import Handle, then
from .dispatch import on
from .gather import allgather_object

__all__ = ["alltoall", "ialltoall"]


@_context.numbered
def alltoall(x, counts=None):
    """Rank r's part for rank p, on rank p, for every r and p: the pattern of sharded and
    expert-parallel models. ``x`` is a list of one array per rank (shapes and lengths may
    differ: MPI's ``Alltoallv``) and the result the list of what each rank sent this one, in
    rank order; or ``x`` is an array, split along axis 0 into one part per rank by
    ``counts`` (rows to each rank; by default as synk splits rows), and the result the rows
    received joined in rank order (torch.distributed's ``all_to_all_single``). Device
    arrays travel on NCCL (one group of sends and receives) and arrive as device arrays.

    Raises:
        ValueError: a list of another length, ``counts`` that do not add up to ``len(x)``,
            or ranks that pass different forms; on every rank.
    """
    if autograd.framed(x):
        return on("alltoall", x, autograd.alltoall_params(x, counts))
    return _alltoall.alltoall(x, counts)


@_context.numbered
def ialltoall(x, counts=None) -> Handle:
    """Non-blocking ``alltoall``; ``wait()`` returns the result."""
    if autograd.framed(x):
        return on("alltoall", x, autograd.alltoall_params(x, counts), wait=False)
    return _alltoall.alltoall(x, counts, wait=False)


# -- adjoints --------------------------------------------------------------------------------------

@register
class Alltoall(Rule):
    """``alltoall`` of a list (its adjoint: an alltoall of the cotangents' list) or of an
    array cut by ``counts`` (its adjoint: with the counts transposed, which every rank
    learns from the others' counts: ``back``)."""

    name = "alltoall"

    def forward(self, xs, p, wait=True):
        if p.get("listed"):
            call = alltoall if wait else ialltoall
            return then(call(list(xs)), list, wait)
        x, counts = xs[0], p.get("counts")
        if p.get("back"):
            sent = [int(c) for c in (counts or np.diff(split_bounds(p["rows"], size())))]
            everyones = allgather_object(sent)
            counts = [rows[rank()] for rows in everyones]
        call = alltoall if wait else ialltoall
        return then(call(x, counts), lambda r: [r], wait)

    def adjoint(self, p, xs_avals):
        if p.get("listed"):
            return "alltoall", {"listed": True}
        if p.get("back"):
            return "alltoall", {"counts": p.get("counts"), "rows": p["rows"]}
        return "alltoall", {"counts": p.get("counts"), "rows": xs_avals[0][0][0], "back": True}

    def avals(self, avals, p, rank, size):
        if p.get("listed"):
            return list(avals)
        shape, dtype = avals[0]
        if p.get("back"):
            rows = p["rows"]
        elif p.get("counts") is not None:
            rows = size * int(p["counts"][rank])
        else:
            bounds = split_bounds(shape[0], size)
            rows = size * (bounds[rank + 1] - bounds[rank])
        return [((rows,) + tuple(shape[1:]), dtype)]
