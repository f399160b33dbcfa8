"""Allreduce: every rank holds an array of S bytes and the sum over the ranks comes back.

synk's CPU collective today is the reduction of a function's outputs: outputs of 1 MiB and
more go through shared memory and are combined by all ranks in parallel. Baselines: this
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

from ._timing import median_time, result, size_label

BENCH = "allreduce"
_held: dict = {}


def held_array(n: int):
    """Each rank's own array of ``n`` float32 ones, made once (not part of the timing)."""
    arr = _held.get(n)
    if arr is None:
        _held.clear()
        arr = _held[n] = np.ones(n, np.float32)
    return arr


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
    """{bytes: median seconds} of mpi4py Allreduce, or {} where MPI is not installed."""
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
