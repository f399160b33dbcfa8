"""The NCCL transport between real processes under the CUDA simulator (2 and 3 ranks):
every op and dtype against numpy, data movement, and failures that must raise in bounded
time: disagreeing ranks, a killed rank, an asynchronous NCCL error, a hanging set-up."""
import os
import sys
import time

import numpy as np
import pytest
from conftest import first_op

# No public handle: this file tests the NCCL transport itself, on the simulator's devices
# and NCCL, in processes of its own with no synk group.
from synk import __file__ as synk_file, simulator as sim
from synk._testing import NcclCommunicator, devices as _devices, make_id, sim_net
from synk.simulator import cupy as cp

pytestmark = pytest.mark.gpu

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

    status = _devices.gpu_status()
    dev = _devices.open("cuda", status.devices[rank % len(status.devices)])
    dev.bind()
    comm = None
    started = time.monotonic()
    try:
        stop_after = float(os.environ.get("STOP_AFTER", "0"))
        should_stop = ((lambda: "the test gave up" if time.monotonic() - started > stop_after
                        else None) if stop_after else None)
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


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_every_op_and_dtype_matches_numpy(n):
    found, codes = run_ranks(n, "every_op_and_dtype")
    assert codes == [0] * n
    for rank in range(n):
        kind, value, _ = found[rank]
        assert kind == "ok", value
        assert value == [], value


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


def test_should_stop_gives_up_a_collective_a_rank_skips():
    found, codes = run_ranks(2, "skips_the_collective", stop_after=1)
    kind, (name, message, _), seconds = found[0]
    assert (kind, name) == ("error", "CommAborted") and "the test gave up" in message
    assert seconds < 3
    assert found[1][0] == "ok"


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4])
