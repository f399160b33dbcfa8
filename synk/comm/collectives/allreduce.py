"""Reductions to every rank or to one: ``allreduce`` (and its fused form over a structure
of arrays) and ``reduce``."""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ... import _reduction, _tree
from ..._reduction import canonical
from ...errors import SynkError
from .. import autograd, context as _context, route as _route
from ..algorithms import fused as _fused, moves as _moves, rooted as _rooted
from ..autograd.rules import Rule, dummy, like, many, no_gradient, one, register
from ..context import rank, size
from ..frame_marks import marked, unmark
from ..handle import Handle, then
from .dispatch import WITH_LOC, on

__all__ = ["allreduce", "iallreduce", "reduce", "ireduce", "average_gradients",
           "allreduce_init"]


@_context.numbered
def allreduce(x: Any, op: str = "sum", *, weight: float | None = None, out=None) -> Any:
    """``x`` combined over every rank with ``op`` (``"sum"``, ``"prod"``, ``"max"``,
    ``"min"``, ``"mean"``; bitwise ``"band"``, ``"bor"``, ``"bxor"`` of integers and bools;
    logical ``"land"``, ``"lor"``, ``"lxor"``, giving bools; any case), on every rank.
    Booleans sum to counts, as in numpy. A device array (GPU ranks) is reduced on NCCL and
    the result is a device array (NCCL lacks the bitwise and logical ops: synk gathers the
    ranks' arrays on NCCL and combines them on the device).

    ``"maxloc"``, ``"minloc"`` (MPI's MAXLOC, MINLOC; one array or number, real, no
    ``weight``) give a pair ``(values, ranks)``: each element's largest (smallest) value
    and the lowest rank holding it, ``ranks`` int64 of ``x``'s shape and kind.

    ``x`` may also be a list, tuple or dict of arrays (nested too), such as a model's
    gradients: they are reduced in one fused buffer per dtype (one collective each, not
    one per array) and come back in the same structure. Every rank must pass the same
    structure.

    ``weight`` (with ``op="mean"``): this rank's share of the average, typically the rows
    it processed, so that uneven shares average exactly: the result is
    ``sum(weight_r * x_r) / sum(weight_r)``, for weights of any size. A rank with weight 0
    contributes nothing. A mean, weighted or not, is scaled and summed in ``x``'s own float
    dtype (float16's in float32), one collective of the data's own bytes, within a few ulps
    of float64's answer per rank; ``"exact_mean"`` accumulates in float64 on every back
    end, the same bits everywhere (see "How mean is computed").

        grads = synk.comm.allreduce(grads, "mean", weight=len(x))

    Python ints are combined as int64, as Python's: a sum or product past its range
    raises ``OverflowError`` rather than wrap.

    ``out``: an array (or a structure of them, as ``x``) of the result's shape and dtype
    to write the result into and return, e.g. ``x`` itself for an allreduce in place. Host
    arrays (into another array than ``x``, or ``x`` itself for a mean) and NCCL (other ops
    than mean) write it there directly; elsewhere the result is copied into it.

    Raises:
        ValueError: the ranks passed different ops, shapes, dtypes or structures (on every
            rank, naming what each passed), ``op`` is unknown, ``weight`` is given with
            another op, is negative or not finite, or is given on some ranks only, the
            weights sum to 0, or ``out`` names the same memory twice.
        TypeError: an array is not numeric (bool, integers, floats, complex), is not of
            an integer or bool dtype for a bitwise op or is complex for maxloc/minloc, or
            device and host arrays are mixed.
        OverflowError: a sum or product of Python ints leaves int64's range.
    """
    return allreduce_for(x, op, weight, out, True, "allreduce")


@_context.numbered
def iallreduce(x: Any, op: str = "sum", *, weight: float | None = None,
               out=None) -> Handle:
    """Non-blocking ``allreduce`` (structures and ``weight`` as there); ``wait()`` returns
    the result. On device arrays the reduction runs on NCCL's own stream while the rank's
    stream computes, and ``wait()`` waits on the CUDA event recorded after it (the small
    exchange that checks structures and weights is done before returning)."""
    return allreduce_for(x, op, weight, out, False, "iallreduce")


