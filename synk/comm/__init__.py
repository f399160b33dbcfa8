"""``synk.comm``: communication between the ranks from inside a synk function.

Call these only inside a function wrapped with ``synk.function``, while it runs: every
rank of the call takes part. Collectives must be called by every rank, in the same order.
Messages belong to their call: what one call sent cannot be received by the next.

    def step(x, w):
        g = grad(x, w)                      # this rank's rows
        g = synk.comm.allreduce(g, "sum")   # summed over every rank
        w -= lr * g

On CPU ranks a socketpair joins every two ranks, served by a progress thread in each rank,
and large arrays (128 KiB and more on 2 ranks, 64 KiB and more in larger groups) travel
through shared memory (``host/shm_channel.py``): the receiver reads them where the sender
put them. When all the ranks are on one host, ``allreduce`` and ``barrier`` meet on a shared
board instead (``host/shm_board.py``), with no message; between hosts the messages go over
MPI (``host/mpi_mesh.py``). On GPU ranks, device arrays are reduced and gathered on NCCL
(``nccl/``), on the rank's stream, and come back as device arrays; numpy arrays still take
the host communicator. Each collective lives whole in one module of ``collectives/`` (one
per family: the user function, its checks, its dispatch and its adjoint); the communicator
of its array (``route``: the host one, NCCL, or the host-staged one,
``host/staged_comm.py``, all of the one interface in ``communicator.py``) does it; what is
written once over that interface (the fused allreduce, rooted collectives, alltoall,
groups) is in ``algorithms/``, and the machinery of the gradients for torch and JAX (their
``Function``, their primitive, the rules' table) in ``autograd/``.
If a rank's function raises, the other ranks' waits in that call raise ``CommAborted``.
A rank whose function returns without a collective (or a send) that others wait for: their
waits raise ``ValueError``, naming it (under MPI, within about a second: a wait asks the
rank on another host where it is). So do theirs where a rank refused its value of a
collective (it raised before sending any of it: Python objects, a dtype) and caught the
error: such a rank must not go on with the call's collectives. Two ranks that wait for each
other (each receives first) are named after 2 s ([Reliability](reliability.md)).
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
