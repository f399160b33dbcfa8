"""Scatter: each rank sums its share of a large float32 array. synk with a ``Data``, synk
with a plain numpy argument, ProcessPoolExecutor with pickled chunks, and joblib with
memmapping. Baseline: the same sum in this process, single-threaded (the work itself)."""
from __future__ import annotations

import concurrent.futures as cf

import numpy as np

import synk

from ._timing import group, median_time, result, size_label

BENCH = "scatter"


def share_sum(x):
    """A rank's (or a pool worker's) share of the sum."""
    return x.sum(dtype=np.float64)


def rss_anon_bytes(*_) -> int:
    """This process's private (anonymous) resident memory: a copy of its share would show."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def run(ranks: int, sizes: list[int], repeat: int) -> list[dict]:
    rows = []
    with group(ranks):
        f = synk.function(share_sum, reduce="sum")
        rss = synk.function(rss_anon_bytes, reduce=None)
        for nbytes in sizes:
            repeat = repeat if nbytes < 1 << 28 else max(3, repeat // 3)
            arr = np.random.default_rng(0).random(nbytes // 4, dtype=np.float32)
            truth = arr.sum(dtype=np.float64)
            base_s = median_time(lambda: share_sum(arr), repeat)
            d = synk.data(arr)
            assert np.isclose(f(d), truth, rtol=1e-6)
            before = rss()
            data_s = median_time(lambda: f(d), repeat)
            growth = max(a - b for a, b in zip(rss(), before))
            plain_s = median_time(lambda: f(arr), repeat)
            label = size_label(nbytes)
            rows.append(result(BENCH, f"synk Data, {label}", data_s, "numpy, 1 process",
                               base_s, ranks=ranks, bytes=nbytes,
                               max_rank_memory_growth=growth, share_bytes=nbytes // ranks))
            rows.append(result(BENCH, f"synk plain array, {label}", plain_s, "numpy, 1 process",
                               base_s, ranks=ranks, bytes=nbytes))
            d.free()
            rows += _alternatives(arr, ranks, repeat, label, base_s, nbytes)
    return rows


def _alternatives(arr, ranks: int, repeat: int, label: str, base_s: float, nbytes: int):
    rows = []
    chunks = np.array_split(arr, ranks)
    with cf.ProcessPoolExecutor(max_workers=ranks) as pool:
        pool_s = median_time(lambda: sum(pool.map(share_sum, chunks)), repeat)
    rows.append(result(BENCH, f"ProcessPoolExecutor, {label}", pool_s, "numpy, 1 process",
                       base_s, ranks=ranks, bytes=nbytes))
    try:
        import joblib
    except ImportError:
        return rows
    with joblib.Parallel(n_jobs=ranks, max_nbytes="1M", mmap_mode="r") as parallel:
        job = lambda: sum(parallel(joblib.delayed(share_sum)(c) for c in chunks))  # noqa: E731
        joblib_s = median_time(job, repeat)
    rows.append(result(BENCH, f"joblib memmapping, {label}", joblib_s, "numpy, 1 process",
                       base_s, ranks=ranks, bytes=nbytes))
    return rows
