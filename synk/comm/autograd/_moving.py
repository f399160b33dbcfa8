"""The rules of the collectives that move arrays (``rules``): broadcast, allgather,
reduce_scatter, scatter, gather, alltoall, and their adjoints."""
from __future__ import annotations

import numpy as np

from ... import _tree
from ..._shares import split_bounds
from ...errors import SynkError
from ..frame_marks import mark, marked, unmark
from ._base import Rule, _dummy, _like, _many, _no_gradient, _one, _rows, _rule, _then, _xp


@_rule
class Broadcast(Rule):
    """The root's leaves on every rank, marked with their frames (so that ranks which
    passed None get the framework back, and learn whether autograd follows them)."""

    name, receives = "broadcast", True

    def forward(self, plain, xs, p, wait=True):
        root = p["root"]
        sent = None
        if plain.rank() == root:
            frames = p["frames"]
            sent = [mark(x, f) if f is not None else x for x, f in zip(xs, frames)]
            template = p.get("template")
            sent = sent[0] if template is None else _tree.rebuild(template, iter(sent))
        call = plain.broadcast if wait else plain.ibroadcast
        mine = plain.rank() == root
        return _then(call(sent, root), lambda got: received(got, mine), wait)

    def adjoint(self, p, xs_avals):
        return "reduce_to", {"root": p["root"], "avals": tuple(xs_avals)}


class Received(list):
    """The leaves a broadcast or a scatter brought, unmarked: [(native, Frame or None)],
    and their structure (``template``)."""

    template = None


def received(got, copy: bool = False) -> Received:
    """``got`` unmarked (``copy``: the root's own, copied off its input's memory)."""
    leaves, template = _tree.flatten(got)
    out = Received(unmark(leaf)[:2] if marked(leaf) else (leaf, None) for leaf in leaves)
    if copy:
        out[:] = [(n.copy(), f) for n, f in out]
    out.template = template
    return out


@_rule
class ReduceTo(Rule):
    """Each cotangent summed over the ranks on the root; zeros of the input elsewhere."""

    name, math = "reduce_to", True

    def forward(self, plain, xs, p, wait=True):
        out, avals = [], p["avals"]
        for i, ct in enumerate(xs):  # (a rank that passed None has no input: no gradient)
            got = plain.reduce(ct, "sum", p["root"])
            if i < len(avals):
                shape, dtype = avals[i]
                out.append(_xp(ct).zeros(shape, dtype) if got is None
                           else _like(got, shape, dtype))
        return out

    def adjoint(self, p, xs_avals):
        return "broadcast", {"root": p["root"], "frames": (None,) * len(xs_avals)}

    def avals(self, avals, p, rank, size):
        return [(tuple(s), d) for s, d in p["avals"]]


@_rule
class Allgather(Rule):
    name = "allgather"

    def forward(self, plain, xs, p, wait=True):
        call = plain.allgather if wait else plain.iallgather
        return _then(call(_one(xs)), lambda r: _many(r, len(xs)), wait)

    def adjoint(self, p, xs_avals):
        return "rows_back", {"avals": tuple(xs_avals), "scale": None}

    def avals(self, avals, p, rank, size):
        return [((size * _rows(s),) + tuple(s[1:]), d) for s, d in avals]


@_rule
class RowsBack(Rule):
    """Each rank's own rows of the cotangents, summed over the ranks (a reduce_scatter by
    the rows each rank gave, which may differ: every rank tells its own first)."""

    name, math = "rows_back", True

    def forward(self, plain, xs, p, wait=True):
        avals = p["avals"]
        everyones = plain.allgather_object([_rows(s) for s, _ in avals])
        out = []
        for i, (ct, (shape, dtype)) in enumerate(zip(xs, avals)):
            counts = [rows[i] for rows in everyones]
            got = plain.reduce_scatter(ct.reshape((len(ct),) + tuple(ct.shape[1:]))
                                       if ct.ndim else ct.reshape(1), "sum", counts)
            if p.get("scale") is not None:
                got = got * p["scale"]
            out.append(_like(got, shape, dtype))
        return out

    def adjoint(self, p, xs_avals):
        return "allgather_rows", {"avals": tuple(p["avals"]), "scale": p.get("scale")}

    def avals(self, avals, p, rank, size):
        return [(tuple(s), d) for s, d in p["avals"]]


@_rule
class ReduceScatter(Rule):
    name, math = "reduce_scatter", True

    def forward(self, plain, xs, p, wait=True):
        call = plain.reduce_scatter if wait else plain.ireduce_scatter
        return _then(call(xs[0], p["op"], p.get("counts")), lambda r: [r], wait)

    def adjoint(self, p, xs_avals):
        if p["op"] not in ("sum", "mean"):
            _no_gradient("reduce_scatter", p["op"])
        return "allgather_rows", {"avals": tuple(xs_avals),
                                  "scale": "mean" if p["op"] == "mean" else None}

    def avals(self, avals, p, rank, size):
        shape, dtype = avals[0]
        counts = p.get("counts")
        bounds = (split_bounds(shape[0], size) if counts is None
                  else list(np.cumsum([0, *counts])))
        return [((int(bounds[rank + 1] - bounds[rank]),) + tuple(shape[1:]), dtype)]


