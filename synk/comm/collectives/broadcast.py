"""One rank's values to the others: ``broadcast`` and ``scatter`` (and their Python-object
forms)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ... import _tree
from .. import autograd, context as _context
from ..algorithms import moves as _moves, out as _out, rooted as _rooted
from ..autograd.rules import Rule, like, received, register, rows_of, xp
from ..context import rank
from ..frame_marks import mark
from ..handle import Handle, then
from .allreduce import reduce
from .dispatch import into, on
from .gather import gather

__all__ = ["broadcast", "ibroadcast", "scatter", "iscatter", "broadcast_object", "scatter_object"]


@_context.numbered
def broadcast(x, root: int = 0, *, out=None) -> Any:
    """Rank ``root``'s ``x`` on every rank (the others may pass None); a device array
    everywhere when it is one at the root. ``x`` may be a list, tuple or dict of arrays
    (nested too), such as a model's parameters: they travel in one fused buffer, one
    collective in all, and every rank gets the same structure. ``out``: an array of the
    result's shape and dtype to receive it into (as ``allreduce``'s)."""
    if autograd.framed(x) or autograd.framed(out):
        return on("broadcast", x, {"root": root}, out=out,
                  direct=lambda v, o: broadcast(v, root, out=o))
    got = _moves.broadcast(x, root, out=out)
    if out is not None:  # (the root's framework value, into this rank's buffer)
        got = autograd.unmarked(got, "broadcast")
    got = into(got, out, "broadcast")
    return got if type(got) is np.ndarray and got.dtype.names is None else autograd.arrived(
        "broadcast", got, {"root": root})


@_context.numbered
def ibroadcast(x, root: int = 0, *, out=None) -> Handle:
    """Non-blocking ``broadcast``; ``wait()`` returns the result."""
    if autograd.framed(x) or autograd.framed(out):
        return on("broadcast", x, {"root": root}, wait=False, out=out,
                  direct=lambda v, o: broadcast(v, root, out=o))
    begun = _moves.broadcast(x, root, wait=False, out=out)
    handle = begun if out is None else Handle(lambda: _out.deliver(  # (as broadcast's)
        autograd.unmarked(begun.wait(), "ibroadcast"), _tree.apart(out), "ibroadcast"))
    return Handle(lambda: autograd.arrived("broadcast", handle.wait(), {"root": root}))


@_context.numbered
def scatter(chunks, root: int = 0):
    """Rank ``root``'s ``chunks[r]`` on each rank r: the root passes a list of one array
    per rank (their shapes may differ: MPI's ``Scatterv``), the others pass None. Device
    arrays at the root arrive as device arrays. torch.distributed's ``scatter``."""
    if autograd.framed(chunks):
        return on("scatter", list(chunks), {"root": root})
    got = _rooted.scatter(chunks, root)
    return got if got.dtype.names is None else autograd.arrived("scatter", got,
                                                                {"root": root})


@_context.numbered
def iscatter(chunks, root: int = 0) -> Handle:
    """Non-blocking ``scatter``; ``wait()`` returns this rank's chunk."""
    if autograd.framed(chunks):
        return on("scatter", list(chunks), {"root": root}, wait=False)
    handle = _rooted.scatter(chunks, root, wait=False)
    return Handle(lambda: autograd.arrived("scatter", handle.wait(), {"root": root}))


@_context.numbered
def broadcast_object(obj: Any, root: int = 0) -> Any:
    """Rank ``root``'s Python object (pickled) on every rank: metadata, shapes, dicts.
    mpi4py's ``bcast``, torch.distributed's ``broadcast_object_list``."""
    return _rooted.broadcast_object(obj, root)


@_context.numbered
def scatter_object(objs, root: int = 0) -> Any:
    """Rank ``root``'s ``objs[r]`` (a list of one object per rank; None elsewhere) on each
    rank r. mpi4py's ``scatter``."""
    return _rooted.scatter_object(objs, root)


# -- adjoints --------------------------------------------------------------------------------------

@register
class Broadcast(Rule):
    """The root's leaves on every rank, marked with their frames (so that ranks which
    passed None get the framework back, and learn whether autograd follows them)."""

    name, receives = "broadcast", True

    def forward(self, xs, p, wait=True):
        root = p["root"]
        sent = None
        if rank() == root:
            frames = p["frames"]
            sent = [mark(x, f) if f is not None else x for x, f in zip(xs, frames)]
            template = p.get("template")
            sent = sent[0] if template is None else _tree.rebuild(template, iter(sent))
        call = _moves.broadcast
        mine = rank() == root
        return then(call(sent, root, wait=wait), lambda got: received(got, mine), wait)

    def adjoint(self, p, xs_avals):
        return "reduce_to", {"root": p["root"], "avals": tuple(xs_avals)}


@register
class ReduceTo(Rule):
    """Each cotangent summed over the ranks on the root; zeros of the input elsewhere."""

    name, math = "reduce_to", True

    def forward(self, xs, p, wait=True):
        out, avals = [], p["avals"]
        for i, ct in enumerate(xs):  # (a rank that passed None has no input: no gradient)
            got = reduce(ct, "sum", p["root"])
            if i < len(avals):
                shape, dtype = avals[i]
                out.append(xp(ct).zeros(shape, dtype) if got is None
                           else like(got, shape, dtype))
        return out

    def adjoint(self, p, xs_avals):
        return "broadcast", {"root": p["root"], "frames": (None,) * len(xs_avals)}

    def avals(self, avals, p, rank, size):
        return [(tuple(s), d) for s, d in p["avals"]]


@register
class Scatter(Rule):
    """The root's chunks, one per rank, marked with their frames."""

    name, receives = "scatter", True

    def forward(self, xs, p, wait=True):
        root = p["root"]
        chunks = None
        if rank() == root:
            chunks = [mark(x, f) if f is not None else x for x, f in zip(xs, p["frames"])]
        return then(_rooted.scatter(chunks, root, wait=wait), received, wait)

    def adjoint(self, p, xs_avals):
        return "gather_to", {"root": p["root"], "avals": tuple(xs_avals)}


@register
class GatherTo(Rule):
    """Every rank's cotangent on the root, as the gradients of the root's chunks."""

    name = "gather_to"

    def forward(self, xs, p, wait=True):
        ct = xs[0]
        got = gather(ct.reshape((len(ct),) + tuple(ct.shape[1:])) if ct.ndim
                           else ct.reshape(1), p["root"])
        if got is None:  # (a rank other than the root that passed arrays: they count for 0)
            return [xp(ct).zeros(shape, dtype) for shape, dtype in p["avals"]]
        out, at = [], 0
        for shape, dtype in p["avals"]:
            n = rows_of(shape)
            out.append(like(got[at:at + n], shape, dtype))
            at += n
        return out

    def adjoint(self, p, xs_avals):
        return "scatter", {"root": p["root"], "frames": (None,) * len(p["avals"])}
