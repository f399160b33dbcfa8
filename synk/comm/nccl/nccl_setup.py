"""Making one rank's NCCL communicator: joined under a deadline, connected at once, and
the environment NCCL needs for ranks that share a GPU.

::

    join    a daemon thread, watched until the deadline (else _abandon):
              process_env -> ncclCommInitRank (NCCL_RUNTIME_CONNECT=0) -> connect_all
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any

from ... import _interrupts
from ..._devices import nccl_env
from ..._devices.cuda_api import nccl_module
from ...errors import (
    CommError,
    CommInitError,
    CommInitTimeout,
    DeviceFailedError,
    sticky_cuda_error,
)

MULTI_RANK_GPU_FROM = 23000  # NCCL 2.30: NCCL_MULTI_RANK_GPU_ENABLE
LAST_PAIR_NVML_FROM = 23007  # NCCL 2.30.7: NVLS off only if the last two ranks share a GPU
RUNTIME_CONNECT_FROM = 22200  # NCCL 2.22: NCCL_RUNTIME_CONNECT, default 1
_VARIABLES = {"NCCL_MULTI_RANK_GPU_ENABLE": 0, "NCCL_NVLS_ENABLE": 2,
              "NCCL_RUNTIME_CONNECT": 1}
_PROCESS: dict = {}  # what this process's NCCL read, at synk's first communicator here
# (not in synk._process.PROCESS, which a child of os.fork() resets: NCCL's own state, read
# once, goes on in the child)


def version_of(xp) -> int | None:
    """The NCCL runtime's version code (2.30.7 -> 23007), None without one."""
    try:
        return int(nccl_module(xp).get_version())
    except Exception:  # no NCCL runtime
        return None


def first_use_env(xp) -> dict:
    """What this process's NCCL must read at its first communicator: every algorithm
    connected in ``ncclCommInitRank`` (``NCCL_RUNTIME_CONNECT=0``), and ranks that share a
    GPU allowed, so that later groups may share GPUs (only relaxes a check: nothing changes
    for one rank per GPU)."""
    version = version_of(xp)
    env = {}
    if version is not None and version >= RUNTIME_CONNECT_FROM:
        env["NCCL_RUNTIME_CONNECT"] = "0"
    if version is not None and version >= MULTI_RANK_GPU_FROM:
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    return env


