"""Faults under mpiexec with pretend hosts: an exception on a rank of another host, a rank
killed (in its function, and while the others wait for it in synk.comm), a call past its
timeout, close() ending every process, and start-up mistakes. A broken group ends the MPI
job within seconds: never a hang (the runs have hard timeouts)."""
import re

import mpirun
import pytest

EXCEPTION = """
class Custom(Exception):
    pass


def f(x):
    if synk.rank() == 3:
        raise Custom(f"bad rows {len(x)}")
    return x.sum()


try:
    synk.function(f)(np.ones((40, 2)))
except Custom as err:
    print("RAISED", type(err).__name__, err, flush=True)
    print("CAUSE", err.__cause__, flush=True)


def in_comm(x):
    if synk.rank() == 3:
        raise KeyError("no such key")
    return synk.comm.allreduce(x.sum(axis=0))  # the others wait for rank 3 here


try:
    synk.function(in_comm)(np.ones((40, 2)))
except KeyError as err:
    print("COMM RAISED", repr(err), getattr(err, "__notes__", ""), flush=True)
g = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None)
assert all(np.allclose(r, [40, 40]) for r in g(np.ones((40, 2))))  # still usable
print("USABLE", flush=True)
"""


def test_an_exception_on_another_host_comes_back_and_the_group_stays_usable(tmp_path):
    run = mpirun.run(tmp_path, EXCEPTION)
    assert run.rc == 0 and "USABLE" in run.out, run
    assert "RAISED Custom bad rows 10" in run.out, run
    assert "Traceback from rank 3" in run.out and 'raise Custom(f"bad rows' in run.out, run
    assert "COMM RAISED KeyError('no such key')" in run.out, run


UNRECEIVED = """
def f(x, big):
    if synk.rank() == 3:  # (on host b) it fails before it takes rank 1's message
        raise LookupError("rank 3 fails before receiving")
    if synk.rank() == 1:  # (on host a) 8 MB: MPI sends it only once rank 3 takes it
        synk.comm.isend(np.ones(1_000_000), 3).wait()
    if synk.rank() == 2:
        synk.comm.send(big, 3)
    return x.sum()


start = time.monotonic()
try:
    synk.function(f, bcast_inputs=["big"], timeout=30)(np.ones((40, 2)), np.ones(500_000))
except LookupError as err:
    print(f"RAISED after {time.monotonic() - start:.1f} s: {err}", flush=True)
print(synk.function(lambda x: x.sum(), reduce="sum")(np.ones(8)), "USABLE", flush=True)
"""


def test_a_large_send_whose_receiver_failed_ends_with_the_receivers_error(tmp_path):
    """A large message under MPI goes only once its receiver takes it (a rendezvous); a
    receiver whose share failed first never does: the sender's wait ends with the call's
    abort, as a wait to receive does, never a hang (nor the call's timeout)."""
    run = mpirun.run(tmp_path, UNRECEIVED)
    assert run.rc == 0 and "USABLE" in run.out, run
    seen = re.search(r"RAISED after ([0-9.]+) s: rank 3 fails before receiving", run.out)
    assert seen is not None and float(seen.group(1)) < 15, run


KILLED = """
import signal


def f(x):
    if synk.rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    {wait}
    return x.sum()


start = time.monotonic()
try:
    synk.function(f)(np.ones((40, 2)))
except synk.WorkerDiedError as err:
    print(f"DIED after {{time.monotonic() - start:.2f}} s: {{err}}", flush=True)
    raise
"""


def _check_killed(run):
    """The job ended in seconds, saying which rank died: the master's line (rank and host),
    unless the launcher, which ends a job whose process was killed by a signal, stopped the
    master (SIGTERM, then SIGKILL) first; then the launcher's own notice names the rank."""
    assert run.rc != 0, run
    said = "synk: WorkerDiedError: worker rank 2 on host 'b'" in run.err
    if said:
        assert "the MPI job is ending" in run.err, run
    else:
        assert re.search(r"process rank 2 .*\n?.*signal 9", run.err), run
    seen = re.search(r"DIED after ([0-9.]+) s", run.out)
    assert seen is None or float(seen.group(1)) < 5, run
    assert run.seconds < 20, run


def test_a_killed_rank_ends_the_job_with_a_clear_error(tmp_path):
    run = mpirun.run(tmp_path, KILLED.format(wait="time.sleep(0.5)"))
    _check_killed(run)


def test_a_rank_killed_while_the_others_wait_for_it_in_synk_comm(tmp_path):
    run = mpirun.run(tmp_path, KILLED.format(wait="synk.comm.allreduce(x.sum(axis=0))"))
    _check_killed(run)


