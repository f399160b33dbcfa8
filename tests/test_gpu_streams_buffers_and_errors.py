"""The GPU path where the strict simulator (CuPy's stream stack and memory pool, NCCL's
first-use connections, sticky CUDA errors) found it wrong: every device operation of synk
runs on a stream synk chose, whatever the user's function left current; buffers NCCL reads
live until it is done; a sticky CUDA error is a typed error in seconds; a peer that raised
before a fresh communicator's first collective cannot leave the others stuck; freeing a
communicator waits for a thread inside it. Under the simulator here; for real with CUDA."""
import os
import threading
import time

import numpy as np
import pytest
from conftest import REAL, first_op, fresh_nccl_process, nccl_env, two_sim_comms, use_devices

import synk

pytestmark = pytest.mark.gpu

PROMPT = 15  # seconds: "in seconds", with room for a loaded machine
X = np.random.default_rng(0).standard_normal((13, 4))


@pytest.mark.parametrize("left", ["use", "null",
                                  pytest.param("device", marks=pytest.mark.one_gpu_per_rank(3))])
def test_outputs_are_combined_on_synks_stream_whatever_fn_left_current(gpus, left):
    """``fn`` makes another stream current (``use()``, which a ``with`` would not undo), or
    the null stream, or switches devices, and computes its outputs there: synk orders its
    own stream after that work and combines on it (every op, mean included)."""

    def fn(x):
        xp = synk.xp(x)
        if left in ("use", "null"):  # (ordered after synk's stream, as CUDA requires)
            before = xp.cuda.get_current_stream().record()
            mine = xp.cuda.Stream(non_blocking=True) if left == "use" else xp.cuda.Stream.null
            mine.wait_event(before)
            mine.use()
        out = (x * 2).sum(axis=0)
        outs = out, out.mean(), x * 3
        if left == "device":
            xp.cuda.Device((x.device.id + 1) % synk.comm.size()).use()
        return outs

    f = synk.function(fn, reduce=("mean", "sum", "gather"))
    for _ in range(2):
        mean, total, gathered = f(X)
        parts = np.array_split(X, gpus)
        want = sum(len(p) * (p * 2).sum(axis=0) for p in parts) / len(X)
        np.testing.assert_allclose(mean, want)
        np.testing.assert_allclose(total, sum((p * 2).sum(axis=0).mean() for p in parts))
        np.testing.assert_allclose(gathered, X * 3)


def test_non_blocking_collectives_keep_their_buffers_until_done(gpus):
    """``iallreduce`` of integers under ``mean`` casts to float64 (a temporary NCCL reads);
    the function then allocates and writes memory of the same size on its stream before
    waiting: CuPy's pool would hand it the freed temporary. A handle never waited on keeps
    its buffers too, until the share ends."""

    def fn(x):
        xp = synk.xp(x)
        r = synk.comm.rank()
        h = synk.comm.iallreduce(xp.arange(64) + r, "mean")
        forgotten = synk.comm.iallreduce(xp.full(64, float(r)), "sum")  # never waited on
        del forgotten
        scratch = [xp.full(64, 7.0) for _ in range(4)]  # same sizes, same stream
        got = h.wait()
        return [got, sum(float(s.sum()) for s in scratch)]

    got = synk.function(fn, reduce=None)(X)
    n = gpus
    for mean, scratch in got:
        np.testing.assert_allclose(mean, np.arange(64) + (n - 1) / 2)
        assert scratch == 4 * 64 * 7.0


def test_fused_weighted_non_blocking_allreduce_keeps_its_temporaries(gpus):
    def fn(x):
        xp = synk.xp(x)
        h = synk.comm.iallreduce({"a": x.sum(axis=0), "b": xp.ones(3)}, "mean", weight=len(x))
        junk = [xp.zeros(8) for _ in range(3)]  # reuse whatever was freed
        out = h.wait()
        return out["a"], out["b"], len(junk)

    a, b, _ = synk.function(fn, reduce="max")(X)
    parts = np.array_split(X, gpus)
    np.testing.assert_allclose(a, sum(len(p) * p.sum(axis=0) for p in parts) / len(X))
    np.testing.assert_allclose(b, np.ones(3))


