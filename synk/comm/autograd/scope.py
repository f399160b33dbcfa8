"""The call, and the sub-group, an operation of ``synk.comm`` ran in: its gradient must run
there too, while that call runs (the other ranks take part in it then, and only then)."""
from __future__ import annotations

import contextlib

from ...errors import SynkError
from .. import context as _context
from ..algorithms import groups as _groups


class Scope:
    """Where an operation ran: its context (the call's, or a sub-group's) and the call."""

    __slots__ = ("context", "call_id", "root", "device")

    def __init__(self) -> None:
        c = _context.now()
        self.context, self.call_id = c, c.call_id
        self.root = getattr(c, "root", None) or c
        self.device = c.device

    def alive(self) -> bool:
        return self.root.active and self.root.call_id == self.call_id

    @contextlib.contextmanager
    def entered(self, what: str):
        """``with``: the operation's context current, or ``SynkError`` if its call ended."""
        if not self.alive():
            raise SynkError(
                f"the gradient of synk.comm.{what} was asked for after the synk function call "
                "that ran it had ended: its adjoint is a collective of that call's ranks, which "
                "have left it. Call backward (loss.backward(), jax.grad...) inside the "
                "function, in the call that ran the collective")
        if self.context is not self.root:
            with _groups.inside(self.context):
                yield
            return
        with _context.using(self.root):
            yield
