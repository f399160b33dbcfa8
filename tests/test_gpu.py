"""The GPU backend end to end: CuPy ranks made by synk.fork(backend="gpu"), with inputs on
the devices, outputs back as numpy, synk.comm on NCCL, shared variables on the devices, and
the failures that must raise in bounded time. Without CUDA these run under the CUDA
simulator (SYNK_SIMULATE_GPUS); with CUDA present (and the simulator off) on the real GPUs.
"""
import os
import signal
import time

import numpy as np
import pytest
from conftest import REAL, first_op, use_devices as _use_devices

import synk

pytestmark = pytest.mark.gpu

PROMPT = 15  # seconds: "in seconds", with room for a loaded machine
def _rows(n=11, d=3, seed=0):
    return np.random.default_rng(seed).standard_normal((n, d))


# -- ranks, devices, inputs ------------------------------------------------------------------
@pytest.mark.one_gpu_per_rank(3)
def test_one_rank_per_device_and_inputs_are_device_arrays(gpus):
    assert synk.devices() == list(range(gpus))
    assert "backend 'gpu'" in synk.backend()
    # it says when the devices are the simulator's (it used to read as real CUDA devices)
    assert ("simulated CUDA devices" in synk.backend()) is not REAL, synk.backend()

    def where(x, y):
        xp = synk.xp(x)
        try:
            np.asarray(x)
        except TypeError as err:
            refused = "Implicit conversion to a NumPy array is not allowed" in str(err)
        else:
            refused = False
        return [x.device.id, y.device.id, xp is not np, refused, type(x).__name__]

    got = synk.function(where, bcast_inputs=["y"], reduce=None)(_rows(), np.ones(3))
    assert got == [[r, r, True, True, "ndarray"] for r in range(gpus)]


def test_every_reduce_op_and_batch_form_matches_numpy(gpus):
    """Every reduce op with every form of ``batch=``, in one group; the failures are listed
    together."""
    failed = []
    for op in ["mean", "sum", "prod", "max", "min", "gather", None]:
        for batch in [None, 7, slice(1, 10, 2), "index", "mask"]:
            try:
                _check_op_and_batch(gpus, op, batch)
            except AssertionError as err:
                failed.append(f"reduce={op!r} batch={batch!r}: {err}")
    assert not failed, "\n".join(failed)


def _check_op_and_batch(gpus, op, batch):
    x = _rows(13)
    w = np.random.default_rng(1).standard_normal(3)
    if batch == "index":
        batch = np.random.default_rng(2).permutation(13)[:9]
    elif batch == "mask":
        batch = np.random.default_rng(3).random(13) < 0.6

    def per_row(x, w):
        xp = synk.xp(x)
        return xp.tanh(x @ w) if op == "gather" else xp.mean(xp.tanh(x @ w) + 1.0)

    f = synk.function(per_row, bcast_inputs=["w"], reduce=op)
    rows = x if batch is None else x[:batch] if isinstance(batch, int) else x[batch]
    got = f(x, w, batch=batch)
    single = np.tanh(rows @ w) if op == "gather" else np.mean(np.tanh(rows @ w) + 1.0)
    if op in ("mean", "gather"):
        assert isinstance(got, (np.ndarray, np.generic, float)) and np.allclose(got, single)
    elif op is None:  # each rank's own value, from its rows
        parts = [p for p in np.array_split(rows, gpus) if len(p)]
        assert all(isinstance(v, (np.ndarray, np.generic, float)) for v in got)
        assert len(got) == len(parts)
        for v, p in zip(got, parts):
            assert np.allclose(v, np.mean(np.tanh(p @ w) + 1.0))
    else:
        parts = np.array_split(rows, gpus)
        means = [np.mean(np.tanh(p @ w) + 1.0) for p in parts if len(p)]
        want = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](means)
        assert np.allclose(got, want)


