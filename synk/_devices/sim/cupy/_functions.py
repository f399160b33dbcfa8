"""Simulated CuPy functions that synk itself uses (``synk._devices.cuda_api``): each has
CuPy 14's argument list (checked against the real library by the contract tests) and runs
numpy's function of the same name as a kernel on the current device and stream, by the
general mechanism every other CuPy name goes through (``_generic``)."""
from __future__ import annotations

import numpy as np

from .. import _core
from ._generic import define
from ._ndarray import _new, check_dtype, ndarray, unwrap

# name -> CuPy 14's argument list (see _generic.define for how it goes to numpy's function)
SIGNATURES = {
    "ascontiguousarray": "(a, dtype=None)",
    "asfortranarray": "(a, dtype=None)",
    "zeros": "(shape, dtype=float, order='C')",
    "ones": "(shape, dtype=float, order='C')",
    "empty": "(shape, dtype=float, order='C')",
    "full": "(shape, fill_value, dtype=None, order='C')",
    "zeros_like": "(a, dtype=None, order='K', subok=None, shape=None)",
    "ones_like": "(a, dtype=None, order='K', subok=None, shape=None)",
    "empty_like": "(prototype, dtype=None, order='K', subok=None, shape=None)",
    "full_like": "(a, fill_value, dtype=None, order='K', subok=None, shape=None)",
    "arange": "(start, stop=None, step=1, dtype=None)",
    "linspace": "(start, stop, num=50, endpoint=True, retstep=False, dtype=None, axis=0)",
    "eye": "(N, M=None, k=0, dtype=float, order='C')",
    "identity": "(n, dtype=float)",
    "copy": "(a, order='K')",
    "concatenate": "(tup, axis=0, out=None, *, dtype=None, casting='same_kind')",
    "stack": "(tup, axis=0, out=None, *, dtype=None, casting='same_kind')",
    "vstack": "(tup, *, dtype=None, casting='same_kind')",
    "hstack": "(tup, *, dtype=None, casting='same_kind')",
    "reshape": "(a, newshape, order='C', *, copy=None)",
    "transpose": "(a, axes=None)",
    "ravel": "(a, order='C')",
    "squeeze": "(a, axis=None)",
    "expand_dims": "(a, axis)",
    "split": "(ary, indices_or_sections, axis=0)",
    "array_split": "(ary, indices_or_sections, axis=0)",
    "tile": "(A, reps)",
    "repeat": "(a, repeats, axis=None)",
    "flip": "(a, axis=None)",
    "broadcast_to": "(array, shape)",
    "moveaxis": "(a, source, destination)",
    "swapaxes": "(a, axis1, axis2)",
    "atleast_1d": "(*arys)",
    "atleast_2d": "(*arys)",
    "roll": "(a, shift, axis=None)",
    "take": "(a, indices, axis=None, out=None)",
    "where": "(condition, x=None, y=None)",
    "clip": "(a, a_min, a_max, out=None)",
    "sort": "(a, axis=-1, kind=None)",
    "argsort": "(a, axis=-1, kind=None)",
    "nonzero": "(a)",
    "diag": "(v, k=0)",
    "tril": "(m, k=0)",
    "triu": "(m, k=0)",
    "sum": "(a, axis=None, dtype=None, out=None, keepdims=False)",
    "mean": "(a, axis=None, dtype=None, out=None, keepdims=False)",
    "prod": "(a, axis=None, dtype=None, out=None, keepdims=False)",
    "max": "(a, axis=None, out=None, keepdims=False)",
    "min": "(a, axis=None, out=None, keepdims=False)",
    "amax": "(a, axis=None, out=None, keepdims=False)",
    "amin": "(a, axis=None, out=None, keepdims=False)",
    "argmax": "(a, axis=None, dtype=None, out=None, keepdims=False)",
    "argmin": "(a, axis=None, dtype=None, out=None, keepdims=False)",
    "std": "(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False)",
    "var": "(a, axis=None, dtype=None, out=None, ddof=0, keepdims=False)",
    "cumsum": "(a, axis=None, dtype=None, out=None)",
    "cumprod": "(a, axis=None, dtype=None, out=None)",
    "any": "(a, axis=None, out=None, keepdims=False)",
    "all": "(a, axis=None, out=None, keepdims=False)",
    "count_nonzero": "(a, axis=None)",
    "dot": "(a, b, out=None)",
    "vdot": "(a, b)",
    "inner": "(a, b)",
    "outer": "(a, b, out=None)",
    "tensordot": "(a, b, axes=2)",
    "einsum": "(subscripts, *operands, dtype=None, optimize=False)",
    "trace": "(a, offset=0, axis1=0, axis2=1, dtype=None, out=None)",
    "isclose": "(a, b, rtol=1e-05, atol=1e-08, equal_nan=False)",
    "allclose": "(a, b, rtol=1e-05, atol=1e-08, equal_nan=False)",
    "array_equal": "(a1, a2, equal_nan=False)",
    "average": "(a, axis=None, weights=None, returned=False, *, keepdims=False)",
    "round": "(a, decimals=0, out=None)",
    "around": "(a, decimals=0, out=None)",
}
# numpy's function where the name differs, or where numpy returns a Python scalar and CuPy
# a 0-d device array.
_NUMPY = {"amax": np.max, "amin": np.min,
          # CuPy's take wraps out-of-bounds indices, a scalar one included (cupy/_core/
          # _routines_indexing.pyx ``_take_kernel_core``; cupy/_indexing/indexing.py: "This
          # function does not support ``mode`` option"): numpy's mode "wrap"
          "take": lambda a, indices, axis=None, out=None: np.take(a, indices, axis, out,
                                                                  mode="wrap"),
          "allclose": lambda *a, **k: np.asarray(np.allclose(*a, **k)),
          "array_equal": lambda *a, **k: np.asarray(np.array_equal(*a, **k))}
_ALLOCATING = ("empty", "empty_like")  # uninitialised memory (see _memory: fresh is poisoned)

for _name, _sig in SIGNATURES.items():
    if _name not in _ALLOCATING:  # (the general mechanism: see _generic)
        globals()[_name] = define(f"cupy.{_name}", _sig, _NUMPY.get(_name) or getattr(np, _name))


def _allocate(template: np.ndarray) -> ndarray:
    """Device memory shaped as ``template``, from the pool: no kernel, nothing written on any
    stream (fresh memory holds the poison pattern, reused memory what its last owner left)."""
    order = "F" if template.flags.f_contiguous and not template.flags.c_contiguous else "C"
    return _new(template.shape, template.dtype, order)


def empty(shape, dtype=float, order="C"):
    """Simulated ``cupy.empty``: uninitialised device memory on the current device. The
    dtype is checked as given (numpy would expand a subarray dtype, which CuPy refuses)."""
    return _allocate(np.empty(shape, check_dtype(dtype), order))


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    """Simulated ``cupy.empty_like``: uninitialised device memory shaped as ``prototype``."""
    if subok is not None:
        raise _core.not_modelled("cupy.empty_like(subok=...)")
    template = np.empty_like(unwrap(prototype, [], host_ok=True), dtype, order, shape=shape)
    return _allocate(template)


def result_type(*arrays_and_dtypes):
    """``numpy.result_type`` over arrays (device or host) and dtypes."""
    return np.result_type(*[a.dtype if isinstance(a, ndarray) else a for a in arrays_and_dtypes])


__all__ = [*SIGNATURES, "result_type"]