def allreduce_for(x, op: str, weight, out, wait: bool, what: str):
    """``allreduce`` (``wait=False``: ``iallreduce``) of ``x``, its errors naming the
    collective ``what`` (``reduce_scatter`` of Python ints reduces them whole here)."""
    op = canonical(op, WITH_LOC)
    weight = _checked_weight(weight, op, lambda: allreduce_for(x, op, None, None, True, what))
    if type(x) is int and op in _reduction.LOC_OPS and not _fused.in_int64(x):
        _refused_location(x, op, what)
    value = _tree.apart(x)  # (once: what follows takes it apart as it is here)
    given = None if out is None else _tree.apart(out)
    layout = None
    if out is None or not autograd.framed(out):
        layout = _fused.known(value, op, weight is not None)
    if layout is not None:  # a value laid out before: its leaves were checked then
        comm = _route.for_arrays(value.leaves, what)
    elif autograd.framed(x) or autograd.framed(out):
        return autograd.run("allreduce", value, {"op": op, "weight": weight}, wait=wait,
                            out=given,
                            direct=lambda v, o: allreduce_for(v, op, weight, o, wait, what))
    else:
        comm = _numbers(value.leaves, op, what)
    return _fused.allreduce(comm, value, op, weight, wait=wait, out=given, layout=layout,
                            what=what)


@_context.numbered
def allreduce_init(x: Any, op: str = "sum", *, out=None) -> Persistent:
    """A persistent allreduce of ``x`` (MPI-4's ``Allreduce_init``): ``x`` (an array, or a
    list, tuple or dict of them, the fused form) and ``op`` are bound once, and checked
    across the ranks now: ranks whose shapes, dtypes, structures or ops differ raise the
    same ``ValueError`` on every rank, here (this takes part in one collective). Each use
    reads the arrays' current contents:

        p = synk.comm.allreduce_init(grads, "mean")      # once, grads computed in place
        for ...:
            compute_into(grads)
            mean = p(weight=len(x))          # what synk.comm.allreduce(grads, "mean",
                                             # weight=len(x)) gives, the same bits

    ``p(weight=None)`` returns what ``synk.comm.allreduce(x, op, weight=weight, out=out)``
    would; ``p.start(weight=None)`` starts it and returns a ``Handle`` whose ``wait()`` does
    (``iallreduce``). Every rank uses its persistent collectives in the same order, as any
    collective. A handle lives until ``p.free()`` or the end of the group it was made in:
    kept on the rank (in state the function keeps), it serves every step of every later
    call of that group; used after ``free()``, or in another group (after ``close()`` or a
    replacement), it raises ``SynkError``.
    """
    return Persistent(x, op, out)


class Persistent:
    """A persistent allreduce (``allreduce_init``): call it, or ``start`` it; ``free()``
    ends it. It holds its value, op and ``out``, the group it was made in, and its value
    taken apart once (``flat``, and ``out``'s): each use lays it out as ``allreduce`` does,
    from the layout its first use found (``layouts``, by whether a weight is given: the
    one cache is this handle)."""

    __slots__ = ("value", "op", "out", "group", "freed", "flat", "given", "layouts")

    def __init__(self, x: Any, op: str, out) -> None:
        self.op = canonical(op, WITH_LOC)
        allreduce_for(x, self.op, None, None, True, "allreduce_init")  # (the check)
        self.value, self.out = x, out
        self.group, self.freed = _context.group_mark(), False
        self.flat = _tree.apart(x)
        self.given = None if out is None else _tree.apart(out)
        self.layouts: dict = {}

    def __call__(self, weight: float | None = None) -> Any:
        return _use(self, weight, True)

    def start(self, weight: float | None = None) -> Handle:
        """Start the allreduce; a ``Handle`` whose ``wait()`` returns the result."""
        return _use(self, weight, False)

    def free(self) -> None:
        """End the handle: it lets go of its arrays, and any later use raises."""
        self.freed, self.value, self.out, self.given = True, None, None, None
        self.flat = _tree.apart(None)

    def _check(self) -> None:
        if self.freed:
            raise SynkError("this persistent allreduce was freed (p.free()): make another "
                            "with synk.comm.allreduce_init")
        if self.group != _context.group_mark():
            raise SynkError("this persistent allreduce was made in another group, which has "
                            "ended (synk.close(), or its replacement after a rank died): "
                            "make it again in this one")

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"op {self.op!r}"
        return f"<synk.comm persistent allreduce: {state}>"