@pytest.mark.parametrize("num_slices", [1, 3, 100])
def test_num_slices_and_a_data_input(gpus, num_slices):
    x = synk.data(_rows(17))
    f = synk.function(lambda x: synk.xp(x).sum(x, axis=0), reduce="sum")
    assert np.allclose(f(x, num_slices=num_slices), x.array.sum(axis=0))
    g = synk.function(lambda x: x * 2, reduce="gather")
    out = g(x, num_slices=num_slices)
    assert type(out) is np.ndarray and np.allclose(out, x.array * 2)


# -- synk.comm on device arrays ----------------------------------------------------------------
@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "mean"])
def test_comm_collectives_on_device_arrays_match_numpy(gpus, op):
    base = np.arange(1.0, 13.0)

    def run(x, base):  # base arrives on the device; rank 0's is broadcast
        xp = synk.xp(x)
        r, n = synk.comm.rank(), synk.comm.size()
        dev_base = xp.asarray(base) if r == 0 else None
        b = synk.comm.broadcast(dev_base, root=0)
        parts = b[r::n][:2] + r
        reduced = synk.comm.allreduce(parts, op)
        gathered = synk.comm.allgather(b[: r + 1] * (r + 1))
        scattered = synk.comm.reduce_scatter(b + r, op)
        kinds = {type(v).__module__ for v in (b, reduced, gathered, scattered)}
        return [reduced.get(), gathered.get(), scattered.get(), kinds == {type(x).__module__}]

    got = synk.function(run, bcast_inputs=["base"], reduce=None)(np.ones((gpus, 1)), base)
    n = gpus
    parts = [base[r::n][:2] + r for r in range(n)]
    fn = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min, "mean": np.mean}[op]
    want_reduced = fn(np.stack(parts), axis=0)
    want_gathered = np.concatenate([base[: r + 1] * (r + 1) for r in range(n)])
    whole = fn(np.stack([base + r for r in range(n)]), axis=0)
    bounds = np.cumsum([0] + [len(p) for p in np.array_split(base, n)])
    for r, (reduced, gathered, scattered, same_kind) in enumerate(got):
        assert same_kind
        assert np.allclose(reduced, want_reduced)
        assert np.allclose(gathered, want_gathered)
        assert np.allclose(scattered, whole[bounds[r]:bounds[r + 1]])


def test_send_and_recv_of_device_arrays_in_both_directions(gpus):
    def ring(x):
        xp = synk.xp(x)
        r, n = synk.comm.rank(), synk.comm.size()
        mine = xp.arange(5.0) * (r + 1)
        synk.comm.send(mine, (r + 1) % n)  # everyone sends first: must not deadlock
        got = synk.comm.recv((r - 1) % n)
        handle = synk.comm.isend(np.full(2, r), (r + 1) % n, tag=7)  # a host array
        plain = synk.comm.recv((r - 1) % n, tag=7)
        handle.wait()
        return [got.get(), type(got).__module__ == type(x).__module__,
                type(plain) is np.ndarray, plain.tolist()]

    got = synk.function(ring, reduce=None)(np.ones((gpus, 1)))
    for r, (values, on_device, host_kind, plain) in enumerate(got):
        left = (r - 1) % gpus
        assert np.allclose(values, np.arange(5.0) * (left + 1))
        assert on_device and host_kind and plain == [left, left]


