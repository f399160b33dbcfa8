"""float32 arithmetic on device arrays that keeps subnormals, as numpy and NCCL keep them:
synk's own arithmetic on a rank's float32 or complex64 device arrays (a mean's terms, an exact
mean's widening and rounding back) runs in float64 through the kernels here, with numpy's bits
(the other ops on device arrays, scans and the ops NCCL lacks, ``synk._reduction`` runs on the
host).
"""
from __future__ import annotations

import functools

import numpy as np

FLUSHED = (np.dtype(np.float32), np.dtype(np.complex64))  # (float32, or float32 parts)

# float32 v as float64, by its bits where it is subnormal (a ``(double)v`` conversion would
# flush it): its 23 fraction bits times 2**-149, with its sign
_WIDENED = ("((__float_as_uint(v) & 0x7f800000) == 0"
            " ? (double)(__float_as_uint(v) & 0x7fffff)"
            " * ((__float_as_uint(v) >> 31) ? -1.401298464324817e-45 : 1.401298464324817e-45)"
            " : (double)v)")
# float64 r rounded to float32, by its bits where the result is subnormal (below 2**-126,
# where a ``(float)r`` conversion gives zero): |r| in units of 2**-149, rounded to the
# nearest even by rint, with r's sign (a unit count of 2**23 is the smallest normal's bits)
_NARROWED = ("(fabs(r) < 1.1754943508222875e-38"
             " ? __uint_as_float((__double_as_longlong(r) < 0 ? 0x80000000 : 0)"
             " | (unsigned int)rint(fabs(r) * 7.1362384635297994e+44))"
             " : (float)r)")


@functools.cache
def _kernels(xp) -> tuple:
    """(widen, narrow, scale) for the device module ``xp`` (CuPy, or the simulator's): made once per
    module, as CuPy compiles a kernel once (the cache never goes stale: the kernels' code is
    constant). They move a float32 to float64 and back by its bits. One operation on float32 values
    done in float64 and rounded once to float32 is IEEE's float32 operation (float64's 53 bits hold
    a float32 product or sum exactly, or round it harmlessly), so the bits are numpy's."""
    widen = xp.ElementwiseKernel("float32 v", "float64 y", f"y = {_WIDENED};",
                                 "synk_widen_float32")
    narrow = xp.ElementwiseKernel("float64 r", "float32 y", f"y = {_NARROWED};",
                                  "synk_narrow_float64")
    scale = xp.ElementwiseKernel(
        "float32 v, float64 f", "float32 y",
        f"double r = {_WIDENED} * f; y = {_NARROWED};", "synk_scale_float32")
    return widen, narrow, scale


def flushes(xp, dtype) -> bool:
    """Whether ``xp``'s arithmetic on ``dtype`` would flush subnormals: a device module's float32
    and complex64. CuPy compiles every kernel with ``-ftz=true`` (cupy/cuda/compiler.py): its
    float32 arithmetic, comparisons and conversions read a subnormal (below 1.2e-38 in magnitude) as
    zero and write zero for a subnormal result. float64 and integer operations are untouched."""
    return xp is not np and np.dtype(dtype) in FLUSHED


def _as_floats(xp, x):
    """``x`` (float32 or complex64) as a contiguous 1-d float32 array of its parts."""
    flat = xp.ascontiguousarray(x).reshape(-1)
    return flat.view(xp.float32) if flat.dtype == np.complex64 else flat


def widened(xp, x):
    """``x`` (a device array of float32 or complex64) as float64 or complex128, exactly."""
    wide = _kernels(xp)[0](_as_floats(xp, x))
    if x.dtype == np.complex64:
        wide = wide.view(xp.complex128)
    return wide.reshape(x.shape)


def narrowed(xp, r, dtype):
    """``r`` (a device array of float64 or complex128) rounded to ``dtype`` (float32 or
    complex64) as numpy rounds it, subnormal results kept."""
    flat = xp.ascontiguousarray(r).reshape(-1)
    if flat.dtype.kind == "c":
        flat = flat.view(xp.float64)
    out = _kernels(xp)[1](flat)
    if np.dtype(dtype) == np.complex64:
        out = out.view(xp.complex64)
    return out.reshape(r.shape)


def scaled(xp, x, factor: float, out=None):
    """``x * factor`` in ``x``'s dtype (float32 or complex64; ``factor`` a float32's value),
    as numpy's float32 product, subnormals kept; written into ``out`` where given."""
    if x.dtype == np.complex64:  # (a complex product, as numpy's: (a + bi)(f + 0i))
        result = narrowed(xp, widened(xp, x) * np.complex128(factor), x.dtype)
        if out is None:
            return result
        out[...] = result
        return out
    if out is None:
        return _kernels(xp)[2](x, np.float64(factor))
    return _kernels(xp)[2](x, np.float64(factor), out)
