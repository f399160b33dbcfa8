"""Device discovery and the per-rank environment (BLAS/OpenMP thread limits)."""
from __future__ import annotations

import os

#: Variables that cap the threads of the common BLAS and OpenMP runtimes.
THREAD_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def cpu_count() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def threads_per_rank(n_ranks: int) -> int:
    return max(1, cpu_count() // n_ranks)


def worker_env(n_ranks: int) -> dict:
    """Environment for a worker: thread caps unless the user set them explicitly."""
    env = dict(os.environ)
    threads = str(threads_per_rank(n_ranks))
    for var in THREAD_VARS:
        env.setdefault(var, threads)
    env.setdefault("PYTHONUNBUFFERED", "1")  # a worker's prints appear when made, not at exit
    return env


class MasterThreadLimit:
    """Caps the master's own BLAS/OpenMP pools while a group runs, with ``threadpoolctl``
    (a dependency; should it fail to import, the master keeps its pools as they are), and,
    for the libraries it loads meanwhile (torch's OpenMP pool, imported by the function on
    rank 0 as in the workers), sets the threads' variables as the workers have them."""

    def __init__(self, n_ranks: int) -> None:
        self._limiter = None
        self._set: list = []
        if any(var in os.environ for var in THREAD_VARS):
            return
        threads = threads_per_rank(n_ranks)
        for var in THREAD_VARS:
            os.environ[var] = str(threads)
            self._set.append(var)
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return
        self._limiter = threadpool_limits(limits=threads)

    def restore(self) -> None:
        for var in self._set:
            os.environ.pop(var, None)
        self._set = []
        if self._limiter is not None:
            self._limiter.restore_original_limits()
            self._limiter = None
