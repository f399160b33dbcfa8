"""The simulated ``cupy.ndarray``: numpy data in simulated device memory, strict about
where it lives and which stream touches it."""
from __future__ import annotations

from typing import Literal

import numpy as np

from ... import device_dtypes
from .. import _core, _flush, _memory
from .._core import LOCK
from .._memory import Allocation

_IMPLICIT = ("Implicit conversion to a NumPy array is not allowed. "
             "Please use `.get()` to construct a NumPy array explicitly.")


def _other_device(device: int) -> ValueError:
    return ValueError(
        f"The device where the array resides ({device}) is different from the current "
        f"device ({_core.current_device()}). Peer access is unavailable between these devices.")


def unwrap(value, reads: list, *, host_ok: bool = False):
    """``value`` with simulated arrays replaced by their numpy views (their memory added to
    ``reads``); numpy arrays raise as CuPy's kernels do unless ``host_ok``."""
    if isinstance(value, ndarray):
        alloc = value._alloc
        if alloc.device != _core.current_device():
            raise _other_device(alloc.device)
        _check_aligned(value)
        reads.append(alloc)
        return value._a
    if isinstance(value, np.ndarray):
        if host_ok:
            return value
        raise TypeError(f"Unsupported type {type(value)}")
    if isinstance(value, (list, tuple)):
        return type(value)(unwrap(v, reads, host_ok=host_ok) for v in value)
    if isinstance(value, dict):
        return {k: unwrap(v, reads, host_ok=host_ok) for k, v in value.items()}
    return value


def _check_aligned(value: ndarray) -> None:
    """cudaErrorMisalignedAddress (716), a sticky error, where a kernel reads or writes an element
    at an address that is not a multiple of its size (CUDA C++ Programming Guide, "Device Memory
    Accesses": naturally aligned words of 1 to 16 bytes; CUDA Runtime API: "any further CUDA
    work will return the same error"). CuPy loads through typed pointers
    (cupy/_core/include/cupy/carray.cuh) and its views check no alignment: a float64 view of a
    uint8 buffer at byte 25 fails the next kernel that reads it (seen on an H200, CuPy 14.2)."""
    itemsize = value._a.itemsize
    if itemsize not in (2, 4, 8, 16) or value._a.size == 0:
        return
    offset = _core.host_ptr(value._a) - value._alloc.host_ptr  # (allocations: 256-aligned)
    if offset % itemsize:
        _core.set_sticky(value._alloc.device, 716)


def launch(reads=(), writes=()) -> tuple:
    """Launch a kernel on the current stream: its place in stream order and its checks."""
    with LOCK:
        state = _core.current_state()
        _core.check_device(state.device)
        seq = _core.begin(state)
    _core.ready(state)
    with LOCK:
        _core.access(state, seq, reads, writes)
        if not state.pending:
            state.done_seq = seq
    return state, seq


def wrap(result, sources, state, seq):
    """numpy results of a kernel as simulated arrays: views of an input stay views of its
    memory; anything new is stored in pool memory written by this kernel (on its device)."""
    if isinstance(result, np.ndarray):
        for alloc in sources:
            if np.may_share_memory(result, alloc.buf):
                return ndarray._view(result, alloc)
        return _store(result, state, seq)
    if isinstance(result, np.generic):
        return wrap(np.asarray(result), (), state, seq)
    if isinstance(result, tuple):
        parts = [wrap(r, sources, state, seq) for r in result]
        return type(result)(*parts) if hasattr(result, "_fields") else tuple(parts)
    if isinstance(result, list):
        return [wrap(r, sources, state, seq) for r in result]
    return result


def _store(result: np.ndarray, state, seq) -> ndarray:
    """A kernel's new array ``result`` copied into memory from the pool (the arena of the
    kernel's stream, current now), written by work ``seq`` on ``state``."""
    order: Literal["C", "F"] = (
        "F" if result.flags.f_contiguous and not result.flags.c_contiguous else "C")
    check_dtype(result.dtype)
    alloc = _memory.allocate(result.nbytes)
    view = np.ndarray(result.shape, result.dtype, buffer=alloc.buf, order=order)
    with LOCK:
        _core.access(state, seq, writes=[alloc])  # a reused block: its old users must be done
    np.copyto(view, result)
    return ndarray._view(view, alloc)


