"""``synk.comm``: communication between the ranks from inside a synk function, while it
runs. Every rank of the call takes part, collectives are called by every rank in the same
order, and what one call sent cannot be received by the next. On CPU ranks messages go over
a socketpair between every two ranks and large arrays through shared memory, where the
receiver reads them; on one host ``allreduce`` and ``barrier`` meet on a shared board, with
no message; between hosts messages go over MPI; on GPU ranks device arrays are reduced and
gathered on NCCL, on the rank's stream ([Architecture](architecture.md)). If a rank's
function raises, the other ranks' waits in that call raise ``CommAborted``; if it returns
without a collective (or a send) that others wait for, their waits raise ``ValueError``
naming it ([Reliability](reliability.md)).

    def step(x, w):
        g = grad(x, w)                      # this rank's rows
        g = synk.comm.allreduce(g, "sum")   # summed over every rank
        w -= lr * g
"""
from __future__ import annotations

from typing import Any

from ..errors import CommAborted, CommError
from .algorithms import groups as _groups
from .algorithms.groups import Group
from .collectives import (
    allreduce as _allreduce,
    alltoall as _alltoall,
    barrier as _barrier,
    broadcast as _broadcast,
    gather as _gather,
    messages as _messages,
    reduce_scatter as _reduce_scatter,
    scan as _scan,
)
from .collectives.allreduce import *  # noqa: F403 (its __all__)
from .collectives.alltoall import *  # noqa: F403 (its __all__)
from .collectives.barrier import *  # noqa: F403 (its __all__)
from .collectives.broadcast import *  # noqa: F403 (its __all__)
from .collectives.gather import *  # noqa: F403 (its __all__)
from .collectives.messages import *  # noqa: F403 (its __all__)
from .collectives.reduce_scatter import *  # noqa: F403 (its __all__)
from .collectives.scan import *  # noqa: F403 (its __all__)
from .context import rank, size
from .handle import Handle
from .host.mailbox import ANY
from .status import Status

_FAMILIES = (_allreduce, _broadcast, _gather, _reduce_scatter, _alltoall, _scan, _messages,
             _barrier)  # each collective's module: its public names are its __all__
__all__ = ["rank", "size", "split", "new_group", "Group", "Status", "ANY", "Handle", "CommError",
           "CommAborted", *(name for family in _FAMILIES for name in family.__all__)]


def split(color: Any, key: int = 0) -> Group | None:
    """Split the ranks into groups, one per ``color``: this rank's group, a ``Group`` of
    the ranks that passed the same color, numbered by ``key`` then by rank; None where
    ``color`` is None (MPI's ``UNDEFINED``). Every rank calls it (MPI's ``Comm.Split``).
    Groups from one split run their collectives independently, at the same time. A color
    is a value equal to itself (an int, a string): NaN raises ``ValueError`` on every rank.

        row = synk.comm.split(color=synk.comm.rank() // 2)
        partial = row.allreduce(x)      # over this rank's pair only
    """
    context = _groups.split(color, key)
    return None if context is None else Group(context, _ON_GROUPS)


def new_group(ranks) -> Group | None:
    """The ``Group`` of ``ranks`` (this call's ranks, numbered in the group in the order
    given), on its members; None on the other ranks. Every rank calls it, with the same
    list (torch.distributed's ``new_group``; MPI's ``Group.Incl`` then ``Comm.Create``)."""
    context = _groups.new_group(ranks)
    return None if context is None else Group(context, _ON_GROUPS)


#: synk.comm's operations by name: its functions, each its family module's own
_OPERATIONS = {"rank": rank, "size": size, "split": split, "new_group": new_group,
               **{name: getattr(family, name) for family in _FAMILIES
                  for name in family.__all__ if name[0].islower()}}
#: a ``Group``'s methods: the operations run over its ranks (a persistent allreduce
#: belongs to the call's group, whose calls it serves)
_ON_GROUPS = {name: _groups.method(fn) for name, fn in _OPERATIONS.items()
              if name != "allreduce_init"}
