"""Prefix reductions: ``scan`` (inclusive) and ``exscan`` (exclusive)."""
from __future__ import annotations

from ..._reduction import canonical
from .. import autograd, context as _context
from ..algorithms import alltoall as _alltoall
from ..autograd.rules import Rule, no_gradient, register, xp
from ..context import rank
from ..handle import Handle, then
from .allreduce import allreduce
from .dispatch import WITH_LOC, on

__all__ = ["scan", "iscan", "exscan", "iexscan"]


@_context.numbered
def scan(x, op: str = "sum"):
    """``x`` combined with ``op`` over ranks 0 to r, on each rank r (an inclusive prefix
    reduction: MPI's ``Scan``). Ops, dtypes and shapes as ``allreduce``'s (no weights):
    ``"maxloc"``/``"minloc"`` give ``(values, ranks)`` over ranks 0 to r. Python ints raise
    ``OverflowError`` on every rank where one is past int64's range, or where the sum or
    product that some rank gets leaves it (as ``exscan``'s)."""
    return _scan(x, op, exclusive=False, wait=True)


@_context.numbered
def iscan(x, op: str = "sum") -> Handle:
    """Non-blocking ``scan``; ``wait()`` returns the result."""
    return _scan(x, op, exclusive=False, wait=False)


@_context.numbered
def exscan(x, op: str = "sum"):
    """``x`` combined with ``op`` over ranks 0 to r - 1, on each rank r, and None on rank 0
    (an exclusive prefix reduction: MPI's ``Exscan``)."""
    return _scan(x, op, exclusive=True, wait=True)


@_context.numbered
def iexscan(x, op: str = "sum") -> Handle:
    """Non-blocking ``exscan``; ``wait()`` returns the result."""
    return _scan(x, op, exclusive=True, wait=False)


def _scan(x, op: str, exclusive: bool, wait: bool):
    op = canonical(op, WITH_LOC)
    if autograd.framed(x):
        return on("scan", x, {"op": op, "exclusive": exclusive}, wait=wait)
    return _alltoall.scan(x, op, exclusive=exclusive, wait=wait)


# -- adjoints --------------------------------------------------------------------------------------

@register
class Scan(Rule):
    name, math = "scan", True

    def forward(self, xs, p, wait=True):
        x, exclusive = xs[0], p["exclusive"]
        call = (exscan if exclusive else scan) if wait else (
            iexscan if exclusive else iscan)
        got = call(x, p["op"])
        return then(got, lambda r: [xp(x).zeros_like(x) if r is None else r], wait)

    def adjoint(self, p, xs_avals):
        if p["op"] != "sum":
            no_gradient("exscan" if p["exclusive"] else "scan", p["op"])
        return "suffix_sum", {"exclusive": p["exclusive"]}


@register
class SuffixSum(Rule):
    """sum over ranks q >= r (``exclusive``: q > r, the cotangent of rank 0's constant
    zeros left out) of the cotangents: the total less the (other) prefix sum."""

    name, math = "suffix_sum", True

    def forward(self, xs, p, wait=True):
        ct, exclusive = xs[0], p["exclusive"]
        if exclusive and rank() == 0:
            ct = xp(ct).zeros_like(ct)
        total = allreduce(ct, "sum")
        before = scan(ct, "sum") if exclusive else exscan(ct, "sum")
        return [total if before is None else (total - before).astype(ct.dtype, copy=False)]

    def adjoint(self, p, xs_avals):
        return "scan", {"op": "sum", "exclusive": p["exclusive"]}