@contextlib.contextmanager
def process_env(extra: dict):
    """Around this process's first NCCL communicator: ``extra`` set where the user did not
    set it, then the environment restored; what NCCL read, once per process, is remembered
    (``_PROCESS``) and decides whether later groups can share GPUs."""
    if _PROCESS:
        yield
        return
    added = {k: v for k, v in extra.items() if os.environ.get(k) in (None, "")}
    os.environ.update(added)
    try:
        for name, default in _VARIABLES.items():
            _PROCESS[name] = nccl_env.read(name, default)
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def shared_gpu_plan(xp, device_ids: list) -> tuple[dict | None, str]:
    """Whether ranks that share GPUs (``device_ids``, one per rank) can use NCCL: (the
    workers' extra environment, "") or (None, why not, in words). NCCL 2.30.7 turns NVLink
    SHARP off only when the last two ranks share a GPU (``hasMultiRankNvml`` is overwritten
    at each pair of its loop, src/init.cc v2.30.7-1 line 1053), hence
    ``NCCL_NVLS_ENABLE=0``."""
    version = version_of(xp)
    if version is None:
        return None, "no NCCL runtime"
    if version < MULTI_RANK_GPU_FROM:
        dotted = f"{version // 10000}.{version // 100 % 100}.{version % 100}"
        return None, (f"NCCL {dotted} refuses ranks that share a GPU (NCCL 2.30 and later "
                      "take them)")
    if nccl_env.read("NCCL_MULTI_RANK_GPU_ENABLE", None) == 0:
        return None, "NCCL_MULTI_RANK_GPU_ENABLE is 0 in the environment"
    if _PROCESS.get("NCCL_MULTI_RANK_GPU_ENABLE", 1) == 0:
        return None, ("this process's NCCL read NCCL_MULTI_RANK_GPU_ENABLE=0 when it made its "
                      "first communicator, and NCCL reads its variables once per process: set "
                      "it to 1 before the first synk.fork() to share GPUs through NCCL")
    if 1 in (nccl_env.read("NCCL_NVLS_ENABLE", 2), _PROCESS.get("NCCL_NVLS_ENABLE")):
        return None, ("NCCL_NVLS_ENABLE=1: NCCL refuses NVLink SHARP with several ranks on one "
                      "GPU")
    if version >= LAST_PAIR_NVML_FROM and _PROCESS.get("NCCL_NVLS_ENABLE", 0) != 0:
        return None, ("this process's NCCL read NCCL_NVLS_ENABLE as on when it made its first "
                      "communicator, and NCCL 2.30.7 and later keep NVLink SHARP on over ranks "
                      "that share a GPU unless the last two ranks share one: set "
                      "NCCL_NVLS_ENABLE=0 before the first synk.fork() to share GPUs through "
                      "NCCL")
    if version >= LAST_PAIR_NVML_FROM and nccl_env.read("NCCL_NVLS_ENABLE", 0) != 0:
        return None, ("NCCL_NVLS_ENABLE is set and not 0: NCCL 2.30.7 and later keep NVLink "
                      "SHARP on over ranks that share a GPU unless the last two ranks share "
                      "one; unset it or set it to 0 to share GPUs through NCCL")
    counts = {d: device_ids.count(d) for d in set(device_ids)}
    crowded = max(counts.values())
    if crowded > 2 and nccl_env.read("NCCL_MAX_CTAS", None) is None:
        gpu = min(d for d, n in counts.items() if n == crowded)
        return None, (f"{crowded} ranks share GPU {gpu}, and with its default resources NCCL "
                      "runs at most 2 ranks per GPU (more hang); set NCCL_MAX_CTAS to let "
                      "NCCL take them")
    extra = {"NCCL_NVLS_ENABLE": "0"}  # (unset by the user: checked above)
    if nccl_env.read("NCCL_MULTI_RANK_GPU_ENABLE", None) is None:
        extra["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    return extra, ""


def join(device, comm_id: bytes, size: int, rank: int, deadline: float, should_stop=None,
         env: dict | None = None):
    """This rank's CuPy ``NcclCommunicator``, joined and connected by ``deadline``, or
    ``CommInitError`` / ``CommInitTimeout``; ``env``: ``shared_gpu_plan``'s. It joins in a
    daemon thread (CuPy releases the GIL there), since CuPy 14 has no non-blocking set-up
    (``NcclConfig`` has only ``split_share``): one stuck in ``ncclCommInitRank`` stays
    there until the process ends."""
    xp = device.xp
    box: dict[str, Any] = {"lock": threading.Lock()}
    nccl = nccl_module(xp)

    def init():
        try:
            xp.cuda.Device(device.device_id).use()  # a new thread starts on device 0
            with process_env({**first_use_env(xp), **(env or {})}):
                comm = nccl.NcclCommunicator(size, comm_id, rank)
            with box["lock"]:
                given_up = box.get("abandoned", False)
                if not given_up:
                    box["comm"] = comm
            if given_up:  # while it was being made: nobody else will free it
                with contextlib.suppress(Exception):
                    comm.abort()
                return
            connect_all(xp, nccl, comm, rank, size, deadline, box)
        except BaseException as err:  # handed to the caller
            box["error"] = err

    thread = threading.Thread(target=init, name=f"synk-nccl-init-r{rank}", daemon=True)
    thread.start()
    while True:
        thread.join(0.01)
        if not thread.is_alive():
            break
        why = should_stop() if should_stop is not None else None
        if why:
            _abandon(box)
            raise CommInitError(f"NCCL set-up of rank {rank} of {size} abandoned: {why}")
        if time.monotonic() >= deadline:
            stuck = _abandon(box)
            raise CommInitTimeout(
                f"NCCL set-up of rank {rank} of {size} did not finish by its deadline: a rank "
                "died or hung while joining" + (
                    "" if not stuck else " (ncclCommInitRank cannot be cancelled through "
                    "CuPy; it stays in a background thread until the process ends)"))
    if "error" in box:
        _abandon(box)
        err = box["error"]
        status = device.failure()  # (a sticky CUDA error: the rank's GPU is lost)
        if status is not None and sticky_cuda_error(status) is not None:
            raise DeviceFailedError(rank, status, "while joining its NCCL communicator") \
                from err
        if isinstance(err, CommInitError):
            raise err
        raise CommInitError(f"NCCL set-up of rank {rank} of {size} failed: "
                            f"{type(err).__name__}: {err}") from err
    return box["comm"]


def _abandon(box: dict) -> bool:
    """Give up a set-up: abort its communicator if it was made (which frees a thread blocked
    connecting); True if the set-up thread is stuck inside ncclCommInitRank instead."""
    with _interrupts.uninterruptible():  # (see Guard._end)
        with box["lock"]:  # (a communicator made after this is the set-up thread's to free)
            box["abandoned"] = True
            comm = box.pop("comm", None)
        if comm is None:
            return "error" not in box
        with contextlib.suppress(Exception):
            comm.abort()
    return False


COLLECTIVE_KINDS = 5  # allReduce, reduce, broadcast, reduceScatter, allGather


def connect_ops(size: int) -> int:
    """How many NCCL operations ``connect_all`` makes on each rank of ``size``."""
    return 0 if size == 1 else COLLECTIVE_KINDS + 2 * (size - 1)


def connect_all(xp, nccl, comm, rank: int, size: int, deadline: float, box: dict) -> None:
    """Run each collective and a send/receive with every peer once, so that what NCCL
    connects on first use (since 2.22, each algorithm: ring, tree, NVLS, PAT; blocking in C
    without a timeout until the peers take part, so a rank that failed first leaves the
    others stuck) is connected under the set-up deadline. ``NCCL_RUNTIME_CONNECT=0``
    (``first_use_env``) connects every algorithm in ``ncclCommInitRank`` (src/init.cc
    v2.30.7-1 lines 1552-1580; a one-element warm-up would connect none of what a large
    operation picks); point-to-point connections are always made on first use."""
    if size == 1:
        return
    u8, total = nccl.NCCL_UINT8, nccl.NCCL_SUM
    with xp.cuda.Device(comm.device_id()):
        stream = xp.cuda.Stream(non_blocking=True)
        with stream:
            buf = box["buffer"] = xp.zeros(4 * size, xp.uint8)  # kept while NCCL uses it
        one, many, peers = buf[:1], buf[size:2 * size], buf[2 * size:]
        s = stream.ptr
        comm.allReduce(one.data.ptr, one.data.ptr, 1, u8, total, s)
        comm.reduce(one.data.ptr, one.data.ptr, 1, u8, total, 0, s)
        comm.broadcast(one.data.ptr, one.data.ptr, 1, u8, 0, s)
        comm.reduceScatter(many.data.ptr, one.data.ptr, 1, u8, total, s)
        comm.allGather(one.data.ptr, many.data.ptr, 1, u8, s)
        nccl.groupStart()
        try:
            for peer in range(size):
                if peer != rank:
                    comm.send(peers[peer:peer + 1].data.ptr, 1, u8, peer, s)
                    comm.recv(peers[size + peer:size + peer + 1].data.ptr, 1, u8, peer, s)
        finally:
            nccl.groupEnd()
        done = stream.record()
        query = xp.cuda.runtime.eventQuery
        while True:
            status = query(done.ptr)
            if status == 0:
                break
            if status != 600:
                raise CommError(f"CUDA error {status} while rank {rank} connected its NCCL "
                                "communicator")
            if box.get("abandoned"):
                return  # the caller gave up (and aborts the communicator)
            if time.monotonic() > deadline:
                raise CommInitTimeout(f"rank {rank} joined its NCCL communicator but could "
                                      "not connect it to its peers by the set-up deadline")
            time.sleep(0.001)
