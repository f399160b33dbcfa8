"""A small training step: the call shape of a hand-written mini-batch SGD loop. An MLP layer
pair of MNIST's sizes (784 -> 30 -> 10), ``batch=`` of 10 random rows of a ``synk.Data``
(10,000 rows), the two weight matrices as broadcast inputs and a tuple of outputs (the
mean loss and a sum over the rows). Baseline: the same step in one process with numpy on
the same 10 rows (ratio < 1: the cost of spreading so little work over the ranks)."""
from __future__ import annotations

import numpy as np

import synk

from ._timing import group, median_time, result

ROWS, FEATURES, HIDDEN, CLASSES, BATCH = 10_000, 784, 30, 10, 10


def step(x, y, w1, w2):
    """One forward pass and its loss: what each rank computes on its rows."""
    xp = synk.xp(x)
    h = xp.tanh(x @ w1)
    return ((h @ w2 - y) ** 2).mean(), h.sum(axis=0)


def run(bench: str, ranks: int, repeat: int, backend: str = "cpu", label: str = "") -> dict:
    """The step's median seconds per call on a fresh group of ``ranks`` (``backend``), as a
    result row against the one-process numpy step."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((ROWS, FEATURES)), rng.standard_normal((ROWS, CLASSES))
    w1, w2 = rng.standard_normal((FEATURES, HIDDEN)), rng.standard_normal((HIDDEN, CLASSES))
    batches = [rng.permutation(ROWS)[:BATCH] for _ in range(64)]
    turn = iter(range(1 << 62))

    def alone():
        idx = batches[next(turn) % len(batches)]
        return step(x[idx], y[idx], w1, w2)

    baseline_s = median_time(alone, repeat, warmup=20)
    with group(ranks, backend=backend):
        x_data, y_data = synk.data(x), synk.data(y)
        f = synk.function(step, inputs=["x", "y"], bcast_inputs=["w1", "w2"],
                          reduce=("mean", "sum"))
        loss, total = f(x_data, y_data, w1, w2, batch=batches[0])
        want = step(x[batches[0]], y[batches[0]], w1, w2)
        assert np.isclose(loss, want[0]) and np.allclose(total, want[1]), "wrong step"
        seconds = median_time(
            lambda: f(x_data, y_data, w1, w2, batch=batches[next(turn) % len(batches)]),
            repeat, warmup=50)
    return result(bench, f"{label}small training step, {ranks} ranks", seconds,
                  "the step in one process", baseline_s, ranks=ranks,
                  overhead_s=seconds - baseline_s)