# -- shared variables on the devices -------------------------------------------------------
def test_shared_variables_live_on_the_devices(gpus):
    v = synk.shared(np.zeros(3))
    w = synk.shared(np.ones((2, 2), np.float32))
    x = _rows(10)

    def step(x, v, w):
        v += x.sum(axis=0)
        w *= 2
        return [type(v).__module__ == type(x).__module__, v.device.id == x.device.id]

    for _ in range(2):
        assert synk.function(step, reduce=None)(x, v, w) == [[True, True]] * gpus
    parts = np.array_split(x, gpus)
    for r in range(gpus):
        assert np.allclose(v.get_value(r), 2 * parts[r].sum(axis=0))
        assert np.allclose(w.get_value(r), 4)
    assert type(v.get_value(0)) is np.ndarray
    synk.shared_all_reduce([v, w], "sum")
    assert np.allclose(v.get_value(1), 2 * x.sum(axis=0)) and np.allclose(w.get_value(0), 4 * gpus)
    synk.shared_broadcast(v, np.arange(3.0))
    assert np.allclose(synk.shared_gather(v), np.tile(np.arange(3.0), gpus))
    synk.shared_scatter(v, np.arange(gpus * 2.0))
    assert v.shapes() == [(2,)] * gpus and np.allclose(synk.shared_gather(v), np.arange(gpus * 2.0))
    synk.shared_all_gather(v)
    assert np.allclose(v.get_value(gpus - 1), np.arange(gpus * 2.0))
    synk.close()
    assert type(v.value) is np.ndarray  # back on the host when its group ends


def test_local_runs_on_rank_0s_device_and_gives_host_results(gpus2):
    # f.local() over a shared variable set by shared_scatter: rank 0's replica is a device
    # array, so fn's result is one too; local() gives the host value, as a call does
    s = synk.shared(np.zeros((4, 3)))
    synk.shared_scatter(s, np.arange(24.0).reshape(8, 3))
    f = synk.function(lambda s: s.mean(axis=0), reduce="mean")
    local = f.local(s)
    assert type(local) is np.ndarray and np.allclose(local, [4.5, 5.5, 6.5])
    assert np.allclose(f(s), [10.5, 11.5, 12.5])
    where = synk.function(lambda s: type(s).__module__, reduce=None)
    assert where.local(s) == where(s)[0]  # on the device, as in rank 0's share of a call


# -- failures ------------------------------------------------------------------------------------
class Boom(Exception):
    pass


def test_an_exception_on_one_rank_and_the_group_stays_usable(gpus):
    def fails(x):
        if synk.comm.rank() == 1:
            raise Boom("boom on rank 1")
        return synk.comm.allreduce(x.sum(axis=0), "sum")  # the others wait in NCCL

    start = time.monotonic()
    with pytest.raises(Boom, match="boom on rank 1"):
        synk.function(fails, reduce=None, timeout=60)(_rows(9))
    assert time.monotonic() - start < PROMPT
    f = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0), "sum"), reduce=None)
    x = _rows(9)
    assert all(np.allclose(v, x.sum(axis=0)) for v in f(x))


def test_a_rank_killed_inside_a_collective_raises_in_seconds(monkeypatch):
    if REAL:
        pytest.skip("fault injection is the simulator's")
    _use_devices(monkeypatch, 3)
    monkeypatch.setenv("SYNK_SIM_FAULTS", f"kill:rank=2:collective={first_op(3)}")
    synk.fork(3, backend="gpu")

    def reduce(x):
        return synk.comm.allreduce(x.sum(axis=0), "sum")

    start = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="rank 2 was killed by SIGKILL"):
        synk.function(reduce, reduce=None, timeout=60)(_rows(9))
    assert time.monotonic() - start < PROMPT
    synk.close()


def test_an_asynchronous_nccl_error_raises_in_seconds(monkeypatch):
    if REAL:
        pytest.skip("fault injection is the simulator's")
    _use_devices(monkeypatch, 2)
    monkeypatch.setenv("SYNK_SIM_FAULTS", f"async_error:rank=1:collective={first_op(2)}")
    synk.fork(2, backend="gpu")
    from synk.errors import CollectiveError

    def reduce(x):
        return synk.comm.allreduce(x.sum(axis=0), "sum")

    start = time.monotonic()
    with pytest.raises(synk.comm.CommError) as info:
        synk.function(reduce, reduce=None, timeout=60)(_rows(8))
    assert time.monotonic() - start < PROMPT
    errors = [info.value, *(getattr(info.value, "__notes__", []))]
    assert isinstance(info.value, CollectiveError) or "NCCL" in " ".join(map(str, errors))
    # the communicators were aborted: the next call makes new ones, and the group works
    f = synk.function(lambda x: synk.xp(x).sum(x, axis=0), reduce="sum")
    x = _rows(8)
    assert np.allclose(f(x), x.sum(axis=0))
    synk.close()


