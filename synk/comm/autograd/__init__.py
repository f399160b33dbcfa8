"""``synk.comm`` on torch tensors and JAX arrays, with their gradients: the operation's rule
(``rules``) runs on their native forms (``synk._arrays``), the results back in the framework,
dtype and device they came in.

::

    synk.comm's function --run--> native arrays --rule--> results, back in the framework:
        a torch tensor that requires grad    ``_torch``: an ``autograd.Function`` (adjoint)
        a JAX value a transformation traces  ``_jax``: a primitive over the same rules
        anything else                        converted and back (two views)
    a marked message, where this rank passed no framework value --arrived--> its framework
"""
from __future__ import annotations

import itertools

import numpy as np

from ... import _arrays, _tree
from ...errors import SynkError
from .. import context as _context, route as _route
from ..frame_marks import marked, unmark
from ..handle import Handle, then
from ..status import Status
from .rules import RULES, dummy

_numbers = itertools.count(1)  # each message this process sends that carries a gradient


def run(name: str, flat: _tree.Flat, params: dict, *, wait: bool | None = True,
        out: _tree.Flat | None = None, direct=None):
    """``synk.comm``'s operation ``name`` (a rule) on ``flat`` (a framework value, or a
    structure holding some, taken apart), as the framework gives it (a Handle of it when
    not ``wait``). ``out``: framework buffers (taken apart), filled by ``direct(native
    tree, native out)``, and returned."""
    if wait is False:
        return started(lambda: run(name, flat, params, wait=None, out=out, direct=direct))
    wait = wait is not None  # (None: started non-blocking, from here on)
    leaves, template = flat.leaves, flat.structure
    if any(_arrays.is_traced(leaf) for leaf in leaves):
        return _traced(name, leaves, template, params, wait)
    rule = RULES[name]
    kept = [leaf for leaf in leaves if leaf is not None]
    natives, frames = _natives(name, rule, kept)
    if out is not None:  # (a rank that passed None, as a broadcast's non-root: None still)
        given = iter(natives)
        sent = [None if leaf is None else next(given) for leaf in leaves]
        return _into(direct, sent, template, frames, out, name, kept)
    params = _with_frames(name, params, frames, template)
    if params.get("op") in ("maxloc", "minloc"):
        return _located(name, rule, kept, natives, frames, params, wait)
    begun = rule.forward(natives, params, wait)

    def finish(outs: list):
        got = _finish(name, rule, params, kept, natives, frames, outs)
        return _tree.rebuild(_out_template(name, template, got, outs), iter(got))

    if wait:
        return finish(begun)
    if name == "send":  # its node now, when the send starts (a receive's: when its array
        # arrives, ``arrived``), so that autograd, which runs the nodes made last first,
        # sends a rank's gradients back (``recv``'s adjoint, buffered) before it waits for its
        # own (``send``'s adjoint): two ranks that exchange messages never wait for each other
        # in their backward
        sent = finish([dummy(natives[0])])
        return Handle(lambda: (begun.wait(), sent)[1])
    return Handle(lambda: finish(begun.wait()))


def _natives(name: str, rule, leaves: list) -> tuple[list, list]:
    """The native forms of ``leaves`` (none None), on the host where ``name`` runs on
    host ranks (back on their device by their frames), and their frames."""
    pairs = [_arrays.native(leaf, rule.math) for leaf in leaves]
    natives = [n for n, _ in pairs]
    frames = [f for _, f in pairs]
    if any(f is not None and f.device.startswith(("cuda", "gpu")) for f in frames) and \
            _route.on_host_ranks(name):
        natives = [_arrays.host(n) for n in natives]
    return natives, frames


def _with_frames(name: str, params: dict, frames: list, template) -> dict:
    """``params`` with the inputs' frames and structure (a send's: its frame, and number)."""
    if name == "send" and any(f is not None and f.grad for f in frames):
        params = {**params, "number": next(_numbers)}
    params = {**params, "frames": tuple(frames), "template": template}
    if name == "send":
        params["frame"] = frames[0]
    return params


