"""Nothing of a call or a group is left behind after a
failure, an interrupt of ``close()``, or a SIGTERM to a master that forked from a thread."""
import subprocess
import sys
import threading

import numpy as np
import pytest

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

# Ctrl-C raises KeyboardInterrupt here, as in a terminal, however the test was started: a
# shell without job control starts a background command (`pytest ... &` in a script) with
# SIGINT ignored, which its children inherit, and Python then installs no handler of its own
signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
signal.signal(signal.SIGINT, signal.default_int_handler)
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

def ctrl_c_once_close_waits():
    # Ctrl-C once the main thread waits inside close() for a worker to exit (a timer could
    # fire before close() began on a loaded machine)
    main = threading.main_thread().ident
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        frame, synk_close, waiting = sys._current_frames().get(main), False, False
        while frame is not None:
            code = frame.f_code
            synk_close |= code.co_name == "close" and code.co_filename.startswith(SYNK)
            waiting |= code.co_name == "wait" and code.co_filename.endswith("subprocess.py")
            frame = frame.f_back
        if synk_close and waiting:
            break
        time.sleep(0.002)
    os.kill(os.getpid(), signal.SIGINT)

def check(case, ranks=2):
    if left() != ([], [], []):  # only if Ctrl-C came before close() began: the group runs on
        assert f"running on {ranks} CPU" in synk.backend(), (case, left(), synk.backend())
        synk.close()
        assert left() == ([], [], []), (case, left())
    synk.close()  # a later close() is fine
    assert left() == ([], [], []), (case, "after close", left())

# Ctrl-C while close() waits for a worker to exit
synk.fork(3, backend="cpu")
assert synk.function(slow_exit, reduce="sum")(np.ones((100, 4))) == 400
interrupter = threading.Thread(target=ctrl_c_once_close_waits)
interrupter.start()
try:
    synk.close()
    raise AssertionError("close() was not interrupted")
except KeyboardInterrupt:
    pass
interrupter.join()
check("waiting", ranks=3)

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


# -- item 5: SIGTERM to a master that forked from another thread ------------------------------
_FORK_IN_A_THREAD = """
import os, sys, threading, time
import numpy as np
import synk

def children():
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        found.append(int(entry))
            except OSError:
                pass
    return found

def start():
    synk.fork(3, backend="cpu")
    x = np.ones((50_000, 4))  # staged in shared memory
    assert synk.function(lambda x: x.sum(), reduce="sum")(x) == x.sum()

def segments():
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"synk-{os.getpid()}-")]

# a group forked and closed in a thread leaves nothing, its guardian included
thread = threading.Thread(target=start)
thread.start(); thread.join()
assert len(children()) >= 2, children()  # two workers (and the guardian)
thread = threading.Thread(target=synk.close)
thread.start(); thread.join()
assert children() == [] and segments() == [], (children(), segments())

data = synk.data(np.arange(10.0))  # the process's own Data block goes too
thread = threading.Thread(target=start)
thread.start(); thread.join()
print(" ".join(map(str, children())), flush=True)
time.sleep(120)
"""


_TERMINATE_IT = """
import os, signal, subprocess, sys, time

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

def segments(pid):
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"synk-{pid}-")]

proc = subprocess.Popen([sys.executable, "-W", "ignore", sys.argv[1]], stdout=subprocess.PIPE,
                        text=True)
children = [int(p) for p in proc.stdout.readline().split()]
assert children and segments(proc.pid), "the script did not start its group"
proc.send_signal(signal.SIGTERM)
assert proc.wait(timeout=30) == -signal.SIGTERM
deadline = time.monotonic() + 60
while (segments(proc.pid) or any(alive(p) for p in children)) and time.monotonic() < deadline:
    time.sleep(0.05)
print("left:", segments(proc.pid), [p for p in children if alive(p)])
"""


@pytest.mark.timeout(150)
def test_sigterm_to_a_master_that_forked_from_a_thread_leaves_nothing(tmp_path):
    """In a private /dev/shm, which other synk programs on the machine (whose fork() would
    sweep what a dead master left) do not see."""
    (tmp_path / "fork_in_a_thread.py").write_text(_FORK_IN_A_THREAD)
    (tmp_path / "terminate_it.py").write_text(_TERMINATE_IT)
    shell = ("mount -t tmpfs -o size=256m,mode=1777 tmpfs /dev/shm || exit 99\n"
             '"$0" "$1" "$2"\n')
    try:
        out = subprocess.run(["unshare", "--mount", "sh", "-c", shell, sys.executable,
                              str(tmp_path / "terminate_it.py"),
                              str(tmp_path / "fork_in_a_thread.py")],
                             capture_output=True, text=True, timeout=140)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"unshare is not available: {err}")
    if out.returncode == 99 or "unshare:" in out.stderr:
        pytest.skip(f"needs root, to mount a private /dev/shm: {out.stderr}")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "left: [] []", out.stdout + out.stderr
