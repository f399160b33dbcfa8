"""Call overhead: a no-op on n ranks and a tiny call with arguments, plain, as a bound step
and with one core kept busy, against ProcessPoolExecutor (the baseline), multiprocessing.Pool
and mpi4py; then the check of what a function captured and a small training step.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import statistics

import numpy as np

import synk

from . import capture_cost as captures, step
from ._load import busy_core, environment
from ._timing import group, median_time, result
from .mpi_baselines import mpi_times

BENCH = "call overhead"
TINY_X = np.arange(16.0)


def noop(*_):
    return None


def tiny(x, y):
    return x.sum() * y


def _synk_times(ranks: int, repeat: int) -> tuple[float, float, float]:
    """(no-op, tiny call, tiny call as a bound step) median seconds per call on a fresh group."""
    with group(ranks):
        f = synk.function(noop, reduce=None)
        g = synk.function(tiny, bcast_inputs=["y"], reduce="sum")
        assert g(TINY_X, 3.0) == TINY_X.sum() * 3.0
        bound = g.bind(TINY_X, 3.0)
        assert bound() == TINY_X.sum() * 3.0
        return (median_time(f, repeat, warmup=50),
                median_time(lambda: g(TINY_X, 3.0), repeat, warmup=50),
                median_time(bound, repeat, warmup=50))


def _executor_time(pool, ranks: int, repeat: int) -> float:
    def executor_call():
        for fut in [pool.submit(noop) for _ in range(ranks)]:
            fut.result()

    return median_time(executor_call, repeat, warmup=20)


def run(ranks: int, repeat: int, loaded: bool = True) -> list[dict]:
    """The rows: a no-op on n ranks, and a tiny call with arguments (a 16-element array
    split across the ranks and a broadcast number; each rank sums its rows, the sums are
    added up), plain (``g(x, 3.0)``) and as a bound step (``g.bind(x, 3.0)()``), against
    ProcessPoolExecutor (one task per worker), multiprocessing.Pool.map and the same tiny
    call written with mpi4py (bcast, then reduce). Baseline: ProcessPoolExecutor (ratio > 1:
    faster than it). Then the check of what a function captured (``captures``, against the
    tiny call), a small training step on the CPU ranks (``step``), against the step in one
    process, and, with ``loaded``, the "one busy core" rows (``_loaded_rows``)."""
    synk_s, tiny_s, bound_s = _synk_times(ranks, repeat)
    with cf.ProcessPoolExecutor(max_workers=ranks) as pool:
        pool_s = _executor_time(pool, ranks, repeat)
    with mp.Pool(ranks) as pool:
        mp_s = median_time(lambda: pool.map(noop, range(ranks), chunksize=1), repeat, warmup=20)
    mpi = mpi_times(ranks, [], 3, calls=repeat)
    base = "ProcessPoolExecutor"
    rows = [
        result(BENCH, f"synk, {ranks} ranks", synk_s, base, pool_s, ranks=ranks,
               target="<= 25 us per call on 2 ranks, >= 3x faster than the executor"),
        result(BENCH, f"synk tiny call, {ranks} ranks", tiny_s, base, pool_s, ranks=ranks,
               vs_noop=tiny_s / synk_s, target="<= 1.5x the no-op call",
               **({"vs_mpi": mpi["call"] / tiny_s} if "call" in mpi else {})),
        result(BENCH, f"synk tiny call as a bound step, {ranks} ranks", bound_s, base, pool_s,
               ranks=ranks, vs_plain=bound_s / tiny_s,
               **({"vs_mpi": mpi["call"] / bound_s} if "call" in mpi else {})),
        result(BENCH, f"ProcessPoolExecutor, {ranks} workers", pool_s, base, pool_s,
               ranks=ranks),
        result(BENCH, f"multiprocessing.Pool.map, {ranks} workers", mp_s, base, pool_s,
               ranks=ranks),
    ]
    if "call" in mpi:
        rows.append(result(BENCH, f"mpi4py tiny call, {ranks} ranks", mpi["call"], base,
                           pool_s, ranks=ranks))
    rows += captures.run(ranks, repeat, tiny_s)
    rows.append(step.run(BENCH, ranks, repeat))
    if loaded:
        rows += _loaded_rows(ranks, max(200, repeat // 4))
    return rows


def _loaded_rows(ranks: int, repeat: int) -> list[dict]:
    """The no-op and tiny calls with one core kept busy by another process: the ranks no
    longer have a core each. synk runs them as it is (adaptive waiting) and with polling off
    (``SYNK_SPIN_US=0``), beside the executor under the same load, which is their baseline.
    Where the scheduler puts the ranks beside the busy process changes from group to group,
    so each figure is the median of three groups, the forms taking turns."""
    runs: dict = {"adaptive": [], "off": []}
    with busy_core():
        for _ in range(3):
            runs["adaptive"].append(_synk_times(ranks, repeat))
            with environment(SYNK_SPIN_US="0"):
                runs["off"].append(_synk_times(ranks, repeat))
        with cf.ProcessPoolExecutor(max_workers=ranks) as pool:
            pool_s = _executor_time(pool, ranks, repeat)
    adaptive, off = ([statistics.median(t[i] for t in runs[k]) for i in (0, 1)]
                     for k in ("adaptive", "off"))
    base = "ProcessPoolExecutor, one busy core"
    target = "no slower than polling off, nor than the executor"
    return [
        result(BENCH, f"synk, {ranks} ranks, one busy core", adaptive[0], base, pool_s,
               ranks=ranks, vs_polling_off=off[0] / adaptive[0], target=target),
        result(BENCH, f"synk polling off, {ranks} ranks, one busy core", off[0], base, pool_s,
               ranks=ranks),
        result(BENCH, f"synk tiny call, {ranks} ranks, one busy core", adaptive[1], base,
               pool_s, ranks=ranks, vs_polling_off=off[1] / adaptive[1], target=target),
        result(BENCH, f"synk tiny call polling off, {ranks} ranks, one busy core", off[1],
               base, pool_s, ranks=ranks),
        result(BENCH, f"ProcessPoolExecutor, {ranks} workers, one busy core", pool_s, base,
               pool_s, ranks=ranks),
    ]
