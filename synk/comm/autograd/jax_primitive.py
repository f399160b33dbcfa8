"""JAX's transformations over the rules (``rules``): one primitive, ``synk_comm``, whose
parameter ``name`` picks the rule, bound only by a traced value (outside transformations
the values go straight to numpy).

::

    bind(name, values) --> synk_comm_p, with CommEffect (ordered: one token through them all)
        evaluated eagerly   _impl:       the rule on numpy views of the values
        jax.jvp             _jvp:        the operation on the tangents
        transposed          _transpose:  the rule's adjoint
        jax.vmap            _batched:    elementwise operations on the batch whole
        jax.jit             _lowering:   a call into Python, run when the compiled function runs
"""
from __future__ import annotations

import ctypes
import dataclasses
import sys
from typing import Any

import jax
import numpy as np
from jax import core
from jax._src import effects, ffi as _ffi  # (JAX's effect types: no public module has them)
from jax._src.core import abstract_token as _TOKEN
from jax._src.lib.mlir import ir
from jax._src.sharding_impls import ShardingContext  # (a jit's devices, when it lowers)
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ... import _arrays
from ..._arrays import _jax as adapter
from ...errors import SynkError
from .. import context as _context
from ..frame_marks import marked, unmark
from . import callback_errors as _callback_errors, xla_handler as _xla
from .rules import RULES

synk_comm_p = Primitive("synk_comm")
synk_comm_p.multiple_results = True


class CommEffect(effects.Effect):
    """The effect of a collective, carried by every binding: ordered and never dropped, as
    ``jax.io_callback(..., ordered=True)``'s and mpi4jax's are. XLA threads a token through
    the callbacks, so collectives run in program order on every rank (reordering two
    independent ones would pair one rank's first with another's second) and one whose
    result is unused (a send) is kept. Allowed inside control flow, custom derivatives and remat."""

    __str__ = lambda self: "synk.comm"  # noqa: E731


_EFFECT = CommEffect()
for _kind in (effects.lowerable_effects, effects.ordered_effects,
              effects.shardable_ordered_effects, effects.control_flow_allowed_effects,
              effects.custom_derivatives_allowed_effects, effects.remat_allowed_effects):
    _kind.add_type(CommEffect)


class Params:
    """A rule's parameters, hashable (JAX caches compiled functions by them)."""

    __slots__ = ("items",)

    def __init__(self, params: dict) -> None:
        self.items = tuple(sorted((k, _frozen(v)) for k, v in params.items()))

    def dict(self) -> dict:
        return dict(self.items)

    def __hash__(self) -> int:
        return hash(self.items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Params) and self.items == other.items

    def __repr__(self) -> str:
        return repr(dict(self.items))


def _frozen(value):
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, np.dtype):
        return value.str
    return value


def bind(name: str, leaves: list, params: dict) -> list:
    """``name`` on JAX values (some traced), through the primitive."""
    return synk_comm_p.bind(*leaves, name=name, params=Params(params))


def _avals(name: str, avals, params: Params) -> list:
    c = _context.require("a JAX transformation")
    ins = [(tuple(a.shape), np.dtype(a.dtype)) for a in avals]
    return RULES[name].avals(ins, params.dict(), c.rank, c.size)


def _abstract(*avals, name: str, params: Params):
    """The outputs' shapes: the rule's, or those its evaluation gave (``out_shapes``, set
    where the primal was computed: the tangents' shapes then follow it, uneven too)."""
    shapes = params.dict().get("out_shapes")
    outs = _avals(name, avals, params)
    if shapes is not None:
        outs = [(shape, dtype) for shape, (_, dtype) in zip(shapes, outs)]
    return [core.ShapedArray(tuple(shape), jax.dtypes.canonicalize_dtype(np.dtype(dtype)))
            for shape, dtype in outs]


def _run(name: str, params: Params, values: list, wanted: list, strict: bool = True,
         into: list | None = None) -> list:
    """The rule on numpy ``values`` (bfloat16 as ml_dtypes'), its outputs in the ``wanted``
    (shape, dtype); ``strict``: check the shapes traced under jax.jit, which assumed every
    rank's alike. ``into``: writable outputs a ``Rule.writes_into`` rule fills directly
    where the dtypes need no conversion."""
    rule = RULES[name]
    natives = [adapter.host_form(np.asarray(v), rule.math) for v in values]
    direct = (into is not None and rule.writes_into(params.dict()) and len(into) == len(natives)
              and all(n.dtype == o.dtype and n.shape == o.shape
                      for n, o in zip(natives, into)))
    if direct:
        outs = rule.forward(natives, params.dict(), into=into)
    else:
        outs = rule.forward(natives, params.dict())
    if rule.receives:
        outs = [o for o, _ in outs]
    return _results(name, outs, wanted, strict)


