"""Which dtypes a CUDA device holds: CuPy 14.2's rule, written once for the device layer, the
simulator and ``Data.to_device``.
"""
from __future__ import annotations

import numpy as np

CUPY_CHARS = frozenset("?bhilqBHILQefdFD")  # cupy/_core/_dtype.pyx all_type_chars
_WHAT = {"O": "Python objects", "U": "strings", "S": "bytes", "M": "datetimes",
         "m": "timedeltas", "f": "long doubles", "c": "long double complex numbers"}


def refusal(dtype) -> str | None:
    """CuPy's error for a device array of ``dtype`` (its text), or None where CuPy makes one. CuPy
    accepts only types with a C name (cupy/_core/_dtype.pyx ``check_supported_dtype``, called from
    ``ndarray.__init__`` and ``_init_fast``, cupy/_core/core.pyx lines 246 and 297): bool, the
    integers, float16/32/64, complex64/128 (``CUPY_CHARS``), void or structured types without
    objects; no big-endian type. Others raise ``ValueError: Unsupported dtype ...``."""
    dtype = np.dtype(dtype)
    if dtype.byteorder == ">":
        return f"Unsupported dtype {dtype} with big-endian byte-order"
    if dtype.char in CUPY_CHARS:
        return None
    if dtype.kind == "V" and dtype.subdtype is None and dtype.itemsize:
        if dtype.hasobject:
            return (f"Unsupported dtype {dtype} because it contains references which cannot "
                    "be supported by CuPy.\nThis may happen even if a dtype only contains "
                    "basic types if the original array contained e.g. object dtype.")
        return None
    return f"Unsupported dtype {dtype}"


def on_device(dtype) -> np.dtype | None:
    """The dtype a host array of ``dtype`` gets on a device: its own, a big-endian number's
    in native byte order (the same values); None where CuPy holds no such array."""
    dtype = np.dtype(dtype)
    if refusal(dtype) is None:
        return dtype
    native = dtype.newbyteorder("=")
    if dtype.byteorder == ">" and refusal(native) is None:
        return native
    return None


def why_not(dtype) -> str:
    """In words, why a device cannot hold arrays of ``dtype`` (for synk's errors)."""
    dtype = np.dtype(dtype)
    kind = _WHAT.get(dtype.kind, "") if dtype.kind not in "fc" or dtype.char in "gG" else ""
    return (f"CuPy holds no device array of dtype {dtype}"
            + (f" ({kind})" if kind else "") + f": {refusal(dtype)} (cupy/_core/_dtype.pyx)")
