"""The CUDA simulator and synk's CUDA layer on it, checked from the inside, below the public
API: synk's NCCL transport run straight on the simulator's devices in processes of its own
(every op and dtype, data movement, failures, NCCL's rules for ranks sharing a GPU) and over
its network transport (TCP between ranks that share no /dev/shm); the device layer on its
own (transfers, counters, page-locking, discovery); page-locking on every rank of a group;
the simulator's pointer resolution, fault bookkeeping, tables of CuPy's names and reading
of its variables; NCCL operations run straight on a rank's transport.

It reaches synk's internals (``synk._testing``) because none of these has a public handle:
what a program may read of the simulator is ``synk.simulator``, and the behaviour built on
them is tested through the public API elsewhere (test_sim*.py, test_gpu*.py)."""
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
from conftest import REAL, first_op, fresh_nccl_process, on_every_rank, use_devices

import synk
from synk import __file__ as synk_file, _settings, simulator as sim
from synk._testing import (
    NcclCommunicator,
    comm_context,
    cuda_host,
    devices,
    discovery,
    make_id,
    shm,
    sim_core,
    sim_faults,
    sim_net,
)
from synk.simulator import cupy as cp

nccl, runtime = cp.cuda.nccl, cp.cuda.runtime

# the pinned-memory tests read the simulator's own records of every rank
ON_THE_SIMULATORS_RECORDS = pytest.mark.skipif(REAL, reason="reads the CUDA simulator's records")


# ================================================ synk's NCCL transport on the simulator
# (the transport between real processes, 2 and 3 ranks, each
# process running this file as a script)

INIT_DEADLINE = 8.0
DTYPES = ["int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
          "float32", "float64", "complex64", "complex128", "bool"]


def _data(rank: int, dtype: str, shape=(3, 4)) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if np.dtype(dtype).kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(1, 4, shape).astype(dtype)  # small: products stay in range


def _expected(op: str, parts: list) -> np.ndarray:
    if op == "mean":
        acc = np.complex128 if parts[0].dtype.kind == "c" else np.float64
        return np.mean(np.stack(parts), axis=0, dtype=acc).astype(
            parts[0].dtype if parts[0].dtype.kind in "fc" else np.float64)
    if parts[0].dtype == bool and op in ("sum", "prod"):
        parts = [p.astype(np.int64) for p in parts]
    fn = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    result = parts[0]
    for p in parts[1:]:
        result = fn(result, p)
    return result


# ---------------------------------------------------------------- what each rank runs

def every_op_and_dtype(comm, dev, rank, n):
    problems = []
    for dtype in DTYPES:
        parts = [_data(r, dtype) for r in range(n)]
        for op in ("sum", "prod", "max", "min", "mean"):  # (a complex product, maximum or
            # minimum: gathered over NCCL, combined on the device)
            got = dev.to_host(comm.allreduce(dev.to_device(parts[rank]), op))
            want = _expected(op, parts)
            tol = 1e-2 if dtype == "float16" else 1e-6
            if got.dtype != want.dtype or not np.allclose(got, want, rtol=tol, atol=tol):
                problems.append(f"{dtype} {op}: got {got.dtype} {got.ravel()[:4]}, want "
                                f"{want.dtype} {want.ravel()[:4]}")
    with pytest.raises(TypeError, match="NCCL has no datatype"):
        comm.allreduce(dev.xp.zeros(2, "V8"))  # (long doubles: CuPy holds none on a device)
    return problems


def data_movement(comm, dev, rank, n):
    x = np.arange(12.0).reshape(4, 3) + 100 * rank
    out = {}
    root = n - 1
    out["broadcast"] = dev.to_host(comm.broadcast(dev.to_device(x) if rank == root else None,
                                                  root, shape=(4, 3), dtype=np.float64))
    out["allgather"] = dev.to_host(comm.allgather(dev.to_device(x[:rank + 1])))
    out["allgather_0d"] = dev.to_host(comm.allgather(dev.to_device(np.float32(rank))))
    out["allgather_bool"] = dev.to_host(comm.allgather(dev.to_device(np.array([True, rank == 1]))))
    out["reduce_scatter"] = dev.to_host(comm.reduce_scatter(dev.to_device(np.arange(7.0) + rank)))
    out["reduce_scatter_mean"] = dev.to_host(comm.reduce_scatter(dev.to_device(np.arange(7) * rank),
                                                                 "mean"))
    right, left = (rank + 1) % n, (rank - 1) % n
    out["ring"] = dev.to_host(comm.exchange(sends=[(dev.to_device(x), right)],
                                            recvs=[(left, (4, 3), np.float64)])[0])
    if rank == 0:  # one way: a lone NCCL send, received straight into a buffer
        comm.exchange(sends=[(dev.to_device(np.array([7, 8], np.int16)), 1)])
    elif rank == 1:
        out["recv"] = dev.to_host(comm.exchange(recvs=[(0, (2,), np.int16)])[0])
    comm.barrier()
    with pytest.raises(ValueError, match="other dimensions and the dtype must agree"):
        comm.allgather(dev.to_device(np.zeros((2, 2 + rank))))
    return out


def mismatched_count(comm, dev, rank, n):
    comm.allreduce(dev.to_device(np.ones(4 + (rank == 1), np.float32)))


def mismatched_op(comm, dev, rank, n):
    comm.allreduce(dev.to_device(np.ones(4, np.float32)), "max" if rank == 0 else "sum")


def mismatched_root(comm, dev, rank, n):
    comm.broadcast(dev.to_device(np.ones(4)), root=0 if rank == 0 else 1)


def mismatched_kind(comm, dev, rank, n):
    x = dev.to_device(np.ones(4, np.float32))
    comm.allreduce(x) if rank == 0 else comm.broadcast(x, 0)


def many_allreduces(comm, dev, rank, n):
    for _ in range(5):
        comm.allreduce(dev.to_device(np.ones(1000, np.float32)))


def skips_the_collective(comm, dev, rank, n):
    if rank == 0:
        comm.allreduce(dev.to_device(np.ones(4, np.float32)))
    else:
        time.sleep(3)


# ---------------------------------------------------------------- running ranks

def _raw_rank(rank, n, uid):
    """The simulator's NCCL itself, no synk in between: join, one allreduce, wait."""
    nccl = cp.cuda.nccl
    placement = os.environ.get("TEST_PLACEMENT")  # each rank's device, else round-robin
    cp.cuda.Device(int(placement.split(",")[rank]) if placement
                   else rank % cp.cuda.runtime.getDeviceCount()).use()
    comm = nccl.NcclCommunicator(n, uid, rank)
    try:
        x = cp.ones(4, cp.float32)
        comm.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                       cp.cuda.Stream.null.ptr)
        cp.cuda.Stream.null.synchronize()
        return float(x.get()[0])
    finally:
        comm.destroy()