@pytest.mark.parametrize("fault", ["hang_init:rank=1", "kill_init:rank=1"])
def test_communicator_set_up_that_hangs_or_dies_hits_its_deadline(monkeypatch, fault):
    if REAL:
        pytest.skip("fault injection is the simulator's")
    _use_devices(monkeypatch, 2)
    monkeypatch.setenv("SYNK_SIM_FAULTS", fault)
    monkeypatch.setenv("SYNK_SIM_HANG_TIMEOUT", "3")
    start = time.monotonic()
    with pytest.raises(synk.WorkerStartError, match="communicator"):
        synk.fork(2, backend="gpu", start_timeout=4)
    assert time.monotonic() - start < PROMPT
    deadline = time.monotonic() + 10  # the master's abandoned set-up thread ends with the
    while any(t.name.startswith("synk-nccl-init") for t in __import__("threading").enumerate()):
        assert time.monotonic() < deadline  # simulator's bound on a hang
        time.sleep(0.1)
    monkeypatch.delenv("SYNK_SIM_FAULTS")
    synk.fork(2, backend="gpu")
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4)) == 4
    synk.close()


# -- choosing the backend ---------------------------------------------------------------------
@pytest.mark.one_gpu_per_rank(3)
def test_devices_picks_a_subset_and_more_ranks_go_round_robin(monkeypatch):
    _use_devices(monkeypatch, 3)
    assert synk.fork(backend="gpu", devices=[2, 0]) == 2
    assert synk.devices() == [2, 0]
    got = synk.function(lambda x: x.device.id, reduce=None)(np.ones((2, 1)))
    assert got == [2, 0]
    synk.close()
    with pytest.raises(ValueError, match="distinct visible CUDA devices"):
        synk.fork(backend="gpu", devices=[5])
    with pytest.raises(ValueError, match="backend='gpu' only"):
        synk.fork(backend="cpu", devices=[0])
    assert synk.fork(3, backend="gpu", devices=[1, 2]) == 3
    assert synk.devices() == [1, 2, 1]
    synk.close()


def test_auto_picks_the_simulated_gpus_and_cpu_without_them(monkeypatch):
    if REAL:
        pytest.skip("checks the choice without CUDA")
    _use_devices(monkeypatch, 2)
    synk.fork()
    assert synk.devices() == [0, 1]
    synk.close()
    monkeypatch.delenv("SYNK_SIMULATE_GPUS")  # (docs/api/environment.md): at the next fork()
    synk.fork(2)
    assert synk.devices() == [None, None] and "backend 'cpu'" in synk.backend()
    synk.close()
    with pytest.raises(synk.GpuUnavailableError, match=r'pip install "synk\[gpu\]"|driver|device'):
        synk.fork(backend="gpu")


def test_the_intro_demo_runs_on_the_gpu_code_path(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ)
    if not REAL:
        env["SYNK_SIMULATE_GPUS"] = "2"
    demo = os.path.join(os.path.dirname(__file__), "..", "demos", "intro.py")
    out = subprocess.run([sys.executable, demo], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "All assertions passed." in out.stdout


def test_a_dead_rank_during_a_call_leaves_nothing_behind(gpus2):
    victim = synk.function(lambda x: os.getpid(), reduce=None)(np.ones(2))[1]  # rank 1's pid

    def hang(x):
        if synk.comm.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return synk.comm.allreduce(x.sum(axis=0), "sum")

    with pytest.raises(synk.WorkerDiedError, match="rank 1"):
        synk.function(hang, reduce=None, timeout=60)(_rows(6))
    with pytest.raises(ProcessLookupError):  # the killed rank is gone, reaped by the master
        os.kill(victim, 0)
