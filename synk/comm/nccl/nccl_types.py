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
    """A fresh communicator id (``get_unique_id()``: 128 bytes)."""
    return check_id(nccl_module(xp).get_unique_id())


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
        if x.ndim == 0:  # (a 0-d array's view keeps its itemsize, CuPy's rule as numpy's:
            # one element of a 1-d one)
            return (x.reshape(1).view(real), dtypes[char], 2,
                    lambda r: r.view(x.dtype).reshape(()))
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
    """``native``'s answer for floats under max/min, by synk's rule on every back end (IEEE
    754-2019 maximum/minimum: a NaN wins, -0.0 < +0.0; a NaN result is numpy's quiet NaN,
    ``_QUIET_NAN``). NCCL's ``fmaxf``/``fminf``/``__hmax`` let a NaN lose
    (src/device/reduce_kernel.h, ``FuncMinMax``), so each float goes as its bits made a
    monotonic integer (``_flip``), a NaN as a key beyond every number's (the quiet NaN's for
    max, the lowest integer for min, made the quiet NaN on the way back), reduced exactly.
    float16's key is widened to int32, never through float32 (CUDA's makes a NaN 0x7fff)."""
    size = x.dtype.itemsize
    ints = {2: xp.int16, 4: xp.int32, 8: xp.int64}[size]
    low = (1 << (8 * size - 1)) - 1  # every bit but the sign
    nan = _QUIET_NAN[size]  # (a positive integer: its own key)
    keys = _flip(xp, x.view(ints), low)
    keys = xp.where(xp.isnan(x), ints(nan if op == "max" else -low - 1), keys)
    sent = keys.astype(xp.int32) if size == 2 else keys

    def back(reduced):
        reduced = reduced.astype(ints) if size == 2 else reduced
        if op == "min":
            reduced = xp.where(reduced == ints(-low - 1), ints(nan), reduced)
        return _flip(xp, reduced, low).view(x.dtype)

    return sent, dtypes[np.dtype(sent.dtype).char], sent.size, back


#: The quiet NaN of numpy (``np.nan`` in each float dtype), by item size: its bits
_QUIET_NAN = {2: 0x7E00, 4: 0x7FC00000, 8: 0x7FF8000000000000}


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


def dtype_number(dtype) -> int:
    """``dtype``'s number in the headers the ranks compare: the same for equal dtypes.
    numpy numbers ``np.dtype("q")`` 9 and ``np.dtype("l")`` 7 (``.char`` "q" and "l"),
    though on Linux both are int64 and compare equal (so do "Q" and "L"): the ranks may hold
    either (a worker's copy of a master's "q" array is "l"), and CuPy maps both to
    ``ncclInt64`` (cupyx/distributed/_nccl_comm.py ``_nccl_dtypes``, as ``tables``)."""
    return _NUMBERS.get(dtype, dtype.num)


#: numpy's number of each dtype by dtype, that of the dtype its ``str`` names ("<i8" is "l"
#: on Linux): equal dtypes share one key, so they get one number
_NUMBERS: dict = {np.dtype(c): np.dtype(np.dtype(c).str).num for c in "?bBhHiIlLqQefdgFDG"}


def len_tail(head) -> str:
    """A size header as words: "3 rows of (4,) float32"."""
    ndim = int(head[2])
    tail = tuple(int(d) for d in head[3:3 + max(ndim - 1, 0)])
    names: dict[int, str] = {np.dtype(c).num: np.dtype(c).name for c in "?bBhHiIlLqQefdgFD"}
    return f"{int(head[0])} rows of {tail} {names.get(int(head[1]), f'dtype #{int(head[1])}')}"
