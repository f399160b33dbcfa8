"""Group lifetime: fork / close / fork, start-up failures, scripts without a main guard.

The fault cases (errors, deaths, timeouts, Ctrl-C) are in test_faults.py."""

import gc
import os
import signal
import weakref

import numpy as np
import pytest
from conftest import run_script, synk_segments

import synk


def _blocks() -> set:
    """This process's synk segments, their locks left out."""
    return {n for n in synk_segments() if not n.endswith("-lock")}


def pid_of_rank_1():
    return synk.function(lambda x: os.getpid(), reduce=None)(np.ones(2))[1]


def test_fork_close_fork():
    f = synk.function(lambda x: x.sum(), reduce="sum")
    for n in (2, 3, 2):
        synk.fork(n)
        assert f(np.ones(10)) == 10
        d = synk.data(np.arange(10.0))
        assert f(d) == 45
        synk.close()
        synk.close()  # idempotent
    synk.fork(2)
    assert f(np.ones(4)) == 4  # reshipped to the new group
    synk.close()


def test_fork_after_worker_death():
    synk.fork(2)
    os.kill(pid_of_rank_1(), signal.SIGKILL)
    with pytest.raises(synk.WorkerDiedError):
        synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4))
    synk.close()
    synk.fork(2)
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4)) == 4
    synk.close()


def test_worker_start_failure_is_reported(monkeypatch):
    monkeypatch.setattr("sys.executable", "/bin/false")  # a worker that exits at once
    with pytest.raises(synk.WorkerStartError, match="rank 1 failed to start"):
        synk.fork(2)
    monkeypatch.undo()
    synk.fork(2)  # nothing half-started is left in the way
    synk.close()


def test_script_without_main_guard_and_master_exit(tmp_path):
    """A plain top-level script works, and its workers go when it exits without close()."""
    out = run_script(
        tmp_path / "script.py",
        "import numpy as np, synk\n"
        "synk.fork(2)\n"
        "def f(x):\n    return x.sum()\n"
        "g = synk.function(f, reduce='sum')\n"
        "print(g(np.ones(10)), flush=True)\n",
    )
    assert out.strip() == "10.0"





def test_fork_again_straight_after_a_death():
    synk.fork(2)
    os.kill(pid_of_rank_1(), signal.SIGKILL)
    with pytest.raises(synk.WorkerDiedError):
        synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4))
    synk.fork(2)  # as the error says: no close() needed first
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4)) == 4
    synk.close()




def test_a_collected_functions_staging_blocks_are_freed_by_the_next_call(ranks2):
    """A large plain-numpy input is staged in a shared-memory block kept for its function;
    once the function is garbage-collected, the next call of another function frees it."""
    before = _blocks()
    f = synk.function(lambda x: x.sum(), reduce="sum")
    assert f(np.ones((1 << 16, 4))) == 1 << 18
    staged = _blocks() - before
    assert staged  # (the input's staging block)
    del f
    gc.collect()
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(3)) == 3
    assert not staged & _blocks()


def test_a_call_that_passes_nothing_frees_what_was_collected_too(ranks2):
    """A call with no arguments does the upkeep any call does: the staging blocks of a
    collected function are freed, and the workers drop the replicas of a collected shared
    variable."""
    before = _blocks()
    f = synk.function(lambda x: x.sum(), reduce="sum")
    assert f(np.ones((1 << 16, 4))) == 1 << 18
    staged = _blocks() - before
    assert staged
    v = synk.shared(np.arange(3.0))
    assert synk.function(_watch_replica, reduce="sum")(v) == 6.0
    held = synk.function(_replica_alive, reduce=None)
    assert held() == [True, True]
    del f, v
    gc.collect()
    assert held() == [False, False]
    assert not staged & _blocks()


_REPLICAS: list = []  # on each rank: a weak reference to the replica a call was given


def _watch_replica(w) -> float:
    _REPLICAS.append(weakref.ref(w))
    return float(w.sum())


def _replica_alive() -> bool:
    gc.collect()
    return _REPLICAS[-1]() is not None
