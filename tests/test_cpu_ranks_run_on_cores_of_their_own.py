"""CPU ranks on one host run on cores of their own, as ``mpiexec`` binds its ranks: rank r
on the r-th run of ``cores // n`` of the cores the master may run on (rank 0 is the master:
every thread of it while the group runs, and where it ran before once it is closed); any
core where there are more ranks than cores, or with ``SYNK_BIND_CORES=0``."""
import os
import threading

import pytest

import synk

CORES = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CORES) < 2, reason="one core: no cores to share out")


def cores() -> list:
    return sorted(os.sched_getaffinity(0))


def threads_cores() -> dict:
    return {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}


def test_each_rank_runs_on_cores_of_its_own_and_the_master_as_before_once_closed():
    k = len(CORES) // 2
    before = threads_cores()
    late, seen = threading.Event(), []
    synk.fork(2)
    try:
        ranks = synk.function(cores, reduce=None)()
        in_a_thread = synk.function(lambda: _in_a_thread(cores), reduce=None)()
        during = cores()
        waiting = threading.Thread(target=lambda: (late.wait(60), seen.append(cores())))
        waiting.start()  # (started during the group, running on after it)
    finally:
        synk.close()
    late.set()
    waiting.join()
    assert ranks == in_a_thread == [CORES[:k], CORES[k:2 * k]]
    assert during == CORES[:k]
    assert seen == [CORES]  # (where the master ran before)
    after = threads_cores()
    assert all(after[t] == c for t, c in before.items() if t in after)


def _in_a_thread(fn):
    got = []
    t = threading.Thread(target=lambda: got.append(fn()))
    t.start()
    t.join()
    return got[0]


@pytest.mark.skipif(len(CORES) > 8, reason="a rank for every core and one more: too many here")
def test_more_ranks_than_cores_run_on_any_core():
    synk.fork(len(CORES) + 1)
    try:
        assert synk.function(cores, reduce=None)() == [CORES] * (len(CORES) + 1)
    finally:
        synk.close()


def test_bind_cores_0_lets_every_rank_run_on_any_core(monkeypatch):
    monkeypatch.setenv("SYNK_BIND_CORES", "0")
    synk.fork(2)
    try:
        assert synk.function(cores, reduce=None)() == [CORES, CORES]
        assert cores() == CORES
    finally:
        synk.close()
