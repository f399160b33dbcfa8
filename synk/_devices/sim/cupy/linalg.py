"""Simulated ``cupy.linalg``: numpy.linalg as kernels on the current device. ``svd``, ``qr``
and ``eigh`` are defined below (CuPy returns a plain tuple where numpy's result is a named
one); every other name CuPy's ``cupy.linalg`` has (``norm``, ``inv``, ``solve``, ``det``...)
comes from the general mechanism, with CuPy's argument list (see ``_generic``)."""
from __future__ import annotations

import numpy as np

from ._generic import attribute
from ._ndarray import kernel

# (the others synk uses, ``cuda_api``, served by ``__getattr__``: listed for ``import *``)
__all__ = ["svd", "qr", "eigh", *"norm inv solve cholesky det".split()]


def svd(a, full_matrices=True, compute_uv=True):
    return kernel(lambda m: tuple(np.linalg.svd(m, full_matrices, compute_uv))
                  if compute_uv else np.linalg.svd(m, full_matrices, compute_uv), a)


def qr(a, mode="reduced"):
    return kernel(lambda m: tuple(np.linalg.qr(m, mode)), a)


def eigh(a, UPLO="L"):
    return kernel(lambda m: tuple(np.linalg.eigh(m, UPLO)), a)


def __getattr__(name: str):
    return attribute("cupy.linalg", name, globals())
