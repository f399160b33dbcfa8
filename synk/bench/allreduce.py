"""Allreduce: every rank holds an array of S bytes and the sum over the ranks comes back.

Two synk forms: the reduction of a function's outputs (a whole call: dispatch, the function
on every rank, outputs of 256 KiB and more left in shared memory and combined there), and
``synk.comm.allreduce`` inside a running function (one collective among ranks already at
work; messages of 64 KiB and more go through shared memory), timed as MPI's is: runs of
back-to-back calls after a barrier, as the OSU micro-benchmarks do. Baselines: this
machine's single-thread memory copy of S bytes (the physical reference), and mpi4py's
``Allreduce`` on the same number of ranks when mpi4py and an ``mpiexec`` are installed.
Reported as algorithm bandwidth, S / time.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np

import synk

from .. import comm
from ._timing import collective_time, median_time, result, size_label

BENCH = "allreduce"
_held: dict = {}


def held_array(n: int):
    """Each rank's own array of ``n`` float32 ones, made once (not part of the timing)."""
    arr = _held.get(n)
    if arr is None:
        _held.clear()
        arr = _held[n] = np.ones(n, np.float32)
    return arr


def comm_allreduce_times(sizes: list[int], repeat: int) -> np.ndarray:
    """On every rank: seconds per ``synk.comm.allreduce`` at each size, timed as
    mpi_allreduce times MPI's (``collective_time``)."""
    times = []
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        out = comm.allreduce(x)
        assert out[0] == out[-1] == comm.size()
        times.append(collective_time(lambda: comm.allreduce(x), comm.barrier, repeat, nbytes))
    return np.array(times)


def run(ranks: int, sizes: list[int], repeat: int) -> list[dict]:
    rows, synk_s = [], {}
    synk.fork(ranks)
    try:
        f = synk.function(held_array, bcast_inputs=["n"], reduce="sum")
        for nbytes in sizes:
            n = nbytes // 4
            out = f(n)
            assert out.shape == (n,) and out[0] == ranks and out[-1] == ranks
            synk_s[nbytes] = median_time(lambda: f(n), repeat)
        in_fn = synk.function(comm_allreduce_times, bcast_inputs=["sizes", "repeat"],
                              reduce="max")  # the slowest rank's median
        comm_s = dict(zip(sizes, in_fn(sizes, repeat)))
    finally:
        synk.close()
        _held.clear()
    mpi = _mpi_times(ranks, sizes, repeat)
    for nbytes in sizes:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        copy_s = median_time(lambda: np.copyto(dst, src), repeat)
        label = size_label(nbytes)
        extra = dict(ranks=ranks, bytes=nbytes, gb_per_s=nbytes / synk_s[nbytes] / 1e9,
                     copy_gb_per_s=nbytes / copy_s / 1e9)
        rows.append(result(BENCH, f"synk, {label}", synk_s[nbytes], "memory copy", copy_s,
                           target=">= 50% of copy bandwidth at 64 MiB, no slower than MPI",
                           **extra))
        rows.append(result(BENCH, f"synk.comm, {label}", comm_s[nbytes], "memory copy", copy_s,
                           ranks=ranks, bytes=nbytes, gb_per_s=nbytes / comm_s[nbytes] / 1e9,
                           **({"vs_mpi": mpi[nbytes] / comm_s[nbytes]} if nbytes in mpi
                              else {})))
        if nbytes in mpi:
            rows.append(result(BENCH, f"mpi4py Allreduce, {label}", mpi[nbytes], "memory copy",
                               copy_s, ranks=ranks, bytes=nbytes,
                               gb_per_s=nbytes / mpi[nbytes] / 1e9,
                               synk_speedup=mpi[nbytes] / synk_s[nbytes]))
    return rows


def mpiexec() -> str | None:
    """The mpiexec next to this Python (a pip-installed Open MPI), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def _mpi_times(ranks: int, sizes: list[int], repeat: int) -> dict:
    """{bytes: seconds} of mpi4py Allreduce, or {} where MPI is not installed."""
    launcher = mpiexec()
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return {}
    if launcher is None:
        return {}
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd = [launcher, "-n", str(ranks), sys.executable, "-m", "synk.bench.mpi_allreduce",
           str(repeat), *map(str, sizes)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"  (mpi4py baseline skipped: {err})")
        return {}
    if out.returncode != 0:
        print(f"  (mpi4py baseline skipped: mpiexec failed: {out.stderr.strip()[-300:]})")
        return {}
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
