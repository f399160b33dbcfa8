"""torch's autograd over the rules (``rules``): one ``autograd.Function`` for every
operation. Its forward hands back outputs synk computed already (on native arrays, perhaps
non-blocking), so that its node joins the graph where the outputs are used; its backward
runs the rule's adjoint on the gradients, in the call (and the sub-group) that made it."""
from __future__ import annotations

import torch

from ... import _arrays
from .rules import RULES
from .scope import Scope


class _State:
    """What a node keeps for its backward."""

    __slots__ = ("name", "params", "avals", "frames", "outs", "out_frames", "scope", "device")

    def __init__(self, name, params, avals, frames, outs, out_frames) -> None:
        self.name, self.params = name, params
        self.avals, self.frames = avals, frames
        self.outs, self.out_frames = outs, out_frames
        self.scope = Scope()
        self.device = self.scope.device


class _Collective(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: _State, *inputs):
        ctx.state = state
        outs = [_arrays.restore(o, f, state.device) for o, f in zip(state.outs, state.out_frames)]
        state.outs = None  # (the natives: no longer needed)
        fixed = [t for t in outs if not (t.is_floating_point() or t.is_complex())]
        if fixed:
            ctx.mark_non_differentiable(*fixed)
        ctx.out_meta = [(tuple(t.shape), t.dtype) for t in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        state = ctx.state
        rule = RULES[state.name]
        with state.scope.entered(state.name):
            adjoint, params = rule.adjoint(state.params, state.avals)
            adjoint_rule = RULES[adjoint]
            cts = []
            for g, (shape, dtype) in zip(grads, ctx.out_meta):
                if g is None:
                    g = torch.zeros(shape, dtype=dtype)
                cts.append(_arrays.native(g, adjoint_rule.math)[0])
            got = adjoint_rule.forward(cts, params)
        ins = [None if f is None else _arrays.restore(g, f, state.device)
               for g, f in zip(got, state.frames)]
        ins += [None] * (len(ctx.needs_input_grad) - 1 - len(ins))
        return (None, *ins)


def attach(name: str, params: dict, leaves: list, natives: list, frames: list,
           outs: list, out_frames: list) -> tuple:
    """The outputs (native ``outs``) as tensors that autograd follows back to ``leaves``
    (the inputs; a rank whose inputs autograd does not follow gets a leaf of its own, so
    that its backward still takes part in the adjoint)."""
    avals = [(tuple(x.shape), x.dtype) for x in natives if x is not None]
    state = _State(name, params, avals, frames, outs, out_frames)
    inputs = list(leaves)
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        inputs.append(torch.zeros((), requires_grad=True))
    return _Collective.apply(state, *inputs)