def _results(name: str, outs: list, wanted: list, strict: bool = True) -> list:
    """A rule's outputs as numpy arrays of the ``wanted`` (shape, dtype) (``_run``'s)."""
    result = []
    for out, (shape, dtype) in zip(outs, wanted):
        out = _arrays.host(out)
        if strict and tuple(out.shape) != tuple(shape):
            raise SynkError(f"synk.comm.{name} under a JAX transformation: this rank got shape "
                            f"{tuple(out.shape)} where {tuple(shape)} was traced; under "
                            "jax.jit every rank must pass the same shape to it (call it "
                            "outside jax.jit for shapes that differ)")
        dtype = np.dtype(dtype)
        if dtype == adapter._BFLOAT16 and out.dtype == np.uint16:
            out = out.view(dtype)
        result.append(np.asarray(out).astype(dtype, copy=False))
    return result


def _callback(name: str, params: Params, wanted: list):
    """The host callback of the rule under ``jax.jit``: ``_run``, keeping what it raises
    (JAX hands on only its text: ``callback_errors``)."""
    def on_host(*values):
        try:
            return _run(name, params, list(values), wanted)
        except BaseException as exc:
            _callback_errors.keep(exc)
            raise

    return on_host


def _in_place(name: str, params: Params, wanted: list, avals_in: list, direct: bool):
    """The rule under ``jax.jit`` on the CPU, run by synk's XLA target (``xla_handler``):
    XLA's own buffers in (read-only) and out (written here), so that no array is copied on
    the way back. ``direct``: the rule writes into the outputs itself (``_writes_directly``)."""
    forward, p = RULES[name].forward, params.dict()
    ins, outs = [_xla.spec(a.shape, a.dtype) for a in avals_in], [_xla.spec(*w) for w in wanted]

    def on_host(inputs, outputs):
        values = [_xla.view(inputs[i], spec, False) for i, spec in enumerate(ins)]
        into = [_xla.view(outputs[i], spec, True) for i, spec in enumerate(outs)]
        for out in into:
            _huge_pages(out)
        if direct:
            got = forward(values, p, into=into)
        else:
            got = _run(name, params, values, wanted, into=into)
        for result, out in zip(got, into):
            if result is not out:  # (not written straight into it)
                np.copyto(out, result)

    return on_host


def _on_cpu(name: str, params: Params, wanted: list, ctx):
    """What synk's XLA target runs for the operation: an allreduce the board can carry
    (``xla_handler.Allreduce``: a sum or product of one array, no weight), a sendrecv
    whose messages the rings can carry (``xla_handler.SendRecv``), else the rule."""
    direct = _writes_directly(name, params, ctx)
    on_host = _in_place(name, params, wanted, ctx.avals_in, direct)
    p, specs = params.dict(), [_xla.spec(a.shape, a.dtype) for a in ctx.avals_in]
    if (name == "allreduce" and direct and p["op"] in _xla.OPS and p.get("weight") is None
            and len(specs) == 1 and specs[0][1] in _xla.TYPES):
        return _xla.Allreduce(on_host, p["op"], specs[0])
    if name == "sendrecv" and _carried(ctx):
        return _xla.SendRecv(on_host, specs[0], p, _delivered(name, wanted))
    return _xla.Whole(on_host)


def _delivered(name: str, wanted: list):
    """What writes a message received for ``name`` (as its rule takes it: a marked one
    unmarked) into XLA's output buffer (``xla_handler.SendRecv``'s, in Python)."""
    out = _xla.spec(*wanted[0])

    def deliver(message, outputs) -> None:
        message = unmark(message)[0] if marked(message) else message
        np.copyto(_xla.view(outputs[0], out, True), _results(name, [message], wanted)[0])

    return deliver


def _writes_directly(name: str, params: Params, ctx) -> bool:
    """Whether the rule writes its results straight into XLA's output buffers, decided
    once, as the function lowers: it can (``Rule.writes_into``) and its values are carried
    as they are (``_carried``)."""
    return RULES[name].writes_into(params.dict()) and _carried(ctx)


