"""Point to point: ``send``, ``recv``, ``sendrecv``, ``probe`` and their non-blocking forms."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import SynkError
from .. import autograd, route as _route
from ..autograd.rules import Rule, dummy, grad_tag, like, register
from ..frame_marks import mark, marked, unmark
from ..handle import Handle, then
from ..host.mailbox import ANY
from ..status import Status
from .dispatch import on

__all__ = ["send", "isend", "recv", "irecv", "sendrecv", "probe", "iprobe", "ANY_SOURCE", "ANY_TAG"]


def isend(x, dest: int, tag: int = 0) -> Handle:
    """Start sending array ``x`` to rank ``dest``; ``wait()`` returns once it is out.
    Do not change ``x`` before that. A device array is copied to the host first and
    arrives as a device array. ``dest`` may be this rank: the message is copied into its
    own mailbox at once. A torch tensor or a JAX array: ``wait()`` returns what ``send``
    does."""
    if autograd.framed(x):
        return on("send", x, {"dest": dest, "tag": tag}, wait=False)
    return _route.host("isend").isend(_route.as_array(x, "isend"), dest, tag)


def send(x, dest: int, tag: int = 0) -> Any:
    """Send array ``x`` to rank ``dest`` (matched by ``recv(source, tag)`` there). Buffered,
    as MPI's: it returns once ``x`` is out or copied, even to this rank itself
    (``send(x, rank(), tag)``, then ``recv(rank(), tag)`` gets a copy of ``x``). ``tag``
    may not be ``ANY_TAG``.

    A torch tensor or a JAX array arrives as one, and ``send`` returns a 0-d zero of its
    framework (None for numpy arrays): add it to this rank's loss (``loss + sent``) so that
    autograd, on a rank that only sends, brings the receiver's gradient back to ``x``."""
    if autograd.framed(x):
        return on("send", x, {"dest": dest, "tag": tag})
    isend(x, dest, tag).wait()
    return None


def irecv(source: int = ANY, tag: Any = ANY, *, status: Status | None = None) -> Handle:
    """Non-blocking ``recv``; ``wait()`` returns the array (and fills ``status`` in)."""
    if status is None and isinstance(source, (int, np.integer)) and source == ANY:
        status = Status()  # (a framework array's gradient goes back to its sender)
    handle = _route.host("irecv").irecv(source, tag, status)
    return Handle(lambda: autograd.received(handle.wait(), source, status))


def recv(source: int = ANY, tag: Any = ANY, *, status: Status | None = None,
         like: Any = None) -> Any:
    """The next array sent to this rank by ``source`` with ``tag``, waiting for it (mpi4py's
    ``Recv``). ``ANY_SOURCE`` takes a message from any rank, ``ANY_TAG`` one with any tag
    (the defaults): the one that arrived first among those that match, and from one rank
    in the order it sent them. ``status`` (a ``Status``), if given, is filled in with the
    message's source, tag, shape and dtype. A device array sent arrives as a device array.

    ``like``: an array of the message's shape and dtype (its values are not used), and the
    result is of its kind: inside ``jax.jit``, where a receive must know its result's shape
    when JAX traces, a JAX array of that shape (mpi4jax's ``recv(x, source)``); the
    message's shape and dtype are checked against it. Under JAX's differentiation the
    result is a constant.

        status = synk.comm.Status()
        x = synk.comm.recv(synk.comm.ANY_SOURCE, status=status)
        synk.comm.send(x * 2, status.source)          # answer whoever sent it

    Raises:
        ValueError: ``source`` is not a rank; or it is this rank itself (or ``ANY_SOURCE``
            in a call of one rank) and no message from itself matches: nothing else could
            send one, so the wait would never end.
    """
    if like is not None:
        if _is_any(source) or _is_any(tag):
            raise ValueError("synk.comm.recv(like=...) takes a given source and tag (its "
                             "message is one rank's, in order), not ANY_SOURCE or ANY_TAG")
        return on("recv_like", like, {"source": source, "tag": tag})
    return irecv(source, tag, status=status).wait()


def _is_any(value) -> bool:
    return isinstance(value, (int, np.integer)) and value == ANY


