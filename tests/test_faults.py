"""The fault-injection suite: each fault surfaces in the master as a typed error that says
what happened and what to do, within seconds, and leaves nothing behind (see conftest)."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import run_script

import synk
from synk.errors import RemoteTraceback

PROMPT = 10  # seconds: "within seconds", with room for a loaded CI machine


class Custom(Exception):
    pass


def fail_on(ranks, delay_for=None):
    def fn(x):
        if delay_for and synk.rank() in delay_for:
            time.sleep(0.3)
        if synk.rank() in ranks:
            raise Custom(f"boom on {synk.rank()}")
        return x.sum()

    return fn


def sums(x):
    return x.sum()


def assert_usable():
    assert synk.function(sums, reduce="sum")(np.ones(9)) == 9


def assert_broken_then_refork(f):
    with pytest.raises(synk.GroupBrokenError, match=r"synk.fork\(\)"):
        f(np.ones(9))
    synk.fork(2)  # replaces the broken group; no close() needed
    assert_usable()


def pid_of(rank):
    from synk._engine import state as _state

    return _state.group.procs[rank].pid


# -- 1. exceptions in fn ---------------------------------------------------------------------
@pytest.mark.parametrize("bad_rank", [0, 1, 2])
def test_exception_on_one_rank(ranks3, bad_rank):
    f = synk.function(fail_on({bad_rank}), reduce="sum")
    with pytest.raises(Custom, match=f"boom on {bad_rank}") as info:
        f(np.ones(9))
    if bad_rank:
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert f"Traceback from rank {bad_rank}" in str(cause)
        assert "boom on" in str(cause) and "in fn" in str(cause)
    assert_usable()
    assert f.fn  # the failing function itself is still callable
    with pytest.raises(Custom):
        f(np.ones(9))


def test_exception_on_all_ranks_reports_the_first(ranks3):
    # rank 2 fails at once, ranks 0 and 1 a moment later: rank 2's error is the one raised
    f = synk.function(fail_on({0, 1, 2}, delay_for={0, 1}), reduce="sum")
    with pytest.raises(Custom, match="boom on 2") as info:
        f(np.ones(9))
    assert "Traceback from rank 2" in str(info.value.__cause__)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "ranks [2, 0, 1] raised" in notes or "ranks [2, 1, 0] raised" in notes
    assert "rank 0: Custom: boom on 0" in notes and "rank 1: Custom: boom on 1" in notes
    assert_usable()


def test_builtin_exception_types_are_kept(ranks3):
    def lookup(x):
        if synk.rank() == 2:
            return {}["missing"]
        return x.sum()

    with pytest.raises(KeyError):
        synk.function(lookup, reduce="sum")(np.ones(9))
    assert_usable()


def test_exception_that_cannot_travel_becomes_remote_error(ranks2):
    def unpicklable_error(x):
        class Local(Exception):
            def __reduce__(self):
                raise TypeError("no")

        if synk.rank() == 1:
            raise Local("weird")
        return x.sum()

    with pytest.raises(synk.RemoteError, match="Local: weird"):
        synk.function(unpicklable_error, reduce="sum")(np.ones(4))
    assert_usable()


# -- 2. a function the workers cannot unpickle ----------------------------------------------
def test_function_the_workers_cannot_import(ranks2, tmp_path, monkeypatch):
    (tmp_path / "master_only_mod.py").write_text("def shout(x):\n    return x.sum()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import master_only_mod

    good = synk.function(lambda x: x.max(), reduce="max")
    bad = synk.function(master_only_mod.shout, reduce="sum")
    sys.path.remove(str(tmp_path))  # gone before the workers look for it
    with pytest.raises(synk.DistributeError, match="shout.*rank 1.*master_only_mod.*import"):
        synk.distribute()
    assert good(np.arange(5.0)) == 4.0
    with pytest.raises(synk.DistributeError, match="shout"):
        bad(np.ones(3))
    synk.distribute()  # the bad one does not block later distributes
    assert_usable()


# -- 3. things that cannot be pickled: refused in the master, nothing sent --------------------
def test_unpicklable_function_is_refused_before_sending(ranks2):
    lock = threading.Lock()
    f = synk.function(lambda x: (lock, x.sum())[1], reduce="sum")
    with pytest.raises(TypeError, match="cannot pickle .*lambda.* to ship it"):
        synk.distribute()
    with pytest.raises(TypeError, match="cannot pickle"):
        f(np.ones(3))
    assert_usable()


def test_unpicklable_argument_is_refused_before_sending(ranks2):
    d = synk.data(np.arange(6.0))
    f = synk.function(lambda x, opts: d.array.sum(), bcast_inputs=["opts"], reduce="max")
    assert f(np.ones(2), None) == 15
    d.resize(8)  # a move the ranks hear of with the next call: not lost with a refused one
    d[6:] = 1
    with pytest.raises(TypeError, match="arguments of .*cannot be pickled"):
        f(np.ones(2), threading.Lock())
    assert f(np.ones(2), None) == 17  # every rank sees the resized block
    assert_usable()


def test_instance_of_a_script_class_travels(tmp_path):
    out = run_script(
        tmp_path / "script.py",
        "import numpy as np, synk\n"
        "class Scale:\n    def __init__(self, k):\n        self.k = k\n"
        "synk.fork(2)\n"
        "f = synk.function(lambda x, s: (x * s.k).sum(), bcast_inputs=['s'], reduce='sum')\n"
        "print(f(np.ones(10), Scale(3)), flush=True)\n",
    )
    assert out.strip() == "30.0"


# -- 4. a worker dies -------------------------------------------------------------------------
def sleeper(x):
    if synk.rank() == 1:
        time.sleep(60)
    return x.sum()


def test_sigkill_mid_call(ranks3):
    f = synk.function(sleeper, reduce="sum")
    threading.Timer(0.5, os.kill, (pid_of(1), signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="rank 1 was killed by SIGKILL") as info:
        f(np.ones(9))
    assert time.monotonic() - start < PROMPT
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"
    assert "during a call of" in str(info.value) and "synk.fork()" in str(info.value)
    assert_broken_then_refork(f)


@pytest.mark.parametrize(
    "death,expect",
    [("os._exit(3)", "exited with code 3"), ("ctypes.string_at(0)", "was killed by SIGSEGV")],
)
def test_worker_dies_mid_call(ranks3, death, expect):
    def die(x):
        import ctypes  # noqa: F401 (used by eval(death))
        import os  # noqa: F401

        if synk.rank() == 2:
            eval(death)
        return x.sum()

    f = synk.function(die, reduce="sum")
    with pytest.raises(synk.WorkerDiedError, match=f"rank 2 {expect}"):
        f(np.ones(9))
    assert_broken_then_refork(f)


def test_worker_dies_while_idle(ranks3):
    from synk._engine import state as _state

    f = synk.function(sums, reduce="sum")
    assert f(np.ones(3)) == 3
    proc = _state.group.procs[2]
    proc.kill()
    proc.wait()
    with pytest.raises(synk.WorkerDiedError, match="rank 2 was killed by SIGKILL"):
        f(np.ones(3))
    assert_broken_then_refork(f)


def test_worker_dies_while_the_master_computes_its_share(ranks2):
    def master_busy(x):
        if synk.rank() == 0:
            end = time.monotonic() + 60
            while time.monotonic() < end:  # a long share in Python code
                sum(range(1000))
        return x.sum()

    f = synk.function(master_busy, reduce="sum")
    threading.Timer(0.5, os.kill, (pid_of(1), signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="rank 1 was killed by SIGKILL"):
        f(np.ones(4))
    assert time.monotonic() - start < PROMPT


# -- 5. a rank that never returns ------------------------------------------------------------
def spin_on(rank):
    def fn(x):
        if synk.rank() == rank:
            while True:
                pass
        return x.sum()

    return fn


def test_timeout_per_call_names_the_late_rank(ranks3):
    f = synk.function(spin_on(2), reduce="sum")
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\] did not finish.*within 1 s") as info:
        f(np.ones(9), timeout=1)
    assert time.monotonic() - start < PROMPT
    assert isinstance(info.value, synk.SynkError)
    assert "synk.fork()" in str(info.value)
    assert_broken_then_refork(f)


def test_timeout_as_function_default_on_the_master_share(ranks2):
    f = synk.function(spin_on(0), reduce="sum", timeout=0.5)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0\] did not finish"):
        f(np.ones(4))
    assert time.monotonic() - start < PROMPT
    assert_broken_then_refork(f)


def test_calls_within_their_timeout_are_unaffected(ranks2):
    f = synk.function(sums, reduce="sum", timeout=30)
    for _ in range(50):
        assert f(np.ones(8)) == 8
    assert f(np.ones(8), timeout=None) == 8  # the per-call value overrides the default


def test_timeout_covers_combining_large_outputs(ranks2, monkeypatch):
    monkeypatch.setenv("SYNK_INLINE_OUTPUT_BYTES", "1")
    monkeypatch.setenv("SYNK_PARALLEL_REDUCE_RANKS", "2")
    synk.close()
    synk.fork(2)
    f = synk.function(lambda x: np.ones(1000) * x.sum(), reduce="sum", timeout=30)
    assert np.array_equal(f(np.ones(6)), np.full(1000, 6.0))


class SlowToUnpickle:
    """Unpickling one sleeps for a minute: a stand-in for an import that hangs."""

    def __reduce__(self):
        return (time.sleep, (60,))


def test_distribute_timeout_names_the_ranks_that_hang_unpickling(ranks3):
    slow = SlowToUnpickle()
    f = synk.function(lambda x: (slow, x.sum())[1], reduce="sum")
    start = time.monotonic()
    with pytest.raises(synk.CallTimeoutError, match=r"rank\(s\) \[1, 2\] did not finish "
                       r"while shipping functions within 1 s") as info:
        synk.distribute(timeout=1)
    assert list(info.value.ranks) == [1, 2]
    assert time.monotonic() - start < PROMPT
    with pytest.raises(synk.GroupBrokenError):
        f(np.ones(3))
    synk.fork(3)  # a stopped group is replaced
    assert synk.function(sums, reduce="sum")(np.ones(3)) == 3
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        synk.distribute(timeout=0)


# -- 6. Ctrl-C in the master -----------------------------------------------------------------
@pytest.mark.parametrize("busy_rank", [0, 1])
def test_ctrl_c_in_master_during_a_long_call(ranks3, busy_rank):
    def long_call(x):
        if synk.rank() == busy_rank:
            end = time.monotonic() + 60
            while time.monotonic() < end:
                time.sleep(0.01)
        return x.sum()

    f = synk.function(long_call, reduce="sum")
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        f(np.ones(9))
    assert time.monotonic() - start < PROMPT
    assert_broken_then_refork(f)


# -- 7. the master is killed -----------------------------------------------------------------
def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("state", ["idle", "busy"])
def test_workers_exit_when_the_master_is_killed(tmp_path, state):
    from conftest import synk_segments

    script = tmp_path / "victim.py"
    script.write_text(
        "import sys, time, numpy as np, synk\n"
        "synk.fork(3)\n"
        "d = synk.data(np.ones(100))\n"
        "print(' '.join(str(p.pid) for p in synk._engine.state.group.procs.values()), flush=True)\n"
        + ("time.sleep(60)\n" if state == "idle" else
           "def spin(x):\n    while True:\n        pass\n"
           "synk.function(spin)(d)\n")
    )
    victim = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in victim.stdout.readline().split()]
    time.sleep(0.3)
    victim.kill()
    victim.wait()
    victim.stdout.close()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "workers outlived their master by 5 s"
    assert synk_segments([victim.pid])  # the dead master's Data block is still there...
    synk.fork(2)  # ...until the next fork() on this machine reclaims it
    synk.close()
    assert not synk_segments([victim.pid])