def _used(p: Persistent, weight, wait: bool):
    """One use of ``p``: ``allreduce`` (``wait=False``: ``iallreduce``) of its value, the
    way ``allreduce_for`` takes it, from the leaves and layout the handle holds."""
    p._check()
    what = "allreduce" if wait else "iallreduce"
    weighted = weight is not None
    layout = p.layouts.get(weighted)
    if layout is None or autograd.framed(p.value) or p.out is not None and \
            autograd.framed(p.out):
        result = allreduce_for(p.value, p.op, weight, p.out, wait, what)
        found = _fused.known(p.flat, p.op, weighted)
        if found is not None:
            p.layouts[weighted] = found
        return result
    weight = _checked_weight(weight, p.op, lambda: allreduce_for(p.value, p.op, None, None,
                                                                 True, what))
    comm = _route.for_arrays(p.flat.leaves, what)
    return _fused.allreduce(comm, p.flat, p.op, weight, wait=wait, out=p.given,
                            layout=layout, what=what)


_use = _context.numbered(_used)  # (a collective of its own number, as synk.comm's)


def _refused_location(x: int, op: str, what: str):
    """Raise for a Python int past int64's range under ``maxloc``/``minloc``, which carry
    no flag to the other ranks: this rank takes part with the int as a float, which the
    others' ints disagree with (their ``ValueError``, which comes first), then raises."""
    refused = OverflowError(f"synk.comm.{what}: the Python int {x} is past the range of "
                            "int64, in which synk combines Python ints; pass a float")
    try:
        allreduce_for(float(x), op, None, None, True, what)
    except (TypeError, ValueError) as theirs:
        raise theirs from refused
    raise refused


def _numbers(leaves: list, op: str, what: str):
    """The communicator of a value's ``leaves``, checked (``_route.numbers_of``), but not
    refusing a Python int past int64: the fused allreduce raises on every rank
    (``_fused._checked_ints``)."""
    try:
        return _route.numbers_of(leaves, what, op)
    except OverflowError:
        if op in _reduction.LOC_OPS:
            raise
        return _route.numbers_of([0 if type(v) is int and not _fused.in_int64(v) else v
                                  for v in leaves], what, op)


def average_gradients(params, weight: float | None = None, *,
                      bucket_mb: float = 25.0) -> AbstractContextManager:
    """A ``with`` block whose backward passes leave every rank the mean of the ranks'
    gradients of ``params`` (a torch module, or an iterable of its parameters), reduced in
    buckets while the backward pass still runs, as ``DistributedDataParallel`` does:

        with synk.comm.average_gradients(model, weight=len(x)):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.step()

    The parameters that need gradients are cut into buckets of at most ``bucket_mb`` MB,
    from the last to the first (the order backward reaches them). A bucket whose every
    gradient is accumulated is averaged at once (``iallreduce``, a weighted mean with
    ``weight``: this rank's rows), in bucket order on every rank, while backward goes on;
    leaving the block waits for them all, each parameter's ``grad`` then holding the
    average (written in place). A parameter backward did not reach on a rank counts as a
    zero gradient there. One backward pass per block; gradients accumulated before the
    block are averaged with the rest. Raises ``TypeError`` for parameters that are not
    torch tensors and ``ValueError`` for ``bucket_mb <= 0``; an error inside the block
    leaves it with the hooks removed and no wait."""
    return GradientAveraging(params, weight, bucket_mb)


