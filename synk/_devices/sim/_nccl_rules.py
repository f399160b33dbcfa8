"""NCCL's documented rules that the simulated communicators follow, by NCCL version.

Each rule cites where NCCL has it (github.com/NVIDIA/nccl, tag v2.x.y-1):

* **Environment variables are read once per process** (src/misc/param.cc, ``ncclLoadParam``:
  the first read is cached in a static) with ``strtoll(value, NULL, 0)``: "0x1" is 1, "1abc"
  is 1, "yes" is 0. The simulator reads them at the first communicator a process makes.
* **Ranks sharing a GPU.** Before 2.30 every rank that shares its GPU with another rank of
  the communicator fails ``ncclCommInitRank`` with ncclInvalidUsage, "Duplicate GPU detected"
  (src/init.cc, v2.28.9-1 line 904); the others wait for them in the next bootstrap step,
  forever. 2.30.3 and 2.30.4 check only on the host's first rank, "Multiple ranks detected
  using the same GPU on this node" (src/graph/topo.cc ``ncclCheckMultiRank``, v2.30.3-1 line
  1976); from 2.30.7 every rank checks every pair, "Multiple Ranks are using the same
  GPU/Partition" (src/init.cc, v2.30.7-1 line 1055). From 2.30, a non-zero
  ``NCCL_MULTI_RANK_GPU_ENABLE`` allows it (docs/userguide env.rst, "since 2.30").
* **NVLS** is silently disabled for such a communicator unless ``NCCL_NVLS_ENABLE`` is 1,
  which makes set-up fail (src/transport/nvls.cc ``ncclNvlsInit``, v2.30.7-1 line 252;
  src/init.cc v2.30.3-1 line 1121).
* **Resources**: "With the default configuration, NCCL should be able to run up to 2 ranks
  per GPU ... Failing to do so will result in a hang in NCCL" (env.rst,
  NCCL_MULTI_RANK_GPU_ENABLE); ``NCCL_MAX_CTAS`` limits the channels per rank.
* **Connections on first use** (since 2.22, ``NCCL_RUNTIME_CONNECT``, default 1; env.rst):
  the first collective that needs a connection, and the first send/receive between two
  ranks, connect them inside the NCCL call, blocking the calling thread until the peers
  take part (src/enqueue.cc, ``initAlgoChannels``). There is no timeout; the thread is freed
  only by ``ncclCommAbort`` (its sockets see the abort flag and return ncclInternalError,
  src/misc/socket.cc line 490). With ``NCCL_RUNTIME_CONNECT=0`` collectives connect at
  set-up; point-to-point connections are always made on first use.
* **Ranks of one node use the network** when ``NCCL_P2P_DISABLE=1`` and
  ``NCCL_SHM_DISABLE=1`` ("NCCL will use the network ... when SHM is disabled", env.rst
  lines 797-855); ranks of different nodes always do. See ``_net`` for the simulator's
  network transport, TCP between the ranks, as NCCL's socket transport.
* **Pointers are not checked** unless ``NCCL_CHECK_POINTERS=1`` (src/init.cc line 2227,
  src/misc/argcheck.cc ``ArgsCheck``): a bad buffer is an illegal address in NCCL's kernel,
  a sticky CUDA error. Empty collectives are discarded (src/enqueue.cc ``taskAppend``: "Empty
  collectives can be discarded"), after the root, type and op checks.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import re
import socket

from ... import _settings
from .. import nccl_env

DEFAULT_VERSION = 23203  # nvidia-nccl-cu12's runtime when no NCCL wheel is installed
MULTI_RANK_FROM = 23000  # 2.30: NCCL_MULTI_RANK_GPU_ENABLE exists
EVERY_RANK_CHECKS_FROM = 23007  # 2.30.7: each rank checks every pair (before: the first one)
RUNTIME_CONNECT_FROM = 22200  # 2.22: NCCL_RUNTIME_CONNECT, default on

_DEFAULTS = {"NCCL_MULTI_RANK_GPU_ENABLE": 0, "NCCL_NVLS_ENABLE": 2, "NCCL_RUNTIME_CONNECT": 1,
             "NCCL_CHECK_POINTERS": 0, "NCCL_MAX_CTAS": None, "NCCL_P2P_DISABLE": 0,
             "NCCL_SHM_DISABLE": 0}
_params: dict = {}  # what this process's NCCL read, at its first communicator


def installed_version() -> int:
    """The version code of the installed NCCL runtime wheel (nvidia-nccl-cu12/13), as
    ``ncclGetVersion`` gives it (2.32.3 -> 23203); ``DEFAULT_VERSION`` without one."""
    for dist in ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl-cu11"):
        try:
            text = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
        found = re.match(r"(\d+)\.(\d+)\.(\d+)", text)
        if found:
            major, minor, patch = (int(g) for g in found.groups())
            return major * 10000 + minor * 100 + patch
    return DEFAULT_VERSION


_installed: list = []


def version() -> int:
    """The simulated NCCL's version: ``SYNK_SIM_NCCL_VERSION`` (tests pretend another one),
    else the installed wheel's."""
    pretended = _settings.sim_nccl_version()
    if pretended is not None:
        return pretended
    if not _installed:
        _installed.append(installed_version())
    return _installed[0]


