"""The NCCL communicator's reductions (allreduce of one array or a fused structure's
buffers, reduce, reduce_scatter), each launched on the communicator's stream.

::

    x -> header posted (nccl_agree) -> a mean's term scaled (_scaled) -> a datatype NCCL
      has (nccl_types.native) -> NCCL -> back to x's dtype; the headers checked
    an op NCCL lacks: gathered, combined on the device (nccl_gathered)
"""
from __future__ import annotations

import numpy as np

from ... import _reduction
from ..._shares import split_bounds
from ..communicator import Packed, usable
from . import nccl_gathered as gathered, nccl_types as types


def _scaled(comm, x, op: str, weights):
    """(A mean's term of ``x`` on this rank, as NCCL sums it; what finishes the sum), by
    ``synk._reduction``'s rule: scaled by ``w / W`` in ``mean_dtype`` so that NCCL moves the
    data's own bytes; an ``exact_mean`` moves float64 terms and divides after."""
    dtype = _reduction.mean_dtype([x.dtype])
    if weights is not None:  # (as the host takes them: relative to the largest where their
        weights, total = _reduction.weights_of([(w, None) for w in weights])  # total is
        # past float64's range)
    if op == "exact_mean":
        weight = 1.0 if weights is None else weights[comm.rank]
        total = float(comm.size) if weights is None else total
        return (_reduction.exact_term(comm.xp, x, weight),
                lambda result: _reduction.exact_finish(result, total, dtype, comm.xp))
    if weights is None:
        factor = 1.0 / comm.size
    else:
        factor = _reduction.factors(weights, total)[comm.rank]
    return (_reduction.scaled(comm.xp, x, factor, dtype),  # (float16's in float32)
            lambda result: result if result.dtype == dtype else result.astype(dtype))


def _gathered(comm, dtype, op: str) -> bool:
    """Whether ``op`` over ``dtype`` is gathered and combined on the device: the ops NCCL
    lacks, and complex prod/max/min (NCCL sums complex numbers as float pairs only)."""
    return op not in types.NATIVE_OPS or (
        np.dtype(dtype).kind == "c" and not comm.supports(dtype, op))


def start_allreduce(comm, x, op: str, weights, out=None):
    """Launch an allreduce of ``x`` on ``comm`` (an ``NcclCommunicator``); (what to wait
    for, what makes the result). Other ops than a mean receive straight into ``out`` where
    it fits."""
    if op == _reduction.SCALED_SUM:  # (a weighted mean's part, scaled by its rank: its
        if weights is not None and weights[comm.rank] != 1:  # factor, where it is not 1)
            x = _reduction.scaled(comm.xp, x, weights[comm.rank], x.dtype)
        op = "sum"
    if _gathered(comm, x.dtype, op):
        return gathered.start_allreduce(comm, x, op)
    if x.size == 0:  # (nothing to send; the result's dtype is the op's, bools sum to ints)
        dtype = _reduction.result_dtype(op, [x.dtype])
        return None, lambda: x.astype(dtype, copy=True)
    mean = op in _reduction.MEANS
    finish = None
    work = x
    if mean:
        work, finish = _scaled(comm, x, op, weights)
    work, datatype, count, back = types.native(comm.xp, comm.dtypes, work,
                                               "sum" if mean else op)
    in_place = not mean and work is x and usable(out, x.shape, x.dtype, xp=comm.xp)
    recv = out if in_place else comm.xp.empty_like(work)
    nop = comm.ops["sum" if mean else op]
    done = comm.launch("allreduce", lambda c, s: c.allReduce(
        work.data.ptr, recv.data.ptr, count, datatype, nop, s), (x, work, recv))
    if finish is None:
        return done, lambda: back(recv)
    return done, lambda: finish(back(recv))


def allreduce(comm, x, op: str, weights=None, out=None, wait: bool = True):
    """``x`` allreduced (``wait=False``: a Handle of it), what the ranks pass checked beside
    the operation."""
    op = _reduction.canonical(op, what="the NCCL communicator")
    with comm.scope():
        x = comm.device_array(x, "allreduce")
        x, verify = comm.agreement.array("allreduce", op, x)
        return comm.ended("allreduce", *start_allreduce(comm, x, op, weights, out), verify,
                          wait)


