"""The NCCL communicator's reductions with the ops NCCL lacks (bitwise and logical: NCCL has
sum, prod, max and min), written once for allreduce, reduce and reduce_scatter.

::

    every rank's array -> gathered on NCCL (an allgather; to the root for reduce)
      -> combined on the device by ``synk._reduction``'s rule -> numpy's answer
"""
from __future__ import annotations

from ... import _reduction


def _combined(xp, op: str, stacked):
    """``stacked`` (one row per rank, in rank order) combined with ``op`` over its rows."""
    return _reduction.combine(op, [(1, stacked[r]) for r in range(len(stacked))], xp)


def _start_gather_all(comm, x, what: str):
    """(what to wait for, what gives every rank's ``x`` stacked) of an allgather, whose
    exchange of sizes checks that the ranks' shapes and dtypes agree (n times the data of
    NCCL's own reduction)."""
    x = comm.device_array(x, what)
    return comm._start_allgather(x.reshape((1,) + tuple(x.shape)), None)


def start_allreduce(comm, x, op: str):
    """An allreduce of ``x`` with ``op`` on ``comm`` (an ``NcclCommunicator``), launched: (what
    to wait for, what makes the result), as ``nccl_reduce.start_allreduce``."""
    done, gathered = _start_gather_all(comm, x, "allreduce")
    return done, lambda: _combined(comm.xp, op, gathered())


def start_reduce_scatter(comm, x, op: str, bounds):
    """This rank's part of ``x`` (split along axis 0 at ``bounds``) combined with ``op``,
    launched, as ``start_allreduce``."""
    lo, hi = bounds[comm.rank], bounds[comm.rank + 1]
    done, gathered = _start_gather_all(comm, x, "reduce_scatter")
    return done, lambda: _combined(comm.xp, op, gathered()[:, lo:hi])


def reduce(comm, x, op: str, root: int):
    """``x`` (of one shape and dtype on every rank) combined with ``op`` on rank ``root``
    (None elsewhere): gathered to the root, combined there."""
    with comm.scope():
        x = comm.device_array(x, "reduce")
        stacked = comm.gather(x.reshape((1,) + tuple(x.shape)), [1] * comm.size, root,
                              tail=tuple(x.shape), dtype=x.dtype)
        return None if stacked is None else _combined(comm.xp, op, stacked)
