"""The rules of the reductions (``rules``): allreduce, its weighted mean, reduce, scan."""
from __future__ import annotations

import numpy as np

from ... import _reduction
from ..frame_marks import marked, unmark
from ._base import Rule, _dummy, _like, _many, _no_gradient, _one, _rule, _then, _xp


@_rule
class AllReduce(Rule):
    name, math = "allreduce", True

    def forward(self, plain, xs, p, wait=True):
        call = plain.allreduce if wait else plain.iallreduce
        got = call(_one(xs), p["op"], weight=p.get("weight"))
        return _then(got, lambda r: _many(r, len(xs)), wait)

    def adjoint(self, p, xs_avals):
        if p["op"] == "sum":
            return "allreduce", {"op": "sum"}
        if p["op"] == "mean":
            return "mean_adjoint", {"weight": p.get("weight")}
        _no_gradient("allreduce", p["op"])

    def avals(self, avals, p, rank, size):
        return [(s, _reduction.result_dtype(p["op"], [np.dtype(d)])) for s, d in avals]


@_rule
class MeanAdjoint(Rule):
    """(w_r / W) * the sum of the cotangents over the ranks (w: 1 and W: the ranks, when
    no weights were given): one fused allreduce of the cotangents and the weight."""

    name, math = "mean_adjoint", True

    def forward(self, plain, xs, p, wait=True):
        weight = p.get("weight")
        if weight is None:
            scale, summed = 1.0 / plain.size(), _many(plain.allreduce(_one(xs), "sum"), len(xs))
        else:
            got = plain.allreduce([*xs, np.float64(weight)], "sum")
            summed, scale = got[:-1], weight / float(got[-1])
        return [(s * scale).astype(x.dtype, copy=False) for s, x in zip(summed, xs)]

    def adjoint(self, p, xs_avals):
        return "allreduce", {"op": "mean", "weight": p.get("weight")}


@_rule
class Reduce(Rule):
    """``reduce``: the result on the root, a 0-d zero elsewhere (to connect to a loss)."""

    name, math = "reduce", True

    def forward(self, plain, xs, p, wait=True):
        x = xs[0]
        call = plain.reduce if wait else plain.ireduce
        got = call(x, p["op"], p["root"], weight=p.get("weight"))
        return _then(got, lambda r: [_dummy(x) if r is None else r], wait)

    def adjoint(self, p, xs_avals):
        if p["op"] not in ("sum", "mean"):
            _no_gradient("reduce", p["op"])
        shape, dtype = xs_avals[0]
        return "broadcast_from", {"root": p["root"], "shape": shape, "dtype": dtype,
                                  "mean": p["op"] == "mean", "weight": p.get("weight")}

    def avals(self, avals, p, rank, size):
        shape, dtype = avals[0]
        return [(shape, dtype) if rank == p["root"] else ((), dtype)]


@_rule
class BroadcastFrom(Rule):
    """The root's cotangent on every rank (in this rank's input's shape), scaled by
    w_r / W for a mean."""

    name, math = "broadcast_from", True

    def forward(self, plain, xs, p, wait=True):
        root, rank = p["root"], plain.rank()
        got = plain.broadcast(xs[0] if rank == root else None, root)
        got = _like(unmark(got)[0] if marked(got) else got, p["shape"], p["dtype"])
        if p.get("mean"):
            weight = p.get("weight")
            total = plain.size() if weight is None else float(plain.allreduce(
                np.float64(weight), "sum"))
            got = (got * ((1.0 if weight is None else weight) / total)).astype(got.dtype)
        return [got]

    def adjoint(self, p, xs_avals):
        if p.get("mean"):
            return "reduce", {"op": "mean", "root": p["root"], "weight": p.get("weight")}
        return "reduce", {"op": "sum", "root": p["root"]}

    def avals(self, avals, p, rank, size):
        return [(tuple(p["shape"]), p["dtype"])]


@_rule
class Scan(Rule):
    name, math = "scan", True

    def forward(self, plain, xs, p, wait=True):
        x, exclusive = xs[0], p["exclusive"]
        call = (plain.exscan if exclusive else plain.scan) if wait else (
            plain.iexscan if exclusive else plain.iscan)
        got = call(x, p["op"])
        return _then(got, lambda r: [_xp(x).zeros_like(x) if r is None else r], wait)

    def adjoint(self, p, xs_avals):
        if p["op"] != "sum":
            _no_gradient("exscan" if p["exclusive"] else "scan", p["op"])
        return "suffix_sum", {"exclusive": p["exclusive"]}


@_rule
class SuffixSum(Rule):
    """sum over ranks q >= r (``exclusive``: q > r, the cotangent of rank 0's constant
    zeros left out) of the cotangents: the total less the (other) prefix sum."""

    name, math = "suffix_sum", True

    def forward(self, plain, xs, p, wait=True):
        ct, exclusive = xs[0], p["exclusive"]
        if exclusive and plain.rank() == 0:
            ct = _xp(ct).zeros_like(ct)
        total = plain.allreduce(ct, "sum")
        before = plain.scan(ct, "sum") if exclusive else plain.exscan(ct, "sum")
        return [total if before is None else (total - before).astype(ct.dtype, copy=False)]

    def adjoint(self, p, xs_avals):
        return "scan", {"op": "sum", "exclusive": p["exclusive"]}