def maybe_view(np_func, this: ndarray):
    """``np_func(this)`` where CuPy makes a view when it can (reshape, transpose, basic
    slicing...): a view launches no kernel, so it is no work on any stream and races with
    nothing (cupy/_core: views share ``data`` and enqueue nothing); a copy is a kernel."""
    result = np_func(this._a)
    if isinstance(result, np.ndarray) and (
            result.size == 0 or np.may_share_memory(result, this._alloc.buf)):
        return ndarray._view(result, this._alloc)
    return kernel(np_func, this)


def kernel(np_func, *args, out=None, **kwargs):
    """Run ``np_func`` as a kernel on the current device and stream."""
    return kernel_on(np_func, args, kwargs, out)


def kernel_on(np_func, args, kwargs: dict, out=None, written=(), cast=None):
    """``np_func(*args, **kwargs)`` as a kernel on the current device and stream: device
    arrays in the arguments are read (``written`` ones, and ``out``, written too), the
    numpy result is stored in device memory written by this kernel (``cast`` to a dtype
    first, when given) and views of an input stay views of it."""
    reads: list = []
    args = unwrap(args, reads)
    kwargs = unwrap(kwargs, reads)
    writes = [a._alloc for a in written]
    if out is not None:
        if not isinstance(out, ndarray):
            raise TypeError(f"out must be a cupy.ndarray, not {type(out)}")
        out_reads: list = []
        kwargs["out"] = unwrap(out, out_reads)
        writes = writes + out_reads
    state, seq = launch(reads, writes)
    with np.errstate(all="ignore"):  # CuPy's kernels do not warn
        result = np_func(*args, **kwargs)
    if out is not None and isinstance(result, np.ndarray) and result is kwargs["out"]:
        return out
    if cast is not None and isinstance(result, (np.ndarray, np.generic)):
        result = np.asarray(result)
        if result.dtype != np.dtype(cast):
            result = convert(result, cast)
    return wrap(result, reads + writes, state, seq)


def _new(shape, dtype, order="C") -> ndarray:
    """Uninitialised device memory on the current device, from the pool (the arena of the
    current stream): fresh memory holds the poison pattern, reused memory what its last
    owner left. No work on any stream (cudaMalloc / a pool hit)."""
    dtype = check_dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    alloc = _memory.allocate(nbytes)
    view = np.ndarray(shape, dtype, buffer=alloc.buf, order="F" if order == "F" else "C")
    return ndarray._view(view, alloc)


def check_dtype(dtype) -> np.dtype:
    """``dtype`` if CuPy 14.2 makes device arrays of it, else its ``ValueError``: every new
    array is checked (cupy/_core/_dtype.pyx ``check_supported_dtype``, from
    ``ndarray.__init__`` and ``_init_fast``, cupy/_core/core.pyx lines 246 and 297): no
    objects, strings, bytes, datetimes, long doubles, nor big-endian types."""
    dtype = np.dtype(dtype)
    why = device_dtypes.refusal(dtype)
    if why is not None:
        raise ValueError(why)
    return dtype


# ---------------------------------------------------------------- where CuPy's semantics differ

