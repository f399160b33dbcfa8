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
    """Start a group of ranks; return once every worker has reported ready.

    This process becomes rank 0 and computes its own share of every call; ``n - 1`` worker
    processes become ranks 1 to ``n - 1``. Each worker is a fresh interpreter
    (``python -m synk._engine.worker``), never a fork of this one, started with this
    process's interpreter, environment and working directory; its ``sys.path`` is this
    process's ``sys.path`` at this moment. So a script needs no
    ``if __name__ == "__main__":`` guard. The BLAS/OpenMP thread variables are set in the
    workers' environment (see [Environment variables](api.md#environment-variables)).

    Before starting, shared-memory blocks left behind by synk masters that are no longer
    alive are removed. The workers have 120 seconds to report ready. Afterwards
    ``synk.rank()`` is 0 and ``synk.size()`` is ``n``. After a failed start nothing is left
    running, and ``fork()`` may be called again.

    Args:
        n: the number of ranks **including this process**. Default: the CPU cores this
            process may run on (``os.sched_getaffinity``, else ``os.cpu_count()``).
            ``n = 1`` runs everything in the master. More ranks than cores work, with a
            ``RuntimeWarning``.
        backend: ``"auto"`` and ``"cpu"`` start CPU ranks. ``"gpu"`` is not available yet.

    Returns:
        ``n``, the number of ranks.

    Raises:
        ValueError: ``backend`` is not ``"auto"``, ``"cpu"`` or ``"gpu"``; ``n`` is not a
            positive ``int`` (a ``bool`` is refused too); or ``SYNK_INLINE_OUTPUT_BYTES``
            or ``SYNK_PARALLEL_REDUCE_RANKS`` is set but not an integer, or
            ``SYNK_SPIN_US`` is set but not a number.
        SynkError: ``backend="gpu"``, or a working group already exists ("synk.fork() was
            already called; call synk.close() first"). A broken group (a worker died, or a
            call was interrupted) is closed and replaced instead.
        WorkerStartError: a worker exited during start-up ("rank R failed to start (exit
            code C); its error output is above", chained from a ``WorkerDiedError``),
            raised an exception while starting (chained from it), failed the key check on
            its control channel ("rank R failed authentication ..."), or did not answer
            within 120 s.
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
    """End the group and free all shared memory of this process.

    Asks every worker to exit, waits up to 5 seconds, then kills those that remain
    (SIGKILL); a broken group's workers are killed at once. Removes every shared-memory
    block of the group (staging and output blocks), and frees every live ``Data`` created
    by this process, even when no group is running: using one afterwards raises
    ``SynkError``. Restores the master's thread-pool limits and resets ``rank()`` to 0 and
    ``size()`` to 1.

    Idempotent, and registered with ``atexit``, so it also runs when the interpreter exits.
    ``fork()`` may be called again afterwards. Raises nothing of its own.
    """
    group, _state.group = _state.group, None
    try:
        if group is not None:
            group.close()
    finally:
        free_all()
        _state.set_rank(0, 1)


def size() -> int:
    """The number of ranks in the running group, the same in the master and in the workers;
    1 when no group is running."""
    return _state.size


def rank() -> int:
    """This process's rank: 0 in the master (with or without a group); in a worker, that
    worker's rank, so inside a synk function it tells which rank is running."""
    return _state.rank


def xp(x):
    """The array module for ``x``: ``cupy`` when ``x``'s type comes from the ``cupy``
    package, otherwise ``numpy`` (a ``Data`` included), so that one function body serves
    numpy and CuPy arrays."""
    if type(x).__module__.split(".", 1)[0] == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


atexit.register(close)