def test_a_sticky_cuda_error_is_a_typed_error_naming_rank_and_status(monkeypatch):
    """NCCL's kernel on rank 1 hits an illegal address (the simulator's ``cuda_error``
    fault): its queries never return cudaSuccess again. The call ends in seconds with
    DeviceFailedError naming rank 1 and CUDA's status 700; the group is stopped."""
    if REAL:
        pytest.skip("fault injection is the simulator's")
    use_devices(monkeypatch, 2)
    monkeypatch.setenv("SYNK_SIM_FAULTS", f"cuda_error:rank=1:collective={first_op(2)}")
    synk.fork(2, backend="gpu")
    start = time.monotonic()
    with pytest.raises(synk.DeviceFailedError) as info:
        synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None,
                      timeout=60)(X)
    assert time.monotonic() - start < PROMPT
    assert info.value.rank == 1 and info.value.status == 700
    assert "rank 1" in str(info.value) and "700" in str(info.value)
    with pytest.raises(synk.GroupBrokenError):
        synk.function(lambda x: x.sum(), reduce="sum")(X)
    synk.close()
    monkeypatch.delenv("SYNK_SIM_FAULTS")
    synk.fork(2, backend="gpu")  # a new group works
    assert np.isclose(synk.function(lambda x: x.sum(), reduce="sum")(X), X.sum())
    synk.close()


@pytest.mark.parametrize("fresh", [False, True])
def test_a_rank_that_raises_before_the_first_collective_leaves_nobody_stuck(gpus, fresh):
    """NCCL connects on first use, blocking the caller in C until the peers take part: a
    rank that raises before the first collective of a (fresh) communicator must not leave
    the others inside it. ``fresh``: after a failed call, whose communicators were
    renewed."""
    if fresh:
        with pytest.raises(ZeroDivisionError):
            synk.function(lambda x: 1 / 0, reduce=None)(X)

    def fn(x):
        if synk.comm.rank() == 1:
            raise KeyError("rank 1 gives up")
        return synk.comm.allreduce(x.sum(axis=0))

    start = time.monotonic()
    with pytest.raises(KeyError, match="rank 1 gives up"):
        synk.function(fn, reduce=None, timeout=60)(X)
    assert time.monotonic() - start < PROMPT
    got = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None)(X)
    assert all(np.allclose(g, X.sum(axis=0)) for g in got)


def _refuses_then(then):
    """Rank 0 refuses its value of an allgather (Python objects), catches the error and
    goes on: to a receive, or to another allgather of as many bytes, which NCCL would match
    with the others' first one (it matches operations by their order)."""
    def fn(x):
        comm, xp = synk.comm, synk.xp(x)
        mine = xp.full(4, float(comm.rank()))
        if comm.rank() == 0:
            try:
                comm.allgather(np.array([1, "a"], dtype=object))
            except TypeError:
                pass
            if then == "a receive":
                comm.recv(1)
            else:
                comm.allgather(mine + 100)
            return None
        first = comm.allgather(mine)
        if then == "a receive":
            comm.send(np.ones(2), 0)
        return first
    return fn


