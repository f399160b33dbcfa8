"""CuPy's array API under the simulator, by one mechanism: every name CuPy 14 has (its tables,
``_names``) is served from numpy's function of the same name, run as a kernel on the current
device and stream, with CuPy's own argument list; names the simulator cannot serve that way
raise ``NotModelled`` when used, saying that real CuPy has them.
"""
from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from .. import _core
from . import _names
from ._ndarray import _from_host, _new, check_dtype, kernel_on, ndarray
from ._ufuncs import ufunc

# numpy's function for a CuPy name where it is not numpy's own of that name: numpy 2 dropped
# these numpy 1 names, which CuPy 14 keeps; CuPy's indexing wraps where numpy's raises; CuPy
# returns a 0-d device array where numpy returns a Python bool
ALIASES = {
    "amax": np.max, "amin": np.min,
    "allclose": lambda *a, **k: np.asarray(np.allclose(*a, **k)),
    "array_equal": lambda *a, **k: np.asarray(np.array_equal(*a, **k)),
    "alltrue": np.all, "sometrue": np.any, "product": np.prod, "cumproduct": np.cumprod,
    "round_": np.round,
    "trapz": getattr(np, "trapezoid", None) or np.trapz,  # type: ignore[attr-defined]
    # (numpy 1.x has trapz alone)
    "in1d": lambda ar1, ar2, assume_unique=False, invert=False, **kw: np.isin(
        ar1, ar2, assume_unique=assume_unique, invert=invert, **kw).ravel(),
    "msort": lambda a: np.sort(a, axis=0),
    "asfarray": lambda a, dtype=np.float64: np.asarray(
        a, dtype if np.dtype(dtype).kind in "fc" else np.float64),
    # CuPy indexes with the array of indices (cupy/_indexing/indexing.py take_along_axis,
    # cupy/lib/_shape_base.py put_along_axis): out-of-bounds indices wrap around; put's
    # mode is "wrap" by default (cupy/_indexing/insert.py), numpy's "raise"
    "put": lambda a, ind, v, mode="wrap": np.put(a, ind, v, mode=mode),
    # take wraps too, a scalar index included (cupy/_core/_routines_indexing.pyx
    # ``_take_kernel_core``; cupy/_indexing/indexing.py: "This function does not support
    # ``mode`` option")
    "take": lambda a, indices, axis=None, out=None: np.take(a, indices, axis, out, mode="wrap"),
    "take_along_axis": lambda arr, indices, axis: np.take_along_axis(
        arr, _wrapped_along(arr, indices, axis), axis),
    "put_along_axis": lambda arr, indices, values, axis: np.put_along_axis(
        arr, _wrapped_along(arr, indices, axis), values, axis),
}


def _wrapped_along(arr, indices, axis):
    if not isinstance(indices, np.ndarray) or indices.dtype.kind not in "iu":
        return indices  # (numpy's error)
    length = arr.size if axis is None else arr.shape[axis] if arr.ndim else 0
    return np.mod(indices.astype(np.int64), length) if length else indices
# the argument each one writes in place (its position in CuPy's argument list)
IN_PLACE = {"copyto": 0, "put": 0, "place": 0, "putmask": 0, "fill_diagonal": 0,
            "put_along_axis": 0}
# arrays made from host data (files, buffers, Python values): computed on the host, copied
FROM_HOST = frozenset("""asanyarray asarray_chkfinite frombuffer fromfile fromfunction fromiter
    fromstring genfromtxt load loadtxt""".split())