def wrap_indices(index, shape: tuple):
    """``index`` with its integer *arrays* wrapped around their axis, as CuPy 14.2 does
    (docs/source/user_guide/difference.rst, "Out-of-bounds indices"): one array index is
    ``take`` (cupy/_core/_routines_indexing.pyx ``_take_kernel_core``), several
    ``_prepare_array_indexing``, assignment ``_scatter_update_kernel``. Lists, tuples
    (``_prepare_slice_list``) and 0-d integer arrays are arrays; integer scalars are not
    (numpy's ``IndexError``), nor are axes of length 0."""
    items = list(index) if isinstance(index, tuple) else [index]
    for i, item in enumerate(items):
        if isinstance(item, (list, tuple)):
            found = np.asarray(item)
            items[i] = found.astype(np.int32) if found.size == 0 else found
    explicit = sum(_axes_taken(item) for item in items)
    axis, out = 0, []
    for item in items:
        if item is Ellipsis:
            axis += len(shape) - explicit
        elif isinstance(item, np.ndarray) and item.dtype.kind in "iu":
            if axis < len(shape) and shape[axis] > 0:
                item = np.mod(item.astype(np.int64), shape[axis])
            axis += 1
        else:
            axis += _axes_taken(item)
        out.append(item)
    return tuple(out) if isinstance(index, tuple) else out[0]


def _axes_taken(item) -> int:
    if item is None or item is Ellipsis or isinstance(item, (bool, np.bool_)):
        return 0
    if isinstance(item, np.ndarray) and item.dtype.kind == "b":
        return item.ndim
    return 1