@pytest.mark.parametrize("then", ["a receive", "the next allgather"])
def test_ranks_waiting_in_nccl_for_a_part_a_peer_refused_raise_at_once(gpus, then):
    """Never the next operation's data for the refused one's, nor a wait until the call's
    timeout: the others raise ``ValueError`` naming the refusing rank, in seconds; the
    next call renews the communicators."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="from rank 0, which refused its value of that "
                                         "collective"):
        synk.function(_refuses_then(then), reduce=None, timeout=60)(X)
    assert time.monotonic() - start < PROMPT
    got = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None)(X)
    assert all(np.allclose(g, X.sum(axis=0)) for g in got)


def _skips_an_allgather(which):
    """The last rank skips an allgather of device arrays (which NCCL runs alone, without
    the host): the first of two, so that its second meets the others' first, or the only
    one."""
    def fn(x):
        comm, xp = synk.comm, synk.xp(x)
        mine = xp.full(3, float(comm.rank()))
        skips = comm.rank() == comm.size() - 1
        if not skips:
            comm.allgather(mine)
        if which == "the first of two":
            return comm.allgather(mine + 10)
        return None
    return fn


@pytest.mark.parametrize("which", ["the first of two", "the only one"])
def test_ranks_waiting_in_nccl_for_a_rank_that_skipped_the_collective_raise_at_once(gpus, which):
    """Not a wait until the call's timeout, nor the skipping rank's next allgather's data
    taken for the one it skipped: the others raise ``ValueError`` naming it, in seconds, once
    its function returned; the next call renews the communicators."""
    start = time.monotonic()
    last = gpus - 1
    called = "up to its #1 only" if which == "the first of two" else "none of this call's"
    # (ranks sharing a real GPU take the staged transport: they wait on the host, and say so)
    with pytest.raises(ValueError, match=f"for rank {last}, whose function returned having "
                                         f"called {called}:|from rank {last}, whose function "
                                         "returned without sending it"):
        synk.function(_skips_an_allgather(which), reduce=None, timeout=60)(X)
    assert time.monotonic() - start < PROMPT
    got = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None)(X)
    assert all(np.allclose(g, X.sum(axis=0)) for g in got)


def _the_others_skip_a_collective_of_the_host(x):
    """The last rank calls a scan of host values, which the others skip, then an allgather
    of device arrays: it waits on the host for their part, they inside NCCL for its."""
    comm, xp = synk.comm, synk.xp(x)
    if comm.rank() == comm.size() - 1:
        comm.scan(np.ones(2))
    return comm.allgather(xp.full(3, float(comm.rank())))


def test_a_rank_on_the_host_and_the_others_inside_nccl_in_different_collectives_raise(gpus):
    """A wait inside NCCL that sleeps says so in the rank's row: the rank that waits on the
    host in its collective of the same number names both within seconds."""
    start = time.monotonic()
    # (ranks sharing a real GPU take the staged transport: all of them wait on the host)
    with pytest.raises(ValueError, match=r"collective #1 \(scan\) from rank 0, which waits "
                                         r"inside NCCL in its collective #1 \(allgather\), "
                                         r"where rank \d called another collective|called "
                                         r"different collectives at the same point: rank \d "
                                         r"called (scan|allgather) \(its collective #1 of this "
                                         r"call\), rank \d called (allgather|scan) \(#1\)"):
        synk.function(_the_others_skip_a_collective_of_the_host, reduce=None, timeout=60)(X)
    assert time.monotonic() - start < PROMPT


def _late_to_an_allgather(x):
    """Rank 1 is late (a minute) to the allgather of device arrays that the others, rank 0
    the master among them, wait in inside NCCL."""
    if synk.comm.rank() == 1:
        time.sleep(60)
    return synk.comm.allgather(x[:2])


def test_a_calls_timeout_ends_the_masters_wait_inside_nccl(gpus2):
    """The timeout interrupts the master's share inside NCCL; its operation in flight,
    which the late rank has not launched, is aborted rather than waited for (it would keep
    the call until that rank launched it, or for ever)."""
    start = time.monotonic()
    with pytest.raises(synk.CallTimeoutError, match="within 2 s"):
        synk.function(_late_to_an_allgather, reduce=None)(X, timeout=2)
    assert time.monotonic() - start < PROMPT


def _refuses_in_a_sub_group(kind):
    """Rank 0 refuses its value of a sub-group's collective (of every rank), catches the
    error and goes on to the group's next one of as many bytes."""
    def fn(x):
        comm, xp = synk.comm, synk.xp(x)
        group = comm.split(0)
        run = group.allreduce if kind == "allreduce" else group.allgather
        mine = xp.full(4, float(comm.rank()))
        if comm.rank() == 0:
            try:
                run(np.array([1, "a", 2, 3], dtype=object))
            except TypeError:
                pass
            return run(mine + 100)
        return run(mine)
    return fn


@pytest.mark.parametrize("kind", ["allreduce", "allgather"])
def test_a_gpu_rank_that_refused_its_value_in_a_sub_group_is_named_at_once(gpus2, kind):
    start = time.monotonic()
    with pytest.raises(ValueError, match="sub-group's collective from rank 0, which refused "
                                         "its value of that collective"):
        synk.function(_refuses_in_a_sub_group(kind), reduce=None, timeout=60)(X)
    assert time.monotonic() - start < PROMPT
    got = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None)(X)
    assert all(np.allclose(g, X.sum(axis=0)) for g in got)


def _every_rank_refuses_in_turn(x):
    """Every rank refuses its value of three allgathers (Python objects), catches each
    error and goes on; then an allgather of device arrays and one with a numpy ``out=``
    for its device result, which raises after its NCCL operation, on every rank."""
    comm, xp = synk.comm, synk.xp(x)
    said = []
    for _ in range(3):
        try:
            comm.allgather(np.array([1, "a"], dtype=object))
        except TypeError as err:
            said.append(type(err).__name__)
    mine = xp.full(2, float(comm.rank()))
    try:
        comm.allgather(mine, out=np.empty(2 * comm.size()))
    except TypeError as err:
        said.append(type(err).__name__)
    return said, comm.allgather(mine)