@_rule
class AllgatherRows(Rule):
    """Every rank's cotangent joined along axis 0, as this rank's input (scaled by
    1/size for a mean)."""

    name, math = "allgather_rows", True

    def forward(self, plain, xs, p, wait=True):
        out = []
        for ct, (shape, dtype) in zip(xs, p["avals"]):
            got = plain.allgather(ct)
            if p.get("scale") == "mean":
                got = got / plain.size()
            if tuple(got.shape) != tuple(shape):
                raise SynkError(f"synk.comm: the gradient of a reduce_scatter needs every "
                                f"rank's rows back ({tuple(shape)}), got {tuple(got.shape)}")
            out.append(_like(got, shape, dtype))
        return out

    def adjoint(self, p, xs_avals):
        scale = None if p.get("scale") is None else 1.0
        return "rows_back", {"avals": tuple(xs_avals), "scale": scale}

    def avals(self, avals, p, rank, size):
        return [(tuple(s), d) for s, d in p["avals"]]


@_rule
class Scatter(Rule):
    """The root's chunks, one per rank, marked with their frames."""

    name, receives = "scatter", True

    def forward(self, plain, xs, p, wait=True):
        root = p["root"]
        chunks = None
        if plain.rank() == root:
            chunks = [mark(x, f) if f is not None else x for x, f in zip(xs, p["frames"])]
        call = plain.scatter if wait else plain.iscatter
        return _then(call(chunks, root), received, wait)

    def adjoint(self, p, xs_avals):
        return "gather_to", {"root": p["root"], "avals": tuple(xs_avals)}


@_rule
class GatherTo(Rule):
    """Every rank's cotangent on the root, as the gradients of the root's chunks."""

    name = "gather_to"

    def forward(self, plain, xs, p, wait=True):
        ct = xs[0]
        got = plain.gather(ct.reshape((len(ct),) + tuple(ct.shape[1:])) if ct.ndim
                           else ct.reshape(1), p["root"])
        if got is None:  # (a rank other than the root that passed arrays: they count for 0)
            return [_xp(ct).zeros(shape, dtype) for shape, dtype in p["avals"]]
        out, at = [], 0
        for shape, dtype in p["avals"]:
            n = _rows(shape)
            out.append(_like(got[at:at + n], shape, dtype))
            at += n
        return out

    def adjoint(self, p, xs_avals):
        return "scatter", {"root": p["root"], "frames": (None,) * len(p["avals"])}


@_rule
class Gather(Rule):
    """``gather``: the joined rows on the root, a 0-d zero elsewhere."""

    name = "gather"

    def forward(self, plain, xs, p, wait=True):
        x = xs[0]
        call = plain.gather if wait else plain.igather
        return _then(call(x, p["root"]), lambda r: [_dummy(x) if r is None else r], wait)

    def adjoint(self, p, xs_avals):
        return "scatter_rows", {"root": p["root"], "aval": xs_avals[0]}

    def avals(self, avals, p, rank, size):
        shape, dtype = avals[0]
        if rank != p["root"]:
            return [((), dtype)]
        return [((size * _rows(shape),) + tuple(shape[1:]), dtype)]


@_rule
class ScatterRows(Rule):
    """The root's cotangent cut into every rank's rows (each rank tells its own)."""

    name = "scatter_rows"

    def forward(self, plain, xs, p, wait=True):
        root, (shape, dtype) = p["root"], p["aval"]
        lengths = plain.allgather_object(_rows(shape))
        parts = None
        if plain.rank() == root:
            starts = np.cumsum([0, *lengths])
            parts = [xs[0][starts[r]:starts[r + 1]] for r in range(len(lengths))]
        return [_like(plain.scatter(parts, root), shape, dtype)]

    def adjoint(self, p, xs_avals):
        return "gather", {"root": p["root"]}

    def avals(self, avals, p, rank, size):
        return [(tuple(p["aval"][0]), p["aval"][1])]


@_rule
class Alltoall(Rule):
    """``alltoall`` of a list (its adjoint: an alltoall of the cotangents' list) or of an
    array cut by ``counts`` (its adjoint: with the counts transposed, which every rank
    learns from the others' counts: ``back``)."""

    name = "alltoall"

    def forward(self, plain, xs, p, wait=True):
        if p.get("listed"):
            call = plain.alltoall if wait else plain.ialltoall
            return _then(call(list(xs)), list, wait)
        x, counts = xs[0], p.get("counts")
        if p.get("back"):
            sent = [int(c) for c in (counts or np.diff(split_bounds(p["rows"], plain.size())))]
            everyones = plain.allgather_object(sent)
            counts = [rows[plain.rank()] for rows in everyones]
        call = plain.alltoall if wait else plain.ialltoall
        return _then(call(x, counts), lambda r: [r], wait)

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