# why the simulator does not serve a name CuPy has (default: numpy has no such function)
WHY = {
    "RawKernel": "it compiles CUDA C++ source, which the simulator cannot run",
    "RawModule": "it compiles CUDA C++ source, which the simulator cannot run",
    "apply_along_axis": "it calls your Python function on device arrays",
    "apply_over_axes": "it calls your Python function on device arrays",
    "piecewise": "it calls your Python functions on device arrays",
    "fromDlpack": "DLPack exchange of device memory is not modelled",
    "from_dlpack": "DLPack exchange of device memory is not modelled",
    "toDlpack": "DLPack exchange of device memory is not modelled",
    "get_default_pinned_memory_pool": "its pinned memory pool is not modelled",
    "testing": "cupy.testing compares device arrays through CuPy internals",
    **{module: "this submodule is not modelled" for module in ("lib", "polynomial", "typing",
                                                                "exceptions")},
}
# CuPy's parameters that numpy's function has at the same place under another name (the
# contract tests check that these are all: any other difference goes by keyword)
RENAMED = {
    "arange": {"start": "start_or_stop"}, "array_str": {"arr": "a"},
    "matrix_transpose": {"a": "x"},
    "concat": {"tup": "arrays"}, "concatenate": {"tup": "arrays"}, "corrcoef": {"a": "x"},
    "cov": {"a": "m"}, "delete": {"indices": "obj"}, "ediff1d": {"arr": "ary"},
    "extract": {"a": "arr"}, "flip": {"a": "m"}, "fliplr": {"a": "m"}, "flipud": {"a": "m"},
    "histogram": {"x": "a"}, "intersect1d": {"arr1": "ar1", "arr2": "ar2"},
    "reshape": {"newshape": "shape"}, "rot90": {"a": "m"}, "stack": {"tup": "arrays"},
    "take_along_axis": {"a": "arr"}, "union1d": {"arr1": "ar1", "arr2": "ar2"},
    "unravel_index": {"dims": "shape"}, "matrix_power": {"M": "a"}, "matrix_rank": {"M": "A"},
}
_EXEC_NAMES = {"float": float, "int": int, "bool": bool, "complex": complex,
               "float64": np.float64}


class NotModelledName:
    """A CuPy name the simulator does not model: using it (calling it, or any of its
    attributes) raises ``NotModelled``, naming it and saying that real CuPy has it."""

    def __init__(self, qualname: str, why: str | None = None) -> None:
        self._qualname = qualname
        self._why = why or WHY.get(qualname.rpartition(".")[2]) or "numpy has no counterpart"

    def _refuse(self, *args, **kwargs):
        raise _core.not_modelled_name(self._qualname, self._why)

    __call__ = _refuse
    __getitem__ = _refuse
    __iter__ = _refuse

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise _core.not_modelled_name(f"{self._qualname}.{name}", self._why)

    def __repr__(self) -> str:
        return f"<{self._qualname}: not modelled by the CUDA simulator>"


# ---------------------------------------------------------------- numpy's functions

class _Spec:
    """How a CuPy argument list maps onto a numpy function's."""

    def __init__(self, qualname: str, np_func, params: dict) -> None:
        self.qualname, self.np_func = qualname, np_func
        self.name = qualname.rpartition(".")[2]
        self.plan = _plan(params, np_func, RENAMED.get(self.name, {}))


def _numpy_params(np_func) -> list | None:
    try:
        return list(inspect.signature(np_func).parameters.values())
    except (TypeError, ValueError):
        return None


_VARIADIC = {inspect.Parameter.VAR_POSITIONAL: "star", inspect.Parameter.VAR_KEYWORD: "starstar"}


def _plan(params: dict, np_func, renamed: dict) -> list:
    """[(CuPy parameter, how it goes to numpy, its default)]: "pos" (by position, while
    numpy's parameter there has the same name, or ``renamed``'s, or none), "kw", "star",
    "starstar", "out", "dtype" (the result cast to it) or "absent" (default only)."""
    theirs = _numpy_params(np_func)
    names = {p.name for p in theirs or [] if p.kind is not p.POSITIONAL_ONLY}
    takes_any = theirs is None or any(p.kind is p.VAR_KEYWORD for p in theirs)
    plan, positional = [], True
    rest = next((i for i, p in enumerate(theirs or []) if p.kind is p.VAR_POSITIONAL), None)
    for i, (name, p) in enumerate(params.items()):
        if p.kind in _VARIADIC:
            plan.append((name, _VARIADIC[p.kind], None))
            continue
        if name == "out":
            plan.append((name, "out", p.default))
            positional = False
            continue
        if positional and p.kind is not p.KEYWORD_ONLY and _same_position(
                i, name, theirs, rest, renamed):
            plan.append((name, "pos", p.default))
            continue
        positional = False
        if takes_any or name in names:
            plan.append((name, "kw", p.default))
        else:
            plan.append((name, "dtype" if name == "dtype" else "absent", p.default))
    return plan


