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
from conftest import child_pids, synk_segments  # this script's folder is on sys.path

import synk

MESSAGES = "synk.comm message segments"


def resources() -> dict:
    """The master's open fds and threads, its children, and synk's /dev/shm segments (those
    that synk.comm pools for large messages, and the descriptors of their mappings, are
    counted apart)."""
    segments = synk_segments()
    messages = {name for name in segments if "-msg" in name}
    fds = [target for target in _fd_targets() if not _is_message(target)]
    return {
        "open fds": len(fds),
        "threads": len(os.listdir("/proc/self/task")),
        "child processes": len(child_pids()),
        "/dev/shm segments": len(segments - messages),
        MESSAGES: len(messages),
    }


def _fd_targets() -> list:
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, already closed
            pass
    return targets


def _is_message(target: str) -> bool:
    """A synk.comm message segment: each mapping holds a descriptor (mmap keeps one)."""
    return target.startswith("/dev/shm/synk-") and "-msg" in target


def message_pool_bound(ranks: int) -> int:
    """The most message segments the calls below need: a rank has at most two messages out
    to each peer at once (both phases of an allreduce), and reuses those segments after."""
    return 2 * ranks * (ranks - 1)


def _loss(x, y):
    return float(np.mean(x @ y))


def _fail(x):
    raise ValueError("planned failure")


def _comm_exchange(n):
    """A synk.comm allreduce large enough to go through shared memory, and a small one."""
    big = synk.comm.allreduce(np.ones(n))
    return float(big[-1] + synk.comm.allreduce(np.ones(3))[0])


def calls(n: int, ranks: int) -> tuple[dict, dict, float]:
    """``n`` small calls of several kinds (after a warm-up) on one group, some with synk.comm
    messages through shared memory; resources before
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
        exchange = synk.function(_comm_exchange, bcast_inputs=["n"], reduce="max")

        def one(i: int) -> None:
            kind = i % 4
            if kind == 0:
                assert np.isclose(loss(x, y), np.mean(x.array @ y), rtol=1e-4, atol=1e-5)
            elif kind == 1:
                assert np.allclose(total(plain), plain.sum(axis=0), rtol=1e-4, atol=1e-4)
            elif kind == 2:
                idx = rng.integers(0, 1000, 64)
                want = np.mean(x.array[idx] @ y)
                assert np.isclose(loss(x, y, batch=idx), want, rtol=1e-4, atol=1e-5)
            elif i % 100 == 3:  # the error path, too
                try:
                    fail(x)
                except ValueError:
                    pass
            elif i % 10 == 7:  # communication between the ranks
                assert exchange(40_000) == 2 * ranks
            else:
                loss(x, y, timeout=30)

        for i in range(100):  # warm-up: staging blocks, lazily opened files
            one(i)
        before = resources()
        start = time.perf_counter()
        for i in range(n):
            one(i)
        per_call = (time.perf_counter() - start) / max(n, 1)
        after = settled(before, ranks)
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
    return before, settled(before, ranks), per_cycle


def growth(before: dict, after: dict, ranks: int = 2) -> dict:
    """What grew; message segments count only beyond their pool's bound."""
    grown = {k: after[k] - before[k] for k in before if k != MESSAGES and after[k] > before[k]}
    if after.get(MESSAGES, 0) > message_pool_bound(ranks):
        grown[MESSAGES] = after[MESSAGES]
    return grown


def settled(before: dict, ranks: int, wait: float = 2.0) -> dict:
    """Resources now, after giving exiting threads and processes up to ``wait`` seconds to
    be gone (a joined thread's OS task ends a moment after ``join`` returns)."""
    end = time.monotonic() + wait
    now = resources()
    while growth(before, now, ranks) and time.monotonic() < end:
        time.sleep(0.02)
        now = resources()
    return now


def report(title: str, before: dict, after: dict) -> None:
    print(title)
    for key in before:
        print(f"  {key:<28} {before[key]:>5} -> {after[key]:>5}")


def main(argv: list[str]) -> int:
    n_calls = int(argv[1]) if len(argv) > 1 else 10_000
    n_cycles = int(argv[2]) if len(argv) > 2 else 100
    ranks = int(argv[3]) if len(argv) > 3 else 2
    grown = {}
    before, after, per_call = calls(n_calls, ranks)
    report(f"{n_calls} calls on {ranks} ranks ({per_call * 1e6:.0f} us per call):", before, after)
    grown.update(growth(before, after, ranks))
    before, after, per_cycle = cycles(n_cycles, ranks)
    report(f"{n_cycles} fork/close cycles of {ranks} ranks ({per_cycle * 1e3:.0f} ms per cycle):",
           before, after)
    grown.update(growth(before, after, ranks))
    print("no growth" if not grown else f"GROWTH: {grown}")
    return 1 if grown else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