def convert(values: np.ndarray, dtype, order="K") -> np.ndarray:
    """``values.astype(dtype)`` as a CUDA kernel converts (CuPy's ``astype`` and every kernel's
    output: cupy/_core/_ufuncs.py ``elementwise_copy``): a float (a complex's real part) to an
    integer saturates and NaN gives 0 (PTX ISA, ``cvt``: "the result is clamped to the
    destination range by default"; CuPy 14.2's difference.rst, "Cast behavior from float to
    integer": -1.0 to uint32 is 0, inf to int32 2147483647); float32 subnormals are flushed
    (``_flush.converted``); other conversions are numpy's."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu" or values.dtype.kind not in "fc":
        return _flush.converted(values, dtype, order)
    wide = (values.real if values.dtype.kind == "c" else values).astype(np.float64)
    info = np.iinfo(dtype)
    out = np.zeros_like(values, dtype=dtype, order=order)
    with np.errstate(invalid="ignore"):
        truncated = np.trunc(wide)
        high = truncated >= float(info.max) + 1.0  # (exact: a power of two, in float64)
        low = truncated < float(info.min)
        inside = ~(high | low | np.isnan(wide))
        np.copyto(out, truncated.astype(dtype), where=inside)
    np.copyto(out, info.max, where=high)
    np.copyto(out, info.min, where=low)
    return out


def _sim_cupy():
    # The math is reached through the package's face: the ufunc and function modules build
    # on this one, so importing them here would close a circle.
    from .. import cupy

    return cupy


def _binary(name: str, reflected: bool = False):
    def method(self, other):
        if isinstance(other, np.ndarray) and not isinstance(other, ndarray):
            raise TypeError(f"Unsupported type {type(other)}")
        ufunc = getattr(_sim_cupy(), name)
        return ufunc(other, self) if reflected else ufunc(self, other)
    return method


def _inplace(name: str):
    def method(self, other):
        getattr(_sim_cupy(), name)(self, other, out=self)
        return self
    return method


def _unary(name: str):
    def method(self):
        return getattr(_sim_cupy(), name)(self)
    return method


# ndarray methods that are CuPy's functions: CuPy 14's argument list for each, and the
# function's parameter each one goes to (by keyword: the orders differ).
_METHODS = {
    "all": "(self, axis=None, out=None, keepdims=False)",
    "any": "(self, axis=None, out=None, keepdims=False)",
    "argmax": "(self, axis=None, out=None, dtype=None, keepdims=False)",
    "argmin": "(self, axis=None, out=None, dtype=None, keepdims=False)",
    "clip": "(self, min=None, max=None, out=None)",
    "cumprod": "(self, axis=None, dtype=None, out=None)",
    "cumsum": "(self, axis=None, dtype=None, out=None)",
    "max": "(self, axis=None, out=None, keepdims=False)",
    "mean": "(self, axis=None, dtype=None, out=None, keepdims=False)",
    "min": "(self, axis=None, out=None, keepdims=False)",
    "prod": "(self, axis=None, dtype=None, out=None, keepdims=None)",
    "round": "(self, decimals=0, out=None)",
    "std": "(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False)",
    "sum": "(self, axis=None, dtype=None, out=None, keepdims=False)",
    "put": "(self, indices, values, mode='wrap')",  # (numpy's method: mode='raise')
    "take": "(self, indices, axis=None, out=None)",
    "trace": "(self, offset=0, axis1=0, axis2=1, dtype=None, out=None)",
    "var": "(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False)",
}
# the function's names of the method's parameters, where they differ
_RENAMED = {"clip": {"min": "a_min", "max": "a_max"}, "put": {"indices": "ind", "values": "v"}}


def _call_function(name: str, params: dict):
    this = params.pop("self")
    renamed = _RENAMED.get(name, {})
    kwargs = {renamed.get(k, k): v for k, v in params.items()}
    if name == "prod" and kwargs.get("keepdims") is None:
        kwargs["keepdims"] = False
    return getattr(_sim_cupy(), name)(this, **kwargs)


def _method(name: str, signature: str):
    space = {"_call_function": _call_function}
    exec(f"def {name}{signature}:\n    return _call_function({name!r}, dict(locals()))", space)
    method = space[name]
    method.__doc__ = f"Simulated ``cupy.ndarray.{name}``."
    return method


class ndarray:
    """A simulated CUDA device array (stands in for ``cupy.ndarray``)."""

    __slots__ = ("_a", "_alloc", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise _core.not_modelled("ndarray(memptr=, strides=)")
        new = _new(shape, dtype, order)
        self._a, self._alloc = new._a, new._alloc

    @classmethod
    def _view(cls, array: np.ndarray, alloc: Allocation) -> ndarray:
        self = object.__new__(cls)
        self._a, self._alloc = array, alloc
        return self

    # ------------------------------------------------------------ attributes
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)

    @property
    def device(self):
        from .cuda import Device

        return Device(self._alloc.device)

    @property
    def data(self):
        from .cuda import MemoryPointer

        offset = _core.host_ptr(self._a) - self._alloc.host_ptr
        return MemoryPointer(self._alloc, offset)

    @property
    def T(self):
        return self.transpose()

    @property
    def real(self):
        return maybe_view(np.real, self)

    @property
    def imag(self):
        return maybe_view(np.imag, self)

    # ------------------------------------------------------------ host conversion
    def __array__(self, dtype=None, copy=None):
        raise TypeError(_IMPLICIT)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        sim = getattr(_sim_cupy(), ufunc.__name__, None)
        if sim is None or method != "__call__":
            raise _core.not_modelled(f"numpy.{ufunc.__name__}.{method} on device arrays")
        if "out" in kwargs:
            (kwargs["out"],) = kwargs["out"]
        return sim(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        sim = getattr(_sim_cupy(), func.__name__, None)
        if sim is None or func.__module__.split(".")[:2] not in (["numpy"], ["numpy", "_core"],
                                                                 ["numpy", "core"]):
            raise _core.not_modelled(f"{func.__module__}.{func.__name__} on device arrays")
        for t in types:
            if not issubclass(t, (ndarray, np.ndarray)):
                return NotImplemented
        return sim(*args, **kwargs)

    def get(self, stream=None, order="C", out=None, blocking=True):
        """Copy to the host (a numpy array, or into ``out``) on ``stream`` (default: the
        current one), as CuPy 14.2's ``ndarray.get`` (cupy/_core/core.pyx) checks and does
        it; with ``blocking=False`` into page-locked memory, ``out`` is filled only once the
        stream is synchronised."""
        from . import cuda

        if stream is None:
            stream = cuda.get_current_stream()
        if out is not None:
            a_gpu, a_cpu = self._source_for(out, stream), out
        elif self.size == 0:
            return np.ndarray(self.shape, dtype=self.dtype)
        else:
            order = order.upper()
            if order == "A":
                order = "F" if self.flags.f_contiguous else "C"
            a_gpu = self
            if not (order == "C" and self.flags.c_contiguous
                    or order == "F" and self.flags.f_contiguous):
                a_gpu = self._in_order(order, stream, ValueError(f"unsupported order: {order}"))
            a_cpu = np.empty(self.shape, dtype=self.dtype, order=order)
        with cuda.Device(self._alloc.device):
            _to_host(a_gpu, cuda._stream_state(stream), a_cpu, blocking)
        return a_cpu

    def _source_for(self, out: np.ndarray, stream) -> ndarray:
        """What ``get(out=out)`` copies from: this array or a copy in ``out``'s layout."""
        if not isinstance(out, np.ndarray):
            raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
        if self.dtype != out.dtype:
            raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
        if self.shape != out.shape:
            raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: "
                             f"{out.shape}")
        if (out.flags.c_contiguous and self.flags.c_contiguous
                or out.flags.f_contiguous and self.flags.f_contiguous):
            return self
        order = "C" if out.flags.c_contiguous else "F" if out.flags.f_contiguous else ""
        return self._in_order(order, stream, RuntimeError(
            "`out` cannot be specified when copying to non-contiguous ndarray"))

    def _in_order(self, order: str, stream, error: Exception) -> ndarray:
        """A copy in ``order`` ("C" or "F", else ``error`` is raised) made on ``stream``."""
        from . import cuda

        with cuda.Device(self._alloc.device), stream:
            if order == "C":
                return kernel(np.ascontiguousarray, self)
            if order == "F":
                return kernel(np.asfortranarray, self)
            raise error

    def set(self, arr, stream=None):
        """Copy the host array ``arr`` into this array on ``stream`` (default: the current
        one), as CuPy 14.2's ``ndarray.set`` checks and does it."""
        from . import cuda

        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if self.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        elif self.flags.f_contiguous:
            arr = np.asfortranarray(arr)
        else:
            raise RuntimeError("Cannot set to non-contiguous array")
        if stream is None:
            stream = cuda.get_current_stream()
        with cuda.Device(self._alloc.device):
            _from_host(self, arr, cuda._stream_state(stream))

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().item()

    def tolist(self):
        return self.get().tolist()

    def tobytes(self, order="C"):
        return self.get().tobytes(order)

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __complex__(self):
        return complex(self.get())

    def __bool__(self):
        return bool(self.get())

    def __index__(self):
        if self.ndim != 0 or self.dtype.kind not in "iu":
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return int(self.get())

    def __repr__(self):
        return repr(self.get())

    def __str__(self):
        return str(self.get())

    def __format__(self, spec):
        return format(self.get(), spec)

    def __reduce__(self):
        from . import array

        return array, (self.get(),)

    # ------------------------------------------------------------ container
    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, index):
        """CuPy's indexing: integer arrays wrap around (``wrap_indices``)."""
        reads: list = []
        idx = wrap_indices(unwrap(index, reads, host_ok=True), self.shape)
        return maybe_view(lambda a: a[idx], self) if not reads else _index_with(self, idx, reads)

    def __setitem__(self, index, value):
        """CuPy's assignment: integer arrays wrap around (``wrap_indices``); a device array
        of floats stored into integers saturates (``convert``: ``value.astype(a.dtype)``,
        cupy/_core/_routines_indexing.pyx ``_scatter_op_single``, or a copy kernel)."""
        reads: list = []
        idx = wrap_indices(unwrap(index, reads, host_ok=True), self.shape)
        val = unwrap(value, reads)
        if isinstance(value, ndarray) and value.dtype != self.dtype:
            val = convert(val, self.dtype)
        target: list = []
        view = unwrap(self, target)
        launch(reads, target)
        view[idx] = val

    # ------------------------------------------------------------ methods
    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        """A converted copy, converted as CUDA converts (``convert``: floats to integers
        saturate)."""
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return kernel(lambda a: convert(a, dtype, order), self)

    def copy(self, order="C"):
        return kernel(lambda a: a.copy(order=order), self)

    def reshape(self, *shape, order="C", copy=None):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return maybe_view(lambda a: a.reshape(shape, order=order), self)

    def transpose(self, *axes):
        axes = axes[0] if len(axes) == 1 and isinstance(axes[0], (tuple, list)) else axes
        return maybe_view(lambda a: a.transpose(*axes), self)

    def ravel(self, order="C"):
        return maybe_view(lambda a: a.ravel(order), self)

    def flatten(self, order="C"):
        return kernel(lambda a: a.flatten(order), self)

    def squeeze(self, axis=None):
        return maybe_view(lambda a: a.squeeze(axis), self)

    def swapaxes(self, axis1, axis2):
        return maybe_view(lambda a: a.swapaxes(axis1, axis2), self)

    def view(self, dtype=None, type=None):
        if type is not None:
            raise _core.not_modelled("ndarray.view(type=)")
        return maybe_view(lambda a: a.view() if dtype is None else a.view(dtype), self)

    def fill(self, value):
        if isinstance(value, np.ndarray):
            raise TypeError(f"Unsupported type {type(value)}")
        target: list = []
        view = unwrap(self, target)
        launch((), target)
        view.fill(value)

    def dot(self, b, out=None):
        return _sim_cupy().dot(self, b, out)

    def conj(self):
        return kernel(np.conj, self)

    conjugate = conj

    def nonzero(self):
        return kernel(np.nonzero, self)

    def argsort(self, axis=-1, kind=None):
        return kernel(lambda a: np.argsort(a, axis=axis, kind=kind), self)

    def sort(self, axis=-1, kind=None):
        target: list = []
        view = unwrap(self, target)
        launch(target, target)
        view.sort(axis=axis, kind=kind)

    def repeat(self, repeats, axis=None):
        return kernel(lambda a: a.repeat(repeats, axis), self)

    def diagonal(self, offset=0, axis1=0, axis2=1):
        return kernel(lambda a: a.diagonal(offset, axis1, axis2).copy(), self)

    @property
    def mT(self):  # noqa: N802 (CuPy's name)
        return maybe_view(lambda a: a.mT, self)

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    def __getattr__(self, name: str):
        """The other methods of CuPy's ndarray: numpy's method of that name as a kernel
        (``put`` and ``partition`` write the array, ``scatter_add``/``_max``/``_min`` are
        numpy's ``ufunc.at``); what numpy's array lacks raises ``NotModelled``."""
        from . import _names

        if name.startswith("_") or name not in _names.NAMES["cupy.ndarray"]:
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")
        at = {"scatter_add": np.add.at, "scatter_max": np.maximum.at,
              "scatter_min": np.minimum.at}.get(name)
        if at is not None:  # (CuPy's scatter kernels wrap their indices: wrap_indices)
            return lambda slices, value: kernel_on(
                lambda a, s, v: at(a, wrap_indices(s, a.shape), v), [self, slices, value], {},
                written=(self,))
        if callable(getattr(np.ndarray, name, None)):
            def numpy_method(a, *rest, **kw):
                return getattr(a, name)(*rest, **kw)
        elif callable(getattr(np, name, None)):  # (numpy 2 dropped ndarray.ptp)
            numpy_method = getattr(np, name)
        else:
            raise _core.not_modelled_name(
                f"cupy.ndarray.{name}", "an attribute of CuPy's own" if hasattr(np.ndarray, name)
                else "numpy's array has no such method")
        written = (self,) if name == "partition" else ()

        def method(*args, **kwargs):
            return kernel_on(numpy_method, [self, *args], kwargs, written=written)

        method.__name__ = name
        return method

    # unhashable, as cupy.ndarray (mypy takes only a method here: typeshed's own objects
    # say so with the same ignore)
    __hash__ = None  # type: ignore[assignment]


