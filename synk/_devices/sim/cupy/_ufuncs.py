"""Simulated CuPy ufuncs: numpy's, run as kernels on the current device and stream."""
from __future__ import annotations

import numpy as np

from ...cuda_api import UFUNCS
from .. import _float_minmax, _flush
from ._ndarray import convert, kernel, kernel_on, ndarray, wrap_indices

_SCALARS = (int, float, bool, complex)  # cupy/_core/_scalar.pyx _python_scalar_type_set


def check_operands(args) -> None:
    """What CuPy's kernels take (cupy/_core/_kernel.pyx ``_preprocess_arg``): device arrays,
    Python and numpy scalars; anything else is ``CScalar``'s ``TypeError: Unsupported type``
    (cupy/_core/_scalar.pyx line 344): "Universal Functions in CuPy only work with CuPy
    array or scalar. They do not accept other objects (e.g., lists or numpy.ndarray)"
    (docs/source/user_guide/difference.rst)."""
    for arg in args:
        if not (isinstance(arg, (ndarray, np.generic)) or type(arg) in _SCALARS):
            raise TypeError(f"Unsupported type {type(arg)}")


class ufunc:
    """An elementwise function over device arrays (stands in for ``cupy.ufunc``): numpy's
    ufunc, or ``call`` where CuPy's kernel gives other bits than numpy's, reading and writing
    float32 subnormals as zeros as CuPy's ``-ftz`` kernels do (``_flush``; not ``matmul``,
    which is cuBLAS's). Its methods stay numpy's."""

    def __init__(self, name: str, np_ufunc, call=None) -> None:
        self._np = np_ufunc
        call = np_ufunc if call is None else call
        self._call = call if name == "matmul" else _flush.through(call)
        self.__name__ = f"cupy_{name}"
        self.nin, self.nout = np_ufunc.nin, np_ufunc.nout

    def __call__(self, *args, out=None, casting="same_kind", dtype=None):
        if len(args) != self.nin:
            raise TypeError(f"Wrong number of arguments for {self.__name__!r}: "
                            f"{len(args)} given, {self.nin} expected")
        check_operands(args)
        extra = {"casting": casting}
        if dtype is not None:
            extra["dtype"] = dtype
        if (isinstance(out, ndarray) and casting == "unsafe" and out.dtype.kind in "iu"
                and self.nout == 1):  # the kernel converts its result as CUDA does
            return kernel(self._saturating, *args, out=out, **extra)
        return kernel(self._call, *args, out=out, **extra)

    def _saturating(self, *args, out, casting, **extra):
        result = np.asarray(self._call(*args, **extra))
        np.copyto(out, convert(result, out.dtype) if result.dtype.kind in "fc" else result,
                  casting=casting)
        return out

    def __repr__(self) -> str:
        return f"<ufunc {self.__name__!r} (simulated)>"

    # numpy's methods of the ufunc, as kernels (``at`` writes its first argument in place)
    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        return kernel(self._np.reduce, array, axis, dtype, out=out, keepdims=keepdims)

    def accumulate(self, array, axis=0, dtype=None, out=None):
        return kernel(self._np.accumulate, array, axis, dtype, out=out)

    def reduceat(self, array, indices, axis=0, dtype=None, out=None):
        return kernel(self._np.reduceat, array, indices, axis, dtype, out=out)

    def outer(self, A, B, **kwargs):
        return kernel(self._np.outer, A, B, **kwargs)

    def at(self, a, indices, b=None):
        """In place at ``indices``, which wrap around as CuPy's scatter kernels wrap them
        (``wrap_indices``)."""
        args = [a, indices] if b is None else [a, indices, b]
        kernel_on(lambda x, i, *rest: self._np.at(x, wrap_indices(i, x.shape), *rest), args,
                  {}, written=(a,))


# the ufuncs synk uses (``cuda_api``), but the aliases made below
_NAMES = sorted(UFUNCS - {"divide", "mod", "abs"})
# (bitwise_xor: CuPy's ufunc 'cupy_bitwise_xor', "the bitwise XOR of two arrays elementwise.
# Only integer and boolean arrays are handled": docs.cupy.dev/en/v12.2.0/reference/
# generated/cupy.bitwise_xor.html, and in CuPy's Binary Operations since v7)

# CuPy's maximum/minimum of floats: any NaN gives CuPy's NAN, else CUDA's max/min (+0.0 >
# -0.0); its fmax/fmin are CUDA's (cupy/_math/misc.py; ``_float_minmax``)
_CUDA = {"maximum": _float_minmax.cupy_maximum, "minimum": _float_minmax.cupy_minimum,
         "fmax": _float_minmax.fmax, "fmin": _float_minmax.fmin}
for _name in _NAMES:
    globals()[_name] = ufunc(_name, getattr(np, _name), _CUDA.get(_name))
divide = globals()["true_divide"]  # (made above)
mod = globals()["remainder"]
abs = globals()["absolute"]
__all__ = [*_NAMES, "divide", "mod", "abs", "ufunc"]