def _out_template(name: str, template, got: list, outs=None):
    """The structure of the outputs: the inputs' (a list for alltoall's parts; a
    broadcast's as it arrived), or one."""
    if name == "broadcast" and getattr(outs, "template", None) is not None:
        return outs.template
    if name in ("allreduce", "broadcast", "allgather", "alltoall") and template is not None:
        return template
    return None if len(got) == 1 else ("list", (None,) * len(got))


def _finish(name, rule, params, leaves, natives, frames, outs) -> list:
    """The outputs in their framework: attached to autograd where it follows them."""
    first = next((f for f in frames if f is not None), None)
    outs, out_frames = _framed(rule, outs, frames, first)
    grad = any(f is not None and f.grad for f in frames + out_frames)
    if grad and (first or out_frames[0]).kind == "torch":
        from . import torch_function as _torch

        return list(_torch.attach(name, params, leaves, natives, frames, outs,
                                  out_frames))
    if grad and any(f is not None and f.kind == "jax" for f in out_frames) and not frames:
        _jax_cannot_join(name)
    device = _device()
    return [_arrays.restore(o, f, device) for o, f in zip(outs, out_frames)]


def _framed(rule, outs, frames: list, first) -> tuple[list, list]:
    """The outputs and the frames they go back in."""
    if rule.receives:
        return ([o for o, _ in outs], [f or (frames[i] if i < len(frames) else first)
                                       for i, (_, f) in enumerate(outs)])
    if len(outs) == len(frames):  # leaf by leaf: a number stays a number
        return outs, list(frames)
    return outs, [first] * len(outs)


def _located(name, rule, leaves, natives, frames, params, wait):
    """maxloc/minloc: ``(values, ranks)``, both in the framework; no gradient (the
    values' node raises at backward)."""
    begun = rule.located(natives[0], params, wait)

    def finish(got):
        if got is None:
            return _arrays.zero_like(frames[0], _device())
        values, ranks = got
        ranks_frame = frames[0].replace(dtype="int64", grad=False)
        if frames[0].grad and frames[0].kind == "torch":
            from . import torch_function as _torch

            return tuple(_torch.attach("allreduce", params, leaves, natives, frames,
                                       [values, ranks], [frames[0], ranks_frame]))
        device = _device()
        return (_arrays.restore(values, frames[0], device),
                _arrays.restore(ranks, ranks_frame, device))

    return then(begun, finish, wait)


def _into(direct, natives, template, frames, out: _tree.Flat, name: str, leaves=()):
    """``out`` (framework buffers, or a structure of them, taken apart) holding the result,
    or a Handle of it where ``direct`` gives one; ``natives``: the input's leaves in their
    native form, None where a leaf is None."""
    if any(f is not None and f.grad for f in frames):
        raise TypeError(f"synk.comm.{name}: out= does not take part in autograd (as torch's "
                        "out= arguments do not); drop out=, or detach the input")
    outs, form = out.leaves, out.structure
    if len(outs) == len(leaves) and all(o is x for o, x in zip(outs, leaves)):
        buffers = natives  # in place (out=x): its native views are the buffers already
    else:
        buffers = []
        for o in outs:
            if _arrays.adapter_of(o) is not None and type(o).__module__.startswith("jax"):
                raise TypeError(f"synk.comm.{name}: out= must be a writable array (numpy, "
                                "torch); JAX arrays are immutable: use the result instead")
            buffers.append(_arrays.native(o)[0])
    got = direct(_tree.rebuild(template, iter(natives)), _tree.rebuild(form, iter(buffers)))

    def written():
        _arrays.written(outs)  # (torch's next kernels, on its stream, after synk's writes)
        return out.value

    if isinstance(got, Handle):
        return Handle(lambda: (got.wait(), written())[1])
    return written()


