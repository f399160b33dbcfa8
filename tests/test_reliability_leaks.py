"""Reliability, round 4 (issue 38): nothing of a call or a group is left behind after a
failure, an interrupt of ``close()``, or a SIGTERM to a master that forked from a thread."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import synk_segments

import synk
from synk import comm


def _op_threads(marker=None) -> int:
    return sum(t.name == "synk-comm-op" for t in threading.enumerate())


def _count_everywhere() -> list:
    """The synk-comm-op threads on every rank (the master's counted in the master)."""
    workers = synk.function(_op_threads, bcast_inputs=["marker"], reduce=None)(0)
    return [_op_threads(), *workers[1:]]


# -- item 3: a failed call leaves no thread of its non-blocking collectives -------------------
def _many_in_flight_then_fail(marker, who):
    group = comm.split(0) if marker == "group" else None
    start = group.iallreduce if group is not None else comm.iallreduce
    handles = [start(np.ones(20_000), "max") for _ in range(25)]
    if comm.rank() == who:
        raise ValueError("boom")
    return sum(float(h.wait().sum()) for h in handles)


@pytest.mark.parametrize("who", [1, 0], ids=["a worker fails", "rank 0 fails"])
@pytest.mark.parametrize("where", ["call", "group"])
def test_a_failed_call_leaves_no_comm_op_threads(ranks3, who, where):
    f = synk.function(_many_in_flight_then_fail, bcast_inputs=["marker", "who"],
                      reduce=None, timeout=60)
    for _ in range(4):
        with pytest.raises(ValueError, match="boom"):
            f(where, who)
    assert _count_everywhere() == [0, 0, 0]
    ok = synk.function(lambda m: float(comm.allreduce(np.ones(3)).sum()), bcast_inputs=["m"],
                       reduce=None)
    assert ok(0) == [9.0] * 3  # the group goes on


def _started_not_waited(marker):
    handles = [comm.iallreduce(np.full(20_000, comm.rank() + 1.0)) for _ in range(10)]
    if comm.rank() == 0:
        return float(handles[-1].wait()[0])
    return None  # the other ranks never wait for theirs


def test_operations_not_waited_for_finish_with_the_call_and_leave_no_threads(ranks3):
    f = synk.function(_started_not_waited, bcast_inputs=["marker"], reduce=None, timeout=60)
    for _ in range(3):
        assert f(0) == [6.0, None, None]
    assert _count_everywhere() == [0, 0, 0]


# -- item 4: Ctrl-C inside close() leaves nothing behind --------------------------------------
_CTRL_C_IN_CLOSE = """
import os, signal, sys, threading, time
import numpy as np
import synk

SYNK = os.path.dirname(synk.__file__)

def left():
    me = os.getpid()
    segments = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"synk-{me}-"))
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        children.append(int(entry))
            except OSError:
                pass
    threads = [t.name for t in threading.enumerate() if t.name.startswith("synk")]
    return segments, children, threads

def ctrl_c_at(n):
    # Ctrl-C at the n-th call of a function of synk's inside close() (main thread)
    calls = [0]
    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(SYNK):
            calls[0] += 1
            if calls[0] == n:
                os.kill(os.getpid(), signal.SIGINT)
    return trace

def slow_exit(x):
    if synk.rank():  # the worker takes 3 s to exit: close() waits for it
        import atexit
        atexit.register(time.sleep, 3)
    return x.sum()

def check(case):
    if left() != ([], [], []):  # only if Ctrl-C came before close() began: the group runs on
        assert "running on 2" in synk.backend(), (case, left(), synk.backend())
        synk.close()
        assert left() == ([], [], []), (case, left())
    synk.close()  # a later close() is fine
    assert left() == ([], [], []), (case, "after close", left())

# Ctrl-C while close() waits for a worker to exit
synk.fork(3, backend="cpu")
assert synk.function(slow_exit, reduce="sum")(np.ones((100, 4))) == 400
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    synk.close()
    raise AssertionError("close() was not interrupted")
except KeyboardInterrupt:
    pass
check("waiting")

# Ctrl-C at every STEP-th point of close()
interrupted = 0
for n in range(1, 1000, STEP):
    synk.fork(2, backend="cpu")
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones((10, 2))) == 20
    sys.settrace(ctrl_c_at(n))
    try:
        synk.close()
        sys.settrace(None)
    except KeyboardInterrupt:
        sys.settrace(None)
        interrupted += 1
    else:
        break  # n is past close()'s last call
    check(n)
synk.fork(2, backend="cpu")  # and so are a new group and its close()
assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones((4, 2))) == 8
synk.close()
assert left() == ([], [], []), ("after fork/close", left())
print("ok", interrupted)
"""


@pytest.mark.timeout(180)
def test_ctrl_c_inside_close_leaves_no_segments_processes_or_threads(tmp_path):
    script = tmp_path / "ctrl_c_in_close.py"
    script.write_text(_CTRL_C_IN_CLOSE.replace("STEP", "4"))
    out = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True,
                         text=True, timeout=170)
    assert out.returncode == 0, out.stdout + out.stderr
    said, interrupted = out.stdout.split()
    assert said == "ok" and int(interrupted) >= 10, out.stdout
