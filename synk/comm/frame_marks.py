"""A host message that carries a framework value (a torch tensor, a JAX array) says so in
its dtype: a record of one field whose name holds the ``Frame`` and, for a tensor that
requires grad, the message's number, under which the gradient comes back. So a receiver that
passed nothing (``recv``, a broadcast's non-root) gets the sender's framework back."""
from __future__ import annotations

import numpy as np

from .._arrays import Frame, host

_MARK = "synk_frame"


def mark(value, frame: Frame, number: int | None = None) -> np.ndarray:
    """``value`` (a native array; a device one is copied to the host) as a marked message."""
    arr = np.asarray(host(value), order="C")  # (ascontiguousarray makes a 0-d array 1-d)
    name = "|".join((_MARK, frame.kind, frame.dtype, frame.device, "1" if frame.grad else "0",
                     "" if number is None else str(number)))
    return arr.view(np.dtype([(name, arr.dtype)]))


def marked(value) -> bool:
    """Whether ``value`` is a message ``mark`` made."""
    names = getattr(getattr(value, "dtype", None), "names", None)
    return names is not None and len(names) == 1 and names[0].startswith(_MARK)


def unmark(value) -> tuple:
    """``(native array, Frame, number or None)`` of a marked message."""
    name = value.dtype.names[0]
    _, kind, dtype, device, grad, number = name.split("|")
    native = value.view(value.dtype[name])
    return native, Frame(kind, dtype, device, grad == "1"), int(number) if number else None


def native_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a marked message's ``Status`` reports: its native array's."""
    names = dtype.names
    if names and len(names) == 1 and names[0].startswith(_MARK):
        return dtype[names[0]]
    return dtype
