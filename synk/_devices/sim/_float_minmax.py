"""CUDA's maximum and minimum of floats, bit for bit, where numpy's differ: the simulated
NCCL's ``ncclMax``/``ncclMin``, the simulated CuPy's ``maximum``, ``minimum``, ``fmax``,
``fmin`` and CUDA C's ``max``/``min`` in kernel bodies. Integers, booleans and complex numbers
are numpy's (CuPy's integer ``max`` is exact; its complex forms are not modelled here)."""
from __future__ import annotations

import functools

import numpy as np

_UINTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
# the NaN of two NaNs under PTX's max/min (see ``_extremum``)
_PTX_NAN = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FFFFFFFFFFFFFFF}
# CuPy's NAN (__int_as_float(0x7fffffff)) converted to each output type
_CUPY_NAN = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FFFFFFFE0000000}


def _nan(bits: dict, dtype: np.dtype):
    return np.array(bits[dtype.itemsize], _UINTS[dtype.itemsize]).view(dtype)[()]


def _floats(result) -> bool:
    return isinstance(result, (np.ndarray, np.generic)) and result.dtype.kind == "f" \
        and result.dtype.itemsize in _UINTS


def _extremum(np_func, is_max: bool, a, b, out=None, **kwargs):
    """``np_func`` (numpy's fmax or fmin) of ``a`` and ``b`` as PTX's ``max``/``min``
    (``max_num``), which CUDA's float max/min functions and ``__hmax``/``__hmin`` are: NaN loses
    to a number, ``+0.0 > -0.0`` (PTX ISA, "Floating Point Instructions: max" and "min"), two
    NaNs give the canonical NaN (cuda_fp16.h ``__hmax``): 0x7fff for float16, 0x7fffffff for
    float32 (CUDA C++ Programming Guide, "Floating-Point Standard"); no source gives float64's,
    0x7fffffffffffffff here. (numpy keeps the second of two zeros and the first of two NaNs.)"""
    x, y = np.asarray(a), np.asarray(b)  # (the masks' only: Python numbers stay weak)
    floats = x.dtype.kind == "f" or y.dtype.kind == "f"
    if floats:  # (before the call: ``out`` may be ``a``)
        zeros = (x == 0) & (y == 0)
        negative = (np.signbit(x) & np.signbit(y)) if is_max else (np.signbit(x) | np.signbit(y))
        both = np.isnan(x) & np.isnan(y)
    with np.errstate(invalid="ignore"):
        result = np_func(a, b, out=out, **kwargs)
    if not floats or not _floats(result):
        return result
    scalar = not isinstance(result, np.ndarray)
    fixed = np.array(result) if scalar else result
    if zeros.any():  # +0.0 > -0.0: max is -0.0 only if both are, min if either is
        zero = np.where(negative, fixed.dtype.type(-0.0), fixed.dtype.type(0.0))
        np.copyto(fixed, zero, where=zeros)
    if both.any():
        np.copyto(fixed, _nan(_PTX_NAN, fixed.dtype), where=both)
    return fixed[()] if scalar else fixed


def fmax(a, b, out=None, **kwargs):
    """CUDA's ``fmaxf``/``fmax``/``__hmax`` (PTX ``max``): NaN loses, +0.0 > -0.0."""
    return _extremum(np.fmax, True, a, b, out, **kwargs)


def fmin(a, b, out=None, **kwargs):
    """CUDA's ``fminf``/``fmin``/``__hmin`` (PTX ``min``): NaN loses, -0.0 < +0.0."""
    return _extremum(np.fmin, False, a, b, out, **kwargs)


def _cupy(np_func, cuda_func, a, b, out=None, **kwargs):
    """CuPy's ``maximum``/``minimum`` (numpy's ``np_func`` for complex numbers) of floats on a
    device, with ``cuda_func`` CUDA's ``fmax`` or ``fmin`` (cupy/_math/misc.py, v14: ``out0 =
    (isnan(in0) | isnan(in1)) ? out0_type(NAN) : out0_type(max(in0, in1))`` with ``NAN``
    defined as ``__int_as_float(0x7fffffff)``): any NaN gives that NaN in the output's type
    (float16 0x7fff, cuda_fp16.hpp ``__internal_float2half``; float64 the float's bits widened,
    0x7fffffffe0000000, as the conversion keeps a NaN's payload: the simulator's reading),
    else CUDA's ``max``/``min`` (+0.0 > -0.0). CuPy's ``fmax``/``fmin`` are CUDA's
    ``fmax``/``fmin``."""
    if np.iscomplexobj(a) or np.iscomplexobj(b):
        return np_func(a, b, out=out, **kwargs)
    x, y = np.asarray(a), np.asarray(b)
    either = (np.isnan(x) | np.isnan(y)) if x.dtype.kind == "f" or y.dtype.kind == "f" \
        else None  # (before the call: ``out`` may be ``a``)
    result = cuda_func(a, b, out=out, **kwargs)
    if either is None or not _floats(result) or not either.any():
        return result
    scalar = not isinstance(result, np.ndarray)
    fixed = np.array(result) if scalar else result
    np.copyto(fixed, _nan(_CUPY_NAN, fixed.dtype), where=either)
    return fixed[()] if scalar else fixed


cupy_maximum = functools.partial(_cupy, np.maximum, fmax)
cupy_minimum = functools.partial(_cupy, np.minimum, fmin)