def _rank_main(rank, n, uid, scenario):
    """One rank, in a fresh process: prints its outcome as a pickled line."""
    import base64
    import pickle

    if scenario == "raw":
        try:
            outcome = ("ok", _raw_rank(rank, n, uid))
        except BaseException as err:
            outcome = ("error", (type(err).__name__, str(err), getattr(err, "status", None)))
        line = base64.b64encode(pickle.dumps((*outcome, 0.0))).decode()
        print("RESULT", line, flush=True)
        return

    status = devices.gpu_status()
    dev = devices.open("cuda", status.devices[rank % len(status.devices)])
    dev.bind()
    comm = None
    started = time.monotonic()
    try:
        stop_after = float(os.environ.get("STOP_AFTER", "0"))
        should_stop = ((lambda number=0: "the test gave up"
                        if time.monotonic() - started > stop_after else None)
                       if stop_after else None)
        comm = NcclCommunicator.from_id(dev, uid, n, rank,
                                     deadline=time.monotonic() + INIT_DEADLINE,
                                     should_stop=should_stop)
        sim.reset_transfer_counts()
        outcome = ("ok", globals()[scenario](comm, dev, rank, n))
    except BaseException as err:
        outcome = ("error", (type(err).__name__, str(err), getattr(err, "status", None)))
    finally:
        if comm is not None:
            comm.close()
    line = base64.b64encode(pickle.dumps((*outcome, time.monotonic() - started))).decode()
    print("RESULT", line, flush=True)


