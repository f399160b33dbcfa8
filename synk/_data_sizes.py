"""The checks of a ``synk.Data``'s shape, dtype and block size, with the errors that say
what to give instead."""
from __future__ import annotations

import math
import numbers

import numpy as np

from ._wire import shm as _shm


def as_shape(shape) -> tuple:
    """``shape`` as a tuple of ints (an int n means ``(n,)``)."""
    if np.ndim(shape) == 0:
        return (int(shape),)
    return tuple(int(s) for s in shape)


def check_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(
            f"synk.data cannot hold dtype {dtype}: shared memory holds raw bytes, not Python "
            "objects. Use a numeric, bool or fixed-size string dtype"
        )
    return dtype


def nbytes_of(shape: tuple, dtype: np.dtype) -> int:
    """Bytes of an array of ``shape`` and ``dtype``, or ``ValueError`` for a shape that no
    array can have (a negative length, or more bytes than an address can count)."""
    if any(n < 0 for n in shape):
        raise ValueError(f"a synk.Data cannot have the shape {shape}: lengths must be >= 0")
    # as numpy counts: the lengths other than 0 (and the itemsize) must multiply to a size
    need = math.prod(n for n in shape if n) * max(dtype.itemsize, 1)
    if need > _shm.MAX_BYTES:
        raise ValueError(
            f"a synk.Data of shape {shape} and dtype {dtype} is impossible: it would need "
            f"{need:,} bytes, and no array can have more than {_shm.MAX_BYTES:,} (nor any "
            "memory hold them). Use a smaller shape"
        )
    return math.prod(shape) * dtype.itemsize


def block_bytes(nbytes: int, oversize: float) -> int:
    """Block size for ``nbytes`` with ``oversize``, or ``ValueError`` if it is too large to
    be a size at all."""
    if oversize == 1:
        return nbytes
    size = nbytes * oversize  # (a float: inf when it overflows)
    if size > _shm.MAX_BYTES:
        raise ValueError(
            f"oversize={oversize!r} is impossible for {nbytes:,} bytes of data: the block "
            f"would need {size:.3g} bytes, more than any block can have "
            f"({_shm.MAX_BYTES:,}). Use a smaller oversize (about 1 to 2 is usual)"
        )
    return max(nbytes, math.ceil(size))


def check_oversize(oversize) -> float:
    """``oversize`` as a float >= 1, or a clear error."""
    if isinstance(oversize, bool) or not isinstance(oversize, numbers.Real) or not (
        1 <= float(oversize) < math.inf
    ):
        raise ValueError(
            f"oversize must be a finite number >= 1 (the block's size as a multiple of the "
            f"value's bytes), got {oversize!r}"
        )
    return float(oversize)
