"""Shared fixtures: every test is checked for leaked processes and shared-memory blocks.

It reaches synk's internals (``synk._testing``) for what no public handle shows: whether a
test left a group running, whether CUDA here is real (discovery, and its cache cleared when a
test changes the simulated devices), and NCCL's once-per-process record and set-up."""
import contextlib
import gc
import os
import signal
import threading
import time

import pytest
from hypothesis import settings

import synk

# ``--hypothesis-profile=soak``: the randomized harness (test_random_programs.py) runs for
# SYNK_SOAK_MINUTES (default 30), this many programs at a time.
settings.register_profile("soak", max_examples=200, deadline=None)

SHM = "/dev/shm"


def pytest_sessionstart(session):
    """Compile synk to bytecode once: every test starts worker interpreters, and where
    PYTHONDONTWRITEBYTECODE is set (CI) each would compile the package from source again,
    a quarter of a second of CPU per worker."""
    import compileall
    import pathlib

    with contextlib.suppress(OSError):  # (a read-only install: the workers compile, slower)
        compileall.compile_dir(pathlib.Path(synk.__file__).parent, quiet=1)


def child_pids() -> set:
    """PIDs (zombies included) whose parent is this process."""
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me:
            found.add(int(entry))
    return found


def descendant_pids(roots=None) -> set:
    """Live processes below ``roots`` (pids; default: this process): children,
    grandchildren..."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {os.getpid()} if roots is None else set(roots)
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def synk_segments(owners=None) -> set:
    """synk segments in /dev/shm made by masters among ``owners`` (pids; default: this
    process and its descendants), so that other synk programs on the machine do not count."""
    owners = {os.getpid()} | descendant_pids() if owners is None else set(owners)
    prefixes = tuple(f"synk-{pid}-" for pid in owners)
    return {n for n in os.listdir(SHM) if n.startswith(prefixes)}


def synk_mappings() -> set:
    """synk blocks this process still has mapped."""
    with open("/proc/self/maps") as f:
        return {line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/synk-" in line}


def synk_threads() -> set:
    """synk's threads running in this process."""
    return {t for t in threading.enumerate() if t.name.startswith("synk")}