def run_ranks(n, scenario, faults="", devices=None, hang_timeout=20, stop_after=0, wait=45,
              env_extra=None):
    """Run ``scenario`` on ``n`` ranks in fresh processes; {rank: (kind, value, seconds)} of
    the ranks that reported, and the exit codes. Checks that no segment of the
    communicator is left behind."""
    import base64
    import pickle
    import subprocess
    import sys

    placement = ""
    if isinstance(devices, tuple):  # each rank's device
        placement, devices = ",".join(map(str, devices)), max(devices) + 1
    env = dict(os.environ, SYNK_SIMULATE_GPUS=str(devices or n), SYNK_SIM_FAULTS=faults,
               SYNK_SIM_HANG_TIMEOUT=str(hang_timeout), STOP_AFTER=str(stop_after),
               TEST_PLACEMENT=placement, **(env_extra or {}))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    # the synk under test (not an installed one: the script's own folder comes first)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [
        os.path.dirname(os.path.dirname(os.path.abspath(synk_file))), env.get("PYTHONPATH")]))
    uid = make_id(cp)
    prefix = uid[8:112].rstrip(b"\0").decode()
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(n), uid.hex(), scenario],
                              env=env, stdout=subprocess.PIPE, text=True) for r in range(n)]
    found, codes = {}, []
    deadline = time.monotonic() + wait
    try:
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    found[rank] = pickle.loads(base64.b64decode(line.split()[1]))
            codes.append(proc.returncode)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        # the id's bootstrap root runs in this process: the ranks are gone, so it ends (it
        # ends by itself when it sees their board go, which ranks refused within its 10 ms
        # poll never let it see)
        sim_net.give_up(prefix)
    left = [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
    assert not left, f"segments left behind: {left}"
    return found, codes


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_every_op_and_dtype_matches_numpy(n):
    found, codes = run_ranks(n, "every_op_and_dtype")
    assert codes == [0] * n
    for rank in range(n):
        kind, value, _ = found[rank]
        assert kind == "ok", value
        assert value == [], value


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3])
def test_broadcast_allgather_reduce_scatter_send_recv(n):
    found, codes = run_ranks(n, "data_movement")
    assert codes == [0] * n
    xs = [np.arange(12.0).reshape(4, 3) + 100 * r for r in range(n)]
    bounds = [0]
    for r in range(n):
        bounds.append(bounds[-1] + 7 // n + (r < 7 % n))
    for rank in range(n):
        kind, out, _ = found[rank]
        assert kind == "ok", out
        np.testing.assert_array_equal(out["broadcast"], xs[n - 1])
        np.testing.assert_array_equal(out["allgather"], np.concatenate([x[:r + 1] for r, x in
                                                                         enumerate(xs)]))
        np.testing.assert_array_equal(out["allgather_0d"], np.arange(n, dtype=np.float32))
        assert out["allgather_bool"].dtype == bool
        np.testing.assert_array_equal(out["allgather_bool"],
                                      np.array([[True, r == 1] for r in range(n)]).ravel())
        total = sum(np.arange(7.0) + r for r in range(n))
        np.testing.assert_array_equal(out["reduce_scatter"], total[bounds[rank]:bounds[rank + 1]])
        mean = np.mean([np.arange(7) * r for r in range(n)], axis=0)
        np.testing.assert_allclose(out["reduce_scatter_mean"], mean[bounds[rank]:bounds[rank + 1]])
        np.testing.assert_array_equal(out["ring"], xs[(rank - 1) % n])
    np.testing.assert_array_equal(found[1][1]["recv"], [7, 8])


@pytest.mark.gpu
@pytest.mark.parametrize("scenario, n", [("mismatched_count", 2), ("mismatched_op", 3),
                                         ("mismatched_root", 2), ("mismatched_kind", 3)])
def test_disagreeing_ranks_get_the_simulators_error_on_every_rank(scenario, n):
    """NCCL gives no status for ranks that disagree (undefined behaviour, docs/userguide
    usage/collectives.rst): the simulator's own error, which the transport does not take
    for NCCL's (no CollectiveError), raises on every rank instead of a hang."""
    found, codes = run_ranks(n, scenario)
    for rank in range(n):
        kind, (name, message, status), seconds = found[rank]
        assert (kind, name, status) == ("error", "SimulatorError", None), message
        assert "disagree" in message and "undefined behaviour" in message and seconds < 10


@pytest.mark.gpu
@pytest.mark.parametrize("n", [2, 3])
def test_killed_rank_raises_remote_error_on_the_others(n):
    found, codes = run_ranks(n, "many_allreduces",
                             faults=f"kill:rank=1:collective={first_op(n) + 2}")
    assert codes[1] == -9 and 1 not in found
    for rank in (0, 2)[:n - 1]:
        kind, (name, message, status), seconds = found[rank]
        assert (kind, name, status) == ("error", "CollectiveError", 6), message
        assert "rank 1" in message and "died" in message and seconds < 10
        assert codes[rank] == 0


@pytest.mark.gpu
def test_async_error_raises_on_its_rank_and_the_others_stop_when_told():
    """The failing rank gets NCCL's error and aborts. Its peers on this host are not told by
    NCCL (ncclCommGetAsyncError sees nothing: src/init.cc v2.30.7-1 line 3453, src/proxy.cc
    line 1879): their collective never completes, and only ``should_stop`` (the group's
    own news of the failure; here the test giving up) ends their wait."""
    found, codes = run_ranks(3, "many_allreduces", stop_after=4,
                             faults=f"async_error:rank=2:collective={first_op(3) + 1}")
    name, message, status = found[2][1]
    assert (name, status) == ("CollectiveError", 2) and "injected" in message
    for rank in (0, 1):
        kind, (name, message, status), seconds = found[rank]
        assert (kind, name) == ("error", "CommAborted"), message
        assert "the test gave up" in message and seconds < 8, message
    assert codes == [0, 0, 0]


@pytest.mark.gpu
def test_hanging_set_up_hits_its_deadline():
    found, codes = run_ranks(3, "many_allreduces", faults="hang_init:rank=1",
                             wait=INIT_DEADLINE + 10)
    # every rank gives up at its deadline, the stuck one too (its set-up call is left in a
    # background thread, which ends with the process)
    assert codes == [0, 0, 0]
    for rank in range(3):
        kind, (name, message, _), seconds = found[rank]
        assert (kind, name) == ("error", "CommInitTimeout"), message
        assert INIT_DEADLINE - 1 < seconds < INIT_DEADLINE + 5


@pytest.mark.gpu
def test_rank_dying_in_set_up_hits_the_deadline():
    found, codes = run_ranks(2, "many_allreduces", faults="kill_init:rank=0",
                             wait=INIT_DEADLINE + 10)
    assert codes[0] == -9
    kind, (name, _, _), seconds = found[1]
    assert name == "CommInitTimeout" and seconds < INIT_DEADLINE + 5


DUPLICATE = "Duplicate GPU detected : rank {r} and rank {other} both on CUDA device 0"
FIRST_RANK = "Multiple ranks detected using the same GPU on this node"
EVERY_RANK = "Multiple Ranks are using the same GPU/Partition"
NVLS = 'NCCL_NVLS_ENABLE has been set to "1"'
NVLS_SHARED = "NVLS was set up over ranks that share a GPU"
ALL_NVLS_SHARED = {0: NVLS_SHARED, 1: NVLS_SHARED, 2: NVLS_SHARED}


@pytest.mark.gpu
@pytest.mark.parametrize("version, env, devices, refused", [
    # NCCL 2.28 (src/init.cc v2.28.9-1 line 904): the ranks sharing GPU 0 refuse, rank 1
    # (alone on GPU 1) waits for them forever (SimulatedHang after SYNK_SIM_HANG_TIMEOUT)
    ("22803", {}, 2, {0: DUPLICATE, 1: "hang", 2: DUPLICATE}),
    ("22803", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, 2, {0: DUPLICATE, 1: "hang",
                                                       2: DUPLICATE}),
    # 2.30.3/2.30.4 (src/graph/topo.cc ncclCheckMultiRank): only the host's first rank checks
    ("23004", {}, 2, {0: FIRST_RANK, 1: "hang", 2: "hang"}),
    ("23004", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, 2, {}),
    # 2.30.7 on (src/init.cc v2.30.7-1 line 1055): every rank checks every pair
    ("23007", {}, 2, {0: EVERY_RANK, 1: EVERY_RANK, 2: EVERY_RANK}),
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "0"}, 2, {0: EVERY_RANK, 1: EVERY_RANK,
                                                       2: EVERY_RANK}),
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}, 2, {}),
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "0x1", "NCCL_NVLS_ENABLE": "0"}, 2, {}),  # strtoll
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "yes"}, 2, {0: EVERY_RANK, 1: EVERY_RANK,
                                                         2: EVERY_RANK}),
    # NVLS with several ranks on a GPU (src/init.cc v2.30.7-1 line 1053): 2.30.7 turns it off
    # only when the last two ranks share a GPU (hasMultiRankNvml is overwritten at each pair);
    # placed round-robin ([0, 1, 0]) NVLS is set up over the shared GPU: refused, unless
    # NCCL_NVLS_ENABLE=0
    ("23007", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, 2, ALL_NVLS_SHARED),
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, 2, ALL_NVLS_SHARED),
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "2"}, 2,
     ALL_NVLS_SHARED),
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "1"}, 2,
     ALL_NVLS_SHARED),
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, (0, 1, 1), {}),  # the last two share
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "1"}, (0, 1, 1),
     {0: NVLS, 1: NVLS, 2: NVLS}),  # (=1 refused where NCCL sees the sharing)
    ("23004", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, 2, {}),  # every rank's isMultiRankGpu
    # 3 ranks on one GPU: more than NCCL's default resources take (env.rst): every operation
    # hangs; NCCL_MAX_CTAS lets it run
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}, 1, {0: "hang", 1: "hang", 2: "hang"}),
    ("23203", {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "2"}, 1, {}),
])
def test_ranks_on_one_gpu_follow_nccls_rules_by_version(version, env, devices, refused):
    """The simulator's NCCL alone (no synk, which sets NCCL_MULTI_RANK_GPU_ENABLE where it
    decides to share GPUs through NCCL): each rank joins, runs one allreduce and waits."""
    extra = {"SYNK_SIM_NCCL_VERSION": version, **env}
    for name in ("NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_MAX_CTAS"):
        os.environ.pop(name, None)
    found, codes = run_ranks(3, "raw", devices=devices, env_extra=extra, hang_timeout=3)
    assert codes == [0, 0, 0]
    for rank in range(3):
        kind, value, _ = found[rank]
        expected = refused.get(rank)
        if expected is None:
            assert (kind, value) == ("ok", 3.0), value
        elif expected == "hang":
            assert (kind, value[0]) == ("error", "SimulatedHang"), value
        else:
            text = expected.format(r=rank, other=2 - rank)
            assert kind == "error" and value[0] == "NcclError" and text in value[1], value


@pytest.mark.gpu
def test_should_stop_gives_up_a_collective_a_rank_skips():
    found, codes = run_ranks(2, "skips_the_collective", stop_after=1)
    kind, (name, message, _), seconds = found[0]
    assert (kind, name) == ("error", "CommAborted") and "the test gave up" in message
    assert seconds < 3
    assert found[1][0] == "ok"


# ================================================ the simulator's network transport
# (ranks that do not share the id maker's /dev/shm meet over
# TCP, as NCCL's socket transport does. Here a rank is sent to the network as NCCL sends
# ranks of one node there, with NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1;
# tests/test_hosts_apart.py runs GPU ranks on hosts that share nothing. Every op and dtype
# against numpy, data movement, a rank elsewhere moving the whole communicator to TCP, the
# failures (a killed rank, disagreeing ranks) and a root that cannot be reached, which must
# fail at once)
TCP = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
# the ranks import the synk under test (a checkout's), not the one this Python installed
PYTHONPATH = os.pathsep.join(filter(None, [
    os.path.dirname(os.path.dirname(os.path.abspath(synk.__file__))),
    os.environ.get("PYTHONPATH")]))


