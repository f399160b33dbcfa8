"""Endurance: many small calls and many fork/close cycles must not grow the master's open
file descriptors, threads, child processes or /dev/shm segments.

    python tests/endurance.py [CALLS] [CYCLES] [RANKS]      (default 10000 100 2)

Prints each resource at the start and end of each phase and exits non-zero on growth.
tests/test_endurance.py runs a scaled-down version.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np

import synk
from conftest import child_pids, synk_segments  # this script's folder is on sys.path


def resources() -> dict:
    """The master's open fds and threads, its children, and synk's /dev/shm segments."""
    return {
        "open fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "child processes": len(child_pids()),
        "/dev/shm segments": len(synk_segments()),
    }


def _loss(x, y):
    return float(np.mean(x @ y))


def _fail(x):
    raise ValueError("planned failure")


def calls(n: int, ranks: int) -> tuple[dict, dict, float]:
    """``n`` small calls of several kinds (after a warm-up) on one group; resources before
    and after, and the mean seconds per call."""
    synk.fork(ranks)
    try:
        rng = np.random.default_rng(0)
        x = synk.data(rng.standard_normal((1000, 10)).astype("float32"))
        plain = rng.standard_normal((200, 10)).astype("float32")
        y = rng.standard_normal(10).astype("float32")
        loss = synk.function(_loss, bcast_inputs=["y"], reduce="mean")
        total = synk.function(lambda a: a.sum(axis=0), reduce="sum")
        fail = synk.function(_fail)

        def one(i: int) -> None:
            kind = i % 4
            if kind == 0:
                assert np.isclose(loss(x, y), np.mean(x.array @ y), rtol=1e-4, atol=1e-5)
            elif kind == 1:
                assert np.allclose(total(plain), plain.sum(axis=0), rtol=1e-4, atol=1e-4)
            elif kind == 2:
                idx = rng.integers(0, 1000, 64)
                assert np.isclose(loss(x, y, batch=idx), np.mean(x.array[idx] @ y), rtol=1e-4, atol=1e-5)
            elif i % 100 == 3:  # the error path, too
                try:
                    fail(x)
                except ValueError:
                    pass
            else:
                loss(x, y, timeout=30)

        for i in range(100):  # warm-up: staging blocks, lazily opened files
            one(i)
        before = resources()
        start = time.perf_counter()
        for i in range(n):
            one(i)
        per_call = (time.perf_counter() - start) / max(n, 1)
        after = settled(before)
    finally:
        synk.close()
    return before, after, per_call


def cycles(n: int, ranks: int) -> tuple[dict, dict, float]:
    """``n`` fork / data / call / close cycles after one warm-up cycle; resources before and
    after, and the mean seconds per cycle."""
    f = synk.function(lambda a: a.sum(), reduce="sum")

    def one() -> None:
        synk.fork(ranks)
        try:
            d = synk.data(np.ones(100))
            assert f(d) == 100
        finally:
            synk.close()

    one()
    before = resources()
    start = time.perf_counter()
    for _ in range(n):
        one()
    per_cycle = (time.perf_counter() - start) / max(n, 1)
    return before, settled(before), per_cycle


def growth(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if after[k] > before[k]}


def settled(before: dict, wait: float = 2.0) -> dict:
    """Resources now, after giving exiting threads and processes up to ``wait`` seconds to
    be gone (a joined thread's OS task ends a moment after ``join`` returns)."""
    end = time.monotonic() + wait
    now = resources()
    while growth(before, now) and time.monotonic() < end:
        time.sleep(0.02)
        now = resources()
    return now


def report(title: str, before: dict, after: dict) -> None:
    print(title)
    for key in before:
        print(f"  {key:<18} {before[key]:>5} -> {after[key]:>5}")


def main(argv: list[str]) -> int:
    n_calls = int(argv[1]) if len(argv) > 1 else 10_000
    n_cycles = int(argv[2]) if len(argv) > 2 else 100
    ranks = int(argv[3]) if len(argv) > 3 else 2
    grown = {}
    before, after, per_call = calls(n_calls, ranks)
    report(f"{n_calls} calls on {ranks} ranks ({per_call * 1e6:.0f} us per call):", before, after)
    grown.update(growth(before, after))
    before, after, per_cycle = cycles(n_cycles, ranks)
    report(f"{n_cycles} fork/close cycles of {ranks} ranks ({per_cycle * 1e3:.0f} ms per cycle):",
           before, after)
    grown.update(growth(before, after))
    print("no growth" if not grown else f"GROWTH: {grown}")
    return 1 if grown else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