def test_values_every_gpu_rank_refuses_raise_there_and_the_call_goes_on(gpus):
    """A value refused on every rank is not a refusal of one rank that went on: each rank's
    own error, its next NCCL operation launched once every peer refused too; one that
    raised after its NCCL operation (a wrong ``out=``) refused nothing."""
    for _ in range(3):
        saids, gots = synk.function(_every_rank_refuses_in_turn, reduce=None, timeout=60)(X)
        for said, got in zip(saids, gots):  # (outputs, each a list over the ranks)
            assert said == ["TypeError"] * 4
            np.testing.assert_array_equal(got.get() if hasattr(got, "get") else got,
                                          np.repeat(np.arange(gpus, dtype=float), 2))


def test_the_group_stays_usable_after_each_rank_raising_in_a_collective(monkeypatch):
    """3 ranks, rank 1 raises while the others wait in synk.comm.allreduce, several times:
    each next call renews the communicators and works (the previous call's stop reason must
    not abandon the new set-up), and nothing of the old ones stays mapped."""
    use_devices(monkeypatch, 3)
    synk.fork(3, backend="gpu")
    try:
        def fn(x):
            if synk.comm.rank() == 1:
                raise KeyError("boom")
            return synk.comm.allreduce(x.sum(axis=0))

        for _ in range(5):
            with pytest.raises(KeyError, match="boom"):
                synk.function(fn, reduce=None, timeout=30)(X)
            got = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None,
                                timeout=30)(X)
            assert all(np.allclose(g, X.sum(axis=0)) for g in got)
    finally:
        synk.close()


def test_the_masters_environment_is_not_written(monkeypatch):
    """NCCL reads its variables once per process: synk sets NCCL_MULTI_RANK_GPU_ENABLE=1 and
    NCCL_NVLS_ENABLE=0 in the workers of a group that shares GPUs (NCCL 2.30.7 keeps NVLS on
    over them unless the last two ranks share one), and around the master's first
    communicator only."""
    if REAL:
        pytest.skip("places ranks on simulated devices")
    nccl_env(monkeypatch)
    use_devices(monkeypatch, 2)
    synk.fork(3, backend="gpu")
    try:
        assert "NCCL with NCCL_MULTI_RANK_GPU_ENABLE" in synk.backend()
        envs = synk.function(lambda: [os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE"),
                                      os.environ.get("NCCL_NVLS_ENABLE")], reduce=None)()
        assert envs[1:] == [["1", "0"], ["1", "0"]]
        assert "NCCL_MULTI_RANK_GPU_ENABLE" not in os.environ
        assert "NCCL_NVLS_ENABLE" not in os.environ
    finally:
        synk.close()
        fresh_nccl_process()


def test_freeing_the_communicator_waits_for_a_thread_inside_it(gpus2):
    """Group.kill() (another thread) while a thread is inside an NCCL call: the abort waits
    for the call (ncclCommAbort frees the communicator; the simulator raises if it is freed
    under a thread), then the call's thread sees a closed communicator."""
    if REAL:
        pytest.skip("reaches into the simulator's communicator")
    from synk import _testing

    guard = _testing.device_comm().guard
    entered, leave, seen = threading.Event(), threading.Event(), {}

    def slow(comm):
        entered.set()
        leave.wait(5)  # "inside" the NCCL call, holding the guard
        return comm.rank_id()

    def caller():
        seen["rank"] = guard.call("a slow call", slow)

    t = threading.Thread(target=caller)
    t.start()
    entered.wait(5)
    killer = threading.Thread(target=_testing.kill_group)
    killer.start()
    time.sleep(0.2)
    assert killer.is_alive()  # waiting for the call, not freeing under it
    leave.set()
    killer.join(10)
    t.join(10)
    assert seen["rank"] == 0 and guard.comm is None


def test_a_call_blocked_connecting_is_aborted_by_the_watcher_and_poisons_the_rank(monkeypatch):
    """The last resort when a first-use connection blocks (NCCL would connect an algorithm
    the set-up did not): a call inside NCCL past a moment, with a reason to stop, has its
    communicator aborted from the watcher thread. NCCL leaves that undefined for a blocking
    communicator ("might hang forever"), and the simulator keeps the caller blocked: the
    rank is marked poisoned, so that its process is not reused."""
    if REAL:
        pytest.skip("drives the simulator's NCCL directly")
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "2")
    monkeypatch.setenv("SYNK_SIM_HANG_TIMEOUT", "3")
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT", raising=False)
    fresh_nccl_process()  # (synk's groups had this process's NCCL read it as 0)
    from synk import simulator
    from synk._testing import Guard
    from synk.simulator import SimulatedHang, cupy as cp

    nccl = cp.cuda.nccl
    comms = two_sim_comms()
    asked = time.monotonic()
    guard = Guard(cp, nccl, comms[0], 0, 2,
                  should_stop=lambda number=0: "rank 1 failed" if time.monotonic() - asked > 1
                  else None)
    simulator.reset_thread()  # (this thread's streams: the null stream current)
    cp.cuda.Device(0).use()
    x = cp.ones(4, cp.float32)
    with pytest.raises(SimulatedHang, match="aborted from another thread meanwhile"):
        guard.call("allreduce", lambda c: c.allReduce(
            x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0))
    assert guard.comm is None and "rank 1 failed" in guard.poisoned
    assert "blocked inside NCCL allreduce" in guard.poisoned
    comms[1].destroy()
    simulator.reset_thread()
    fresh_nccl_process()