def allreduce_many(comm, packed: Packed, op: str, agree, wait: bool = True):
    """Each of ``packed.buffers`` allreduced, launched as one NCCL group: one NCCL call per
    dtype, with no round trip before it in the steady state (``nccl_agree``)."""
    with comm.scope():
        weights, verify = comm.agreement.packed(
            packed.head, op, agree, needs_weights=op == "exact_mean" or packed.weighted,
            passed=packed.passed)
        buffers = [comm.device_array(b, "allreduce") for b in packed.buffers]
        started = [start_allreduce(comm, b, op, weights) for b in buffers]  # (in order, on
        # the communicator's stream: the last one's event is after them all)
        finishes = [finish for _, finish in started]
        done = [d for d, _ in started if d is not None]

        return comm.ended("allreduce", done[-1] if done else None,
                          lambda: [finish() for finish in finishes], verify, wait)


def reduce(comm, x, op: str, root: int, weights=None):
    """``x`` combined over every rank with ``op``, on rank ``root`` only (None elsewhere)."""
    op = _reduction.canonical(op, what="the NCCL communicator")
    if not 0 <= root < comm.size:
        raise ValueError(f"root must be a rank, 0..{comm.size - 1}; got {root}")
    if _gathered(comm, x.dtype if hasattr(x, "dtype") else comm.xp.asarray(x).dtype, op):
        return gathered.reduce(comm, x, op, root)
    mean = op in _reduction.MEANS
    with comm.scope():
        x = comm.device_array(x, "reduce")
        term, finish = _scaled(comm, x, op, weights) if mean else (x, None)
        nop_name = "sum" if mean else op
        work, datatype, count, back = types.native(comm.xp, comm.dtypes, term, nop_name)
        mine = comm.rank == root
        recv = comm.xp.empty_like(work) if mine else work
        if count:
            nop = comm.ops[nop_name]
            done = comm.launch("reduce", lambda c, s: c.reduce(
                work.data.ptr, recv.data.ptr, count, datatype, nop, root, s),
                (x, term, work, recv))
            comm.complete("reduce", done)
        if not mine:
            return None
        return back(recv) if finish is None else finish(back(recv))


def start_reduce_scatter(comm, x, op: str, bounds):
    xp, n = comm.xp, comm.size
    if bounds is None:
        bounds = split_bounds(len(x), n)
    if _gathered(comm, x.dtype, op):
        return gathered.start_reduce_scatter(comm, x, op, bounds)
    mean = op in _reduction.MEANS
    work, scale = _scaled(comm, x, op, None) if mean else (x, None)
    rows = max(bounds[r + 1] - bounds[r] for r in range(n))
    if rows * n != len(x):  # uneven shares: pad each to the largest
        padded = xp.zeros((rows * n,) + x.shape[1:], work.dtype)
        for r in range(n):
            lo, hi = bounds[r], bounds[r + 1]
            padded[r * rows:r * rows + hi - lo] = work[lo:hi]
        work = padded
    sendable, datatype, count, back = types.native(xp, comm.dtypes, work,
                                                   "sum" if mean else op)
    per_rank = count // n
    recv = xp.empty(per_rank, sendable.dtype)
    nop = comm.ops["sum" if mean else op]
    done = None
    if per_rank:
        done = comm.launch("reduce_scatter", lambda c, s: c.reduceScatter(
            sendable.data.ptr, recv.data.ptr, per_rank, datatype, nop, s),
            (x, work, sendable, recv))

    def finish():
        mine = bounds[comm.rank + 1] - bounds[comm.rank]
        result = back(recv).reshape((rows,) + x.shape[1:])[:mine]
        return result if scale is None else scale(result)

    return done, finish


def reduce_scatter(comm, x, op: str, bounds=None, wait: bool = True):
    """This rank's part of ``x`` (split at ``bounds``) combined over the ranks with ``op``
    (``wait=False``: a Handle of it), what the ranks pass checked beside the operation."""
    op = _reduction.canonical(op, what="the NCCL communicator")
    with comm.scope():
        x = comm.device_array(x, "reduce_scatter")  # (at least 1-d: checked in synk.comm)
        x, verify = comm.agreement.array("reduce_scatter", op, x)
        return comm.ended("reduce_scatter", *start_reduce_scatter(comm, x, op, bounds), verify,
                          wait)