def sendrecv(x, dest: int, source: int | None = None, tag: int = 0, *,
             status: Status | None = None) -> Any:
    """Send ``x`` to rank ``dest`` and receive what rank ``source`` (default: ``dest``) sends
    this one with ``tag`` (MPI's ``Sendrecv``, mpi4jax's ``sendrecv``): halo and ring
    exchanges, which never deadlock. Differentiable on torch tensors and JAX arrays (under
    ``jax.jit`` too, where every rank must receive an array of ``x``'s shape)."""
    source = dest if source is None else source
    if autograd.framed(x):
        return on("sendrecv", x, {"dest": dest, "source": source, "tag": tag})
    handle = isend(x, dest, tag)
    got = recv(source, tag, status=status)
    handle.wait()
    return got


ANY_SOURCE = ANY  #: ``recv``'s and ``probe``'s source for a message from any rank


ANY_TAG = ANY  #: their tag for a message with any tag (no message may be sent with it)


def probe(source: int = ANY, tag: Any = ANY) -> Status:
    """The ``Status`` (source, tag, shape, dtype) of the message ``recv(source, tag)``
    would take, waiting until one is in, without receiving it (mpi4py's ``Probe``):
    ``recv(status.source, status.tag)`` then gets that very message. Raises ``ValueError``
    as ``recv`` does when only this rank could send it."""
    return _route.host("probe").probe(source, tag)


def iprobe(source: int = ANY, tag: Any = ANY) -> Status | None:
    """``probe``'s ``Status`` if a matching message is in now (looking once, after
    receiving what has arrived), else None (mpi4py's ``Iprobe``)."""
    return _route.host("iprobe").iprobe(source, tag)


def _received(source: int, tag):
    """The next message from ``source`` with ``tag`` as it came (a marked one still
    marked): what the rules take apart themselves."""
    return _route.host("irecv").irecv(source, tag, None).wait()


# -- adjoints --------------------------------------------------------------------------------------

@register
class Send(Rule):
    """``send``: the array out (marked: the receiver's gradient comes back under its
    number), and a 0-d zero for the sender to connect to its loss."""

    name = "send"

    def forward(self, xs, p, wait=True):
        x = xs[0]
        handle = isend(mark(x, p["frame"], p.get("number")), p["dest"], p["tag"])
        if wait:
            handle.wait()
            return [dummy(x)]
        return then(handle, lambda _: [dummy(x)], wait)

    def adjoint(self, p, xs_avals):
        if p.get("number") is None:
            raise SynkError("synk.comm.send: this send carries no gradient")
        return "grad_from", {"peer": p["dest"], "number": p["number"], "aval": xs_avals[0]}

    def avals(self, avals, p, rank, size):
        return [((), avals[0][1])]


@register
class Recv(Rule):
    """A received array, as ``synk.comm.recv`` gave it (its forward is that receive);
    its adjoint sends the gradient back to the sender."""

    name = "recv"

    def adjoint(self, p, xs_avals):
        return "grad_to", {"peer": p["peer"], "number": p["number"]}


@register
class GradFrom(Rule):
    """The gradient of a message this rank sent, from the rank that received it."""

    name = "grad_from"

    def forward(self, xs, p, wait=True):
        shape, dtype = p["aval"]
        got = _received(p["peer"], grad_tag(p["number"]))
        return [like(unmark(got)[0] if marked(got) else got, shape, dtype)]


@register
class GradTo(Rule):
    """A received message's gradient, back to its sender."""

    name = "grad_to"

    def forward(self, xs, p, wait=True):
        isend(xs[0], p["peer"], grad_tag(p["number"])).wait()
        return []


@register
class SendRecv(Rule):
    """``sendrecv``: ``x`` to ``dest`` and the array from ``source``; its adjoint runs the
    other way, on synk's own tag."""

    name = "sendrecv"

    def forward(self, xs, p, wait=True):
        x = xs[0]
        handle = isend(x, p["dest"], p["tag"])
        got = _received(p["source"], p["tag"])
        handle.wait()
        return [unmark(got)[0] if marked(got) else got]

    def adjoint(self, p, xs_avals):
        return "sendrecv", {"dest": p["source"], "source": p["dest"],
                            "tag": grad_tag(p["tag"])}


@register
class RecvLike(Rule):
    """``recv(..., like=template)``: the array from ``source``, of the template's shape and
    dtype (checked); the template's value is not used (mpi4jax's ``recv(x, source)``), so
    the result is a constant to JAX's differentiation: no adjoint, zero tangents."""

    name = "recv_like"
    receives = True

    def forward(self, xs, p, wait=True):
        template = xs[0]
        got = _received(p["source"], p["tag"])
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
