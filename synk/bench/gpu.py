"""GPU figures, when CuPy sees a CUDA device (or tiny ones on the CUDA simulator, said so on
every row: the simulator's times are numpy's, not a GPU's): host-to-device copies, the cost of
a call, a resident replica as a broadcast input, a small training step and NCCL allreduce.
"""
from __future__ import annotations

import numpy as np

import synk

from .._devices import discovery, open as open_device
from .._devices.cuda import CudaDevice
from . import step
from ._timing import collective_time, group, median_time, result, size_label

BENCH = "gpu"
SIMULATED_SIZES = [64 << 10, 256 << 10]


def available() -> str | None:
    """None when a CUDA device (or a simulated one) is usable, else why not."""
    status = discovery.gpu_status()
    return None if status.available else status.reason


def run(sizes: list[int], repeat: int) -> list[dict]:
    status = discovery.gpu_status()
    simulated = status.kind == "sim"
    if simulated:
        sizes, repeat = SIMULATED_SIZES, min(repeat, 3)
    label = "simulated, " if simulated else ""
    rows = _copies(status, sizes, repeat, label)
    rows += _call_overhead(status, repeat, label)
    rows += _resident_broadcast(status, sizes, repeat, label)
    if len(status.devices) >= 2:
        rows.append(step.run(BENCH, len(status.devices), max(repeat, 200), "gpu", label))
        rows += _allreduce(status, sizes, repeat, label)
    return rows


def _copies(status, sizes: list[int], repeat: int, label: str) -> list[dict]:
    """Host-to-device bandwidth from a ``synk.Data`` (the path a rank's rows take: their
    shared-memory block, page-locked once), from pageable numpy memory, and CuPy's own
    page-locked copy, the baseline. Target: the Data >= 80% of CuPy's pinned copy."""
    xp = status.xp
    device = open_device("cuda", status.devices[0])
    assert isinstance(device, CudaDevice)
    device.bind()
    stream = device.stream
    rows = []
    try:
        with device.scope():
            for nbytes in sizes:
                n = nbytes // 4
                data = synk.data(np.ones(n, np.float32))
                pageable = np.ones(n, np.float32)
                memory = xp.cuda.alloc_pinned_memory(nbytes)
                pinned = np.frombuffer(memory, np.float32, n)
                pinned[...] = 1
                out = xp.empty(n, np.float32)

                def cupy_pinned():
                    out.set(pinned, stream=stream)
                    stream.synchronize()

                def from_data():
                    device.to_device(data.array)  # the block: page-locked at the first copy
                    stream.synchronize()

                def from_pageable():
                    out.set(pageable, stream=stream)
                    stream.synchronize()

                base_s = median_time(cupy_pinned, repeat)
                size = size_label(nbytes)
                for case, fn in ((f"H2D synk Data (pinned block), {size}", from_data),
                                 (f"H2D numpy pageable, {size}", from_pageable)):
                    seconds = median_time(fn, repeat)
                    rows.append(result(BENCH, label + case, seconds, "CuPy pinned", base_s,
                                       bytes=nbytes, gb_per_s=nbytes / seconds / 1e9))
                rows.append(result(BENCH, label + f"H2D CuPy pinned, {size}", base_s,
                                   "CuPy pinned", base_s, bytes=nbytes,
                                   gb_per_s=nbytes / base_s / 1e9))
                data.free()
    finally:
        device.close()
    rows[0]["target"] = "synk Data >= 80% of CuPy's pinned copy"
    return rows


def _mean_of(v):
    return synk.xp(v).mean(v)


def _call_overhead(status, repeat: int, label: str) -> list[dict]:
    """The cost of a one-rank synk call over the direct CuPy call it wraps (a mean of a
    device array, back on the host). Target: <= 100 us more."""
    with group(1, backend="gpu"):
        xp = status.xp
        v = synk.shared(np.ones(1024, np.float32))
        f = synk.function(_mean_of, reduce="sum")
        assert f(v) == 1.0
        x = xp.ones(1024, np.float32)  # on rank 0's device, current in this thread

        def direct():
            return float(xp.mean(x))  # the mean, and its copy to the host

        calls = max(repeat, 200)
        direct_s = median_time(direct, calls, warmup=20)
        synk_s = median_time(lambda: f(v), calls, warmup=20)
    return [result(BENCH, label + "direct CuPy call (mean of 1024)", direct_s, "itself",
                   direct_s),
            result(BENCH, label + "synk call, 1 rank (the same mean)", synk_s,
                   "direct CuPy call", direct_s, overhead_s=synk_s - direct_s,
                   target="<= 100 us over the direct call")]


