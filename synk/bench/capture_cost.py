"""The cost of checking, before each call, that what a function captured has not changed
since it was shipped (docs/api/calls.md, "What fn captures"). Functions defined as in a user's
script (a module the workers cannot import, so they are shipped by value): the check alone
for a few kinds of capture, and a whole tiny call of a function capturing a few small
globals against the same tiny call of a module-level function (whose module the workers
import, so there is nothing to check). Baseline: that tiny call. A check's figure is the
best of its batches in CPU time, the call's the median of single calls."""
from __future__ import annotations

import time
import warnings

import numpy as np

import synk

from .._call.captures import Captures
from ._timing import group, median_time, result

BENCH = "capture check"

SCRIPT = '''
import types
import numpy as np

W = np.arange(3.0)
LR = 0.5
CFG = {"scale": 2.0, "bias": 1.0, "name": "run", "layers": (4, 2)}

def tiny(x, y):
    return x.sum() * y * (W[1] * LR * CFG["scale"])  # (the factor is 1.0)

class Model:
    def __init__(self):
        self.w = np.ones(4)
        self.opt = types.SimpleNamespace(lr=0.1, momentum=0.9)
        self.steps = 0
    def step(self, x):
        return self.loss(x) * self.opt.lr
    def loss(self, x):
        return float((x @ self.w).sum())

MODEL = Model()

LONG = list(range(100))
CONFIG = {"model": {"layers": {"head": {"scale": 1.0}}}}
def issue_case():
    return LONG[99] + CONFIG["model"]["layers"]["head"]["scale"]

PARAMS = [np.zeros(5000)]
def large_array():
    return PARAMS[0].sum()

MANY = list(range(10_000))
def many_items():
    return MANY[-1]
'''


def script() -> dict:
    """The namespace of SCRIPT run as a module of its own, not importable by the workers."""
    namespace: dict = {"__name__": "synk_bench_script"}
    exec(SCRIPT, namespace)  # noqa: S102
    return namespace


def per_check(fn, rounds: int, batch: int = 1000) -> float:
    """Seconds of one check of ``fn``'s captures: the best of ``rounds`` batches of
    ``batch`` checks, in this thread's CPU time (as timeit advises for a short statement:
    the other batches, and wall-clock time, measure the machine's other load)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the large array's warning)
        captures = Captures(fn, "bench")
    changed = captures.changed
    assert changed() is None, "the benchmark's captures changed"
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(batch):
            changed()
        times.append((time.thread_time() - start) / batch)
    return min(times)


def run(ranks: int, repeat: int, tiny_s: float) -> list[dict]:
    """Rows for the check alone, and for a tiny call of a function capturing a few small
    globals on a fresh group of ``ranks``; ``tiny_s``: the seconds of the same tiny call
    of ``tiny``, a module-level function."""
    ns = script()
    rounds = max(5, repeat // 100)
    cases = [("a few small globals (an array of 3, a float, a dict of 4)", ns["tiny"]),
             ("a bound method (self: an array, a namespace, a number; 3 methods)",
              ns["MODEL"].step),
             ("item 99 of a 100-item list and a 4-level dict", ns["issue_case"]),
             ("a 40 KB array in a list (sampled)", ns["large_array"]),
             ("a 10,000-item list", ns["many_items"])]
    base = "a tiny synk call"
    rows = [result(BENCH, f"the check: {case}", per_check(fn, rounds), base,
                   tiny_s) for case, fn in cases]
    with group(ranks):
        f = synk.function(ns["tiny"], bcast_inputs=["y"], reduce="sum")
        x = np.arange(16.0)
        assert np.isclose(f(x, 3.0), ns["tiny"](x, 3.0)), "wrong tiny call"
        captured_s = median_time(lambda: f(x, 3.0), repeat, warmup=50)
    rows.append(result(BENCH, f"synk tiny call capturing a few globals, {ranks} ranks",
                       captured_s, base, tiny_s, ranks=ranks, vs_tiny=captured_s / tiny_s))
    return rows