def clean_up(children: set, segments: set) -> None:
    """Take away what a leaking test left: kill ``children`` and every process below them
    (reaping the children), then unlink ``segments`` and any segment those processes made."""
    victims = set(children) | descendant_pids(children)
    for pid in victims:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            while not os.waitpid(pid, os.WNOHANG)[0] and time.monotonic() < deadline:
                time.sleep(0.01)
    for name in set(segments) | synk_segments(victims):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{SHM}/{name}")


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail the test if it leaves a child process, a synk shared-memory block or mapping, or a
    synk thread behind."""
    # Everything is judged against what existed before the test, and a leak is cleaned up
    # once reported: otherwise one leaking test would fail every later test too (hundreds
    # of errors for one bug). Mappings and threads cannot be taken from the objects that
    # hold them, so those stay in the next test's baseline instead.
    children, segments = child_pids(), synk_segments()
    mappings, threads = synk_mappings(), synk_threads()
    yield
    # (no public handle: whether a test left a group running, which would leak it)
    from synk import _testing

    left_open = _testing.running_group() is not None
    synk.close()
    deadline = time.monotonic() + 5
    while True:
        extra_children = child_pids() - children
        extra_segments = synk_segments() - segments
        if not (extra_children or extra_segments) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    gc.collect()
    extra_mappings = synk_mappings() - mappings
    extra_threads = sorted(t.name for t in synk_threads() - threads)
    leaks = [what for what, leaked in [
        ("test left a synk group running (no synk.close())", left_open),
        (f"test left child processes behind: {extra_children}", extra_children),
        (f"test left shared-memory blocks behind: {extra_segments}", extra_segments),
        (f"blocks still mapped after close(): {extra_mappings}", extra_mappings),
        (f"synk threads still running after close(): {extra_threads}", extra_threads),
    ] if leaked]
    if leaks:
        clean_up(extra_children, extra_segments)
    assert not leaks, "; ".join(leaks)


def on_every_rank(fn, *args, **kwargs):
    """fn(args) on each rank of the running group, as a list in rank order (of tuples, if
    fn returns them); keyword arguments go to synk.function."""
    result = synk.function(fn, bcast_inputs=["arg"], reduce=None, **kwargs)(args)
    return list(zip(*result)) if isinstance(result, tuple) else result


def check_every(cases, check) -> None:
    """``check(*case)`` for every case, in the group the test runs (a group per case would
    cost a fork each); fails listing every case that failed."""
    failed = []
    for case in cases:
        try:
            check(*case)
        except AssertionError as err:
            failed.append(f"{case!r}: {err}")
    assert not failed, f"{len(failed)} case(s) failed:\n" + "\n".join(failed)


def run_script(path, text: str) -> str:
    """Run ``text`` as a fresh Python script at ``path``; its stdout, after checking it
    exited with 0."""
    import subprocess
    import sys

    path.write_text(text)
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def _group_on_each_backend(request, monkeypatch, n: int):
    if request.param == "gpu":
        use_devices(monkeypatch, n)
    synk.fork(n, backend=request.param)
    yield request.param
    synk.close()


@pytest.fixture(params=["cpu", "gpu"])
def two(request, monkeypatch):
    """A group of 2 ranks on the CPU, then on (simulated) GPUs; yields the backend."""
    yield from _group_on_each_backend(request, monkeypatch, 2)


@pytest.fixture(params=["cpu", "gpu"])
def three(request, monkeypatch):
    """A group of 3 ranks on the CPU, then on (simulated) GPUs; yields the backend."""
    yield from _group_on_each_backend(request, monkeypatch, 3)


@pytest.fixture
def ranks3():
    """A group of 3 ranks (the master and two workers)."""
    synk.fork(3)
    yield 3
    synk.close()


@pytest.fixture
def ranks2():
    synk.fork(2)
    yield 2
    synk.close()


# -- GPU ranks: simulated here, real where CUDA is present -------------------------------------
def _real_cuda() -> bool:
    from synk._testing import discovery

    status = discovery.gpu_status()
    return os.environ.get("SYNK_SIMULATE_GPUS") is None and status.kind == "cuda" \
        and status.available


REAL = _real_cuda()


@pytest.fixture(autouse=True)
def _cpu_ranks_unless_marked_gpu(request, monkeypatch):
    """On a machine with CUDA, ``synk.fork()``'s default ``backend="auto"`` picks the GPUs;
    the tests not marked ``gpu`` are about CPU ranks (as CI runs them), so there "auto"
    means "cpu". The ``gpu`` tests choose their GPU ranks themselves."""
    if not REAL or request.node.get_closest_marker("gpu") is not None:
        return
    fork = synk.fork

    def on_cpu_ranks(n=None, *, backend="auto", **kwargs):
        return fork(n, backend="cpu" if backend == "auto" else backend, **kwargs)

    monkeypatch.setattr(synk, "fork", on_cpu_ranks)


@pytest.fixture(autouse=True)
def _one_gpu_per_rank(request):
    """A test marked ``one_gpu_per_rank(n)`` checks which device each rank is on, or
    switches a rank to another device: where CUDA is present it needs n real GPUs, and is
    skipped with fewer, also when ``SYNK_TEST_SHARE_GPUS=1`` lets other tests share them."""
    marker = request.node.get_closest_marker("one_gpu_per_rank")
    if marker is None or not REAL:
        return
    from synk._testing import discovery

    have = len(discovery.gpu_status().devices)
    if have < marker.args[0]:
        pytest.skip(f"checks each rank's own device: needs {marker.args[0]} CUDA devices, "
                    f"{have} here")


def use_devices(monkeypatch, n: int) -> None:
    """n simulated devices (or the real ones, when CUDA is present). With fewer real devices
    than n the test is skipped, unless ``SYNK_TEST_SHARE_GPUS=1``: then its n ranks share
    them round-robin, on the multi-rank path of one GPU (the tests that check where ranks
    are placed are marked ``one_gpu_per_rank`` and still skipped)."""
    from synk._testing import discovery

    if REAL:
        if len(discovery.gpu_status().devices) < n and not os.environ.get("SYNK_TEST_SHARE_GPUS"):
            pytest.skip(f"needs {n} CUDA devices (SYNK_TEST_SHARE_GPUS=1: ranks share them)")
        return
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", str(n))
    monkeypatch.setenv("SYNK_SIM_HANG_TIMEOUT", "20")
    discovery._probed.clear()


def fresh_nccl_process() -> None:
    """Forget what this process's NCCL read of its variables (simulated NCCL and synk's
    record of it): as in a fresh process, for tests of the once-per-process rules."""
    from synk._testing import nccl_setup as _nccl_setup, sim_nccl_rules as _nccl_rules

    _nccl_rules.forget_params()
    _nccl_setup._PROCESS.clear()


def nccl_env(monkeypatch, **values) -> None:
    """NCCL's variables for a test: these ``values``, the others unset, read afresh."""
    for var in ("NCCL_MULTI_RANK_GPU_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_MAX_CTAS",
                "SYNK_SIM_NCCL_VERSION"):
        monkeypatch.delenv(var, raising=False)
    for var, value in values.items():
        monkeypatch.setenv(var, value)
    fresh_nccl_process()


