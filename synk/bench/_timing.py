"""Timing helpers shared by the benchmarks."""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import numpy as np


def median_time(fn: Callable[[], object], repeat: int, warmup: int = 1) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def collective_time(op: Callable[[], object], barrier: Callable[[], object], repeat: int,
                    nbytes: int) -> float:
    """Seconds per call of collective ``op``, timed as the OSU micro-benchmarks do: after a
    barrier, a run of back-to-back calls, divided by their number; the median of ``repeat``
    runs. Small messages get longer runs, so that a run is long against clock noise."""
    per_run = max(1, min(100, (4 << 20) // max(nbytes, 1)))
    op()

    def run():
        barrier()
        start = time.perf_counter()
        for _ in range(per_run):
            op()
        return (time.perf_counter() - start) / per_run

    return statistics.median(run() for _ in range(repeat))


def mpi_allreduce_times(comm, sizes: list[int], repeat: int) -> dict:
    """{bytes: seconds per mpi4py ``Allreduce`` (sum) of float32}, the slowest rank's (as
    for synk)."""
    from mpi4py import MPI

    times = {}
    for nbytes in sizes:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        mine = collective_time(lambda: comm.Allreduce(src, dst, op=MPI.SUM),  # noqa: B023
                               comm.Barrier, repeat, nbytes)
        times[nbytes] = comm.allreduce(mine, op=MPI.MAX)
    return times


def parse_size(text: str) -> int:
    """'4K', '64M', '1G' or a plain number of bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def size_label(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def sizes_between(low: int, high: int, factor: int = 4) -> list[int]:
    sizes, size = [], low
    while size <= high:
        sizes.append(size)
        size *= factor
    return sizes


def result(bench: str, case: str, seconds: float, baseline: str, baseline_s: float,
           **extra) -> dict:
    """One row of the results: ``ratio`` is baseline time / this time (>1: faster)."""
    return {"bench": bench, "case": case, "median_s": seconds, "baseline": baseline,
            "baseline_s": baseline_s, "ratio": baseline_s / seconds if seconds else None,
            **extra}


def as_a_scripts(fn):
    """``fn`` as if defined in a user's script (``__main__``): shipped by value and what it
    captures checked before each call, as a user's function is (synk's own are not)."""
    fn.__module__ = "__main__"
    return fn


@contextlib.contextmanager
def group(*args, **kwargs):
    """A group of ranks for the block: ``synk.fork(*args, **kwargs)`` before it, ``synk.close()``
    after it."""
    import synk  # (here: the mpi4py baselines import this module, not synk)

    synk.fork(*args, **kwargs)
    try:
        yield
    finally:
        synk.close()
