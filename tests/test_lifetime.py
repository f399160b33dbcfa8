"""Errors in fn, dying workers, fork / close / fork, and that nothing is left behind."""
import os
import signal
import time

import numpy as np
import pytest

import synk
from synk.errors import RemoteTraceback


class Custom(Exception):
    pass


def fail_on(rank_to_fail):
    def fn(x):
        if synk.rank() == rank_to_fail:
            raise Custom(f"boom on {synk.rank()}")
        return x.sum()

    return fn


@pytest.mark.parametrize("bad_rank", [0, 1, 2])
def test_exception_in_fn_comes_back_and_group_stays_usable(ranks3, bad_rank):
    f = synk.function(fail_on(bad_rank), reduce="sum")
    with pytest.raises(Custom, match=f"boom on {bad_rank}") as info:
        f(np.ones(9))
    if bad_rank:
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert f"Traceback from rank {bad_rank}" in str(cause)
        assert "boom on" in str(cause) and "fn" in str(cause)
    good = synk.function(lambda x: x.sum(), reduce="sum")
    assert good(np.ones(9)) == 9


def test_builtin_exception_types_are_kept(ranks3):
    def divide(x):
        if synk.rank() == 2:
            return {}["missing"]
        return x.sum()

    with pytest.raises(KeyError):
        synk.function(divide, reduce="sum")(np.ones(9))


def sleeper(x):
    if synk.rank() == 1:
        time.sleep(60)
    return x.sum()


def kill_rank_1_soon(signum=signal.SIGKILL, delay=0.5):
    from synk import _state

    pid = _state.group.procs[1].pid
    import threading

    threading.Timer(delay, os.kill, (pid, signum)).start()
    return pid


def test_sigkill_mid_call_raises_typed_error_without_hang(ranks3):
    f = synk.function(sleeper, reduce="sum")
    kill_rank_1_soon()
    start = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="rank 1 was killed by SIGKILL") as info:
        f(np.ones(9))
    assert time.monotonic() - start < 10
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"
    with pytest.raises(synk.GroupBrokenError, match="fork"):
        f(np.ones(9))


@pytest.mark.parametrize(
    "death,expect",
    [
        ("os._exit(3)", "exited with code 3"),
        ("ctypes.string_at(0)", "was killed by SIGSEGV"),
    ],
)
def test_worker_dies_mid_call(ranks3, death, expect):
    def die(x):
        import ctypes, os  # noqa: F401, E401

        if synk.rank() == 2:
            eval(death)
        return x.sum()

    with pytest.raises(synk.WorkerDiedError, match=f"rank 2 {expect}"):
        synk.function(die, reduce="sum")(np.ones(9))


def test_worker_dies_while_idle(ranks3):
    from synk import _state

    f = synk.function(lambda x: x.sum(), reduce="sum")
    assert f(np.ones(3)) == 3
    proc = _state.group.procs[2]
    proc.kill()
    proc.wait()
    with pytest.raises(synk.WorkerDiedError, match="rank 2 was killed by SIGKILL"):
        f(np.ones(3))


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
    from synk import _state

    _state.group.procs[1].kill()
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
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "import numpy as np, synk\n"
        "synk.fork(2)\n"
        "def f(x):\n    return x.sum()\n"
        "g = synk.function(f, reduce='sum')\n"
        "print(g(np.ones(10)), flush=True)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "10.0"


def test_workers_exit_when_master_is_killed(tmp_path):
    import subprocess
    import sys

    from conftest import synk_segments

    script = tmp_path / "victim.py"
    script.write_text(
        "import sys, time, numpy as np, synk\n"
        "synk.fork(3)\n"
        "d = synk.data(np.ones(100))\n"
        "print(' '.join(str(p.pid) for p in synk._state.group.procs.values()), flush=True)\n"
        "time.sleep(60)\n"
    )
    before = synk_segments()
    victim = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in victim.stdout.readline().split()]
    victim.kill()
    victim.wait()
    victim.stdout.close()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    assert synk_segments() - before  # the dead master's Data block is still there...
    synk.fork(2)  # ...until the next fork() reclaims it
    synk.close()
    assert not (synk_segments() - before)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_function_the_workers_cannot_import(ranks2, tmp_path, monkeypatch):
    """A function from a module only the master can import fails to ship, by name; the
    group and the other functions stay usable."""
    import sys

    (tmp_path / "master_only_mod.py").write_text("def shout(x):\n    return x.sum()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import master_only_mod

    good = synk.function(lambda x: x.max(), reduce="max")
    bad = synk.function(master_only_mod.shout, reduce="sum")
    sys.path.remove(str(tmp_path))  # gone before the workers look for it
    with pytest.raises(synk.DistributeError, match="shout.*rank 1.*master_only_mod"):
        synk.distribute()
    assert good(np.arange(5.0)) == 4.0
    with pytest.raises(synk.DistributeError, match="shout"):
        bad(np.ones(3))
    synk.distribute()  # the bad one does not block later distributes


def test_fork_again_straight_after_a_death():
    synk.fork(2)
    from synk import _state

    _state.group.procs[1].kill()
    with pytest.raises(synk.WorkerDiedError):
        synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4))
    synk.fork(2)  # as the error says: no close() needed first
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4)) == 4
    synk.close()


def test_ctrl_c_in_master_during_a_call(ranks3):
    import threading

    f = synk.function(sleeper, reduce="sum")  # rank 1 sleeps for a minute
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        f(np.ones(9))
    assert time.monotonic() - start < 10
    with pytest.raises(synk.GroupBrokenError):
        f(np.ones(9))
    synk.fork(2)  # replaces the stopped group
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4)) == 4
