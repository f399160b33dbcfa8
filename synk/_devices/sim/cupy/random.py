"""Simulated ``cupy.random``: numpy's generators, the numbers made on the current device."""
from __future__ import annotations

import numpy as np

from .. import _core
from ._ndarray import kernel, ndarray, unwrap

__all__ = ["seed", "rand", "randn", "random", "random_sample", "normal", "uniform", "randint",
           "permutation", "shuffle", "choice", "standard_normal"]

_states: dict = {}  # device -> numpy RandomState


def _rs() -> np.random.RandomState:
    device = _core.current_device()
    state = _states.get(device)
    if state is None:
        state = _states[device] = np.random.RandomState()
    return state


def _made(fn, dtype=None):
    def run():
        out = fn()
        return out if dtype is None else np.asarray(out).astype(dtype, copy=False)
    return kernel(run)


def seed(seed=None):
    """Seed the current device's generator."""
    _states[_core.current_device()] = np.random.RandomState(seed)


def rand(*size, **kwarg):
    dtype = kwarg.pop("dtype", float)
    if kwarg:
        raise TypeError(f"rand() got unexpected keyword arguments {sorted(kwarg)}")
    return _made(lambda: _rs().random_sample(size or None), dtype)


def randn(*size, **kwarg):
    dtype = kwarg.pop("dtype", float)
    if kwarg:
        raise TypeError(f"randn() got unexpected keyword arguments {sorted(kwarg)}")
    return _made(lambda: _rs().standard_normal(size or None), dtype)


def random_sample(size=None, dtype=float):
    return _made(lambda: _rs().random_sample(size), dtype)


random = random_sample


def standard_normal(size=None, dtype=float):
    return _made(lambda: _rs().standard_normal(size), dtype)


def normal(loc=0.0, scale=1.0, size=None, dtype=float):
    return kernel(lambda lo, sc: np.asarray(_rs().normal(lo, sc, size)).astype(dtype), loc, scale)


def uniform(low=0.0, high=1.0, size=None, dtype=float):
    return kernel(lambda lo, hi: np.asarray(_rs().uniform(lo, hi, size)).astype(dtype), low, high)


def randint(low, high=None, size=None, dtype="l"):
    return _made(lambda: _rs().randint(low, high, size), dtype)


def permutation(a):
    if isinstance(a, ndarray):
        return kernel(lambda x: _rs().permutation(x), a)
    return _made(lambda: _rs().permutation(a))


def shuffle(a):
    if not isinstance(a, ndarray):
        raise TypeError("The array must be cupy.ndarray")
    target: list = []
    view = unwrap(a, target)
    from ._ndarray import launch

    launch(target, target)
    _rs().shuffle(view)


def choice(a, size=None, replace=True, p=None):
    return kernel(lambda x, q: _rs().choice(x, size, replace, q), a, p)