class GradientAveraging:
    """``average_gradients``' block: gradient hooks on the parameters while it is entered,
    and the handles of the buckets averaged so far."""

    def __init__(self, params, weight, bucket_mb: float) -> None:
        import torch

        if isinstance(params, torch.nn.Module):
            params = params.parameters()
        params = list({id(p): p for p in params}.values())  # (a tied weight once)
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError("synk.comm.average_gradients takes a torch module or its "
                            "parameters (torch tensors)")
        if not bucket_mb > 0:
            raise ValueError(f"synk.comm.average_gradients: bucket_mb must be > 0, got "
                             f"{bucket_mb!r}")
        self.weight = _fused.check_weight(weight, "mean")
        self.context = _context.now()  # (the group's, when made by a group's method)
        self.buckets: list = []  # lists of parameters, from the last to the first
        cap, size = bucket_mb * 1e6, 0.0
        for p in reversed([p for p in params if p.requires_grad]):
            nbytes = p.numel() * p.element_size()
            if not self.buckets or size + nbytes > cap:
                self.buckets.append([])
                size = 0.0
            self.buckets[-1].append(p)
            size += nbytes
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.hooks: list = []

    def __enter__(self) -> GradientAveraging:
        self.ready = [0] * len(self.buckets)  # each bucket's accumulated gradients
        self.seen: set = set()  # the parameters whose gradients are accumulated
        self.launched: list = []  # each launched bucket's Handle, in bucket order
        self.hooks = [p.register_post_accumulate_grad_hook(self._accumulated)
                      for bucket in self.buckets for p in bucket]
        return self

    def _accumulated(self, p) -> None:
        if id(p) in self.seen:
            raise RuntimeError(
                "synk.comm.average_gradients: a second backward pass reached a parameter "
                "inside one block, whose gradient is averaged already; give each backward "
                "pass its own block (to accumulate gradients over several passes, average "
                "after the last: synk.comm.allreduce(grads, 'mean', out=grads))")
        self.seen.add(id(p))
        b = self.bucket_of[id(p)]
        self.ready[b] += 1
        if b == len(self.launched):
            self._launch()

    def _launch(self, everything: bool = False) -> None:
        """Average the buckets that are ready, in order from the next one (``everything``:
        all the rest, their missing gradients zeros)."""
        while len(self.launched) < len(self.buckets):
            bucket = self.buckets[len(self.launched)]
            if not everything and self.ready[len(self.launched)] < len(bucket):
                return
            for p in bucket:
                if p.grad is None:
                    p.grad = p.detach().new_zeros(p.shape)
            grads = [p.grad for p in bucket]
            with _context.using(self.context):
                self.launched.append(allreduce_for(grads, "mean", self.weight, grads, False,
                                                   "iallreduce"))

    def __exit__(self, kind, error, trace) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if kind is not None:
            return
        self._launch(everything=True)
        for handle in self.launched:
            handle.wait()


@_context.numbered
def reduce(x: Any, op: str = "sum", root: int = 0, *, weight: float | None = None) -> Any:
    """``x`` combined over every rank with ``op`` (as ``allreduce``: ops, ``weight=`` of a
    mean, dtypes), on rank ``root`` only; the other ranks get None. MPI's ``Reduce``,
    torch.distributed's ``reduce``. A device array is reduced on NCCL. ``x`` is one array
    or number (a list or tuple of numbers is one array), not a structure of arrays as
    ``allreduce`` takes.

    Raises:
        ValueError: the ranks' shapes differ, ``root`` is not a rank, or weights are given
            on some ranks only; on every rank.
        TypeError: ``x`` is a dict.
        OverflowError: a rank's Python int is past int64's range, or the sum or product of
            the ranks' Python ints leaves it; on every rank.
    """
    return _reduce(x, op, root, weight, True)


@_context.numbered
def ireduce(x: Any, op: str = "sum", root: int = 0, *, weight: float | None = None) -> Handle:
    """Non-blocking ``reduce``; ``wait()`` returns the result (None off the root)."""
    return _reduce(x, op, root, weight, False)


def _reduce(x, op: str, root: int, weight, wait: bool):
    op = canonical(op, WITH_LOC)
    weight = _checked_weight(weight, op, lambda: reduce(x, op, root))
    if autograd.framed(x):
        return on("reduce", x, {"op": op, "root": root, "weight": weight}, wait=wait)
    return _rooted.reduce(x, op, root, weight, wait=wait)


