"""NCCL's documented rules that the simulated communicators follow, by NCCL version, each
cited where NCCL has it (github.com/NVIDIA/nccl, tag v2.x.y-1).
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
LAST_PAIR_NVML_FROM = 23007  # 2.30.7: hasMultiRankNvml from the last pair of ranks only
ALGORITHMS = ("ring", "tree", "nvls", "pat")  # (CollNet needs a plugin: not modelled)
SMALL_ALGO_BYTES = 64 << 10  # up to this, allreduce picks tree (allgather/rs: PAT if it can)
NVLS_ALGO_BYTES = 1 << 20  # from this, collectives that have it pick NVLS where it is on

# NCCL's variables and their defaults. Pointers are not checked unless NCCL_CHECK_POINTERS=1
# (src/init.cc line 2227, src/misc/argcheck.cc ``ArgsCheck``): a bad buffer is an illegal
# address in NCCL's kernel, a sticky CUDA error; empty collectives are discarded
# (src/enqueue.cc ``taskAppend``: "Empty collectives can be discarded"), after the root, type
# and op checks. Ranks of one node use the network when NCCL_P2P_DISABLE=1 and
# NCCL_SHM_DISABLE=1 ("NCCL will use the network ... when SHM is disabled", env.rst lines
# 797-855); ranks of different nodes always do (``_net``: TCP, as NCCL's socket transport).
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
    (later changes to the environment are not seen). NCCL caches the first read in a static
    (src/misc/param.cc, ``ncclLoadParam``) and reads with ``strtoll(value, NULL, 0)``: "0x1"
    is 1, "1abc" is 1, "yes" is 0 (``nccl_env``)."""
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
    (host, device), or None; ranks that pass wait for those that failed, forever. NCCL compares
    ranks of one host only. Before 2.30: ncclInvalidUsage, "Duplicate GPU detected", among the
    ranks of the rank's host (src/init.cc v2.28.9-1 line 904); 2.30.3/2.30.4: on the host's
    first rank only (src/graph/topo.cc ``ncclCheckMultiRank``, v2.30.3-1 line 1976); from 2.30.7
    every rank checks every pair (src/init.cc v2.30.7-1 lines 1051-1058). From 2.30 a non-zero
    ``NCCL_MULTI_RANK_GPU_ENABLE`` allows it (docs/userguide env.rst, "since 2.30")."""
    host, device = gpus[rank]
    if version_code >= EVERY_RANK_CHECKS_FROM:  # every rank checks every pair of the host's
        if len(set(gpus)) == len(gpus):
            return None
        if not multi_rank:
            return ("Multiple Ranks are using the same GPU/Partition. Set "
                    "NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.")
        if nvls == 1 and gpus[-1] == gpus[-2]:  # hasMultiRankNvml: the last pair only
            return ('NCCL_NVLS_ENABLE has been set to "1" and communicator has multiple ranks '
                    'using the same NVML device. This is not compatible with '
                    'NCCL_NVLS_ENABLE=1.')
        return None  # (NVLS set up over shared GPUs all the same: nvls_refusal)
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
    # 2.30.3, 2.30.4
    if rank == mine[0][0] and not multi_rank:  # the host's first rank only
        return ("Multiple ranks detected using the same GPU on this node. Set "
                "NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this configuration.")
    if multi_rank and nvls == 1:
        return ('Multiple ranks detected using the same GPU on this node and '
                'NCCL_NVLS_ENABLE has been set to "1". At this time multiple ranks per '
                'gpu is incompatible with NVLS.')
    return None


def starved(gpus: list, max_ctas) -> str | None:
    """Why every operation of a communicator would hang: more than 2 of its ranks on one GPU
    with NCCL's default resources (no ``NCCL_MAX_CTAS``, which limits the channels per
    rank): "With the default configuration, NCCL should be able to run up to 2 ranks per GPU
    ... Failing to do so will result in a hang in NCCL" (env.rst,
    NCCL_MULTI_RANK_GPU_ENABLE)."""
    if max_ctas is not None:
        return None
    crowded = {g: gpus.count(g) for g in set(gpus) if gpus.count(g) > 2}
    if not crowded:
        return None
    where = ", ".join(f"{n} ranks on GPU {d}" for (_, d), n in sorted(crowded.items()))
    return (f"{where}: with its default resources NCCL runs at most 2 ranks per GPU, more "
            "hang (set NCCL_MAX_CTAS to limit each rank's channels)")


def nvls_on(version_code: int, gpus: list, nvls: int) -> bool:
    """Whether NCCL sets up NVLS for ``gpus`` (every rank's (host, device)) on the simulator's
    NVSwitch machines (nvls.cc lines 257-266): one host (across hosts NVLS needs CollNet,
    tuning.cc line 505), 2 GPUs or more (nvls.cc line 258), ``NCCL_NVLS_ENABLE`` not 0, and no
    shared GPU: among all ranks before 2.30.7 (2.30.3/2.30.4: ``isMultiRankGpu``, src/init.cc
    v2.30.3-1 lines 1121, 1276); from 2.30.7 in the last pair only, as its loop over all pairs
    overwrites ``hasMultiRankNvml`` (src/init.cc v2.30.7-1 line 1053; src/transport/nvls.cc
    ``ncclNvlsInit``, line 252), so round-robin ranks keep NVLS on (``nvls_refusal``). 2.32
    (source not public) is taken to keep 2.30.7's code."""
    if nvls == 0 or len({h for h, _ in gpus}) > 1 or len(set(gpus)) < 2:
        return False
    if version_code >= LAST_PAIR_NVML_FROM:
        return gpus[-1] != gpus[-2]  # hasMultiRankNvml (2 GPUs or more: 2 ranks or more)
    return len(set(gpus)) == len(gpus)


def nvls_refusal(version_code: int, gpus: list, nvls: int) -> str | None:
    """Why set-up fails on every rank when NVLS is set up over ranks that share a GPU (2.30.7
    leaves it on when the last pair of ranks does not share one), or None: what NCCL then
    does is not documented, so the simulator refuses that set-up. (``NCCL_NVLS_ENABLE=1``
    with ranks sharing a GPU makes set-up fail in NCCL itself: ``shared_gpu_refusal``.)"""
    if version_code < LAST_PAIR_NVML_FROM or len(set(gpus)) == len(gpus):
        return None
    if not nvls_on(version_code, gpus, nvls):
        return None
    return ("NVLS was set up over ranks that share a GPU (NCCL_NVLS_ENABLE is not 0): NCCL "
            "2.30.7 turns NVLS off for them only when the last two ranks share one "
            "(hasMultiRankNvml, src/init.cc line 1053); NCCL calls NVLS with several ranks "
            "per GPU not compatible. Set NCCL_NVLS_ENABLE=0 for this communicator's processes")


# Connections on first use, per algorithm (``NCCL_RUNTIME_CONNECT``, since 2.22, default 1;
# env.rst): a collective connects its algorithm (``algorithm``) on that algorithm's first use
# (src/enqueue.cc ``ncclPrepareTasks``: ``comm->initAlgoChannels[task->algorithm]``, v2.30.7-1
# line 495; broadcasts always ring, line 550; src/group.cc ``ncclCollPreconnect``), inside the
# call, blocking it until the peers connect too; two ranks' first send/receive connects them
# (always). With 0, ``ncclCommInitRank`` connects every algorithm (src/init.cc v2.30.7-1 lines
# 1552-1580). No timeout, and an abort from another thread may not free a blocked caller ("If
# NCCL communicators are set blocking, the thread can possibly get stuck inside NCCL calls",
# usage/communicators.rst, "Fault Tolerance", v2.30.7-1 line 508; CuPy 14 makes blocking
# communicators only): the simulator keeps it blocked (``SimulatedHang`` after
# ``SYNK_SIM_HANG_TIMEOUT``).
def algorithm(kind: str, nbytes: int, nvls: bool, one_gpu_per_host: bool) -> str:
    """The algorithm NCCL runs a collective of ``kind`` over ``nbytes`` (per rank) with. NCCL
    picks the fastest by its model (src/graph/tuning.cc: broadcast and reduce ring only, line
    295; allgather and reduce-scatter ring, PAT or NVLS; allreduce ring, tree or NVLS); the
    sizes here are the simulator's: tree for an allreduce up to ``SMALL_ALGO_BYTES``, NVLS from
    ``NVLS_ALGO_BYTES`` where it is on, PAT for small allgathers and reduce-scatters of one GPU
    per host, ring otherwise (that a one-element warm-up connects none of a large operation's
    algorithm is NCCL's)."""
    if kind in ("broadcast", "reduce"):
        return "ring"
    if nvls and nbytes >= NVLS_ALGO_BYTES:
        return "nvls"
    if kind == "allReduce":
        return "tree" if nbytes <= SMALL_ALGO_BYTES else "ring"
    return "pat" if one_gpu_per_host and nbytes <= SMALL_ALGO_BYTES else "ring"
