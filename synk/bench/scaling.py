"""Scaling: a compute-bound function that uses no threads (per-row numpy work in a Python
loop) on 1..n ranks, against the same function in this process."""
from __future__ import annotations

import numpy as np

import synk

from ._timing import group, median_time, result

BENCH = "scaling"


def per_row_work(x):
    """Sort every row and sum the medians: many small numpy calls, no threads."""
    total = 0.0
    for row in x:
        total += float(np.sort(row)[row.shape[0] // 2])
    return total


def run(max_ranks: int, rows: int, repeat: int) -> list[dict]:
    x = np.random.default_rng(0).random((rows, 256))
    truth = per_row_work(x)
    base_s = median_time(lambda: per_row_work(x), repeat)
    out = []
    for n in range(1, max_ranks + 1):
        with group(n):
            f = synk.function(per_row_work, reduce="sum")
            d = synk.data(x)
            assert np.isclose(f(d), truth)
            seconds = median_time(lambda: f(d), repeat)
        speedup = base_s / seconds
        out.append(result(BENCH, f"synk, {n} rank{'s' if n > 1 else ''}", seconds,
                          "numpy, 1 process", base_s, ranks=n, speedup=speedup,
                          efficiency=speedup / n, target=">= 1.8x on 2 cores"))
    return out
