"""Simulated CuPy functions: each has CuPy 14's argument list (checked against the real
library by the contract tests) and runs numpy's function of the same name as a kernel on the
current device and stream."""
from __future__ import annotations

import numpy as np

from .. import _core
from ._ndarray import _new, check_dtype, kernel, ndarray, unwrap

# name -> CuPy 14's argument list. Forwarded to numpy's function of the same name, the
# parameters before ``out`` by position (names differ in places, positions do not), ``out``
# as the array written, the rest by keyword when given.
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
          "allclose": lambda *a, **k: np.asarray(np.allclose(*a, **k)),
          "array_equal": lambda *a, **k: np.asarray(np.array_equal(*a, **k))}
# differ from numpy's: a keyword CuPy has and numpy's function does not
_DROP = {"dtype": ("argmax", "argmin"), "subok": ("zeros_like", "ones_like", "empty_like",
                                                  "full_like")}
_ALLOCATING = ("empty", "empty_like")  # uninitialised memory (see _memory: fresh is poisoned)


def _forward(name: str, np_func, params: dict):
    """Call numpy's ``np_func`` with a simulated function's bound ``params``."""
    args: list = []
    kwargs: dict = {}
    out = None
    positional = True
    for pname, (kind, default) in _PARAMS[name].items():
        value = params[pname]
        if pname == "out":
            out, positional = value, False
        elif name in _DROP.get(pname, ()):
            positional = False  # later parameters go by keyword
            if value is not None:
                raise _core.not_modelled(f"cupy.{name}({pname}=...)")
        elif kind == "var_positional":
            args.extend(value)
        elif kind == "var_keyword":
            kwargs.update(value)
        elif kind == "positional" and positional:
            args.append(value)
        elif value is not default:
            kwargs[pname] = value
    if params.get("dtype") is not None and name not in _DROP["dtype"]:
        check_dtype(params["dtype"])  # (a subarray dtype is refused before numpy reshapes it)
    if name in _ALLOCATING:  # allocation only: no kernel, nothing written on any stream
        template = np_func(*unwrap(args, [], host_ok=True), **unwrap(kwargs, [], host_ok=True))
        order = "F" if template.flags.f_contiguous and not template.flags.c_contiguous else "C"
        return _new(template.shape, template.dtype, order)
    return kernel(np_func, *args, out=out, **kwargs)


_PARAMS: dict = {}


def _define(name: str, signature: str):
    import inspect

    space = {"_forward": _forward, "_np": _NUMPY.get(name) or getattr(np, name), "float": float}
    exec(f"def {name}{signature}:\n    return _forward({name!r}, _np, locals())", space)
    fn = space[name]
    kinds = {inspect.Parameter.VAR_POSITIONAL: "var_positional",
             inspect.Parameter.VAR_KEYWORD: "var_keyword",
             inspect.Parameter.KEYWORD_ONLY: "keyword"}
    _PARAMS[name] = {
        p.name: (kinds.get(p.kind, "positional"), p.default)
        for p in inspect.signature(fn).parameters.values()
    }
    fn.__module__ = "synk._devices.sim.cupy"
    fn.__doc__ = f"Simulated ``cupy.{name}``: numpy's ``{name}`` as a kernel on the current device."
    return fn


for _name, _sig in SIGNATURES.items():
    globals()[_name] = _define(_name, _sig)


def result_type(*arrays_and_dtypes):
    """``numpy.result_type`` over arrays (device or host) and dtypes."""
    return np.result_type(*[a.dtype if isinstance(a, ndarray) else a for a in arrays_and_dtypes])


__all__ = [*SIGNATURES, "result_type"]