def board_kind(comm, dev, rank, n):
    """One allreduce; how this rank met its peers, and the sum."""
    x = dev.to_device(np.full(4, float(rank + 1), np.float32))
    total = float(dev.to_host(comm.allreduce(x))[0])
    return type(comm.guard.comm._board).__name__, total


def run_ranks_apart(n, scenario, rank_env, faults="", uid=None, wait=45, hang_timeout=20):
    """``scenario`` (of the NCCL transport's above, or ``board_kind``) on ``n`` ranks in
    fresh processes, each with its own extra environment; {rank: (kind, value, seconds)} and
    the exit codes. No segment of the communicator is left behind."""
    import base64
    import pickle

    uid = make_id(cp) if uid is None else uid
    prefix = uid[8:112].rstrip(b"\0").decode()
    procs = []
    for rank in range(n):
        env = dict(os.environ, SYNK_SIMULATE_GPUS=str(n), SYNK_SIM_FAULTS=faults,
                   SYNK_SIM_HANG_TIMEOUT=str(hang_timeout), STOP_AFTER="0",
                   PYTHONPATH=PYTHONPATH, **rank_env[rank])
        env.pop("CUDA_VISIBLE_DEVICES", None)
        procs.append(subprocess.Popen([sys.executable, __file__, str(rank), str(n), uid.hex(),
                                       scenario], env=env, stdout=subprocess.PIPE, text=True))
    found, codes = {}, []
    deadline = time.monotonic() + wait
    try:
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    found[rank] = pickle.loads(base64.b64decode(line.split()[1]))
            codes.append(proc.returncode)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    left = [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
    assert not left, f"segments left behind: {left}"
    return found, codes


@pytest.mark.gpu
def test_ranks_with_p2p_and_shm_disabled_meet_over_tcp_and_match_numpy():
    found, codes = run_ranks_apart(3, "every_op_and_dtype", [TCP] * 3)
    assert codes == [0, 0, 0]
    for rank in range(3):
        kind, value, _ = found[rank]
        assert kind == "ok" and value == [], value
    found, codes = run_ranks_apart(3, "board_kind", [TCP] * 3)
    assert codes == [0, 0, 0]
    assert [found[r][1] for r in range(3)] == [("NetBoard", 6.0)] * 3


@pytest.mark.gpu
def test_data_movement_over_tcp():
    found, codes = run_ranks_apart(3, "data_movement", [TCP] * 3)
    assert codes == [0, 0, 0]
    xs = [np.arange(12.0).reshape(4, 3) + 100 * r for r in range(3)]
    for rank in range(3):
        kind, out, _ = found[rank]
        assert kind == "ok", out
        np.testing.assert_array_equal(out["broadcast"], xs[2])
        np.testing.assert_array_equal(out["ring"], xs[(rank - 1) % 3])
    np.testing.assert_array_equal(found[1][1]["recv"], [7, 8])


@pytest.mark.gpu
def test_one_rank_elsewhere_moves_the_whole_communicator_to_tcp():
    """Ranks 0 and 2 wait on the shared-memory board; rank 1 cannot use it and calls the
    root, which marks the board: the two switch, and all three meet over TCP."""
    found, codes = run_ranks_apart(3, "board_kind", [{}, TCP, {}])
    assert codes == [0, 0, 0]
    assert [found[r][1] for r in range(3)] == [("NetBoard", 6.0)] * 3, found


@pytest.mark.gpu
def test_ranks_on_one_board_stay_there():
    found, codes = run_ranks_apart(2, "board_kind", [{}, {}])
    assert [found[r][1] for r in range(2)] == [("Board", 3.0)] * 2, found


@pytest.mark.gpu
def test_a_rank_killed_over_tcp_is_reported_in_seconds():
    """Its connections close: the survivors' collective fails with ncclRemoteError naming
    it, long before the hang timeout (20 s here)."""
    found, codes = run_ranks_apart(3, "many_allreduces", [TCP] * 3,
                             faults=f"kill:rank=1:collective={first_op(3) + 2}")
    assert codes[1] == -9
    for rank in (0, 2):
        kind, (name, message, status), seconds = found[rank]
        assert (kind, name, status) == ("error", "CollectiveError", 6), message
        assert "rank 1" in message and "died" in message and seconds < 15, message


@pytest.mark.gpu
def test_disagreeing_ranks_over_tcp_get_the_simulators_error_on_every_rank():
    found, codes = run_ranks_apart(2, "mismatched_count", [TCP] * 2)
    assert codes == [0, 0]
    for rank in range(2):
        kind, (name, message, status), _ = found[rank]
        assert (kind, name, status) == ("error", "SimulatorError", None), message
        assert "disagree" in message and "undefined behaviour" in message, message


@pytest.mark.gpu
def test_a_root_nobody_can_reach_fails_at_once():
    """The id names an address where nothing listens (as when the maker's NCCL_SOCKET_IFNAME
    names an interface the other hosts cannot reach): the rank says so within seconds,
    where it would wait for the hang timeout (20 s) for a rendezvous that cannot happen."""
    uid = make_id(cp)
    sim_net.give_up(uid[8:112].rstrip(b"\0").decode())  # (its own root is not used)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # (closed: nothing listens there)
    uid = uid[:sim_net.ADDRESS_AT] + socket.inet_aton("127.0.0.1") + struct.pack(">H", dead_port) \
        + uid[sim_net.ADDRESS_AT + 6:]
    found, codes = run_ranks_apart(2, "raw", [TCP] * 2, uid=uid)
    for rank in range(2):
        kind, (name, message, status), seconds = found[rank]
        assert (kind, name, status) == ("error", "NcclError", 6), message
        assert f"cannot reach the bootstrap root at 127.0.0.1:{dead_port}" in message
        assert "cannot be simulated" in message and seconds < 10, message


@pytest.mark.gpu
@pytest.mark.parametrize("spec, interfaces, chosen", [
    # NCCL's default order: ib first, then anything but docker/lo/virbr, then docker, lo
    ("", [("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("eth0", "10.0.0.2")], "eth0"),
    ("", [("lo", "127.0.0.1"), ("eth0", "10.0.0.2"), ("ib0", "10.1.0.2")], "ib0"),
    ("", [("lo", "127.0.0.1"), ("docker0", "172.17.0.1")], "docker0"),
    ("", [("lo", "127.0.0.1")], "lo"),
    # NCCL_SOCKET_IFNAME: prefixes, ^ excludes, = matches exactly
    ("eth", [("lo", "127.0.0.1"), ("eth0", "10.0.0.2"), ("eth1", "10.0.1.2")], "eth0"),
    ("^eth0,lo", [("lo", "127.0.0.1"), ("eth0", "10.0.0.2"), ("eth1", "10.0.1.2")], "eth1"),
    ("=eth", [("eth", "10.0.0.9"), ("eth0", "10.0.0.2")], "eth"),
    ("lo", [("eth0", "10.0.0.2"), ("lo", "127.0.0.1")], "lo"),
])
def test_the_bootstrap_interface_is_chosen_as_nccl_chooses_it(monkeypatch, spec, interfaces,
                                                              chosen):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", spec)
    monkeypatch.setattr(sim_net, "interface_addresses",
                        lambda: [(name, address, True) for name, address in interfaces])
    sim_net.forget_interface()
    try:
        assert sim_net.bootstrap_interface()[0] == chosen
    finally:
        sim_net.forget_interface()


@pytest.mark.gpu
def test_no_interface_is_nccls_invalid_usage_at_get_unique_id(monkeypatch):
    """"Bootstrap : no socket interface found" (src/bootstrap.cc): ncclGetUniqueId fails."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuch")
    sim_net.forget_interface()
    try:
        with pytest.raises(cp.cuda.nccl.NcclError,
                           match="no socket interface found matching NCCL_SOCKET_IFNAME") as info:
            cp.cuda.nccl.get_unique_id()
        assert info.value.status == 5
    finally:
        sim_net.forget_interface()


# ================================================ the device layer on its own
# (transfers, counters, page-locking, discovery and its errors,
# and one function running unchanged on the CPU and on the simulator)
@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SYNK_SIMULATE_GPUS", raising=False)
    discovery._probed.clear()
    yield
    discovery._probed.clear()
    sim.reset_thread()


@pytest.fixture
def simulated(monkeypatch, fresh_probe):
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "2")
    discovery._probed.clear()


def loss(x, w):
    """A user's function: the same source on numpy and on device arrays."""
    xp = devices.array_module(x)
    return xp.mean(xp.tanh(x @ w), axis=0)


@pytest.mark.usefixtures("fresh_probe")
def test_cpu_device_is_the_identity():
    dev = devices.open("cpu")
    dev.bind()
    x = np.arange(4.0)
    assert dev.is_host and dev.xp is np and dev.device_id is None and dev.name == "cpu"
    assert dev.to_device(x) is x and dev.to_host(x) is x
    assert dev.is_device_array(x) and not dev.register(x)
    assert dev.transfer_counts() == {"h2d": 0, "d2h": 0}


@pytest.mark.usefixtures("fresh_probe")
@pytest.mark.gpu
def test_simulated_cuda_device_transfers_and_counts(simulated):
    dev = devices.open("cuda", 1)
    assert (dev.name, dev.device_id, dev.is_host, dev.xp) == ("cuda", 1, False, cp)
    with pytest.raises(RuntimeError, match="bind"):
        dev.to_device(np.ones(2))
    dev.bind()
    assert cp.cuda.runtime.getDevice() == 1
    assert cp.cuda.get_current_stream() == dev.stream and dev.stream.ptr != 0
    sim.reset_transfer_counts()
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = dev.to_device(host)
    assert dev.is_device_array(x) and not dev.is_device_array(host)
    assert x.device.id == 1 and dev.to_device(x) is x
    y = x * 2  # computed on the rank's stream, which bind made current
    np.testing.assert_array_equal(dev.to_host(y), host * 2)
    out = np.empty((3, 4), np.float32)
    assert dev.to_host(y, out=out) is out
    assert dev.to_host(3.5) == 3.5  # host values pass through
    dev.to_device(host[:, ::2])  # not contiguous: copied contiguous first
    dev.synchronize()
    expected = {"h2d": host.nbytes + host.nbytes // 2, "d2h": 2 * host.nbytes}
    assert dev.transfer_counts() == expected == sim.transfer_counts()


@pytest.mark.usefixtures("fresh_probe")
@pytest.mark.gpu
def test_same_function_on_cpu_and_on_simulated_device(simulated):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((8, 3)), rng.standard_normal((3, 2))
    want = loss(x, w)
    dev = devices.open("cuda", 0)
    dev.bind()
    got = loss(dev.to_device(x), dev.to_device(w))
    assert devices.array_module(got) is cp
    np.testing.assert_allclose(dev.to_host(got), want)
    with pytest.raises(TypeError, match="Unsupported type"):
        loss(dev.to_device(x), w)  # forgot to move w: fails as on a GPU


@pytest.mark.usefixtures("fresh_probe")
@pytest.mark.gpu
def test_page_locking_once_per_block_with_fallback(simulated):
    dev = devices.open("cuda", 0)
    dev.bind()
    block = shm.create(shm.session_prefix() + "pin", 3 * 4096 + 100)
    try:
        view = np.ndarray(100, np.uint8, buffer=block.buf, offset=4096 + 8)
        assert dev.register(block.buf)
        assert dev.register(view)  # the same mapping: registered once, no error 712
        runtime = cp.cuda.runtime
        with pytest.raises(runtime.CUDARuntimeError):  # really registered, whole pages
            runtime.hostRegister(view.ctypes.data, 1, 0)
        dev.unregister(view)
        dev.unregister(block.buf)  # no longer registered: nothing to do, no error 713
        base = np.frombuffer(block.buf, np.uint8).ctypes.data
        runtime.hostRegister(base, 4096, 0)  # someone else holds it: synk falls back
        from synk._testing import cuda_host

        cuda_host._warned.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not dev.register(block.buf)
            assert not dev.register(block.buf)
        assert len(caught) == 1 and "pageable" in str(caught[0].message)
        runtime.hostUnregister(base)
    finally:
        dev.close()
        shm.destroy(block)
    assert not sim.page_locked()


@pytest.mark.usefixtures("fresh_probe")
def test_discovery_without_gpu_falls_back_and_explains(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if CuPy were not installed
    assert devices.resolve_backend("auto") == "cpu"
    assert devices.resolve_backend("cpu") == "cpu"
    with pytest.raises(devices.GpuUnavailableError, match=r'CuPy is not installed \(pip install '
                                                          r'"synk\[gpu\]"\)'):
        devices.resolve_backend("gpu")
    assert "CuPy is not installed" in devices.describe()
    with pytest.raises(ValueError, match="unknown backend"):
        devices.resolve_backend("tpu")


@pytest.mark.usefixtures("fresh_probe")
@pytest.mark.gpu
def test_discovery_of_simulated_devices(monkeypatch, simulated):
    assert devices.resolve_backend("auto") == "gpu"
    status = devices.gpu_status()
    assert (status.kind, status.devices, status.xp) == ("sim", [0, 1], cp)
    assert "2 simulated CUDA devices" in devices.describe()
    with pytest.raises(ValueError, match=r"one of the visible CUDA devices \[0, 1\]"):
        devices.open("cuda", 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(devices.GpuUnavailableError,
                       match=r"no simulated CUDA device visible \(CUDA_VISIBLE_DEVICES=''\)"):
        devices.resolve_backend("gpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert devices.gpu_status().devices == [0]
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "two")
    with pytest.raises(devices.GpuUnavailableError, match="SYNK_SIMULATE_GPUS must be a number"):
        devices.resolve_backend("gpu")


@pytest.mark.usefixtures("fresh_probe")
def test_array_module():
    assert devices.array_module(np.ones(2)) is np
    assert devices.array_module(1.5) is np
    assert devices.array_module(np.float32(1)) is np


@pytest.mark.usefixtures("fresh_probe")
@pytest.mark.gpu
def test_array_module_of_simulated_arrays(simulated):
    assert devices.array_module(cp.ones(2)) is cp


@pytest.mark.usefixtures("fresh_probe")
@pytest.mark.gpu
def test_a_new_thread_starts_on_device_zero(simulated):
    dev = devices.open("cuda", 1)
    dev.bind()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(cp.cuda.runtime.getDevice()))
    thread.start()
    thread.join()
    assert seen == [0]  # as in CUDA: work from other threads must select the device itself


# ================================================ page-locked host-to-device copies
# Host-to-device copies from page-locked memory on GPU ranks:
# every shared-memory block a rank copies from is page-locked once (a second
# cudaHostRegister would raise CUDA's error 712 under the simulator) and unlocked when the
# block is freed or retired (an unknown pointer would raise 713); plain arrays of rank 0
# and rows picked by index go through page-locked staging buffers. Checked on every rank
# through the simulator's own records, the rank's staging buffers (through its
# communicator), the mappings of shared-memory blocks, and the device layer's record of
# refused page-locks.
def _row_bounds(n_rows: int, n_ranks: int) -> list:
    """Start of each rank's rows and the end, as numpy splits them (synk splits the same)."""
    sizes = [len(part) for part in np.array_split(np.arange(n_rows), n_ranks)]
    return [0, *(int(b) for b in np.cumsum(sizes))]


def _state(data, rows=None):
    """On a rank: whether ``rows`` of ``data`` (the rank's share) are page-locked and how
    many bytes of ``data``'s block are, what is page-locked, ranges locked that are neither
    in a live mapping nor a staging buffer, and the bytes copied so far (all of them, and
    from page-locked memory)."""
    device = comm_context.current.device
    staging = {slot.base for slot in device._staging._slots}
    block = None if data is None else data.array
    found = None if block is None else shm.mapping_of(block.ctypes.data, block.nbytes)
    mine = None if rows is None else block[rows[synk.comm.rank()]:rows[synk.comm.rank() + 1]]
    locked = sim.page_locked()
    inside = [(b, n) for b, n in locked.items()
              if found is not None and found[0] <= b < found[0] + found[1]]
    chunks = [] if mine is None else cuda_host._chunks(found, mine.ctypes.data, mine.nbytes)
    return {
        "block_pinned": mine is not None and all(
            sim_core.is_pinned(mine.ctypes.data + lo, hi - lo)
            for lo, hi in cuda_host.pinned_pieces(mine)),
        "chunks_of_mine": sum(n for _, n in chunks),
        "block_locked_bytes": sum(n for _, n in inside),
        "registered": locked,
        "stale": [b for b in locked if shm.mapping_of(b, 1) is None
                  and b not in staging],
        "problems": list(cuda_host.problems),
        "h2d": sim.transfer_counts()["h2d"],
        "pinned_h2d": sim.pinned_transfer_counts()["h2d"],
    }


def _states(data=None, rows=None):
    return on_every_rank(lambda arg: _state(*arg[0]), (data, rows))


@pytest.mark.gpu
@ON_THE_SIMULATORS_RECORDS
def test_data_blocks_are_page_locked_once_and_unlocked_when_freed(gpus):
    x = synk.data(np.random.default_rng(0).standard_normal((4096, 8)))  # 256 KiB
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    before = _states()
    for _ in range(3):  # the same block every call: page-locked once (else error 712)
        assert np.allclose(f(x), x.array.sum(axis=0))
    bounds = _row_bounds(4096, gpus)
    after = _states(x, bounds)
    rows = np.diff(bounds) * 8 * 8
    for r in range(gpus):
        assert after[r]["block_pinned"] and not after[r]["problems"], after[r]
        # only the chunks of the block that hold the rank's share are locked (here, small,
        # the whole block: one chunk)
        assert after[r]["block_locked_bytes"] <= after[r]["chunks_of_mine"], after[r]
        copied = after[r]["pinned_h2d"] - before[r]["pinned_h2d"]
        assert copied >= 3 * rows[r]  # every call's rows came from page-locked memory
    x.free()
    f(synk.data(np.ones((6, 8))))  # the ranks hear of the freed block with this call
    freed = _states()
    for r in range(gpus):
        assert not freed[r]["problems"] and not freed[r]["stale"], freed[r]
        assert len(freed[r]["registered"]) <= len(after[r]["registered"])


@pytest.mark.gpu
@ON_THE_SIMULATORS_RECORDS
def test_consecutive_batch_slices_lock_each_chunk_of_a_block_once(gpus):
    """Calls reading further into a 12 MiB Data (``batch=`` slices growing by 512 KiB): each
    rank locks each chunk its rows reach once, never again and never unlocked while the
    block lives: at most the block in all. (Growing one registration re-locked the union
    every call: a 4 MiB Data cost 66 MB of page-locking.)"""
    x = synk.data(np.random.default_rng(7).standard_normal((196608, 8)))  # 12 MiB
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    before = on_every_rank(lambda arg: sim.page_lock_counts(), None)
    for k in range(1, 25):
        batch = slice(0, k * 8192)
        assert np.allclose(f(x, batch=batch), x.array[batch].sum(axis=0))
    after = on_every_rank(lambda arg: sim.page_lock_counts(), None)
    states = _states(x, _row_bounds(196608, gpus))
    for r in range(gpus):
        locked = after[r]["bytes"] - before[r]["bytes"]
        assert 0 < locked <= x.nbytes + 2 * 4096, (before[r], after[r])
        assert after[r]["unregistered"] == before[r]["unregistered"]
        assert not states[r]["problems"]
    x.free()
    f(synk.data(np.ones((6, 8))))  # the ranks hear of the freed block with this call
    assert not any(s["stale"] for s in _states())


@pytest.mark.gpu
@ON_THE_SIMULATORS_RECORDS
def test_a_locked_range_grows_when_a_call_reads_more_of_the_block(gpus):
    x = synk.data(np.random.default_rng(6).standard_normal((8192, 8)))  # 512 KiB
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    for batch in (slice(0, 2048), slice(1024, 6000), None):  # overlapping, then all rows
        want = x.array[batch if batch is not None else slice(None)].sum(axis=0)
        assert np.allclose(f(x, batch=batch), want)
        assert np.allclose(f(x, batch=batch, num_slices=3), want)
    bounds = _row_bounds(8192, gpus)
    after = _states(x, bounds)
    for r in range(gpus):  # no 712 (a second registration) nor 713 on the way
        assert after[r]["block_pinned"] and not after[r]["problems"], after[r]


@pytest.mark.gpu
@ON_THE_SIMULATORS_RECORDS
def test_staging_blocks_are_page_locked_and_unlocked_when_regrown(gpus):
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    small = np.random.default_rng(1).standard_normal((2048, 8))  # 128 KiB: staged
    assert np.allclose(f(small), small.sum(axis=0))
    assert np.allclose(f(small * 2), small.sum(axis=0) * 2)  # the same staging block
    first = _states()
    big = np.random.default_rng(2).standard_normal((16384, 8))  # a larger block: regrown
    assert np.allclose(f(big), big.sum(axis=0))
    second = _states()
    for r in range(gpus):
        assert not first[r]["problems"] and not second[r]["problems"]
        assert not second[r]["stale"], second[r]  # the retired block is no longer locked
        assert second[r]["pinned_h2d"] - first[r]["pinned_h2d"] >= big.nbytes // gpus - 64


@pytest.mark.gpu
@ON_THE_SIMULATORS_RECORDS
@pytest.mark.parametrize("num_slices", [1, 3])
def test_index_batches_and_strided_rows_go_through_page_locked_staging(gpus, num_slices):
    x = synk.data(np.random.default_rng(3).standard_normal((20000, 16)))  # pieces > 64 KiB
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    idx = np.random.default_rng(4).permutation(20000)[:12000]
    before = _states()
    assert np.allclose(f(x, batch=idx, num_slices=num_slices), x.array[idx].sum(axis=0))
    assert np.allclose(f(x, batch=slice(1, None, 3), num_slices=num_slices),
                       x.array[1::3].sum(axis=0))
    after = _states()
    for r in range(gpus):
        pinned = after[r]["pinned_h2d"] - before[r]["pinned_h2d"]
        total = after[r]["h2d"] - before[r]["h2d"]
        assert pinned >= 0.9 * total and total > 0, (pinned, total)
        assert not after[r]["problems"]


@pytest.mark.gpu
@ON_THE_SIMULATORS_RECORDS
def test_a_one_rank_group_stages_plain_arrays_through_page_locked_buffers(monkeypatch):
    from conftest import use_devices

    use_devices(monkeypatch, 1)
    synk.fork(1, backend="gpu")
    x = np.random.default_rng(5).standard_normal((40000, 8))  # 2.4 MiB: copied in turns
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    for _ in range(2):
        assert np.allclose(f(x), x.sum(axis=0))
    state = _states()[0]
    assert state["pinned_h2d"] >= 2 * x.nbytes and not state["problems"]
    synk.close()
    assert not sim.page_locked()  # everything unlocked when the group closed


@pytest.mark.gpu
@ON_THE_SIMULATORS_RECORDS
def test_a_refused_page_lock_falls_back_to_pageable_copies_with_one_warning(gpus2):
    import warnings

    x = synk.data(np.arange(4096.0).reshape(512, 8))
    base, _ = shm.mapping_of(x.array.ctypes.data, x.nbytes)
    runtime.hostRegister(base, 4096, 0)  # someone else holds part of it: CUDA says 712
    cuda_host._warned.clear()
    try:
        f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                assert np.allclose(f(x), x.array.sum(axis=0))  # right, through pageable copies
        refused = [w for w in caught if "pageable" in str(w.message)]
        assert len(refused) == 1 and issubclass(refused[0].category, RuntimeWarning)
    finally:
        runtime.hostUnregister(base)


# ================================================ the simulator's own tables and records
@pytest.mark.gpu
@pytest.mark.usefixtures("two_sim_devices")
def test_pointers_are_checked():
    # (no public handle: the simulator's resolution of a device pointer, checked alone)
    from synk._testing import sim_memory as _memory

    x = cp.ones(10, cp.float32)
    alloc, offset = _memory.resolve(x[2:].data.ptr, 32)
    assert alloc is x._alloc and offset == 8
    with pytest.raises(runtime.CUDARuntimeError, match="past the end"):
        _memory.resolve(x.data.ptr, 44)


@pytest.mark.gpu
@pytest.mark.usefixtures("two_sim_devices_nccl_afresh")
def test_the_cuda_error_fault_corrupts_the_rank_s_device(monkeypatch):
    monkeypatch.setenv("SYNK_SIM_FAULTS", "cuda_error:rank=0:collective=1")
    # (no public handle: the once-per-process record of a fault that fired, reset here)
    from synk._testing import sim_faults as _faults

    _faults._fired.clear()
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    x = cp.ones(4, cp.float32)
    comm.allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)
    assert runtime.streamQuery(0) == 700
    with pytest.raises(runtime.CUDARuntimeError):
        cp.cuda.Stream.null.synchronize()
    comm.abort()


@pytest.mark.gpu
@pytest.mark.usefixtures("two_sim_devices")
def test_every_name_of_cupy_14_is_there_and_none_other():
    # (no public handle: the simulator's table of CuPy 14's names)
    from synk._testing import sim_names as _names

    for namespace, module in (("cupy", cp), ("cupy.random", cp.random),
                              ("cupy.linalg", cp.linalg), ("cupy.fft", cp.fft)):
        for name in _names.NAMES[namespace]:
            getattr(module, name)  # (no AttributeError: served, numpy's, or NotModelled)
    assert hasattr(cp, "RawKernel")  # (as in CuPy: using it is what raises)
    with pytest.raises(AttributeError, match="module 'cupy' has no attribute 'genfromtext'"):
        cp.genfromtext  # noqa: B018 (a typo: CuPy has no such name either)


# ================================================ the simulator's variables, read at the root
SYNK_VARIABLES = ("SYNK_SPIN_US", "SYNK_INLINE_OUTPUT_BYTES", "SYNK_PARALLEL_REDUCE_RANKS",
                  "SYNK_PROFILE", "SYNK_SIMULATE_GPUS", "SYNK_SIM_HANG_TIMEOUT",
                  "SYNK_SIM_FAULTS", "SYNK_SIM_NCCL_VERSION", "SYNK_HOST_ID",
                  "SYNK_MASTER_ADDR", "SYNK_MPI", "SYNK_PEER_TIMEOUT")


@pytest.fixture
def clean_env(monkeypatch):
    """None of synk's variables set (nor CUDA_VISIBLE_DEVICES), as in
    test_settings_checked_at_fork.py."""
    for name in (*SYNK_VARIABLES, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
@pytest.mark.parametrize("backend", ["auto", "gpu", "cpu"])
def test_a_bad_simulate_gpus_never_runs_on_cpu_ranks(clean_env, value, backend):
    clean_env.setenv("SYNK_SIMULATE_GPUS", value)
    with pytest.raises(ValueError, match=f"SYNK_SIMULATE_GPUS={value!r} is not valid"):
        synk.fork(2, backend=backend)
    assert synk.size() == 1
    # at the root: choosing the backend raises, rather than falling back to the CPU
    for asked in ("auto", "gpu"):
        with pytest.raises(discovery.GpuSettingError,
                           match=f"SYNK_SIMULATE_GPUS={value!r} is not valid") as caught:
            discovery.resolve_backend(asked)
        assert isinstance(caught.value, ValueError)
        assert isinstance(caught.value, discovery.GpuUnavailableError)
    assert discovery.resolve_backend("cpu") == "cpu"
    line = synk.backend()
    assert line.startswith("none: synk.fork() raises ValueError"), line
    assert f"SYNK_SIMULATE_GPUS={value!r}" in line


def test_the_simulator_names_its_variables(clean_env):
    clean_env.setenv("SYNK_SIM_HANG_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="SYNK_SIM_HANG_TIMEOUT='soon' is not valid: it must "
                                         "be a number of seconds from 0.01"):
        _settings.sim_hang_timeout()
    clean_env.setenv("SYNK_SIM_HANG_TIMEOUT", " 2.5 ")
    assert _settings.sim_hang_timeout() == 2.5
    clean_env.delenv("SYNK_SIM_HANG_TIMEOUT")
    assert _settings.sim_hang_timeout() == 60.0
    for value in ("two", "-1", "1.5"):
        clean_env.setenv("SYNK_SIMULATE_GPUS", value)
        with pytest.raises(ValueError, match=f"SYNK_SIMULATE_GPUS={value!r} is not valid: it "
                                             "must be a whole number .* unset it"):
            _settings.simulate_gpus()
    clean_env.setenv("SYNK_SIMULATE_GPUS", "3")
    assert _settings.simulate_gpus() == 3
    with pytest.raises(ValueError, match="SYNK_SIM_FAULTS='kill:rank=x' is not valid"):
        sim_faults.parse("kill:rank=x")
    assert sim_faults.parse(" kill:rank=1:collective=3 , async_error:rank=2:code=5,") == [
        {"kind": "kill", "rank": 1, "collective": 3},
        {"kind": "async_error", "rank": 2, "code": 5}]


# ================================================ NCCL operations straight on a rank's transport
# (from test_gpu_matches_cupy_and_nccl.py: no exchange over the host before them), and a
# rank poisoned while blocked inside NCCL
PROMPT = 15  # seconds: "in seconds", with room for a loaded machine
X = np.random.default_rng(36).standard_normal((13, 4))


def _large_allreduce_unless(rank_that_raises):
    """A function: rank ``rank_that_raises`` raises; the others run a 4 MiB allreduce
    straight on the rank's NCCL transport (no exchange over the host before it, which would
    stop them first), the first operation of that size: NCCL picks an algorithm for it that
    synk's one-element warm-ups did not use."""

    # (no public handle: an NCCL operation with no exchange over the host before it)
    def fn(x):

        if synk.comm.rank() == rank_that_raises:
            raise KeyError("gives up")
        transport = comm_context.current.device_comm
        return transport.allreduce(synk.xp(x).ones(1 << 20, synk.xp(x).float32))[:1]

    return fn


@pytest.mark.gpu
def test_a_large_first_operation_never_blocks_inside_nccl(gpus):
    """NCCL >= 2.22 connects each algorithm at its first use, inside the call, waiting in C
    for the peers (src/enqueue.cc): with a peer gone, the caller would block, and only an
    abort from another thread (undefined for CuPy's blocking communicators) could free it.
    synk's processes read NCCL_RUNTIME_CONNECT=0: every algorithm is connected in
    ncclCommInitRank, the large operation is only queued, and its wait gives up in seconds
    (an abort with nobody inside NCCL): the group stays usable."""
    if REAL:
        pytest.skip("reads the simulator's records")
    read = synk.function(lambda: synk.simulator.nccl_communicator().settings[
        "NCCL_RUNTIME_CONNECT"], reduce=None)()
    assert read == [0] * gpus
    start = time.monotonic()
    with pytest.raises(KeyError, match="gives up"):
        synk.function(_large_allreduce_unless(1), reduce=None, timeout=60)(X)
    assert time.monotonic() - start < PROMPT
    got = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None)(X)
    assert all(np.allclose(g, X.sum(axis=0)) for g in got)


@pytest.mark.gpu
def test_a_long_collective_is_waited_for_without_polling_all_along(gpus2, monkeypatch):
    """Rank 0 waits 2 seconds in an allreduce that rank 1 joins late. Its wait sleeps in
    slices, woken by a host function CUDA calls when the operation completes
    (``Stream.launch_host_func``): a few hundred queries of the event in all, where polling
    every 0.5 ms made thousands (a core busy, and up to a slice late)."""
    if REAL:
        pytest.skip("counts the simulator's event queries")
    from synk.simulator import cupy

    runtime = cupy.cuda.runtime

    real, calls = runtime.eventQuery, []

    def counted(event):
        calls.append(1)
        return real(event)

    monkeypatch.setattr(runtime, "eventQuery", counted)

    def fn(x):

        if synk.comm.rank() == 1:
            time.sleep(2.0)
        # (straight on the transport: synk.comm's check of shapes over the host would be
        # where rank 0 waits)
        return comm_context.current.device_comm.allreduce(x.sum(axis=0))

    synk.function(fn, reduce=None)(X)  # (warm)
    calls.clear()
    got = synk.function(fn, reduce=None)(X)
    assert all(np.allclose(g, X.sum(axis=0)) for g in got)
    assert len(calls) < 600, len(calls)  # (a spin, then at most 100 a second)


@pytest.mark.gpu
def test_a_worker_aborted_while_blocked_inside_nccl_stops_itself(monkeypatch):
    """The user set NCCL_RUNTIME_CONNECT=1: rank 1 blocks inside NCCL connecting a large
    allreduce's algorithm while rank 0 has raised. Its watcher aborts the communicator under
    the blocked thread, which NCCL leaves undefined ("might hang forever"; the simulator
    keeps it blocked): the rank is poisoned, its process stops itself instead of being
    reused, and the master reports that in seconds; the next group works."""
    if REAL:
        pytest.skip("makes a rank block inside the simulated NCCL")
    monkeypatch.setenv("NCCL_RUNTIME_CONNECT", "1")
    fresh_nccl_process()
    use_devices(monkeypatch, 2)
    synk.fork(2, backend="gpu")
    try:
        start = time.monotonic()
        with pytest.raises(synk.WorkerDiedError, match="rank 1 stopped itself: its NCCL") as info:
            synk.function(_large_allreduce_unless(0), reduce=None, timeout=60)(X)
        assert time.monotonic() - start < PROMPT
        assert info.value.exitcode == synk.errors.POISONED_EXIT
        with pytest.raises(synk.GroupBrokenError):
            synk.function(lambda x: x.sum(), reduce="sum")(X)
    finally:
        synk.close()
        fresh_nccl_process()
    monkeypatch.delenv("NCCL_RUNTIME_CONNECT")
    synk.fork(2, backend="gpu")
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4)) == 4
    synk.close()
    fresh_nccl_process()


if __name__ == "__main__":  # one rank of the NCCL transport's tests, in a process of its own
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4])