def _index_with(self: ndarray, idx, index_reads: list) -> ndarray:
    reads = [self._alloc, *index_reads]
    if self._alloc.device != _core.current_device():
        raise _other_device(self._alloc.device)
    state, seq = launch(reads)
    return wrap(self._a[idx], (), state, seq)


# ---------------------------------------------------------------- copies host <-> device

def _from_host(dst: ndarray, src: np.ndarray, state) -> None:
    """Host -> device copy on ``state`` (the current device is ``dst``'s), written in stream
    order. From page-locked memory the source is read when the stream gets to it (a DMA). From
    pageable memory the stream is synchronised first and the source read before the call
    returns ("For transfers from pageable host memory to device memory, a stream sync is
    performed before the copy is initiated", CUDA Runtime API, "API synchronization behavior";
    CuPy's ``set`` is ``copy_from_host_async``, cupy/_core/core.pyx): the caller may change the
    source at once, and the host has seen the stream's earlier work finish (memory it used may
    be reused from any stream), not the copy."""
    from . import cuda

    pinned = _core.is_pinned(_core.host_ptr(src), src.nbytes)
    if not pinned:
        _core.wait(state, what="a host-to-device copy from pageable memory (its stream sync)")
    with LOCK:
        seq = _core.begin(state)
        _core.access(state, seq, writes=[dst._alloc])
    _core.count("h2d", src.nbytes, pinned)
    view = dst._a
    if pinned:
        _core.enqueue(state, cuda._Copy(lambda: np.copyto(view, src.reshape(view.shape)),
                                        "host-to-device copy"))
    else:
        staged = np.array(src, copy=True).reshape(view.shape)
        _core.enqueue(state, cuda._Copy(lambda: np.copyto(view, staged),
                                        "host-to-device copy (staged)", eager=True))


