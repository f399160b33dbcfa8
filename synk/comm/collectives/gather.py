"""Every rank's values joined: ``allgather`` on every rank, ``gather`` on one (and their
Python-object forms)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import autograd, context as _context, route as _route
from ..algorithms import moves as _moves, rooted as _rooted
from ..autograd.rules import Rule, dummy, like, many, one, register, rows_of
from ..context import rank
from ..handle import Handle, then
from .dispatch import into, on

__all__ = ["allgather", "iallgather", "gather", "igather", "allgather_object", "gather_object"]


@_context.numbered
def allgather(x, *, out=None) -> Any:
    """Every rank's ``x`` joined along axis 0 in rank order (lengths may differ; 0-d values
    become one row each), on every rank. ``x`` may be a list, tuple or dict of arrays (the
    same structure on every rank): each leaf is joined so, all of them in one fused
    collective. ``out``: an array of the result's shape and dtype to join the parts into
    (as ``allreduce``'s)."""
    return _allgather(x, out, True, "allgather")


@_context.numbered
def iallgather(x, *, out=None) -> Handle:
    """Non-blocking ``allgather``; ``wait()`` returns the result."""
    return _allgather(x, out, False, "iallgather")


def _allgather(x, out, wait: bool, what: str):
    if autograd.framed(x) or autograd.framed(out):
        return on("allgather", x, {}, wait=wait, out=out,
                  direct=lambda v, o: allgather(v, out=o))
    if isinstance(x, (list, tuple, dict)):
        return into(_moves.allgather_structure(x, wait=wait), out, what)
    comm = _route.for_array(x, what)
    return into((comm.allgather if wait else comm.iallgather)(x, out=out), out, what)


@_context.numbered
def gather(x, root: int = 0):
    """Every rank's ``x`` joined along axis 0 in rank order, on rank ``root`` only (the
    others get None). Lengths may differ (MPI's ``Gatherv``); 0-d values are one row each;
    the other dimensions must agree, on every rank. torch.distributed's ``gather`` gives a
    list: ``np.split`` this at the ranks' lengths for one."""
    if autograd.framed(x):
        return on("gather", x, {"root": root})
    return _rooted.gather(x, root)


@_context.numbered
def igather(x, root: int = 0) -> Handle:
    """Non-blocking ``gather``; ``wait()`` returns the result (None off the root)."""
    if autograd.framed(x):
        return on("gather", x, {"root": root}, wait=False)
    return _rooted.gather(x, root, wait=False)


@_context.numbered
def allgather_object(obj: Any) -> list:
    """Every rank's Python object (pickled), in rank order, on every rank. mpi4py's
    ``allgather``."""
    return _rooted.allgather_object(obj)


@_context.numbered
def gather_object(obj: Any, root: int = 0) -> list | None:
    """Every rank's Python object, in rank order, on rank ``root`` (None elsewhere).
    mpi4py's ``gather``."""
    return _rooted.gather_object(obj, root)


# -- adjoints --------------------------------------------------------------------------------------

@register
class Allgather(Rule):
    name = "allgather"

    def forward(self, xs, p, wait=True):
        call = allgather if wait else iallgather
        return then(call(one(xs)), lambda r: many(r, len(xs)), wait)

    def adjoint(self, p, xs_avals):
        return "rows_back", {"avals": tuple(xs_avals), "scale": None}

    def avals(self, avals, p, rank, size):
        return [((size * rows_of(s),) + tuple(s[1:]), d) for s, d in avals]


@register
class Gather(Rule):
    """``gather``: the joined rows on the root, a 0-d zero elsewhere."""

    name = "gather"

    def forward(self, xs, p, wait=True):
        x = xs[0]
        call = gather if wait else igather
        return then(call(x, p["root"]), lambda r: [dummy(x) if r is None else r], wait)

    def adjoint(self, p, xs_avals):
        return "scatter_rows", {"root": p["root"], "aval": xs_avals[0]}

    def avals(self, avals, p, rank, size):
        shape, dtype = avals[0]
        if rank != p["root"]:
            return [((), dtype)]
        return [((size * rows_of(shape),) + tuple(shape[1:]), dtype)]


@register
class ScatterRows(Rule):
    """The root's cotangent cut into every rank's rows (each rank tells its own)."""

    name = "scatter_rows"

    def forward(self, xs, p, wait=True):
        root, (shape, dtype) = p["root"], p["aval"]
        lengths = allgather_object(rows_of(shape))
        parts = None
        if rank() == root:
            starts = np.cumsum([0, *lengths])
            parts = [xs[0][starts[r]:starts[r + 1]] for r in range(len(lengths))]
        return [like(_rooted.scatter(parts, root), shape, dtype)]

    def adjoint(self, p, xs_avals):
        return "gather", {"root": p["root"]}

    def avals(self, avals, p, rank, size):
        return [(tuple(p["aval"][0]), p["aval"][1])]