def _traced(name, leaves, template, params, wait):
    """The operation on JAX values some of which a transformation traces."""
    import jax.numpy as jnp

    from . import jax_primitive as _jax

    values = [jnp.asarray(leaf) for leaf in leaves if leaf is not None]
    params = _with_frames(name, params, [_jax.traced_frame(v) for v in values], template)
    got = list(_jax.bind(name, values, params))
    result = _tree.rebuild(_out_template(name, template, got), iter(got))
    return result if wait else Handle.done(result)


def arrived(name: str, raw, params: dict):
    """What a rank that passed no framework value received (``recv``, or a broadcast's or
    scatter's rank other than the root): marked leaves back in their framework, attached
    to autograd where the sender's are followed (a torch tensor that requires grad), so
    that this rank's backward joins the adjoint."""
    leaves, template = _tree.flatten(raw)
    if not any(marked(leaf) for leaf in leaves):
        return raw
    got = [unmark(leaf) if marked(leaf) else (leaf, None, None) for leaf in leaves]
    natives = [n for n, _, _ in got]
    frames = [f for _, f, _ in got]
    if any(f is not None and f.grad for f in frames):
        kind = next(f.kind for f in frames if f is not None)
        if kind == "jax":
            _jax_cannot_join(name)
        from . import torch_function as _torch

        if name == "recv":
            params = {**params, "number": got[0][2]}
        outs = list(_torch.attach(name, {**params, "frames": (), "template": None},
                                  [], [], [], natives, frames))
    else:
        device = _device()
        outs = [_arrays.restore(n, f, device) for n, f in zip(natives, frames)]
    return _tree.rebuild(template, iter(outs))


def unmarked(got, name: str):
    """What a broadcast brought into ``out=`` (native buffers; a framework's, as their
    native views): the sender's marked leaves as their native arrays, since ``out=``
    gives the result its type. A sender's tensor that autograd follows cannot arrive in
    ``out=``: its adjoint would wait for this rank's gradient, which ``out=`` drops."""
    leaves, template = _tree.flatten(got)
    if not any(marked(leaf) for leaf in leaves):
        return got
    natives = []
    for leaf in leaves:
        native, frame, _ = unmark(leaf) if marked(leaf) else (leaf, None, None)
        if frame is not None and frame.grad:
            raise TypeError(f"synk.comm.{name}: out= does not take part in autograd, but the "
                            "root's value requires grad: drop out= on this rank, or detach "
                            "the value at the root")
        natives.append(native)
    return _tree.rebuild(template, iter(natives))


def _jax_cannot_join(name: str):
    raise SynkError(
        f"synk.comm.{name}: the sender's JAX value is followed by a transformation (jax.grad, "
        "jax.vjp...), but this rank passed no JAX value, so its part of the gradient cannot "
        "be taken: pass an array of the result's shape on every rank (as mpi4jax's bcast "
        "takes one), under the same transformation, or use synk.comm.sendrecv for messages")


def _device():
    return _context.now().device


def framed(x) -> bool:
    """Whether ``x`` holds a torch tensor or a JAX array (a numpy array: at once, no)."""
    return type(x) is not np.ndarray and x is not None and _arrays.framed(x)


def started(start) -> Handle:
    """A Handle of ``start()``'s result (itself, when it is one already)."""
    result = start()
    return result if isinstance(result, Handle) else Handle.done(result)


def counts(values):
    """A ``counts=`` as a tuple of ints (a rule's parameter), or None."""
    return None if values is None else tuple(int(c) for c in _arrays.to_numpy(values))


def alltoall_params(x, values) -> dict:
    if isinstance(x, (list, tuple)):
        return {"listed": True, "counts": counts(values)}
    return {"counts": counts(values), "rows": len(x) if getattr(x, "ndim", 0) else 0}


def received(got, source, status: Status | None):
    """A received array; a marked one (a framework's) back in its framework."""
    if got.dtype.names is None or not marked(got):
        return got
    peer = status.source if status is not None else source
    return arrived("recv", got, {"peer": peer})