def _carried(ctx) -> bool:
    """Whether the operation's values are carried as they are: each output of its
    input's shape and dtype, none bfloat16 (which a rule may take widened), nor of a type
    numpy lacks (which ``_run`` refuses). (A weakly typed input, from a Python number, is
    carried too: its buffer is its dtype's.)"""
    return len(ctx.avals_in) == len(ctx.avals_out) and all(
        (a.shape, a.dtype) == (b.shape, b.dtype) and a.dtype != adapter._BFLOAT16
        and np.dtype(a.dtype).kind != "V" for a, b in zip(ctx.avals_in, ctx.avals_out))


# madvise(2)'s MADV_HUGEPAGE, as numpy gives its own arrays of 4 MiB or more
# (numpy/_core/src/multiarray/alloc.c, ``indicate_hugepages``): XLA's buffers are fresh
# memory at every run, whose first write would fault once per 4 KiB page
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_MADV_HUGEPAGE, _HUGE, _PAGE = 14, 1 << 22, 4096


def _huge_pages(array: np.ndarray) -> None:
    if _LIBC is None or array.nbytes < _HUGE:
        return
    start = array.ctypes.data
    aligned = start + (-start % _PAGE)
    _LIBC.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(start + array.nbytes - aligned),
                  _MADV_HUGEPAGE)


def _impl(*values, name: str, params: Params):
    """The primitive evaluated eagerly: the rule on numpy views of the values."""
    wanted = [(a.shape, a.dtype) for a in _abstract(
        *[core.ShapedArray(np.shape(v), np.asarray(v).dtype) for v in values],
        name=name, params=params)]
    return [jax.numpy.asarray(v) for v in _run(name, params, list(values), wanted, False)]


def _lowering(ctx, *args, name: str, params: Params):
    """The call into Python, ordered by ``CommEffect``'s token (not ``jax.io_callback``,
    which makes JAX arrays only for the rule to take numpy views again). On the CPU, synk's
    own XLA target with XLA's buffers in and out (``xla_handler``, ``_in_place``: an
    allreduce writes into its input's buffer where the function computed it); elsewhere a
    host callback with numpy arrays (``emit_python_callback``). Across several devices
    (sharded, ``shard_map``, ``pmap``) it raises: each device would run its own collective,
    and XLA's other devices wait for ever on one that raises (XLA's CPU runtime from JAX
    0.11: "waiting for `all reduce RendezvousKey` ... may be stuck")."""
    context = ctx.module_context.axis_context
    if not (isinstance(context, ShardingContext) and context.num_devices == 1):
        raise SynkError(
            f"synk.comm.{name} under jax.jit on several devices of this rank (a value "
            "sharded across them, jax.shard_map or jax.pmap): synk runs one rank per "
            "device. Put the rank's values on one device (jax.device_put(x, "
            "jax.devices()[0])), or call synk.comm outside the jitted function")
    wanted = [(a.shape, a.dtype) for a in ctx.avals_out]
    token = ctx.tokens_in.get(_EFFECT)
    result: Any
    if list(ctx.module_context.platforms) == ["cpu"]:
        attributes = _xla.add(_on_cpu(name, params, wanted, ctx),
                              ctx.module_context.add_host_callback)
        tokened = dataclasses.replace(ctx, avals_in=[_TOKEN, *ctx.avals_in],
                                      avals_out=[_TOKEN, *ctx.avals_out])
        aliases = {}  # each result in its operand's buffer, where that is a value computed
        # here (a gradient): a jit's parameter would be copied for it first
        if (RULES[name].writes_into(params.dict()) and ctx.avals_in == ctx.avals_out
                and all(isinstance(a, ir.OpResult) for a in args)):
            aliases = {i: i for i in range(1, 1 + len(args))}
        call = _ffi.build_ffi_lowering_function(_xla.TARGET, has_side_effect=True,
                                                operand_output_aliases=aliases)
        token, *result = call(tokened, token, *args, **attributes).results
    else:
        result, token, _ = mlir.emit_python_callback(
            ctx, _callback(name, params, wanted), token, list(args), ctx.avals_in,
            ctx.avals_out, has_side_effect=True, returns_token=True)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_EFFECT: token})))
    return result


