"""Call overhead: a no-op on n ranks, synk versus ProcessPoolExecutor (one task per worker)
and multiprocessing.Pool.map. Baseline: ProcessPoolExecutor (ratio > 1: faster than it)."""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp

import synk

from ._timing import median_time, result

BENCH = "call overhead"


def noop(*_):
    return None


def run(ranks: int, repeat: int) -> list[dict]:
    synk.fork(ranks)
    try:
        f = synk.function(noop, reduce=None)
        synk_s = median_time(f, repeat, warmup=50)
    finally:
        synk.close()
    with cf.ProcessPoolExecutor(max_workers=ranks) as pool:
        def executor_call():
            for fut in [pool.submit(noop) for _ in range(ranks)]:
                fut.result()

        pool_s = median_time(executor_call, repeat, warmup=20)
    with mp.Pool(ranks) as pool:
        mp_s = median_time(lambda: pool.map(noop, range(ranks), chunksize=1), repeat, warmup=20)
    base = "ProcessPoolExecutor"
    return [
        result(BENCH, f"synk, {ranks} ranks", synk_s, base, pool_s, ranks=ranks,
               target="<= 100 us per call on 2 ranks, >= 3x faster than the executor"),
        result(BENCH, f"ProcessPoolExecutor, {ranks} workers", pool_s, base, pool_s,
               ranks=ranks),
        result(BENCH, f"multiprocessing.Pool.map, {ranks} workers", mp_s, base, pool_s,
               ranks=ranks),
    ]
