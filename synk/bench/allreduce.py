"""Allreduce and barrier: every rank holds an array of S bytes and the sum over the ranks
comes back, from 8 B to 256 MiB; and a barrier.
"""
from __future__ import annotations

import numpy as np

import synk

from .. import comm
from ._timing import collective_time, median_time, result, size_label
from .mpi_baselines import mpi_times

BENCH = "allreduce"
SMALL_SIZES = [8, 64, 512]  # bytes, below the 4 KiB the size ladder starts at
_held: dict = {}


def held_array(n: int):
    """Each rank's own array of ``n`` float32 ones, made once (not part of the timing)."""
    arr = _held.get(n)
    if arr is None:
        _held.clear()
        arr = _held[n] = np.ones(n, np.float32)
    return arr


def comm_times(sizes: list[int], repeat: int) -> np.ndarray:
    """On every rank: seconds per ``synk.comm.barrier``, then per ``synk.comm.allreduce``
    at each size, timed as mpi_allreduce times MPI's (``collective_time``)."""
    times = [collective_time(comm.barrier, comm.barrier, repeat, 0)]
    for nbytes in sizes:
        x = np.ones(nbytes // 4, np.float32)
        out = comm.allreduce(x)
        assert out[0] == out[-1] == comm.size()
        times.append(collective_time(lambda: comm.allreduce(x), comm.barrier, repeat, nbytes))
    return np.array(times)


def run(ranks: int, sizes: list[int], repeat: int) -> list[dict]:
    """The rows: two synk forms of allreduce, the reduction of a function's outputs (a whole
    call: dispatch, the function on every rank, outputs of 32 KiB
    (``SYNK_INLINE_OUTPUT_BYTES``) and more left in shared memory and combined there), and
    ``synk.comm.allreduce`` inside a running function (one collective among ranks already
    at work), timed as MPI's is: runs of back-to-back calls after a barrier, as the OSU
    micro-benchmarks do, the slowest rank's median. ``synk.comm.barrier`` is timed the same
    way. Baselines: this machine's single-thread memory copy of S bytes (the physical
    reference), and mpi4py's ``Allreduce`` and ``Barrier`` on the same number of ranks when
    mpi4py and an ``mpiexec`` are installed. Reported as time and algorithm bandwidth,
    S / time."""
    sizes = [s for s in SMALL_SIZES if s < sizes[0]] + sizes
    rows, synk_s = [], {}
    synk.fork(ranks)
    try:
        f = synk.function(held_array, bcast_inputs=["n"], reduce="sum")
        for nbytes in sizes:
            n = nbytes // 4
            out = f(n)
            assert out.shape == (n,) and out[0] == ranks and out[-1] == ranks
            synk_s[nbytes] = median_time(lambda: f(n), repeat)
        in_fn = synk.function(comm_times, bcast_inputs=["sizes", "repeat"],
                              reduce="max")  # the slowest rank's median
        barrier_s, *times = in_fn(sizes, repeat)
        comm_s = dict(zip(sizes, times))
    finally:
        synk.close()
        _held.clear()
    mpi = mpi_times(ranks, sizes, repeat)
    mpi_ar = mpi.get("allreduce", {})
    if "barrier" in mpi:
        rows.append(result(BENCH, "synk.comm barrier", barrier_s, "mpi4py Barrier",
                           mpi["barrier"], ranks=ranks, vs_mpi=mpi["barrier"] / barrier_s,
                           target="<= 5 us on 2 ranks"))
        rows.append(result(BENCH, "mpi4py Barrier", mpi["barrier"], "mpi4py Barrier",
                           mpi["barrier"], ranks=ranks))
    else:
        rows.append(result(BENCH, "synk.comm barrier", barrier_s, "itself", barrier_s,
                           ranks=ranks, target="<= 5 us on 2 ranks"))
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
                           **({"vs_mpi": mpi_ar[nbytes] / comm_s[nbytes]} if nbytes in mpi_ar
                              else {})))
        if nbytes in mpi_ar:
            rows.append(result(BENCH, f"mpi4py Allreduce, {label}", mpi_ar[nbytes],
                               "memory copy", copy_s, ranks=ranks, bytes=nbytes,
                               gb_per_s=nbytes / mpi_ar[nbytes] / 1e9,
                               synk_speedup=mpi_ar[nbytes] / synk_s[nbytes]))
    return rows