def _checked_weight(weight, op: str, take_part):
    """``weight`` checked for ``op`` (``_fused.check_weight``). A refused one is this rank's
    own mistake: it still takes part (``take_part()``, without the weight), so no peer
    waits, and raises after (the collective's own error first, as the peers raise it)."""
    try:
        return _fused.check_weight(weight, op)
    except (TypeError, ValueError) as refused:
        try:
            take_part()
        except (TypeError, ValueError) as theirs:
            raise theirs from refused
        raise


# -- adjoints --------------------------------------------------------------------------------------

@register
class AllReduce(Rule):
    name, math = "allreduce", True

    def forward(self, xs, p, wait=True, into=None):
        call = allreduce if wait else iallreduce
        out = None if into is None else one(into)
        got = call(one(xs), p["op"], weight=p.get("weight"), out=out)
        return then(got, lambda r: many(r, len(xs)), wait)

    def located(self, x, p, wait):
        return (allreduce if wait else iallreduce)(x, p["op"])

    def writes_into(self, p):
        return p["op"] not in ("maxloc", "minloc")

    def adjoint(self, p, xs_avals):
        if p["op"] == "sum":
            return "allreduce", {"op": "sum"}
        if p["op"] == "mean":
            return "mean_adjoint", {"weight": p.get("weight")}
        no_gradient("allreduce", p["op"])

    def avals(self, avals, p, rank, size):
        return [(s, _reduction.result_dtype(p["op"], [np.dtype(d)])) for s, d in avals]


@register
class MeanAdjoint(Rule):
    """(w_r / W) * the sum of the cotangents over the ranks (w: 1 and W: the ranks, when
    no weights were given): one fused allreduce of the cotangents and the weight."""

    name, math = "mean_adjoint", True

    def forward(self, xs, p, wait=True):
        weight = p.get("weight")
        if weight is None:
            scale, summed = 1.0 / size(), many(allreduce(one(xs), "sum"), len(xs))
        else:
            got = allreduce([*xs, np.float64(weight)], "sum")
            summed, scale = got[:-1], weight / float(got[-1])
        return [(s * scale).astype(x.dtype, copy=False) for s, x in zip(summed, xs)]

    def adjoint(self, p, xs_avals):
        return "allreduce", {"op": "mean", "weight": p.get("weight")}


@register
class Reduce(Rule):
    """``reduce``: the result on the root, a 0-d zero elsewhere (to connect to a loss)."""

    name, math = "reduce", True

    def forward(self, xs, p, wait=True):
        x = xs[0]
        call = reduce if wait else ireduce
        got = call(x, p["op"], p["root"], weight=p.get("weight"))
        return then(got, lambda r: [dummy(x) if r is None else r], wait)

    def located(self, x, p, wait):
        return (reduce if wait else ireduce)(x, p["op"], p["root"])

    def adjoint(self, p, xs_avals):
        if p["op"] not in ("sum", "mean"):
            no_gradient("reduce", p["op"])
        shape, dtype = xs_avals[0]
        return "broadcast_from", {"root": p["root"], "shape": shape, "dtype": dtype,
                                  "mean": p["op"] == "mean", "weight": p.get("weight")}

    def avals(self, avals, p, rank, size):
        shape, dtype = avals[0]
        return [(shape, dtype) if rank == p["root"] else ((), dtype)]


@register
class BroadcastFrom(Rule):
    """The root's cotangent on every rank (in this rank's input's shape), scaled by
    w_r / W for a mean."""

    name, math = "broadcast_from", True

    def forward(self, xs, p, wait=True):
        root = p["root"]
        got = _moves.broadcast(xs[0] if rank() == root else None, root)
        got = like(unmark(got)[0] if marked(got) else got, p["shape"], p["dtype"])
        if p.get("mean"):
            weight = p.get("weight")
            total = size() if weight is None else float(allreduce(
                np.float64(weight), "sum"))
            got = (got * ((1.0 if weight is None else weight) / total)).astype(got.dtype)
        return [got]

    def adjoint(self, p, xs_avals):
        if p.get("mean"):
            return "reduce", {"op": "mean", "root": p["root"], "weight": p.get("weight")}
        return "reduce", {"op": "sum", "root": p["root"]}

    def avals(self, avals, p, rank, size):
        return [(tuple(p["shape"]), p["dtype"])]