def test_nccl_statuses_cupy_cannot_name_become_collective_errors():
    """CuPy 14.2 raises KeyError for NCCL's statuses 7 and 8 (ncclInProgress...)."""
    from synk._testing import CollectiveError, Guard
    from synk.simulator import cupy as cp

    class Comm:
        def abort(self):
            pass

    guard = Guard(cp, cp.cuda.nccl, Comm(), 0, 2)

    def in_progress(comm):
        cp.cuda.nccl.NcclError(7)

    with pytest.raises(CollectiveError, match="status 7") as info:
        guard.call("allreduce", in_progress)
    assert info.value.status == 7 and guard.comm is None


# -- interrupts while a communicator is freed --------------------------------------------------
def _abort_that_takes(seconds: float, started: threading.Event, freed: list):
    class Comm:
        def abort(self):  # Python all along: an interrupt could land anywhere in it
            started.set()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(0.005)
            freed.append(True)

    return Comm()


def test_the_watchdogs_interrupt_waits_until_the_communicator_is_freed():
    """The watchdog interrupts the master's share by raising into its thread, at whatever
    bytecode it runs. Landing inside the guard's abort, it left the communicator neither in
    use nor freed (its shared memory stayed mapped after ``synk.close()``: a rank killed
    inside a collective, seen once in a few dozen runs). It now lands once it is freed."""
    from synk._testing import Guard, interrupts
    from synk.simulator import cupy as cp

    started, freed, raised = threading.Event(), [], []
    guard = Guard(cp, cp.cuda.nccl, _abort_that_takes(0.3, started, freed), 0, 2)

    def abort():
        try:
            guard.abort("a peer died")
        except interrupts.Interrupted:
            raised.append(list(freed))  # (what was freed when it landed)

    thread = threading.Thread(target=abort)
    thread.start()
    assert started.wait(5)
    interrupts.interrupt(thread.ident)
    thread.join(5)
    assert raised == [[True]] and freed == [True] and guard.comm is None


def test_an_interrupt_taken_back_inside_a_release_is_never_raised():
    """The watchdog takes its interrupt back when the share ends before it landed (the share
    was over): one held off by a release is then not raised when the release ends."""
    from synk._testing import interrupts

    started, freed, raised = threading.Event(), [], []
    comm = _abort_that_takes(0.3, started, freed)

    def release():
        try:
            with interrupts.uninterruptible():
                comm.abort()
            time.sleep(0.05)
        except interrupts.Interrupted:
            raised.append(True)

    thread = threading.Thread(target=release)
    thread.start()
    assert started.wait(5)
    interrupts.interrupt(thread.ident)
    interrupts.take_back(thread.ident)
    thread.join(5)
    assert freed == [True] and raised == []


def test_a_communicator_made_after_its_set_up_was_given_up_is_aborted(monkeypatch):
    """``ncclCommInitRank`` returning after rank 0 gave up waiting for it (a worker died
    meanwhile): nobody else holds the communicator it made, so the set-up thread aborts it
    rather than keep it until the process ends."""
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "2")
    from synk._testing import nccl_setup
    from synk.simulator import cupy as cp

    made, go, aborted = threading.Event(), threading.Event(), []

    class LateComm:
        def __init__(self, size, comm_id, rank):
            made.set()
            go.wait(10)

        def abort(self):
            aborted.append(self)

    monkeypatch.setattr(cp.cuda.nccl, "NcclCommunicator", LateComm)
    device = type("Device", (), {"xp": cp, "device_id": 0, "failure": lambda self: None})()
    try:
        with pytest.raises(synk.comm.CommError, match="abandoned: a worker died"):
            nccl_setup.join(device, b"", 2, 0, time.monotonic() + 30,
                            should_stop=lambda: "a worker died" if made.is_set() else None)
        go.set()
        deadline = time.monotonic() + 10
        while any(t.name == "synk-nccl-init-r0" for t in threading.enumerate()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert len(aborted) == 1
    finally:
        go.set()
        fresh_nccl_process()
