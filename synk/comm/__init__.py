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
from . import _alltoall, _fused, _rooted, _route
from ._context import require as _require
from ._handle import Handle

__all__ = [
    "rank", "size", "allreduce", "broadcast", "allgather", "reduce_scatter", "send", "recv",
    "iallreduce", "ibroadcast", "iallgather", "ireduce_scatter", "isend", "irecv", "barrier",
    "reduce", "ireduce", "gather", "igather", "scatter", "iscatter",
    "alltoall", "ialltoall", "scan", "iscan", "exscan", "iexscan",
    "broadcast_object", "allgather_object", "gather_object", "scatter_object",
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


def reduce_scatter(x, op: str = "sum", counts=None) -> np.ndarray:
    """Split ``x`` along axis 0 into one part per rank; rank r gets part r combined over
    every rank with ``op``. ``counts``: each rank's rows (MPI's ``recvcounts``: the same
    list on every rank, adding up to ``len(x)``); by default split as synk splits rows.
    ``x`` must be numeric (as for ``allreduce``), else TypeError."""
    op = canonical(op)
    communicator = _route.numbers(x, "reduce_scatter")  # (its dtype first: numbers)
    return communicator.reduce_scatter(x, op, _rows_of(x, counts, "reduce_scatter"))


def ireduce_scatter(x, op: str = "sum", counts=None) -> Handle:
    """Non-blocking ``reduce_scatter``; ``wait()`` returns the result."""
    op = canonical(op)
    communicator = _route.numbers(x, "ireduce_scatter")  # (its dtype first: numbers)
    return communicator.ireduce_scatter(x, op, _rows_of(x, counts, "ireduce_scatter"))


def _rows_of(x, counts, what: str) -> list | None:
    """The one check, for every communicator, that ``x`` has an axis 0 to split, and the
    part boundaries of ``counts`` (None: synk's split), agreed by every rank."""
    if (x.ndim if hasattr(x, "ndim") else np.ndim(x)) == 0:  # (device arrays: their own)
        raise ValueError(f"synk.comm.{what} splits x along axis 0, so x needs at least 1 "
                         "dimension (got a 0-d value); reshape it, e.g. x.reshape(1)")
    if counts is None:
        return None
    bounds = _alltoall.split_rows(x, counts, size(), what)
    said = _route.host(what).allgather_objects(bounds, what)
    if any(b != bounds for b in said):
        listing = ", ".join(f"rank {r}: {np.diff(b).tolist()}" for r, b in enumerate(said))
        raise ValueError(f"synk.comm.{what}: the ranks passed different counts ({listing}); "
                         "pass the same list on every rank")
    return bounds


def alltoall(x, counts=None):
    """Rank r's part for rank p, on rank p, for every r and p: the pattern of sharded and
    expert-parallel models. ``x`` is a list of one array per rank (shapes and lengths may
    differ: MPI's ``Alltoallv``) and the result the list of what each rank sent this one, in
    rank order; or ``x`` is an array, split along axis 0 into one part per rank by
    ``counts`` (rows to each rank; by default as synk splits rows), and the result the rows
    received joined in rank order (torch.distributed's ``all_to_all_single``). Device
    arrays travel on NCCL (one group of sends and receives) and arrive as device arrays.

    Raises:
        ValueError: a list of another length, ``counts`` that do not add up to ``len(x)``,
            or ranks that pass different forms; on every rank.
    """
    return _alltoall.alltoall(x, counts)


def ialltoall(x, counts=None) -> Handle:
    """Non-blocking ``alltoall``; ``wait()`` returns the result."""
    return _alltoall.alltoall(x, counts, wait=False)


def scan(x, op: str = "sum"):
    """``x`` combined with ``op`` over ranks 0 to r, on each rank r (an inclusive prefix
    reduction: MPI's ``Scan``). Ops, dtypes and shapes as ``allreduce``'s (no weights)."""
    return _alltoall.scan(x, canonical(op), exclusive=False)


def iscan(x, op: str = "sum") -> Handle:
    """Non-blocking ``scan``; ``wait()`` returns the result."""
    return _alltoall.scan(x, canonical(op), exclusive=False, wait=False)


def exscan(x, op: str = "sum"):
    """``x`` combined with ``op`` over ranks 0 to r - 1, on each rank r, and None on rank 0
    (an exclusive prefix reduction: MPI's ``Exscan``)."""
    return _alltoall.scan(x, canonical(op), exclusive=True)


def iexscan(x, op: str = "sum") -> Handle:
    """Non-blocking ``exscan``; ``wait()`` returns the result."""
    return _alltoall.scan(x, canonical(op), exclusive=True, wait=False)


def reduce(x: Any, op: str = "sum", root: int = 0, *, weight: float | None = None) -> Any:
    """``x`` combined over every rank with ``op`` (as ``allreduce``: ops, ``weight=`` of a
    mean, dtypes), on rank ``root`` only; the other ranks get None. MPI's ``Reduce``,
    torch.distributed's ``reduce``. A device array is reduced on NCCL.

    Raises:
        ValueError: the ranks' shapes differ, ``root`` is not a rank, or weights are given
            on some ranks only; on every rank.
    """
    op = canonical(op)
    return _rooted.reduce(x, op, root, _fused.check_weight(weight, op))


def ireduce(x: Any, op: str = "sum", root: int = 0, *, weight: float | None = None) -> Handle:
    """Non-blocking ``reduce``; ``wait()`` returns the result (None off the root)."""
    op = canonical(op)
    return _rooted.reduce(x, op, root, _fused.check_weight(weight, op), wait=False)


def gather(x, root: int = 0):
    """Every rank's ``x`` joined along axis 0 in rank order, on rank ``root`` only (the
    others get None). Lengths may differ (MPI's ``Gatherv``); 0-d values are one row each;
    the other dimensions must agree, on every rank. torch.distributed's ``gather`` gives a
    list: ``np.split`` this at the ranks' lengths for one."""
    return _rooted.gather(x, root)


def igather(x, root: int = 0) -> Handle:
    """Non-blocking ``gather``; ``wait()`` returns the result (None off the root)."""
    return _rooted.gather(x, root, wait=False)


def scatter(chunks, root: int = 0):
    """Rank ``root``'s ``chunks[r]`` on each rank r: the root passes a list of one array
    per rank (their shapes may differ: MPI's ``Scatterv``), the others pass None. Device
    arrays at the root arrive as device arrays. torch.distributed's ``scatter``."""
    return _rooted.scatter(chunks, root)


def iscatter(chunks, root: int = 0) -> Handle:
    """Non-blocking ``scatter``; ``wait()`` returns this rank's chunk."""
    return _rooted.scatter(chunks, root, wait=False)


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """Rank ``root``'s Python object (pickled) on every rank: metadata, shapes, dicts.
    mpi4py's ``bcast``, torch.distributed's ``broadcast_object_list``."""
    return _rooted.broadcast_object(obj, root)


def allgather_object(obj: Any) -> list:
    """Every rank's Python object (pickled), in rank order, on every rank. mpi4py's
    ``allgather``."""
    return _rooted.allgather_object(obj)


def gather_object(obj: Any, root: int = 0) -> list | None:
    """Every rank's Python object, in rank order, on rank ``root`` (None elsewhere).
    mpi4py's ``gather``."""
    return _rooted.gather_object(obj, root)


def scatter_object(objs, root: int = 0) -> Any:
    """Rank ``root``'s ``objs[r]`` (a list of one object per rank; None elsewhere) on each
    rank r. mpi4py's ``scatter``."""
    return _rooted.scatter_object(objs, root)


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
