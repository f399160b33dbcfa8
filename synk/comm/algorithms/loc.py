"""``maxloc`` and ``minloc`` (MPI's MAXLOC, MINLOC), written once for every communicator: each
element's largest (smallest) value over the ranks and the lowest rank holding it.

::

    x --over the host: every rank's shape and dtype (checked alike on every rank)
      --an allgather, or a gather to the root--> the ranks' arrays
      --argmax or argmin along the rank axis--> (values, ranks)
"""
from __future__ import annotations

import numpy as np

from ... import _float32_on_device as _device32, _reduction
from ..handle import then
from ..host.host_collectives import check_root


def locate(comm, host, x, op: str, root: int | None = None, wait: bool = True):
    """``(values, ranks)`` of ``x`` over the ranks of ``comm`` (``host``: the call's host
    communicator), on every rank (``root`` None) or on ``root`` only (None elsewhere);
    ``wait=False``: a Handle. ``ranks``: int64, of ``x``'s kind (device arrays on GPUs)."""
    what = "allreduce" if root is None else "reduce"
    if isinstance(x, (list, tuple, dict)):
        raise TypeError(f"synk.comm.{what}: op {op!r} takes one array or number, not a "
                        f"{type(x).__name__}; call it once per array")
    kind = _reduction.kind_of(x)
    x = comm.xp.asarray(x)
    heads = host.allgather_objects((tuple(x.shape), x.dtype.str), what)
    if root is not None:
        check_root(root, len(heads))
    _reduction.check_same(op, {r: (h[0], h[1]) for r, h in enumerate(heads)})
    dtype = np.result_type(*[np.dtype(h[1]) for h in heads])
    _reduction.check_dtype(op, dtype, f"synk.comm.{what}")  # (every rank: the same dtype)
    row = x.astype(dtype, copy=False).reshape((1,) + tuple(x.shape))
    ones = [1] * len(heads)
    if root is None:
        gathered = (comm.allgather if wait else comm.iallgather)(row, ones)
    else:
        gathered = (comm.gather if wait else comm.igather)(row, ones, root, tail=x.shape,
                                                           dtype=dtype)
    return then(gathered, lambda stacked: None if stacked is None else pick(
        comm.xp, stacked, op, kind), wait)


def pick(xp, stacked, op: str, kind: int) -> tuple:
    """``(values, ranks)`` of ``op`` over ``stacked`` (rank r's array at ``stacked[r]``):
    the first position wins a tie, so the lowest rank. float32 and complex64 device arrays
    are compared on the host, where their subnormals are not read as zeros (CuPy's
    ``-ftz``)."""
    on = np if _device32.flushes(xp, stacked.dtype) else xp  # (where it is compared)
    if on is not xp:
        stacked = xp.asnumpy(stacked)
    pick_at, best = (on.argmax, on.max) if op == "maxloc" else (on.argmin, on.min)
    values = xp.asarray(best(stacked, axis=0))
    ranks = xp.asarray(pick_at(stacked, axis=0)).astype(xp.int64)
    return _reduction.restore_kind(values, kind), _reduction.restore_kind(ranks, kind)