def _to_host(src: ndarray, state, out: np.ndarray, blocking: bool) -> None:
    """Device -> host copy of ``src`` into ``out`` (same layout) on ``state``, the current
    device being ``src``'s; into page-locked ``out`` without ``blocking`` it is deferred and
    ``out`` holds poison until the stream is synchronised; ``blocking``: the stream is
    synchronised after it."""
    from . import cuda

    pinned = _core.is_pinned(_core.host_ptr(out), out.nbytes)
    with LOCK:
        seq = _core.begin(state)
        _core.access(state, seq, reads=[src._alloc])
    _core.count("d2h", src.nbytes, pinned)
    view = src._a
    if not blocking and pinned:
        _poison(out)
        _core.enqueue(state, cuda._Copy(lambda: np.copyto(out, view), "device-to-host copy"))
        return
    _core.ready(state)
    np.copyto(out, view)
    with LOCK:
        if not state.pending:
            state.done_seq = max(state.done_seq, seq)
    if blocking:
        _core.wait(state, what="Stream.synchronize() after a blocking device-to-host copy")


def _poison(out: np.ndarray) -> None:
    flat = out if out.flags.c_contiguous else out.T
    if flat.flags.c_contiguous and out.size:
        flat.view(np.uint8).fill(_memory.POISON)