def _sum_of(x):
    return synk.xp(x).sum(x)


def _plus_replica(x, replica):
    return synk.xp(x).sum(x)


def _resident_broadcast(status, sizes: list[int], repeat: int, label: str) -> list[dict]:
    """What a resident replica costs as a broadcast input: the call with it against the same
    call without (the difference is its copy on the device, made every call so that the
    function's writes to it stay its own)."""
    rows = []
    with group(1, backend="gpu"):
        x = np.ones(1024, np.float32)
        alone = synk.function(_sum_of, reduce="sum")
        calls = max(repeat, 50)
        base_s = median_time(lambda: alone(x), calls, warmup=5)
        for nbytes in sizes:
            replica = synk.data(np.ones(nbytes // 4, np.float32))
            replica.to_device("replicate")
            f = synk.function(_plus_replica, bcast_inputs=["replica"], reduce="sum")
            seconds = median_time(lambda: f(x, replica), calls, warmup=5)
            rows.append(result(BENCH, label + "call with a resident replica as broadcast "
                               f"input, {size_label(nbytes)}", seconds, "the call without it",
                               base_s, bytes=nbytes, copy_s=seconds - base_s))
            replica.free()
    return rows


def _allreduce_times(sizes, repeat):
    """On every GPU rank: seconds per allreduce at each size, synk.comm's and the bare NCCL
    call on the same communicator (both waited for on the stream), as nccl-tests times."""
    from ..comm import context as _context

    device_comm = _context.current.device_comm
    xp, nccl = device_comm.xp, device_comm.nccl
    stream = device_comm.comm_stream
    times = []
    for nbytes in sizes:
        x = xp.ones(nbytes // 4, np.float32)
        got = synk.comm.allreduce(x)
        assert float(got[0]) == synk.comm.size()
        recv = xp.empty_like(x)
        handle = device_comm._live()

        def bare():
            handle.allReduce(x.data.ptr, recv.data.ptr, x.size, nccl.NCCL_FLOAT32,
                             nccl.NCCL_SUM, stream.ptr)
            stream.synchronize()

        barrier = synk.comm.barrier
        times.append((collective_time(lambda: synk.comm.allreduce(x), barrier, repeat, nbytes),
                      collective_time(bare, barrier, repeat, nbytes)))
    return np.array(times)


def _allreduce(status, sizes: list[int], repeat: int, label: str) -> list[dict]:
    """NCCL allreduce over all the devices by size, as nccl-tests reports it: algorithm
    bandwidth S / t and bus bandwidth S / t * 2 (n - 1) / n; ``synk.comm.allreduce`` inside
    a function against the bare NCCL call on the same communicator (what nccl-tests' own
    ``all_reduce_perf`` times; run it too for the target: >= 90% of its bus bandwidth)."""
    n = len(status.devices)
    with group(n, backend="gpu"):
        times = synk.function(_allreduce_times, bcast_inputs=["sizes", "repeat"],
                              reduce="max")(sizes, repeat)  # the slowest rank's
    rows = []
    factor = 2 * (n - 1) / n
    for nbytes, (synk_s, bare_s) in zip(sizes, times):
        size = size_label(nbytes)
        for case, seconds in ((f"allreduce synk.comm, {n} GPUs, {size}", synk_s),
                              (f"allreduce bare NCCL, {n} GPUs, {size}", bare_s)):
            rows.append(result(BENCH, label + case, seconds, "bare NCCL", bare_s,
                               ranks=n, bytes=nbytes, gb_per_s=nbytes / seconds / 1e9,
                               bus_gb_per_s=nbytes / seconds * factor / 1e9))
    rows[0]["target"] = ">= 90% of nccl-tests' bus bandwidth on the same box"
    return rows
