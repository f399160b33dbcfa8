"""Simulated ``cupy.random``: numpy's generators, the numbers made on the current device. Each
device has its own ``RandomState`` (``get_random_state()``), as in CuPy, from which every
distribution draws (those not defined here through ``_generic``). The numbers are numpy's,
not cuRAND's: a seed gives other numbers than on a GPU."""
from __future__ import annotations

import inspect

import numpy as np

from .. import _core
from . import _names
from ._generic import NotModelledName, attribute
from ._ndarray import kernel, kernel_on, ndarray

__all__ = ["seed", "rand", "randn", "random", "random_sample", "normal", "uniform", "randint",
           "permutation", "shuffle", "choice", "standard_normal"]

_states: dict = {}  # device -> RandomState


class RandomState:
    """``cupy.random.RandomState``: numpy's ``RandomState`` (numpy's numbers, not cuRAND's),
    each draw a kernel on the current device and stream; ``dtype=`` casts the draw."""

    def __init__(self, seed=None, method=None):
        self._np = np.random.RandomState(seed)

    def seed(self, seed=None):
        self._np.seed(seed)

    def shuffle(self, a):
        if not isinstance(a, ndarray):
            raise TypeError("The array must be cupy.ndarray")
        kernel_on(self._np.shuffle, [a], {}, written=(a,))

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in _names.NAMES["cupy.random.RandomState"]:
            raise AttributeError(f"'RandomState' object has no attribute {name!r}")
        method = getattr(self._np, name, None)
        if method is None:
            return NotModelledName(f"cupy.random.RandomState.{name}")

        def draw(*args, dtype=None, **kwargs):
            return kernel_on(method, list(args), kwargs, cast=dtype)

        draw.__name__ = name
        return draw


class Generator:
    """``cupy.random.Generator`` (from ``default_rng``): numpy's ``Generator``, each draw a
    kernel on the current device and stream."""

    def __init__(self, bit_generator=None):
        self._np = np.random.default_rng(bit_generator)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._np, name)

        def draw(*args, **kwargs):
            return kernel_on(method, list(args), kwargs)

        draw.__name__ = name
        return draw


def default_rng(seed=None):
    """A ``Generator`` seeded with ``seed``."""
    return Generator(seed)


def get_random_state() -> RandomState:
    """The current device's ``RandomState``."""
    device = _core.current_device()
    state = _states.get(device)
    if state is None:
        state = _states[device] = RandomState()
    return state


def set_random_state(rs):
    """Make ``rs`` the current device's ``RandomState``."""
    _states[_core.current_device()] = rs


def reset_states():
    _states.clear()


def _rs() -> np.random.RandomState:
    return get_random_state()._np


_TEMPLATE = np.random.RandomState(0)  # (its methods' argument lists)


def _distribution(name: str):
    """numpy's ``RandomState.<name>`` of the current device, for the general mechanism."""
    def draw(*args, **kwargs):
        return getattr(_rs(), name)(*args, **kwargs)

    draw.__name__ = name
    draw.__signature__ = inspect.signature(getattr(_TEMPLATE, name))  # type: ignore[attr-defined]
    return draw


def __getattr__(name: str):
    return attribute("cupy.random", name, globals(),
                     lambda n: _distribution(n) if hasattr(_TEMPLATE, n) else None)


def _made(fn, dtype=None):
    def run():
        out = fn()
        return out if dtype is None else np.asarray(out).astype(dtype, copy=False)
    return kernel(run)


def seed(seed=None):
    """Seed the current device's generator."""
    get_random_state().seed(seed)


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
    """The current device's ``RandomState.shuffle``."""
    get_random_state().shuffle(a)


def choice(a, size=None, replace=True, p=None):
    return kernel(lambda x, q: _rs().choice(x, size, replace, q), a, p)
