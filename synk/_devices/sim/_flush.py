"""CuPy's flush of float32 subnormals to zero (``-ftz=true``), as the simulated CuPy applies
it to its ufuncs, its ``astype`` and the bodies of user kernels.
"""
from __future__ import annotations

from typing import Literal

import numpy as np

FLUSHED = (np.dtype(np.float32), np.dtype(np.complex64))  # (float32, or float32 parts)
_TINY = np.float32(np.finfo(np.float32).tiny)  # (the smallest normal float32)


def _flushed_reals(x: np.ndarray) -> np.ndarray:
    subnormal = (np.abs(x) < _TINY) & (x != 0)
    if not subnormal.any():
        return x
    return np.where(subnormal, np.copysign(np.float32(0), x), x).astype(np.float32)


def flushed(value):
    """``value`` with each subnormal float32 (part) a zero of its sign, as single-precision
    instructions under ``-ftz`` read and write it; other values as they are. CuPy compiles
    every kernel with ``-ftz=true`` (cupy/cuda/compiler.py ``_compile_with_cache_cuda``, v14;
    PTX ISA, "Floating-Point Instructions": ``.ftz`` "flush subnormal inputs and results to
    sign-preserving zero"; the ``cupy.nextafter`` docs; cupy/cupy#8382; seen on an H200 with
    CuPy 14.2). Unflushed: loads, stores and copies, the bits read as integers, float64 (``-ftz``
    is single precision only), float16 (its subnormals are normal float32s), NCCL's reductions,
    the host, and CuPy's reductions (not modelled: many are CUB's, of unknown flags)."""
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype in FLUSHED:
        array = np.asarray(value)
        if array.dtype == np.complex64:
            out = array.copy()
            out.real, out.imag = _flushed_reals(array.real), _flushed_reals(array.imag)
        else:
            out = _flushed_reals(array)
        return out if isinstance(value, np.ndarray) else out[()]
    return value


def converted(values: np.ndarray, dtype, order: Literal["K", "A", "C", "F"] = "K") -> np.ndarray:
    """``values.astype(dtype)`` as a conversion compiled with ``-ftz`` gives it: a float32
    (part) converted to any other type but float32's is flushed first (``cvt.ftz``, and a
    bool is ``x != 0``, ``setp.ftz``); a float64 (part) converted to float32 gives zero for a
    subnormal result."""
    dtype = np.dtype(dtype)
    if values.dtype in FLUSHED and dtype not in FLUSHED:
        values = flushed(values)
    out = values.astype(dtype, order=order, casting="unsafe")
    if dtype in FLUSHED and values.dtype.kind in "fc" and values.dtype.itemsize // (
            2 if values.dtype.kind == "c" else 1) == 8:
        out = flushed(out)
    return out


_PYTHON_NUMBERS = (float, complex)


def _loop_dtype(args, dtype) -> np.dtype | None:
    """The input type of the loop a ufunc runs for ``args`` (``dtype``: its ``dtype=``), as
    numpy's promotion gives it, Python scalars weak (NEP 50, which CuPy follows); None where
    numpy finds none."""
    if dtype is not None:
        return np.dtype(dtype)
    try:
        return np.result_type(*args)
    except (TypeError, ValueError):
        return None


def _scalar_as_read(value, loop: np.dtype):
    """A Python float or complex operand of a float32 (complex64) loop as the kernel reads it:
    stored as the loop's input type (cupy/_core/_kernel.pyx ``set_scalar_dtypes``, by numpy's
    ``PyArray_Pack``: cupy/_core/_scalar.pyx), then flushed; still a Python scalar, so that
    numpy picks the same loop."""
    parts = (value.real, value.imag) if type(value) is complex else (value,)
    if not any(0.0 < abs(p) < _TINY for p in parts):  # (never subnormal as a float32)
        return value
    stored = np.asarray(value, loop)
    read = flushed(stored)[()]
    return complex(read) if type(value) is complex else float(read)


def through(function):
    """``function`` (a numpy ufunc's call) as a CuPy kernel runs it: float32 operands read
    flushed (Python scalars too, as the loop's float32 parameters: ``_scalar_as_read``), a
    float32 result (or ``out``) flushed."""
    def run(*args, **kwargs):
        if any(type(a) in _PYTHON_NUMBERS for a in args):
            loop = _loop_dtype(args, kwargs.get("dtype"))
            if loop in FLUSHED:
                args = tuple(_scalar_as_read(a, loop) if type(a) in _PYTHON_NUMBERS else a
                             for a in args)
        result = function(*[flushed(a) for a in args], **kwargs)
        out = kwargs.get("out")
        if isinstance(out, np.ndarray) and out.dtype in FLUSHED:
            np.copyto(out, flushed(out))
            return out
        if isinstance(result, tuple):
            return tuple(flushed(r) for r in result)
        return flushed(result)
    return run
