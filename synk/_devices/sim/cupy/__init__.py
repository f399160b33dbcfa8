"""The CUDA simulator's stand-in for the ``cupy`` module (see ``synk._devices.sim``): device
arrays (``ndarray``) in simulated device memory, and math on them run as numpy "kernels" on
the current device and stream, refusing host arrays and arrays of another device as CuPy
does. A name not defined here or in ``_functions`` (the modelled user kernels, the
allocations) comes from ``__getattr__`` (``_generic``) with CuPy 14's argument list; the
contract tests check both against the real library."""
from __future__ import annotations

import numpy as _np
from numpy import (
    bool_,
    complex64,
    complex128,
    dtype,
    e,
    float16,
    float32,
    float64,
    inf,
    int8,
    int16,
    int32,
    int64,
    nan,
    newaxis,
    pi,
    uint8,
    uint16,
    uint32,
    uint64,
)

from ... import cuda_api as _cuda_api
from .. import _core
from . import _functions, _ufuncs, cuda, fft, linalg, random
from ._functions import *  # noqa: F401,F403
from ._generic import IndexTrick as _IndexTrick, attribute as _attribute, vectorize
from ._kernels import ElementwiseKernel, ReductionKernel, fuse
from ._ndarray import _from_host, _new, kernel as _kernel, ndarray
from ._ufuncs import *  # noqa: F401,F403

r_, c_ = _IndexTrick(_np.r_), _IndexTrick(_np.c_)
mgrid, ogrid = _IndexTrick(_np.mgrid), _IndexTrick(_np.ogrid)


def __getattr__(name: str):
    """Every other name CuPy 14 has (``_generic``): numpy's function of that name as a
    kernel, numpy's object, or ``NotModelled`` when used; AttributeError for a name CuPy
    lacks."""
    return _attribute("cupy", name, globals())


def is_available():
    """Whether a (simulated) CUDA device can be used."""
    return bool(_core.visible())


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    """``a`` as a device array on the current device: host data is copied to the device on
    the current stream; a device array of the current device is returned as it is."""
    if isinstance(a, ndarray):
        if a._alloc.device != _core.current_device():
            return _peer_copy(a).astype(dtype or a.dtype, copy=False)
        if dtype is not None and _np.dtype(dtype) != a.dtype:
            return a.astype(dtype)
        return a.copy() if copy else a
    if copy is False:
        raise ValueError("Unable to avoid copy while creating an array as requested.")
    host = _np.asarray(a, dtype=dtype, order=order)
    out = _new(host.shape, host.dtype)
    _from_host(out, host if host.flags.c_contiguous else _np.ascontiguousarray(host),
               cuda._stream_state(None))
    return out


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    """A device array from ``obj`` (host data or a device array), copied by default."""
    if isinstance(obj, ndarray):
        out = asarray(obj, dtype=dtype, copy=copy)
    else:
        out = asarray(_np.array(obj, dtype=dtype, order=order, ndmin=ndmin))
    if ndmin > out.ndim:
        out = out.reshape((1,) * (ndmin - out.ndim) + out.shape)
    return out


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """``a`` on the host: a device array is copied on ``stream``; host data is returned."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    if out is not None:
        out[...] = a
        return out
    return _np.asarray(a, order=order)


def get_array_module(*args):
    """This module if any argument is a simulated device array, else numpy."""
    import sys

    for arg in args:
        if isinstance(arg, ndarray):
            return sys.modules[__name__]
    return _np


def _peer_copy(a: ndarray) -> ndarray:
    """A copy of ``a`` (on another device) onto the current device and stream, as CuPy's
    peer copy."""
    with cuda.Device(a._alloc.device):
        host = a.get()
    return _kernel(lambda: host)  # device-to-device: written by work on the current stream


def get_default_memory_pool():
    """The memory pool every device array comes from (see ``cuda.MemoryPool``)."""
    return cuda._DEFAULT_POOL


# the other functions synk uses (``cuda_api``): served by ``__getattr__``, listed for ``import *``
_SERVED = [name for name in _cuda_api.NAMES["cupy"] if name not in globals()]
__all__ = ["ElementwiseKernel", "ReductionKernel", "fuse", "vectorize", "r_", "c_", "mgrid",
           "ogrid", "is_available", "fft", "ndarray", "asarray", "array", "asnumpy",
           "get_array_module", "get_default_memory_pool", "cuda", "random",
           "linalg", "bool_", "complex64", "complex128", "dtype", "e", "float16", "float32",
           "float64", "inf", "int8", "int16", "int32", "int64", "nan", "newaxis", "pi", "uint8",
           "uint16", "uint32", "uint64", *_functions.__all__, *_SERVED,
           *_ufuncs.__all__]
__all__.remove("ufunc")
#: what the simulator models of CuPy for user code, beyond the names synk uses (checked
#: against CuPy by the contract tests too)
MODELLED = tuple(__all__[:10])
