"""The rules of point-to-point messages (``rules``): send, recv, sendrecv."""
from __future__ import annotations

from ...errors import SynkError
from ..frame_marks import mark, marked, unmark
from ._base import Rule, _dummy, _like, _rule, _then, grad_tag


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


@_rule
class RecvLike(Rule):
    """``recv(..., like=template)``: the array from ``source``, of the template's shape and
    dtype (checked); the template's value is not used (mpi4jax's ``recv(x, source)``), so
    the result is a constant to JAX's differentiation: no adjoint, zero tangents."""

    name = "recv_like"
    receives = True

    def forward(self, plain, xs, p, wait=True):
        template = xs[0]
        got = plain.recv(p["source"], p["tag"])
        native, frame = (unmark(got)[:2] if marked(got) else (got, None))
        if tuple(native.shape) != tuple(template.shape) or native.dtype != template.dtype:
            raise SynkError(
                f"synk.comm.recv(like=...): the message from rank {p['source']} is "
                f"{tuple(native.shape)} {native.dtype}, but like= is "
                f"{tuple(template.shape)} {template.dtype}; pass a template of the "
                "message's shape and dtype")
        return [(native, frame)]

    def adjoint(self, p, xs_avals):
        raise SynkError("synk.comm.recv(like=...) has no adjoint: its result does not "
                        "depend on the template")