def _same_position(i: int, name: str, theirs: list | None, rest: int | None,
                   renamed: dict) -> bool:
    """Whether CuPy's ``i``th parameter, ``name``, can go to numpy's ``theirs`` by position."""
    if theirs is None or rest is not None and i >= rest:
        return True
    slot = theirs[i] if i < len(theirs) else None
    return (slot is not None and slot.kind in (slot.POSITIONAL_ONLY, slot.POSITIONAL_OR_KEYWORD)
            and slot.name in (name, renamed.get(name)))


def _call(spec: _Spec, bound: dict):
    args, kwargs, out, cast, given = [], {}, None, None, []
    for name, how, default in spec.plan:
        value = bound[name]
        if name == "dtype" and value is not None:  # (as given: CuPy checks it so, and
            check_dtype(value)  # numpy would expand a subarray dtype it refuses)
        if how == "pos":
            args.append(value)
            given.append(value is not default)
        elif how == "star":
            args.extend(value)
            given.extend([True] * len(value))
        elif how == "starstar":
            kwargs.update(value)
        elif how == "out":
            out = value
        elif how == "kw":
            if value is not default:
                kwargs[name] = value
        elif how == "dtype":
            cast = value
        elif value is not default:
            raise _core.not_modelled(f"cupy.{spec.name}({name}=...) (numpy's {spec.name} "
                                     f"has no {name!r})")
    while given and not given[-1]:  # numpy's own defaults for what was not given
        given.pop()
        args.pop()
    return run(spec.name, spec.np_func, args, kwargs, out, cast)


def run(name: str, np_func, args: list, kwargs: dict, out=None, cast=None):
    """numpy's ``np_func`` on device data, as the kernel of CuPy's ``name``."""
    if name in FROM_HOST and not _holds_device_array((args, kwargs)):
        with np.errstate(all="ignore"):
            return upload(np_func(*args, **kwargs))
    written: tuple = ()
    if name in IN_PLACE and args and isinstance(args[IN_PLACE[name]], ndarray):
        written = (args[IN_PLACE[name]],)
    return kernel_on(np_func, args, kwargs, out, written, cast)


def _holds_device_array(value) -> bool:
    if isinstance(value, ndarray):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_device_array(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_device_array(v) for v in value.values())
    return False


def upload(result):
    """Host results as device arrays on the current device (copied on the current stream)."""
    from . import cuda

    if isinstance(result, (np.ndarray, np.generic)):
        host = np.asarray(result, order="C")  # (ascontiguousarray would make 0-d 1-d)
        out = _new(host.shape, host.dtype)
        _from_host(out, host, cuda._stream_state(None))
        return out
    if isinstance(result, tuple):
        return tuple(upload(r) for r in result)
    if isinstance(result, list):
        return [upload(r) for r in result]
    return result


def define(qualname: str, signature: str, np_func):
    """A simulated function with CuPy's argument list ``signature``, running ``np_func`` as a
    kernel (``_ndarray.kernel_on``: stream order and race rules; a numpy array where CuPy wants
    a device array is CuPy's ``TypeError``). CuPy's arguments go to numpy's by position where
    numpy's parameter there has the same name (or ``RENAMED``'s), ``out`` as the array written,
    then by keyword (``_plan``); a keyword numpy's lacks is taken at CuPy's default only
    (``NotModelled`` otherwise), but ``dtype`` casts the result. ``FROM_HOST`` results are
    copied to the device; ``IN_PLACE`` writes are recorded."""
    name = qualname.rpartition(".")[2]
    space: dict[str, Any] = dict(_EXEC_NAMES, _call=_call)
    exec(f"def {name}{signature}:\n    return _call(_spec, locals())", space)
    fn = space[name]
    space["_spec"] = _Spec(qualname, np_func, dict(inspect.signature(fn).parameters))
    fn.__module__ = "synk._devices.sim.cupy"
    fn.__qualname__ = name
    fn.__doc__ = (f"Simulated ``{qualname}``: numpy's ``{getattr(np_func, '__name__', name)}``"
                  " as a kernel on the current device and stream.")
    return fn


