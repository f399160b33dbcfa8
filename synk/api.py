"""fork, close and the small helpers of the public API."""
from __future__ import annotations

import atexit
import warnings

from . import devices as _devices
from ._engine import shm as _shm, state as _state
from ._engine.group import Group
from .data import free_all
from .errors import SynkError


def fork(n: int | None = None, *, backend: str = "auto") -> int:
    """Start the ranks: ``n`` counts them including this process (rank 0).

    Default ``n``: one rank per CPU core. Returns the number of ranks. Returns only when
    every rank has reported ready; raises ``WorkerStartError`` with the cause otherwise.
    """
    group = _state.group
    if group is not None:
        if group.broken is None and not group.closed:
            raise SynkError("synk.fork() was already called; call synk.close() first")
        close()  # the last group broke: clear it away and start afresh
    _devices.choose_backend(backend)
    cores = _devices.cpu_count()
    if n is None:
        n = cores
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int (ranks including the master), got {n!r}")
    if n > cores:
        warnings.warn(
            f"synk.fork(n={n}) starts more ranks than the {cores} CPU cores available; "
            "they will share cores", RuntimeWarning, stacklevel=2,
        )
    _shm.sweep_orphans()
    _state.generation += 1
    _state.group = Group(n)
    _state.set_rank(0, n)
    return n


def close() -> None:
    """Stop the workers and free every shared-memory block (idempotent; runs at exit)."""
    group, _state.group = _state.group, None
    try:
        if group is not None:
            group.close()
    finally:
        free_all()
        _state.set_rank(0, 1)


def size() -> int:
    """Number of ranks in the running group (1 when none is running)."""
    return _state.size


def rank() -> int:
    """This process's rank: 0 in the master, the worker's rank inside a synk function."""
    return _state.rank


def xp(x):
    """The array module of ``x``: ``cupy`` for CuPy arrays, else ``numpy``."""
    if type(x).__module__.split(".", 1)[0] == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


atexit.register(close)