def params() -> dict:
    """NCCL's variables as this process's NCCL read them: at its first communicator, once
    (later changes to the environment are not seen)."""
    if not _params:
        for name, default in _DEFAULTS.items():
            _params[name] = nccl_env.read(name, default)
    return _params


def forget_params() -> None:
    """Forget what was read (tests standing in for a fresh process)."""
    _params.clear()


def host_hash() -> int:
    """This process's host, as NCCL's ``hostHash`` tells hosts apart: synk's pretend host
    (``SYNK_HOST_ID``, for tests of many hosts on one machine) or the machine's name."""
    name = _settings.host_id() or socket.gethostname()
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:7], "little")


def shared_gpu_refusal(version_code: int, rank: int, gpus: list, multi_rank: int,
                       nvls: int) -> str | None:
    """Why ``ncclCommInitRank`` fails on ``rank`` (its message), given every rank's GPU as
    (host, device), or None. Ranks that pass wait for those that failed, forever. NCCL
    compares ranks of the same host only."""
    host, device = gpus[rank]
    mine = [(r, d) for r, (h, d) in enumerate(gpus) if h == host]
    shared = len({d for _, d in mine}) < len(mine)
    if not shared:
        return None
    if version_code < MULTI_RANK_FROM:
        others = [r for r, d in mine if d == device and r != rank]
        if others:
            return (f"Duplicate GPU detected : rank {rank} and rank {others[0]} both on CUDA "
                    f"device {device:x}")
        return None
    if version_code < EVERY_RANK_CHECKS_FROM:
        if rank == mine[0][0] and not multi_rank:  # the host's first rank only
            return ("Multiple ranks detected using the same GPU on this node. Set "
                    "NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.")
        if multi_rank and nvls == 1:
            return ('Multiple ranks detected using the same GPU on this node and '
                    'NCCL_NVLS_ENABLE has been set to "1". At this time multiple ranks per '
                    'gpu is incompatible with NVLS.')
        return None
    if not multi_rank:
        return ("Multiple Ranks are using the same GPU/Partition. Set "
                "NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.")
    if nvls == 1:
        return ('NCCL_NVLS_ENABLE has been set to "1" and communicator has multiple ranks '
                'using the same NVML device. This is not compatible with NCCL_NVLS_ENABLE=1.')
    return None


def starved(gpus: list, max_ctas) -> str | None:
    """Why every operation of a communicator would hang: more than 2 of its ranks on one GPU
    with NCCL's default resources (no ``NCCL_MAX_CTAS``)."""
    if max_ctas is not None:
        return None
    crowded = {g: gpus.count(g) for g in set(gpus) if gpus.count(g) > 2}
    if not crowded:
        return None
    where = ", ".join(f"{n} ranks on GPU {d}" for (_, d), n in sorted(crowded.items()))
    return (f"{where}: with its default resources NCCL runs at most 2 ranks per GPU, more "
            "hang (set NCCL_MAX_CTAS to limit each rank's channels)")
