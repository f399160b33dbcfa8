"""The adjoint of every collective of ``synk.comm``, written once: each ``Rule`` runs an
operation on native arrays (numpy, CuPy) through ``synk.comm`` itself (``plain``, the
functions of ``synk.comm``, handed in by it), says which rule is its adjoint, and what
shapes it gives (for JAX's tracing). torch's ``autograd.Function`` (``_torch``) and JAX's
primitive (``_jax``) are both written over this table.

Each rank's gradient is the derivative of the sum of every rank's loss with respect to its
own input (mpi4torch's convention), so an operation's adjoint is its transpose across the
ranks: allreduce(sum) <-> allreduce(sum); a weighted mean <-> (w_r / W) allreduce(sum);
broadcast <-> reduce(sum) to the root (zeros elsewhere); reduce <-> broadcast from the root;
allgather <-> reduce_scatter(sum) (by each rank's own rows, which may differ);
reduce_scatter <-> allgather; scatter <-> gather; alltoall <-> alltoall with the counts
transposed; scan(sum) <-> a suffix sum; send <-> a receive of the gradient (on a tag of
synk's own); sendrecv <-> sendrecv the other way. Ops that are not linear (max, min, prod,
the bitwise and logical ops, maxloc) have no rule: their gradient raises ``SynkError``.
"""
from __future__ import annotations

import numpy as np

from ... import _reduction, _tree
from ..._devices.discovery import array_module as _xp
from ..._shares import split_bounds
from ...errors import SynkError
from .._frames import mark, marked, unmark
from .._handle import Handle

GRAD = "synk.grad"  # first item of the tags of the gradients' messages


def grad_tag(*key) -> tuple:
    return (GRAD, *key)


class NotDifferentiable(SynkError):
    """The gradient of an operation that has none (max, min, prod, bitwise...)."""


def _one(xs: list):
    """What ``synk.comm`` takes: the leaf itself, or a list of them (fused)."""
    return xs[0] if len(xs) == 1 else list(xs)


def _many(result, n: int) -> list:
    return [result] if n == 1 else list(result)


def _rows(shape) -> int:
    return shape[0] if len(shape) else 1


def _no_gradient(what: str, op: str):
    raise NotDifferentiable(
        f"synk.comm.{what} with op {op!r} has no gradient in synk: only 'sum' and 'mean' are "
        "differentiable (max, min and prod would need the ranks' values and ties, and the "
        "bitwise and logical ops are not smooth), and synk never gives a silently wrong "
        f"gradient. Use op='sum' or 'mean', or detach the input first (x.detach() in torch, "
        "jax.lax.stop_gradient(x) in JAX)")


def _dummy(x):
    """The 0-d zero a rank gets where an operation gives it nothing (``xp`` of ``x``)."""
    return _xp(x).zeros((), x.dtype)


def _like(value, shape, dtype):
    """``value`` (an array received) in ``shape`` and ``dtype``."""
    value = value.reshape(shape)
    return value if value.dtype == dtype else value.astype(dtype)


class Rule:
    """One operation: ``forward`` on native arrays (a Handle of them with ``wait=False``,
    where ``wait`` is taken), its ``adjoint`` (a rule's name and parameters, or
    ``NotDifferentiable``), and ``avals``: its outputs' (shape, dtype) from its inputs'."""

    name = ""
    math = False  # bfloat16 inputs as float32 (it does arithmetic on them)
    receives = False  # its outputs are (native, Frame or None): the sender's frames

    def forward(self, plain, xs: list, p: dict, wait: bool = True):
        raise NotImplementedError

    def adjoint(self, p: dict, xs_avals: list) -> tuple:
        raise NotImplementedError

    def avals(self, avals: list, p: dict, rank: int, size: int) -> list:
        return list(avals)


RULES: dict = {}


def _rule(cls):
    RULES[cls.name] = cls()
    return cls


def _then(result, finish, wait: bool):
    """``finish(result)``, or a Handle of it when ``result`` is one (``wait=False``)."""
    if wait:
        return finish(result)
    return Handle(lambda: finish(result.wait()))


# -- reductions -----------------------------------------------------------------------------
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


# -- moving arrays ------------------------------------------------------------------------
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
        if got is None:
            return []
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


# -- point to point -------------------------------------------------------------------------
@_rule
class Send(Rule):
    """``send``: the array out (marked: the receiver's gradient comes back under its
    number), and a 0-d zero for the sender to connect to its loss."""

    name = "send"

    def forward(self, plain, xs, p, wait=True):
        x = xs[0]
        handle = plain.isend(mark(x, p["frame"], p.get("number")), p["dest"], p["tag"])
        if wait:
            handle.wait()
            return [_dummy(x)]
        return _then(handle, lambda _: [_dummy(x)], wait)

    def adjoint(self, p, xs_avals):
        if p.get("number") is None:
            raise SynkError("synk.comm.send: this send carries no gradient")
        return "grad_from", {"peer": p["dest"], "number": p["number"], "aval": xs_avals[0]}

    def avals(self, avals, p, rank, size):
        return [((), avals[0][1])]


@_rule
class Recv(Rule):
    """A received array, as ``synk.comm.recv`` gave it (its forward is that receive);
    its adjoint sends the gradient back to the sender."""

    name = "recv"

    def adjoint(self, p, xs_avals):
        return "grad_to", {"peer": p["peer"], "number": p["number"]}


@_rule
class GradFrom(Rule):
    """The gradient of a message this rank sent, from the rank that received it."""

    name = "grad_from"

    def forward(self, plain, xs, p, wait=True):
        shape, dtype = p["aval"]
        got = plain.recv(p["peer"], grad_tag(p["number"]))
        return [_like(unmark(got)[0] if marked(got) else got, shape, dtype)]


@_rule
class GradTo(Rule):
    """A received message's gradient, back to its sender."""

    name = "grad_to"

    def forward(self, plain, xs, p, wait=True):
        plain.isend(xs[0], p["peer"], grad_tag(p["number"])).wait()
        return []


@_rule
class SendRecv(Rule):
    """``sendrecv``: ``x`` to ``dest`` and the array from ``source``; its adjoint runs the
    other way, on synk's own tag."""

    name = "sendrecv"

    def forward(self, plain, xs, p, wait=True):
        x = xs[0]
        handle = plain.isend(x, p["dest"], p["tag"])
        got = plain.recv(p["source"], p["tag"])
        handle.wait()
        return [unmark(got)[0] if marked(got) else got]

    def adjoint(self, p, xs_avals):
        return "sendrecv", {"dest": p["source"], "source": p["dest"],
                            "tag": grad_tag(p["tag"])}