# ---------------------------------------------------------------- names of a namespace

_NUMPY_ROOTS = {"": np, "exceptions.": np.exceptions, "linalg.": np.linalg, "fft.": np.fft,
                "random.": np.random}
_NUMPY_OF = {"cupy": np, "cupy.linalg": np.linalg, "cupy.fft": np.fft}


def _numpy_object(path: str):
    for prefix, module in _NUMPY_ROOTS.items():
        if prefix and path.startswith(prefix):
            return getattr(module, path[len(prefix):])
    return getattr(np, path)


def attribute(namespace: str, name: str, space: dict, numpy_function=None):
    """The simulator's ``namespace.name`` (cached in the module's ``space``), resolved from
    CuPy's tables: AttributeError for a name CuPy lacks, as CuPy raises. ``numpy_function``
    finds the numpy function serving a name (default: numpy's module of that namespace)."""
    if name.startswith("__") or name not in _names.NAMES.get(namespace, ()):
        raise AttributeError(f"module {namespace!r} has no attribute {name!r}")
    value = _resolve(namespace, name, numpy_function)
    space[name] = value
    return value


def _resolve(namespace: str, name: str, numpy_function):
    qualname = f"{namespace}.{name}"
    found = _names.NUMPY_OBJECTS.get(namespace, {}).get(name)
    if found is not None:
        return _numpy_object(found)
    if namespace == "cupy" and name in _names.CONSTANTS:
        return _names.CONSTANTS[name]
    if name in WHY:
        return NotModelledName(qualname)
    module = _NUMPY_OF.get(namespace)
    if name in _names.UFUNCS.get(namespace, ()):
        np_ufunc = getattr(module, name, None)
        if isinstance(np_ufunc, np.ufunc):
            return ufunc(name, np_ufunc)
        if callable(np_ufunc):  # a ufunc in CuPy, a function in numpy (fix, i0, sinc)
            return define(qualname, "(x, out=None)", _ufunc_of(np_ufunc))
        return NotModelledName(qualname)
    signature = _names.SIGNATURES.get(namespace, {}).get(name)
    if signature is not None:
        np_func = (numpy_function(name) if numpy_function is not None
                   else ALIASES.get(name) or getattr(module, name, None))
        if callable(np_func) and not isinstance(np_func, type):
            return define(qualname, signature, np_func)
    return NotModelledName(qualname)


def _ufunc_of(np_func):
    """numpy's function ``np_func`` taking what a CuPy ufunc takes (``_ufuncs.
    check_operands``; here after the device arrays were replaced by their numpy views,
    host arrays having been refused then)."""
    def call(x, **kwargs):
        if not (isinstance(x, (np.ndarray, np.generic)) or type(x) in (int, float, bool, complex)):
            raise TypeError(f"Unsupported type {type(x)}")
        return np_func(x, **kwargs)

    call.__name__ = getattr(np_func, "__name__", "ufunc")
    return call


# ---------------------------------------------------------------- index tricks, vectorize

class IndexTrick:
    """``cupy.r_``, ``c_``, ``mgrid``, ``ogrid``: numpy's, on device data, as a kernel."""

    def __init__(self, numpy_trick) -> None:
        self._np = numpy_trick

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if not _holds_device_array(key):
            with np.errstate(all="ignore"):
                return upload(self._np[key])
        return kernel_on(lambda *parts: self._np[parts], list(key), {})

    def __len__(self) -> int:
        return 0


class vectorize:  # noqa: N801 (CuPy's name)
    """``cupy.vectorize``: the Python function applied to each element, as numpy's
    ``vectorize`` does it, in a kernel on the current device and stream."""

    def __init__(self, pyfunc, otypes=None, doc=None, excluded=None, cache=False,
                 signature=None):
        self.pyfunc = pyfunc
        self._np = np.vectorize(pyfunc, otypes=otypes, doc=doc, excluded=excluded,
                                cache=cache, signature=signature)
        self.__doc__ = doc or getattr(pyfunc, "__doc__", None)

    def __call__(self, *args):
        return kernel_on(self._np, list(args), {})
