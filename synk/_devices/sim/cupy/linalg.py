"""Simulated ``cupy.linalg``: numpy.linalg as kernels on the current device (the functions
below, and every other name CuPy's ``cupy.linalg`` has by the general mechanism: see
``_generic``)."""
from __future__ import annotations

import numpy as np

from ._generic import attribute
from ._ndarray import kernel

__all__ = ["norm", "inv", "solve", "svd", "qr", "cholesky", "eigh", "det"]


def norm(x, ord=None, axis=None, keepdims=False):
    return kernel(np.linalg.norm, x, ord, axis, keepdims)


def inv(a):
    return kernel(np.linalg.inv, a)


def solve(a, b):
    return kernel(np.linalg.solve, a, b)


def svd(a, full_matrices=True, compute_uv=True):
    return kernel(lambda m: tuple(np.linalg.svd(m, full_matrices, compute_uv))
                  if compute_uv else np.linalg.svd(m, full_matrices, compute_uv), a)


def qr(a, mode="reduced"):
    return kernel(lambda m: tuple(np.linalg.qr(m, mode)), a)


def cholesky(a):
    return kernel(np.linalg.cholesky, a)


def eigh(a, UPLO="L"):
    return kernel(lambda m: tuple(np.linalg.eigh(m, UPLO)), a)


def det(a):
    return kernel(np.linalg.det, a)


def __getattr__(name: str):
    return attribute("cupy.linalg", name, globals())