def _jvp(primals, tangents, *, name: str, params: Params):
    """The JVP: the operation applied to the tangents (every rule here is linear)."""
    if name == "recv_like":  # (a constant: the template only gives its shape)
        out = synk_comm_p.bind(*primals, name=name, params=params)
        return out, [ad.Zero(jax.typeof(o).to_tangent_aval()) for o in out]
    if name == "send":
        raise SynkError(
            "synk.comm.send of a value that jax.grad/jax.jvp follows: JAX cannot carry its "
            "derivative to the receiving rank (recv takes no input for JAX to follow). Use "
            "synk.comm.sendrecv, which is differentiable, or send jax.lax.stop_gradient(x)")
    # (raises for an op that has no gradient: the forward pass tells at once)
    RULES[name].adjoint(params.dict(), [(tuple(p.shape), p.dtype) for p in primals])
    out = synk_comm_p.bind(*primals, name=name, params=params)
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    if name not in _ELEMENTWISE:  # the tangents take the shapes the primals came in
        shapes = tuple(tuple(o.shape) for o in out)  # (evaluated: uneven ones too)
        params = Params({**params.dict(), "out_shapes": shapes})
    return out, synk_comm_p.bind(*tangents, name=name, params=params)


def _transpose(cts, *args, name: str, params: Params):
    """The transpose: the rule's adjoint bound (so transposing twice gives the operation
    back)."""
    avals = [(tuple(a.aval.shape), np.dtype(a.aval.dtype)) if ad.is_undefined_primal(a)
             else (tuple(np.shape(a)), np.asarray(a).dtype) for a in args]
    adjoint, adjoint_params = RULES[name].adjoint(params.dict(), avals)
    if adjoint == "broadcast":  # (a value of the root's shape on every rank: JAX's way)
        adjoint_params = {**adjoint_params, "frames": (None,) * len(cts)}
    cts = [ad.instantiate_zeros(c) for c in cts]
    return synk_comm_p.bind(*cts, name=adjoint, params=Params(adjoint_params))


_ELEMENTWISE = {"allreduce", "mean_adjoint", "sendrecv", "scan", "suffix_sum"}


def _batched(args, dims, *, name: str, params: Params):
    """Under ``jax.vmap``: elementwise operations take the batched arrays whole (the batch
    axis first); the others raise, saying what to do."""
    if name not in _ELEMENTWISE:
        raise SynkError(
            f"synk.comm.{name} under jax.vmap is not supported: its parts are cut along "
            "axis 0, where vmap's batch would mix with the ranks' rows. Call it outside "
            "jax.vmap (on the whole batch), or loop over the batch")
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved = [batching.bdim_at_front(a, d, size) for a, d in zip(args, dims)]
    return synk_comm_p.bind(*moved, name=name, params=params), [0] * len(moved)


def _effectful(*avals, name: str, params: Params):
    return _abstract(*avals, name=name, params=params), {_EFFECT}


def _raising_originals() -> None:
    """A jitted call raises the exception synk's callback raised, not JAX's error holding
    its text (``callback_errors.raising_originals``), where JAX runs its computation in
    Python: ``pxla.ExecuteReplicated``, for every computation with an ordered effect."""
    from jax._src.interpreters import pxla

    run: Any = pxla.ExecuteReplicated  # (Any: its __call__ is replaced)
    if not getattr(run.__call__, "synk_originals", False):
        run.__call__ = _callback_errors.raising_originals(run.__call__)


_raising_originals()
synk_comm_p.def_impl(_impl)
synk_comm_p.def_effectful_abstract_eval(_effectful)
ad.primitive_jvps[synk_comm_p] = _jvp
ad.primitive_transposes[synk_comm_p] = _transpose
batching.primitive_batchers[synk_comm_p] = _batched
mlir.register_lowering(synk_comm_p, _lowering, cacheable=False)


def traced_frame(x) -> _arrays.Frame:
    """The frame of a traced value (its framework is JAX): followed by autograd where its
    trace is JAX's differentiation's (``jax.grad``, ``jvp``, ``vjp``), not where it is only
    traced to compile (``jax.jit``) or batched (``jax.vmap``)."""
    from jax._src.interpreters import ad as _ad  # (its tracer types: no public name)

    followed = isinstance(x, (_ad.JVPTracer, _ad.LinearizeTracer))
    return _arrays.Frame("jax", adapter.dtype_name(x.dtype), jax.default_backend(), followed)
