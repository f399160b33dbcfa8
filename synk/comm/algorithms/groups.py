"""Sub-groups of a call's ranks (``synk.comm.split``, ``new_group``): the methods of
``synk.comm`` over some of the ranks, each group in a ``Context`` of its own (``make``).

::

    Group.allreduce(x) --the group's context current--> synk.comm.allreduce(x)
        --> the group's numbering, its tags (its scope), its mesh (GroupMesh: the parent's)
"""
from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import numpy as np

from ...errors import SynkError
from .. import context as _context, route as _route
from ..communicators import communicator_class
from ..host.mailbox import ANY


class GroupMesh:
    """The parent's mesh for the ranks ``members`` (parent ranks, in the group's order)."""

    def __init__(self, mesh, members: tuple) -> None:
        self.mesh, self.members = mesh, members

    def _parent_rank(self, rank) -> int:
        if not (isinstance(rank, (int, np.integer)) and 0 <= rank < len(self.members)):
            raise ValueError(f"no rank {rank} in this group of {len(self.members)} ranks "
                             f"(0..{len(self.members) - 1})")
        return self.members[rank]

    def post(self, dest: int, tag: tuple, array):
        return self.mesh.post(self._parent_rank(dest), tag, array)

    def wait_sent(self, send) -> None:
        self.mesh.wait_sent(send)

    def take(self, source: int, tag: tuple):
        return self.mesh.take(self._parent_rank(source), tag)

    def take_view(self, source: int, tag: tuple):
        return self.mesh.take_view(self._parent_rank(source), tag)

    def match(self, source: int, pattern: tuple, take: bool = True, block: bool = True):
        got = self.mesh.match(source if source == ANY else self._parent_rank(source),
                              pattern, take, block)
        if got is None:
            return None
        (parent, tag), item = got
        return (self.members.index(parent), tag), item

    def post_own(self, tag: tuple, array) -> None:
        self.mesh.post_own(tag, array)

    def abort(self, call_id: int, why: str, left: bool = False,
              finished: dict | None = None) -> None:
        self.mesh.abort(call_id, why, left, finished)  # (a failure fails the whole call)

    def failed_here(self, call_id: int, error: BaseException) -> None:
        self.mesh.failed_here(call_id, error)  # (the whole call's waits on this rank)

    def stop_reason(self, number: int = 0) -> str | None:
        return self.mesh.stop_reason(number)


def make(parent, members: tuple, scope: tuple):
    """The context of the group ``members`` (ranks of ``parent``) for this rank, one of
    them: ranks 0..size-1, its own count of collectives, a ``GroupMesh``, and tags carrying
    its ``scope``. Device arrays go through the host-staged communicator (NCCL's is the
    whole call's only)."""
    c = _context.Context()
    c.active, c.in_fn = True, True
    c.call_id, c.size, c.rows = parent.call_id, len(members), parent.rows
    c.rank = members.index(parent.rank)
    c.mesh = None if len(members) == 1 else GroupMesh(parent.mesh, members)
    c.device = parent.device
    c.scope = scope
    c.root = getattr(parent, "root", None) or parent
    c.lanes = c.root.lanes  # (its non-blocking operations end with the call's share)
    if parent.device is not None and not parent.device.is_host:
        c.device_comm = communicator_class("staged")(parent.device, c.size, c.rank)
    return c


@contextlib.contextmanager
def inside(c):
    """``c`` (a group's context) current, in the call it was made in."""
    root = _context.require("a group's method")
    if root is not c.root or root.call_id != c.call_id:
        raise SynkError("this synk.comm group belongs to another call, which has ended: "
                        "make groups inside the call that uses them (split, new_group)")
    root.ops += 1  # (the call's own count: see _call.share)
    with _context.using(c):  # (this thread only: another's collectives stay in the call's)
        yield


class Group:
    """Some of the call's ranks (made by ``split`` or ``new_group``, inside the call that
    uses them): every function of ``synk.comm`` as a method (``rank``, ``size``,
    ``allreduce``, ``send``, ``split``...), over these ranks only, numbered 0..size-1 in the
    group. Its messages never mix with the call's or another group's. On GPU ranks, its
    device arrays travel through the host (not NCCL)."""

    __slots__ = ("_context", "_methods")

    def __init__(self, context, methods: dict) -> None:
        """``methods``: name -> function taking the group first (``method``)."""
        self._context, self._methods = context, methods

    def __getattr__(self, name: str):
        methods = object.__getattribute__(self, "_methods")
        if name not in methods:
            raise AttributeError(f"synk.comm.Group has no method {name!r}: its methods are "
                                 f"synk.comm's functions ({', '.join(sorted(methods))})")
        return types.MethodType(methods[name], self)

    def __dir__(self) -> list:
        return sorted({*super().__dir__(), *self._methods})

    def __repr__(self) -> str:
        c = self._context
        return f"<synk.comm.Group: rank {c.rank} of {c.size}>"

    def __reduce__(self):
        raise TypeError("a synk.comm.Group belongs to the call that made it and cannot be "
                        "pickled: make it inside the function, in each call")


def method(fn):
    """``fn`` (a ``synk.comm`` function) as a method of ``Group``, run in its group: the
    group's context is current while ``fn`` runs, so every collective, rule and communicator
    is the one written for the whole call."""
    @functools.wraps(fn)
    def on_group(self, *args, **kwargs):
        with inside(self._context):
            return fn(*args, **kwargs)
    return on_group


def split(color: Any, key: int, what: str = "split"):
    """This rank's group among the ranks that passed the same ``color`` (ordered by
    ``key``, then rank), as a context; None where ``color`` is None."""
    c = _context.collective(what)
    if not isinstance(key, (int, np.integer)):
        raise TypeError(f"synk.comm.split: key orders the ranks of a group; pass an int, not "
                        f"{key!r}")
    said = _route.host(what).allgather_objects((color, int(key)), what)
    bad = {r: col for r, (col, _) in enumerate(said) if col is not None and not _itself(col)}
    if bad:  # (NaN is no color: it equals nothing, not even itself)
        listing = ", ".join(f"rank {r}: {col!r}" for r, col in bad.items())
        raise ValueError(f"synk.comm.split: a color is None or a value equal to itself (an "
                         f"int, a string...), which the ranks of one group share; got "
                         f"{listing}")
    if color is None:
        return None
    members = tuple(sorted((r for r, (col, _) in enumerate(said) if col == color),
                           key=lambda r: (said[r][1], r)))
    return make(c, members, c.scope + ((c.seq, members[0]),))


def _itself(value) -> bool:
    """Whether ``value == value`` holds (not for NaN, nor for an array)."""
    try:
        return bool(value == value)
    except Exception:
        return False


def new_group(ranks):
    """The group of ``ranks`` (ranks of the running group, in that order) as a context, on
    its members; None elsewhere. Every rank passes the same list."""
    what = "new_group"
    c = _context.collective(what)
    try:
        ranks = tuple(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise TypeError(f"synk.comm.new_group takes a list of ranks, not {ranks!r}") from None
    if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < c.size for r in ranks):
        raise ValueError(f"synk.comm.new_group takes a list of distinct ranks, 0..{c.size - 1};"
                         f" got {list(ranks)}")
    said = _route.host(what).allgather_objects(ranks, what)
    if any(s != ranks for s in said):
        listing = ", ".join(f"rank {r}: {list(s)}" for r, s in enumerate(said))
        raise ValueError(f"synk.comm.new_group: the ranks passed different lists ({listing}); "
                         "every rank passes the same one")
    if c.rank not in ranks:
        return None
    return make(c, ranks, c.scope + ((c.seq, ranks[0]),))
