"""``out=``: a result written into the caller's array, to spare a training loop an
allocation per step. Transports that can write a result in place take the buffer where
``communicator.usable`` says it fits; everything else is copied into it by ``deliver``, the
one check of what ``out`` must be."""
from __future__ import annotations

import numpy as np

from ... import _tree


def deliver(result, out: _tree.Flat | None, what: str):
    """``result`` in ``out`` (taken apart where the collective took it; None: the result
    itself): the same shape and dtype, and on the same side (host or device); a structure
    leaf by leaf into one of the same form. Returns ``out``'s value."""
    if out is None or result is out.value:
        return result
    if isinstance(result, (list, tuple, dict)):
        return deliver_leaves(*_tree.flatten(result), out, what)
    _leaf(result, out.value, what)
    return out.value


def deliver_leaves(leaves: list, template, out: _tree.Flat, what: str):
    """``deliver`` of a result taken apart already (its ``leaves`` and ``template``)."""
    if template is None:
        _leaf(leaves[0], out.value, what)
        return out.value
    if out.structure != template:
        raise ValueError(f"synk.comm.{what}: out= must have the structure of the result "
                         "(the same keys and lengths)")
    outs = out.leaves
    _check_apart(outs, what)
    if _same_arrays(leaves, outs):  # (a model's gradients, in short)
        for r, o in zip(leaves, outs):
            o[...] = r
    else:
        for r, o in zip(leaves, outs):
            _leaf(r, o, what)
    return out.value


def _leaf(result, out, what: str) -> None:
    """One array's ``deliver``."""
    if result is out:
        return
    on_host = isinstance(result, (np.ndarray, np.generic))
    if not hasattr(out, "shape") or isinstance(out, np.ndarray) != on_host:
        raise TypeError(f"synk.comm.{what}: out= must be {'a numpy' if on_host else 'a device'} "
                        f"array, as the result is; got {type(out).__name__}")
    if tuple(out.shape) != tuple(result.shape) or out.dtype != result.dtype:
        raise ValueError(f"synk.comm.{what}: out= must have the result's shape and dtype, "
                         f"{tuple(result.shape)} {result.dtype}; got {tuple(out.shape)} "
                         f"{out.dtype}")
    out[...] = result


def _same_arrays(results: list, outs: list) -> bool:
    """Whether ``outs`` is a flat list of numpy arrays of ``results``' shapes and dtypes."""
    if len(results) != len(outs):
        return False
    for r, o in zip(results, outs):  # (a loop rather than all(): this runs every step)
        if (type(r) is not np.ndarray or type(o) is not np.ndarray or r.shape != o.shape
                or r.dtype != o.dtype):
            return False
    return True


def _check_apart(outs: list, what: str) -> None:
    """``ValueError`` where two arrays of ``out=`` overlap (one array named twice, or two
    views of the same memory): each leaf's result would overwrite another's, as numpy
    refuses for a ufunc's outputs."""
    pair = overlapping(outs)
    if pair is not None:
        raise ValueError(
            f"synk.comm.{what}: out= names the same memory twice (leaves {pair[0]} "
            f"and {pair[1]} of out overlap), so one leaf's result would overwrite "
            "another's; give each leaf an array of its own")


def overlapping(arrays: list) -> tuple[int, int] | None:
    """The indices of two of ``arrays`` that share memory, or None (byte ranges that meet
    checked by ``np.shares_memory``: strided views may interleave without sharing a byte)."""
    spans = []
    for i, o in enumerate(arrays):
        span = _span(o)
        if span is not None and span[0] < span[1]:
            spans.append((span[0], span[1], i))
    if len(spans) < 2:
        return None
    spans.sort()
    reach, far = spans[0][1], spans[0][2]  # the furthest end so far, and whose it is
    for low, high, i in spans[1:]:
        if low < reach and _shares(arrays[far], arrays[i]):
            return min(far, i), max(far, i)
        if high > reach:
            reach, far = high, i
    return None


def _span(a) -> tuple | None:
    """(first byte, end) of the memory array ``a`` covers, or None where it has no address
    synk can read (numpy's and CuPy's arrays have one)."""
    if isinstance(a, np.ndarray):
        start = a.__array_interface__["data"][0]
    else:
        data = getattr(a, "data", None)
        start = getattr(data, "ptr", None)
        if start is None:
            return None
    low = high = start
    for n, stride in zip(a.shape, a.strides):
        if n == 0:
            return start, start
        if stride < 0:
            low += stride * (n - 1)
        else:
            high += stride * (n - 1)
    return low, high + a.dtype.itemsize


def _shares(a, b) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.shares_memory(a, b))
    return True  # (device arrays whose ranges meet)