IN_COMBINE = """
import signal
import sys
import threading


def kill_inside_mpi():  # SIGKILL this rank once its main thread is inside synk's MPI Reduce
    main = threading.main_thread().ident
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "reduce" and "mpi_collectives" in frame.f_code.co_filename:
                os.kill(os.getpid(), signal.SIGKILL)
            frame = frame.f_back
        time.sleep(0.0002)
    os.kill(os.getpid(), signal.SIGKILL)


def f(x):
    if synk.rank() == 2:
        threading.Thread(target=kill_inside_mpi, daemon=True).start()
    return np.ones(1 << 21)  # 16 MiB each: combined by MPI's Reduce, by host


start = time.monotonic()
try:
    synk.function(f, reduce="sum")(np.ones((40, 2)))
except synk.WorkerDiedError as err:
    print(f"DIED after {time.monotonic() - start:.2f} s: {err}", flush=True)
    raise
"""


def test_a_rank_killed_inside_the_mpi_collective_of_the_outputs(tmp_path):
    """Rank 2 dies while it and the others are inside the Reduce that combines the call's
    large outputs (the leader of host 'b': rank 3 reduces into it, rank 0 waits for it):
    the job ends in seconds naming it, never a hang."""
    run = mpirun.run(tmp_path, IN_COMBINE)
    _check_killed(run)


TIMEOUT = """
def f(x, late):
    if synk.rank() == 3 and late:
        time.sleep(600)
    return {out}


g = synk.function(f, bcast_inputs=["late"])
g(np.ones((40, 2)), False)  # (with large outputs: their plan goes with the next call)
start = time.monotonic()
try:
    g(np.ones((40, 2)), True, timeout=2)
except synk.CallTimeoutError as err:
    print(f"TIMED OUT after {{time.monotonic() - start:.2f}} s, ranks {{list(err.ranks)}}",
          flush=True)
"""


@pytest.mark.parametrize("out", ["x.sum()", "np.ones(1 << 16)"],
                         ids=["small output", "large output"])
def test_a_call_past_its_timeout_ends_the_job(tmp_path, out):
    """The late rank is named, also when the others wait for it in the collectives of
    large outputs that the call planned (they reply first)."""
    run = mpirun.run(tmp_path, TIMEOUT.format(out=out))
    assert "TIMED OUT after" in run.out and "ranks [3]" in run.out, run
    assert "did not finish during a call of f within 2 s" in run.text, run
    assert run.rc != 0 and "MPI_Abort" in run.text, run
    assert run.seconds < 30, run


CLOSE = """
pids = synk.function(lambda: os.getpid(), reduce=None)()
synk.close()
deadline = time.monotonic() + 10
while any(os.path.exists(f"/proc/{p}") for p in pids[1:]) and time.monotonic() < deadline:
    time.sleep(0.05)
print("WORKERS LEFT", [p for p in pids[1:] if os.path.exists(f"/proc/{p}")], flush=True)
try:
    synk.fork()
except synk.SynkError as err:
    print("AGAIN", err, flush=True)
print("MASTER GOES ON", flush=True)
"""


def test_close_ends_every_process_and_the_master_goes_on(tmp_path):
    run = mpirun.run(tmp_path, CLOSE)
    assert run.rc == 0 and "MASTER GOES ON" in run.out, run
    assert "WORKERS LEFT []" in run.out, run
    assert "AGAIN under MPI a job runs one synk group" in run.out, run


def test_fork_with_the_wrong_n_releases_the_workers(tmp_path):
    body = """
import synk
try:
    synk.fork(3)
except ValueError as err:
    print("REFUSED", err, flush=True)
"""
    run = mpirun.run(tmp_path, body, preamble="")
    assert run.rc == 0, run
    assert "REFUSED synk.fork(n=3) under MPI: this job has 4 MPI processes" in run.out, run
    assert run.out.count("REFUSED") == 1, run  # the workers never ran the rest of the script


def test_a_master_whose_own_start_fails_raises_at_once_and_the_workers_say_why(tmp_path):
    """The master's device does not exist: the ranks have heard of the group and are
    connecting to it. fork() raises in the master (it used to wait in MPI_Finalize for
    ranks that waited for it), the ranks say that the master failed rather than blame the
    network, and the job ends."""
    body = """
import synk
try:
    synk.fork(backend="gpu", devices=[5, 0])
except ValueError as err:
    print("RAISED", err, flush=True)
"""
    run = mpirun.run(tmp_path, body, preamble="", env={"SYNK_SIMULATE_GPUS": "2"})
    assert "RAISED device_id must be one of the visible CUDA devices [0, 1], got 5" in run.out, run
    # (the job may end before every rank has said it)
    assert "the master's fork() failed (ValueError: device_id must be" in run.err, run
    assert "SYNK_MASTER_ADDR" not in run.err, run
    assert run.rc != 0, run  # the job ends (MPI_Abort), its other processes with it
