"""Device discovery and the per-rank environment: BLAS/OpenMP thread limits, and the cores
each CPU rank runs on."""
from __future__ import annotations

import os

from .. import _settings

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


def rank_cores(n_ranks: int) -> list | None:
    """Each rank's cores for ``n_ranks`` CPU ranks on this host (a tuple each, rank 0's
    first): the cores this process may run on, cut in runs of ``threads_per_rank``, as
    ``mpiexec`` binds its ranks to cores. None where they would share cores anyway (more
    ranks than cores), for one rank, where the system has no affinity, or with
    ``SYNK_BIND_CORES=0``."""
    if n_ranks < 2 or not hasattr(os, "sched_setaffinity") or not _settings.bind_cores():
        return None
    cores = sorted(os.sched_getaffinity(0))
    k = len(cores) // n_ranks
    if k == 0:
        return None
    return [tuple(cores[r * k:(r + 1) * k]) for r in range(n_ranks)]


def bind_process(cores) -> dict:
    """Every thread of this process on ``cores`` (the threads they start inherit them; XLA
    sizes its pool by them); {thread id: the cores it had}."""
    had = {}
    for tid in _threads():
        try:
            had[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
        except OSError:  # (it ended meanwhile)
            pass
    return had


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # (this thread alone)


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
    rank 0 as in the workers), sets the threads' variables as the workers have them. With
    ``cores`` (rank 0's: ``rank_cores``), every thread of the master runs on those, and runs
    where it did again at ``restore()`` (one started meanwhile: where the master did)."""

    def __init__(self, n_ranks: int, cores: tuple | None = None) -> None:
        self._limiter = None
        self._set: list = []
        self._had: dict = {}  # thread id -> the cores it had
        threads = threads_per_rank(n_ranks)
        if cores is not None:
            self._was = os.sched_getaffinity(0)
            self._had = bind_process(cores)
        if any(var in os.environ for var in THREAD_VARS):
            return
        for var in THREAD_VARS:
            os.environ[var] = str(threads)
            self._set.append(var)
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            return
        self._limiter = threadpool_limits(limits=threads)

    def restore(self) -> None:
        if self._had:
            for tid in _threads():
                try:
                    os.sched_setaffinity(tid, self._had.get(tid, self._was))
                except OSError:
                    pass
            self._had = {}
        for var in self._set:
            os.environ.pop(var, None)
        self._set = []
        if self._limiter is not None:
            self._limiter.restore_original_limits()
            self._limiter = None
