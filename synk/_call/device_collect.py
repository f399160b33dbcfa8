"""Combining the ranks' outputs with the communicator's collectives (GPU groups with an NCCL
communicator: ``combines_outputs = "collectives"``; see ``outputs``).

Every rank calls ``finish`` after its share, inside the call, whether it had rows or not.
The ranks first tell each other, over the host device_comm, what each output is (kind,
shape, dtype) and how many rows each rank processed; every rank then checks the shapes and
plans the same collectives, so they agree without asking the master. Each array output is
then combined on the devices, into rank 0 only:

* ``sum``, ``prod``, ``max``, ``min``, ``mean``: the communicator's ``reduce`` (a rank
  without rows sends the op's identity: 0, 1, the dtype's lowest or highest value), in the
  dtype numpy's combination would give (booleans sum and multiply as integers); a mean is
  weighted by the rows each rank processed, by the rule of every back end
  (``synk._reduction``);
* ``gather``: the communicator's ``gather``, every rank's rows (their counts differ)
  joined on rank 0;
* ops the communicator cannot reduce for a dtype (``supports``; NCCL: the product, maximum
  or minimum of complex numbers, and the bitwise and logical ops): the parts are gathered
  to rank 0 and combined there by numpy's rules.

Only rank 0 copies the combined result to the host, once. Small outputs (up to
``SMALL_OUTPUT_BYTES`` on every rank: a loss, a few metrics) are the exception: each rank
copies its own to the host and sends it with the description the ranks exchange anyway,
and rank 0 combines them there by the CPU backend's rule (``ops.combine_output``), so a
scalar costs no NCCL collective, no kernel and no wait of its own. Outputs with reduce op
None come back from every rank as before.
"""
from __future__ import annotations

import numpy as np

from .. import _reduction
from .._reduction import widest
from ..comm import context as _context
from ..comm.host import host_collectives as _collectives
from . import ops as _ops
from .records import DONE_OUTPUT, Share

#: Outputs up to this size travel to rank 0 with their description and are combined on the
#: host: below it a device collective costs more (its launch, NCCL's latency, the waits)
#: than copying the value out on every rank.
SMALL_OUTPUT_BYTES = 4096


def _meta(device, share: Share | None, ops) -> tuple | None:
    """What this rank's outputs are (kind, shape, dtype and, for a small one, its value on
    the host), for the other ranks."""
    if share is None:
        return None
    outs = tuple(None if op is None else (
        int(kind), tuple(value.shape), value.dtype.str,
        _on_host(device, value) if value.nbytes <= SMALL_OUTPUT_BYTES else None)
        for (kind, value), op in zip(share.outputs, ops))
    return share.weight, share.layout(), outs


def _on_host(device, value) -> np.ndarray:
    return device.to_host(value) if device.is_device_array(value) else np.asarray(value)


def finish(device, context, share: Share | None, reduce, fname: str) -> tuple:
    """(the share to reply with, {output index: combined result} on rank 0 or None), on a
    group of several ranks whose communicator combines outputs with collectives.

    Outputs combined on the devices appear in the reply as ``DONE_OUTPUT``."""
    device_comm = context.device_comm
    ops = None if share is None else _ops.share_ops(reduce, share, fname)
    metas = _collectives.allgather_objects(
        context.mesh, context.rank, context.size, _context.next_tag("synk outputs"),
        _meta(device, share, ops))
    have = [r for r, m in enumerate(metas) if m is not None]
    first = metas[have[0]]
    _ops.check_same_outputs(fname, {r: metas[r][1] for r in have})
    multi, templates, n_outputs = first[1]
    ops = _ops.share_ops(reduce, Share(0, multi, (None,) * n_outputs, templates), fname)
    combined: dict = {}
    on_device = False
    for i, op in enumerate(ops):
        if op is None:
            continue
        described = {r: metas[r][2][i] for r in have}
        _ops.check_shapes(op, {f"rank {r}": d[1] for r, d in described.items()}, i, fname)
        kind = widest([d[0] for d in described.values()])
        if all(d[3] is not None for d in described.values()):  # small everywhere: on the host
            if context.rank == 0:
                combined[i] = _ops.combine_output(
                    op, [(metas[r][0], described[r][3]) for r in have], kind)
            continue
        on_device = True
        mine = None if share is None else share.outputs[i][1]
        result = _combine(device_comm, op, mine, described,
                          {r: metas[r][0] for r in have}, context.size)
        if context.rank == 0:
            host = device.result_to_host(result) if device.is_device_array(result) else result
            combined[i] = host if op == "gather" else _ops.restore_kind(np.asarray(host), kind)
    if on_device:
        device_comm.synchronize()  # the buffers of the combining operations are let go
    if share is not None:
        share = share.replace_outputs(
            DONE_OUTPUT if op is not None else out for out, op in zip(share.outputs, ops))
    return share, (combined if context.rank == 0 else None)


def _combine(comm, op: str, mine, described: dict, weights: dict, size: int):
    """Output ``mine`` (None on a rank without rows) combined over the ranks with the
    communicator's ``reduce`` or ``gather``, on rank 0."""
    xp = comm.xp
    if mine is not None and not comm.device.is_device_array(mine):  # (small here, not
        mine = comm.device.to_device(np.asarray(mine))  # on another rank: on the devices)
    dtypes = [np.dtype(d[2]) for d in described.values()]
    shape = tuple(next(iter(described.values()))[1])
    if op == "gather":
        dtype = np.result_type(*dtypes)
        counts = [(described[r][1][0] if described[r][1] else 1) if r in described else 0
                  for r in range(size)]
        part = None if mine is None else xp.atleast_1d(mine).astype(dtype, copy=False)
        return comm.gather(part, counts, root=0, tail=shape[1:], dtype=dtype)
    dtype = _reduction.result_dtype(op, dtypes)
    if comm.supports(dtype, op):
        part = (xp.full(shape, _reduction.identity(op, dtype), dtype) if mine is None
                else mine.astype(dtype, copy=False))
        if op not in _reduction.MEANS:
            return comm.reduce(part, op, root=0)
        ranks = sorted(described)  # a rank without rows weighs nothing
        factors = dict(zip(ranks, _reduction.weights_of([(weights[r], None) for r in ranks])[0]))
        return comm.reduce(part, op, root=0, weights=[factors.get(r, 0) for r in range(size)])
    # the communicator cannot combine these (NCCL: complex prod/max/min, bitwise, logical):
    # gather the parts
    # and combine them on rank 0, by the rule of every back end
    counts = [1 if r in described else 0 for r in range(size)]
    common = np.result_type(*dtypes)
    part = None if mine is None else mine.astype(common).reshape((1,) + shape)
    stacked = comm.gather(part, counts, root=0, tail=shape, dtype=common)
    if stacked is None:
        return None
    host = comm.to_host(stacked)
    parts = [(weights[r], host[j]) for j, r in enumerate(sorted(described))]
    return np.asarray(_reduction.combine(op, parts))
