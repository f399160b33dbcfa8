"""``reduce_scatter``: each rank's part of a reduction over every rank."""
from __future__ import annotations

import numpy as np

from ... import _reduction
from ..._reduction import canonical
from ..._shares import split_bounds
from ...errors import SynkError
from .. import autograd, context as _context, route as _route
from ..algorithms import alltoall as _alltoall, fused as _fused
from ..autograd.rules import Rule, like, no_gradient, register, rows_of
from ..context import size
from ..handle import Handle, then
from .allreduce import allreduce_for
from .dispatch import into, on
from .gather import allgather, allgather_object

__all__ = ["reduce_scatter", "ireduce_scatter"]


@_context.numbered
def reduce_scatter(x, op: str = "sum", counts=None, *, out=None) -> np.ndarray:
    """Split ``x`` along axis 0 into one part per rank; rank r gets part r combined over
    every rank with ``op``. ``counts``: each rank's rows (MPI's ``recvcounts``: the same
    list on every rank, adding up to ``len(x)``); by default split as synk splits rows.
    ``x`` must be numeric (as for ``allreduce``), else TypeError. ``out``: an array of the
    result's shape and dtype to write it into (as ``allreduce``'s).

    Python ints are combined as int64, as Python's: a sum or product past its range raises
    ``OverflowError`` on every rank rather than wrap (as ``allreduce``'s)."""
    return _reduce_scatter(x, op, counts, out, True, "reduce_scatter")


@_context.numbered
def ireduce_scatter(x, op: str = "sum", counts=None, *, out=None) -> Handle:
    """Non-blocking ``reduce_scatter``; ``wait()`` returns the result."""
    return _reduce_scatter(x, op, counts, out, False, "ireduce_scatter")


def _reduce_scatter(x, op: str, counts, out, wait: bool, what: str):
    op = canonical(op)
    if autograd.framed(x) or autograd.framed(out):
        return on("reduce_scatter", x, {"op": op, "counts": autograd.counts(counts)},
                  wait=wait, out=out, direct=lambda v, o: reduce_scatter(v, op, counts, out=o))
    if _fused.python_ints(x) is not None:
        return into(_of_python_ints(x, op, counts, wait, what), out, what)
    communicator = _route.numbers(x, what, op)  # (its dtype first: numbers)
    bounds = _alltoall.reduce_scatter_bounds(x, counts, what)
    call = communicator.reduce_scatter if wait else communicator.ireduce_scatter
    return into(call(x, op, bounds, out), out, what)


def _of_python_ints(x, op: str, counts, wait: bool, what: str):
    """This rank's part of ``x`` (holding Python ints) reduced over the ranks: ``x`` reduced
    whole by ``allreduce`` (Python's answer, or ``OverflowError`` on every rank, not on the
    one rank whose part wrapped), then its rows, in the dtype reduce_scatter gives."""
    bounds = _alltoall.reduce_scatter_bounds(x, counts, what)
    c = _context.require(what)
    if bounds is None:
        bounds = split_bounds(len(x), c.size)
    lo, hi = bounds[c.rank], bounds[c.rank + 1]

    def part(whole):
        dtype = _reduction.result_dtype(op, [np.asarray(x).dtype])
        return np.asarray(whole, dtype)[lo:hi]

    return then(allreduce_for(x, op, None, None, wait, what), part, wait)


# -- adjoints --------------------------------------------------------------------------------------

@register
class ReduceScatter(Rule):
    name, math = "reduce_scatter", True

    def forward(self, xs, p, wait=True):
        call = reduce_scatter if wait else ireduce_scatter
        return then(call(xs[0], p["op"], p.get("counts")), lambda r: [r], wait)

    def adjoint(self, p, xs_avals):
        if p["op"] not in ("sum", "mean"):
            no_gradient("reduce_scatter", p["op"])
        return "allgather_rows", {"avals": tuple(xs_avals),
                                  "scale": "mean" if p["op"] == "mean" else None}

    def avals(self, avals, p, rank, size):
        shape, dtype = avals[0]
        counts = p.get("counts")
        bounds = (split_bounds(shape[0], size) if counts is None
                  else list(np.cumsum([0, *counts])))
        return [((int(bounds[rank + 1] - bounds[rank]),) + tuple(shape[1:]), dtype)]


@register
class AllgatherRows(Rule):
    """Every rank's cotangent joined along axis 0, as this rank's input (scaled by
    1/size for a mean)."""

    name, math = "allgather_rows", True

    def forward(self, xs, p, wait=True):
        out = []
        for ct, (shape, dtype) in zip(xs, p["avals"]):
            got = allgather(ct)
            if p.get("scale") == "mean":
                got = got / size()
            if tuple(got.shape) != tuple(shape):
                raise SynkError(f"synk.comm: the gradient of a reduce_scatter needs every "
                                f"rank's rows back ({tuple(shape)}), got {tuple(got.shape)}")
            out.append(like(got, shape, dtype))
        return out

    def adjoint(self, p, xs_avals):
        scale = None if p.get("scale") is None else 1.0
        return "rows_back", {"avals": tuple(xs_avals), "scale": scale}

    def avals(self, avals, p, rank, size):
        return [(tuple(s), d) for s, d in p["avals"]]


@register
class RowsBack(Rule):
    """Each rank's own rows of the cotangents, summed over the ranks (a reduce_scatter by
    the rows each rank gave, which may differ: every rank tells its own first)."""

    name, math = "rows_back", True

    def forward(self, xs, p, wait=True):
        avals = p["avals"]
        everyones = allgather_object([rows_of(s) for s, _ in avals])
        out = []
        for i, (ct, (shape, dtype)) in enumerate(zip(xs, avals)):
            counts = [rows[i] for rows in everyones]
            got = reduce_scatter(ct.reshape((len(ct),) + tuple(ct.shape[1:]))
                                       if ct.ndim else ct.reshape(1), "sum", counts)
            if p.get("scale") is not None:
                got = got * p["scale"]
            out.append(like(got, shape, dtype))
        return out

    def adjoint(self, p, xs_avals):
        return "allgather_rows", {"avals": tuple(p["avals"]), "scale": p.get("scale")}

    def avals(self, avals, p, rank, size):
        return [(tuple(s), d) for s, d in p["avals"]]
