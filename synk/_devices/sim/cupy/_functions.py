"""The CuPy functions synk uses (``synk._devices.cuda_api``) that ``_generic`` does not serve
from the wheel's tables as they are: the allocations, ``result_type``, and ``einsum``, whose
argument list is CuPy's documented one (the wheel's is ``(*operands, **kwargs)``)."""
from __future__ import annotations

import numpy as np

from .. import _core
from ._generic import define
from ._ndarray import _new, check_dtype, ndarray, unwrap

einsum = define("cupy.einsum", "(subscripts, *operands, dtype=None, optimize=False)", np.einsum)


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


__all__ = ["einsum", "empty", "empty_like", "result_type"]
