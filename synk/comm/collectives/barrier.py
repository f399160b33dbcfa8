"""``barrier`` and ``ibarrier``: every rank waits for the others."""
from __future__ import annotations

from .. import context as _context, route as _route
from ..handle import Handle

__all__ = ["barrier", "ibarrier"]


@_context.numbered
def barrier() -> None:
    """Wait until every rank of the call has reached this point."""
    _route.for_barrier().barrier()


@_context.numbered
def ibarrier() -> Handle:
    """Non-blocking ``barrier``: ``wait()`` returns None once every rank has called
    ``ibarrier`` (MPI's ``Ibarrier``; torch.distributed's ``barrier(async_op=True)``).
    Like the other non-blocking collectives, every rank starts it in the same order."""
    return _route.for_barrier("ibarrier").ibarrier()
