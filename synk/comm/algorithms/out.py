"""``out=``: a result written into the caller's array, to spare a training loop an
allocation per step. Transports that can write a result in place take the buffer where
``usable`` says it fits; everything else is copied into it by ``deliver``, the one check of
what ``out`` must be."""
from __future__ import annotations

import numpy as np

from ... import _tree


def usable(out, shape, dtype, reads: tuple = (), xp=np) -> bool:
    """Whether a result of ``shape`` and ``dtype`` can be written straight into ``out``, an
    array of ``xp`` (numpy on the host; anything else, a list or a host array for a device
    result, is refused by ``deliver`` afterwards, with the error that says what to pass),
    which must not overlap the host arrays it is computed from, ``reads`` (an allreduce
    into its own input combines the ranks' parts in rank order, for the same bits on every
    rank, so it would overwrite its part before reading it: that one is copied)."""
    return (isinstance(out, xp.ndarray) and tuple(out.shape) == tuple(shape)
            and out.dtype == dtype and out.flags.c_contiguous
            and not any(np.may_share_memory(out, r) for r in reads))


def deliver(result, out, what: str):
    """``result`` in ``out`` (None: the result itself): the same shape and dtype, and on
    the same side (host or device); a structure leaf by leaf into one of the same form."""
    if out is None or result is out:
        return result
    if type(result) is list and type(out) is list and _same_arrays(result, out):
        for r, o in zip(result, out):  # (a model's gradients in place, in short)
            o[...] = r
        return out
    if isinstance(result, (list, tuple, dict)):
        leaves, template = _tree.flatten(result)
        outs, form = _tree.flatten(out)
        if form != template:
            raise ValueError(f"synk.comm.{what}: out= must have the structure of the result "
                             "(the same keys and lengths)")
        return _tree.rebuild(template, iter(
            [deliver(r, o, what) for r, o in zip(leaves, outs)]))
    on_host = isinstance(result, (np.ndarray, np.generic))
    if not hasattr(out, "shape") or isinstance(out, np.ndarray) != on_host:
        raise TypeError(f"synk.comm.{what}: out= must be {'a numpy' if on_host else 'a device'} "
                        f"array, as the result is; got {type(out).__name__}")
    if tuple(out.shape) != tuple(result.shape) or out.dtype != result.dtype:
        raise ValueError(f"synk.comm.{what}: out= must have the result's shape and dtype, "
                         f"{tuple(result.shape)} {result.dtype}; got {tuple(out.shape)} "
                         f"{out.dtype}")
    out[...] = result
    return out


def _same_arrays(results: list, outs: list) -> bool:
    """Whether ``outs`` is a flat list of numpy arrays of ``results``' shapes and dtypes."""
    if len(results) != len(outs):
        return False
    for r, o in zip(results, outs):  # (a loop rather than all(): this runs every step)
        if (type(r) is not np.ndarray or type(o) is not np.ndarray or r.shape != o.shape
                or r.dtype != o.dtype):
            return False
    return True
