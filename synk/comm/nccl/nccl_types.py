"""What the NCCL communicator sends: its dtype and op tables (cupyx.distributed's), how a dtype
NCCL lacks travels, and the communicator id."""
from __future__ import annotations

import numpy as np

from ..._devices.cuda_api import nccl_module

ID_BYTES = 128


def tables(nccl) -> tuple[dict, dict]:
    """(numpy dtype char -> NCCL datatype, op name -> NCCL op), as cupyx.distributed keeps
    them; complex types count two elements per value."""
    dtypes = {"b": nccl.NCCL_INT8, "B": nccl.NCCL_UINT8, "i": nccl.NCCL_INT32,
              "I": nccl.NCCL_UINT32, "l": nccl.NCCL_INT64, "L": nccl.NCCL_UINT64,
              "q": nccl.NCCL_INT64, "Q": nccl.NCCL_UINT64, "e": nccl.NCCL_FLOAT16,
              "f": nccl.NCCL_FLOAT32, "d": nccl.NCCL_FLOAT64, "F": nccl.NCCL_FLOAT32,
              "D": nccl.NCCL_FLOAT64}
    ops = {"sum": nccl.NCCL_SUM, "prod": nccl.NCCL_PROD, "max": nccl.NCCL_MAX,
           "min": nccl.NCCL_MIN}
    return dtypes, ops


def make_id(xp) -> bytes:
    """A fresh communicator id (``get_unique_id()``: 128 bytes in CuPy >= 14; older CuPy
    gave a tuple of 128 signed chars, converted here)."""
    uid = nccl_module(xp).get_unique_id()
    if not isinstance(uid, bytes):
        uid = bytes(b & 0xFF for b in uid)
    return check_id(uid)


def check_id(comm_id) -> bytes:
    if not isinstance(comm_id, bytes) or len(comm_id) != ID_BYTES:
        raise ValueError(f"an NCCL unique id is {ID_BYTES} bytes, got {type(comm_id).__name__} "
                         f"of length {len(comm_id) if hasattr(comm_id, '__len__') else '?'}")
    return comm_id


def native(xp, dtypes: dict, x, op: str):
    """(array NCCL can reduce, its datatype, element count, back to x's dtype) for ``x``
    reduced with ``op``: complex as pairs of floats (sum only), int16/uint16 through
    int32/uint32, bool as uint8 for max/min and int64 for sum/prod (numpy counts Trues),
    floats under max/min as ordered integer keys (``nan_first_keys``)."""
    char = x.dtype.char
    if op in ("max", "min") and char in "efd":
        return nan_first_keys(xp, dtypes, x, op)
    if char in "FD":
        if op != "sum":
            raise TypeError(f"NCCL reduces complex arrays by sum (and mean) only, not {op!r}")
        real = np.float32 if char == "F" else np.float64
        return x.view(real), dtypes[char], 2 * x.size, lambda r: r.view(x.dtype)
    if char in dtypes:
        return x, dtypes[char], x.size, lambda r: r
    if char in "hH":
        wide = xp.int32 if char == "h" else xp.uint32
        return (x.astype(wide), dtypes[np.dtype(wide).char], x.size,
                lambda r: r.astype(x.dtype))
    if char == "?":
        if op in ("max", "min"):
            return x.astype(xp.uint8), dtypes["B"], x.size, lambda r: r.astype(xp.bool_)
        return x.astype(xp.int64), dtypes["l"], x.size, lambda r: r
    raise TypeError(f"NCCL has no datatype for {x.dtype}: cast to float32/float64 or an "
                    "int32/int64 type first")


def nan_first_keys(xp, dtypes: dict, x, op: str):
    """``native``'s answer for floats under max/min, so that NaN wins as in numpy.

    NCCL reduces floats with ``fmaxf``/``fminf``/``__hmax`` (src/device/reduce_kernel.h,
    ``FuncMinMax``): IEEE maxNum, which drops NaN, where numpy's maximum propagates it. So
    each float goes as the integer of its bits made monotonic (a negative float's bits with
    every bit but the sign flipped: -inf < ... < -0 < +0 < ... < +inf), NaN first made the
    NaN that sorts beyond every number (positive for max, negative for min); NCCL's integer
    max/min is exact, and the same map undoes itself. Same bytes, same collective; float16
    goes as float32 (NCCL has no 16-bit integers)."""
    wide = x.astype(xp.float32) if x.dtype.char == "e" else x
    ints, bits_of = (xp.int32, 32) if wide.dtype.itemsize == 4 else (xp.int64, 64)
    low = (1 << (bits_of - 1)) - 1  # every bit but the sign
    # a quiet NaN, positive (above +inf's key) for max, negative (below -inf's) for min
    if bits_of == 64:
        nan = 0x7FF8000000000000 if op == "max" else -0x0008000000000000
    else:
        nan = 0x7FC00000 if op == "max" else -0x00400000
    bits = xp.where(xp.isnan(wide), ints(nan), wide.view(ints))
    keys = _flip(xp, bits, low)

    def back(reduced):
        values = _flip(xp, reduced, low).view(wide.dtype)
        return values.astype(x.dtype) if values.dtype != x.dtype else values

    return keys, dtypes[np.dtype(ints).char], keys.size, back


def _flip(xp, bits, low: int):
    """Float bits <-> ordered integer keys (the map is its own inverse)."""
    return xp.where(bits < 0, xp.bitwise_xor(bits, bits.dtype.type(low)), bits)


#: The ops NCCL reduces itself (a mean as a sum); the others (bitwise, logical) are gathered
#: and combined on the device (``_nccl_gathered``).
NATIVE_OPS = ("sum", "prod", "max", "min", "mean", "exact_mean")


def can_reduce(dtypes: dict, dtype, op: str) -> bool:
    """Whether ``native`` takes ``dtype`` with ``op``: whether NCCL reduces it itself."""
    if op not in NATIVE_OPS:
        return False
    char = np.dtype(dtype).char
    if char in "FD":
        return op in ("sum", "mean", "exact_mean")
    return char in dtypes or char in "hH?"


def len_tail(head) -> str:
    """A size header as words: "3 rows of (4,) float32"."""
    ndim = int(head[2])
    tail = tuple(int(d) for d in head[3:3 + max(ndim - 1, 0)])
    names: dict[int, str] = {np.dtype(c).num: np.dtype(c).name for c in "?bBhHiIlLqQefdgFD"}
    return f"{int(head[0])} rows of {tail} {names.get(int(head[1]), f'dtype #{int(head[1])}')}"