for _name, _signature in _METHODS.items():
    setattr(ndarray, _name, _method(_name, _signature))
# Python's operators: the method's stem -> CuPy's function (the arithmetic ones reflected too,
# and in place but for matmul and divmod)
_ARITHMETIC = {"add": "add", "sub": "subtract", "mul": "multiply", "truediv": "true_divide",
               "floordiv": "floor_divide", "mod": "remainder", "pow": "power",
               "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
               "lshift": "left_shift", "rshift": "right_shift", "matmul": "matmul",
               "divmod": "divmod"}
for _stem, _name in _ARITHMETIC.items():
    setattr(ndarray, f"__{_stem}__", _binary(_name))
    setattr(ndarray, f"__r{_stem}__", _binary(_name, True))
    if _stem not in ("matmul", "divmod"):
        setattr(ndarray, f"__i{_stem}__", _inplace(_name))
for _stem, _name in {"eq": "equal", "ne": "not_equal", "lt": "less", "le": "less_equal",
                     "gt": "greater", "ge": "greater_equal"}.items():
    setattr(ndarray, f"__{_stem}__", _binary(_name))
for _stem, _name in {"neg": "negative", "pos": "positive", "abs": "absolute",
                     "invert": "invert"}.items():
    setattr(ndarray, f"__{_stem}__", _unary(_name))
ndarray.__module__ = "synk._devices.sim.cupy"
