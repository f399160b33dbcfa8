"""``synk.comm``: communication between the ranks from inside a synk function.

Call these only inside a function wrapped with ``synk.function``, while it runs: every
rank of the call takes part. Collectives must be called by every rank, in the same order.
Messages belong to their call: what one call sent cannot be received by the next.

    def step(x, w):
        g = grad(x, w)                      # this rank's rows
        g = synk.comm.allreduce(g, "sum")   # summed over every rank
        w -= lr * g

On CPU ranks a socketpair joins every two ranks, served by a progress thread in each rank,
and arrays of 64 KiB and more travel through shared memory (``_shm_channel``): the receiver
reads them where the sender put them. On GPU ranks, device arrays are reduced and gathered
on NCCL, on the rank's stream, and come back as device arrays; numpy arrays still take the
host transport. Each function is one line: the communicator of its array (``_route``: the
host one, NCCL, or the host-staged one, all of the one interface in ``_communicator``) does
it.
If a rank's function raises, the other ranks' waits in that call raise ``CommAborted``.
A rank that skips a collective makes the others wait: give the call a ``timeout=``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._reduction import canonical
from ..errors import CommAborted, CommError
from . import _fused, _route
from ._context import require as _require
from ._handle import Handle

__all__ = [
    "rank", "size", "allreduce", "broadcast", "allgather", "reduce_scatter", "send", "recv",
    "iallreduce", "ibroadcast", "iallgather", "ireduce_scatter", "isend", "irecv", "barrier",
    "Handle", "CommError", "CommAborted",
]


def rank() -> int:
    """This rank's number in the running call (0 is the master)."""
    return _require("rank").rank


def size() -> int:
    """The number of ranks in the running call."""
    return _require("size").size


def allreduce(x: Any, op: str = "sum", *, weight: float | None = None) -> Any:
    """``x`` combined over every rank with ``op`` (``"sum"``, ``"prod"``, ``"max"``,
    ``"min"``, ``"mean"``), on every rank. Booleans sum to counts, as in numpy. A device
    array (GPU ranks) is reduced on NCCL and the result is a device array.

    ``x`` may also be a list, tuple or dict of arrays (nested too), such as a model's
    gradients: they are reduced in one fused buffer per dtype (one collective each, not
    one per array) and come back in the same structure. Every rank must pass the same
    structure.

    ``weight`` (with ``op="mean"``): this rank's share of the average, typically the rows
    it processed, so that uneven shares average exactly: the result is
    ``sum(weight_r * x_r) / sum(weight_r)``. A rank with weight 0 contributes nothing.
    Every mean, weighted or not, accumulates in float64 on every back end, GPU ranks
    included, and is cast back to ``x``'s float dtype (see "How mean is computed").

        grads = synk.comm.allreduce(grads, "mean", weight=len(x))

    Raises:
        ValueError: ``x`` has different shapes (or structures) on different ranks, ``op``
            is unknown, ``weight`` is given with another op, is negative or not finite,
            or is given on some ranks only, or the weights sum to 0.
        TypeError: an array is not numeric (bool, integers, floats, complex), or device
            and host arrays are mixed.
    """
    op = canonical(op)
    weight = _fused.check_weight(weight, op)
    return _fused.allreduce(_route.numbers(x, "allreduce"), x, op, weight)


def iallreduce(x: Any, op: str = "sum", *, weight: float | None = None) -> Handle:
    """Non-blocking ``allreduce`` (structures and ``weight`` as there); ``wait()`` returns
    the result. On device arrays the reduction runs on NCCL's own stream while the rank's
    stream computes, and ``wait()`` waits on the CUDA event recorded after it (the small
    exchange that checks structures and weights is done before returning)."""
    op = canonical(op)
    weight = _fused.check_weight(weight, op)
    return _fused.allreduce(_route.numbers(x, "iallreduce"), x, op, weight, wait=False)


def broadcast(x, root: int = 0) -> np.ndarray:
    """Rank ``root``'s ``x`` on every rank (the others may pass None); a device array
    everywhere when it is one at the root."""
    return _route.broadcast(x, root)


def ibroadcast(x, root: int = 0) -> Handle:
    """Non-blocking ``broadcast``; ``wait()`` returns the result."""
    return _route.broadcast(x, root, wait=False)


def allgather(x) -> np.ndarray:
    """Every rank's ``x`` joined along axis 0 in rank order (lengths may differ; 0-d values
    become one row each), on every rank."""
    return _route.for_array(x, "allgather").allgather(x)


def iallgather(x) -> Handle:
    """Non-blocking ``allgather``; ``wait()`` returns the result."""
    return _route.for_array(x, "iallgather").iallgather(x)


def reduce_scatter(x, op: str = "sum") -> np.ndarray:
    """Split ``x`` along axis 0 into one part per rank (as synk splits rows); rank r gets
    part r combined over every rank with ``op``. ``x`` must be numeric (as for
    ``allreduce``), else TypeError."""
    op = canonical(op)
    communicator = _route.numbers(x, "reduce_scatter")  # (its dtype first: numbers)
    _check_rows(x, "reduce_scatter")
    return communicator.reduce_scatter(x, op)


def ireduce_scatter(x, op: str = "sum") -> Handle:
    """Non-blocking ``reduce_scatter``; ``wait()`` returns the result."""
    op = canonical(op)
    communicator = _route.numbers(x, "ireduce_scatter")  # (its dtype first: numbers)
    _check_rows(x, "ireduce_scatter")
    return communicator.ireduce_scatter(x, op)


def _check_rows(x, what: str) -> None:
    """The one check, for every communicator, that ``x`` has an axis 0 to split."""
    if (x.ndim if hasattr(x, "ndim") else np.ndim(x)) == 0:  # (device arrays: their own)
        raise ValueError(f"synk.comm.{what} splits x along axis 0, so x needs at least 1 "
                         "dimension (got a 0-d value); reshape it, e.g. x.reshape(1)")


def barrier() -> None:
    """Wait until every rank of the call has reached this point."""
    _route.for_barrier().barrier()


def isend(x, dest: int, tag: int = 0) -> Handle:
    """Start sending array ``x`` to rank ``dest``; ``wait()`` returns once it is out.
    Do not change ``x`` before that. A device array is copied to the host first and
    arrives as a device array."""
    return _route.host("isend").isend(x, dest, tag)


def send(x, dest: int, tag: int = 0) -> None:
    """Send array ``x`` to rank ``dest`` (matched by ``recv(source, tag)`` there)."""
    isend(x, dest, tag).wait()


def irecv(source: int, tag: int = 0) -> Handle:
    """Receive from rank ``source``; ``wait()`` returns the array."""
    return _route.host("irecv").irecv(source, tag)


def recv(source: int, tag: int = 0) -> np.ndarray:
    """The next array sent to this rank by ``source`` with ``tag``, waiting for it."""
    return irecv(source, tag).wait()
