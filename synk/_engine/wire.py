"""How arrays travel inside control messages: by name when they are in shared memory,
as raw bytes when they are small. Both stand-ins turn into plain numpy arrays when the
receiving process unpickles them, and both pickle much faster than an ndarray does.
"""
from __future__ import annotations

import numpy as np

from .shm import ATTACHED

INLINE_BYTES = 64 * 1024  # arrays up to this size may travel as bytes


class SharedArray:
    """An array in a shared-memory block; the receiver maps the block (cached by name)."""

    __slots__ = ("name", "shape", "dtype", "offset")

    def __init__(self, name: str, shape, dtype, offset: int = 0) -> None:
        self.name, self.shape, self.dtype, self.offset = name, shape, dtype, offset

    def __reduce__(self):
        return _attach, (self.name, self.shape, self.dtype, self.offset)


def _attach(name: str, shape, dtype, offset: int) -> np.ndarray:
    return ATTACHED.array(name, shape, dtype, offset)


class InlineArray:
    """A small array sent as its bytes; the receiver gets a writable copy."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self):
        a = self.array
        return _rebuild, (a.tobytes(), a.dtype.str, a.shape)


def _rebuild(data: bytes, dtype: str, shape) -> np.ndarray:
    return np.frombuffer(bytearray(data), dtype).reshape(shape)


def wrap(value):
    """``value`` ready to pickle: small plain numeric arrays as InlineArray, else unchanged."""
    if (
        type(value) is np.ndarray
        and value.nbytes <= INLINE_BYTES
        and not value.dtype.hasobject
        and value.dtype.names is None
    ):
        return InlineArray(value)
    return value