def two_sim_comms():
    """The simulator's NCCL: rank 0 on device 0 and rank 1 on device 1 of one communicator,
    made in threads (each blocks in ncclCommInitRank until the other joins)."""
    import threading

    from synk.simulator import cupy as cp

    nccl = cp.cuda.nccl
    uid, comms = nccl.get_unique_id(), [None, None]

    def join(r):
        cp.cuda.Device(r).use()
        comms[r] = nccl.NcclCommunicator(2, uid, r)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return comms


def first_op(n: int) -> int:
    """The number of the first NCCL operation after a communicator of ``n`` ranks is set up
    (for ``SYNK_SIM_FAULTS``'s ``collective=K``): set-up connects with a few of its own."""
    from synk._testing import connect_ops

    return connect_ops(n) + 1


@pytest.fixture(params=[2, 3], ids=["2gpus", "3gpus"])
def gpus(request, monkeypatch):
    """A GPU group of 2, then 3 ranks, one per (simulated) device."""
    use_devices(monkeypatch, request.param)
    n = synk.fork(request.param, backend="gpu")
    yield n
    synk.close()


@pytest.fixture
def gpus2(monkeypatch):
    use_devices(monkeypatch, 2)
    synk.fork(2, backend="gpu")
    yield 2
    synk.close()


@pytest.fixture(params=[pytest.param("gpu-2", marks=pytest.mark.gpu),
                        pytest.param("gpu-3", marks=pytest.mark.gpu), "cpu-2"])
def gpu_ranks_then_cpu(request, monkeypatch):
    """A group of 2, then 3 ranks on (simulated) GPUs, then of 2 CPU ranks; yields its
    size."""
    kind, n = request.param.split("-")
    if kind == "gpu":
        use_devices(monkeypatch, int(n))
    synk.fork(int(n), backend=kind)
    yield int(n)
    synk.close()


@pytest.fixture
def two_sim_devices(monkeypatch):
    """The simulator's CuPy in this process, with two devices, device 0 current; after the
    test, this thread's device and stream as in a new thread (for the tests that drive the
    simulator itself, without a group)."""
    from synk import simulator as sim

    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "2")
    for var in ("CUDA_VISIBLE_DEVICES", "SYNK_SIM_FAULTS"):
        monkeypatch.delenv(var, raising=False)
    sim.cupy.cuda.Device(0).use()
    yield
    sim.reset_thread()


@pytest.fixture
def two_sim_devices_nccl_afresh(monkeypatch):
    """``two_sim_devices``, with NCCL's variables unset and its once-per-process record
    forgotten before and after (as in a fresh process), a simulated hang raising after 5 s,
    and the simulator's sticky errors cleared after."""
    from synk import simulator as sim

    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "2")
    monkeypatch.setenv("SYNK_SIM_HANG_TIMEOUT", "5")
    for var in ("CUDA_VISIBLE_DEVICES", "SYNK_SIM_FAULTS", "NCCL_RUNTIME_CONNECT",
                "NCCL_CHECK_POINTERS", "SYNK_SIM_NCCL_VERSION"):
        monkeypatch.delenv(var, raising=False)
    fresh_nccl_process()
    sim.cupy.cuda.Device(0).use()
    yield
    sim.reset_thread()
    sim.clear_sticky_errors()
    fresh_nccl_process()


# The layouts of the tests ported from MPI's, NCCL's and torch.distributed's suites: CPU
# ranks, and simulated GPUs (one rank each, and two ranks per GPU).
PEER_LAYOUTS = {"3 cpu": (3, None, {}), "4 cpu": (4, None, {}),
                "2 gpus": (2, 2, {}), "4 ranks on 2 gpus": (4, 2, {})}


@contextlib.contextmanager
def layout_group(monkeypatch, n: int, devices, env: dict):
    """A group of ``n`` ranks: on CPU cores (``devices`` None) or on ``devices`` simulated
    GPUs (with NCCL settings ``env``); closed after."""
    if devices is None:
        synk.fork(n)
    else:
        if env:
            nccl_env(monkeypatch, **env)
        use_devices(monkeypatch, devices)
        synk.fork(n, backend="gpu")
    try:
        yield n
    finally:
        synk.close()
        if devices is not None:
            fresh_nccl_process()


def leaves(tree):
    """The arrays of ``tree``, in order (dicts in their order)."""
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in leaves(value)]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in leaves(value)]
    return [tree]
