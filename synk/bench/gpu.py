"""GPU figures, when CuPy sees a device: host-to-device bandwidth from pageable numpy memory
and from CuPy's pinned memory, and the cost of a direct CuPy call (the baselines that
synk's GPU backend is to be measured against; that backend is not built yet, so synk's
own GPU rows are absent)."""
from __future__ import annotations

import numpy as np

from ._timing import median_time, result, size_label

BENCH = "gpu"


def available() -> str | None:
    """None when a CUDA device is usable, else why not."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as err:  # no driver, no device
        return f"no CUDA device ({err})"
    return None


def run(sizes: list[int], repeat: int) -> list[dict]:
    import cupy

    rows = []
    stream = cupy.cuda.Stream(non_blocking=True)
    for nbytes in sizes:
        n = nbytes // 4
        pageable = np.ones(n, np.float32)
        pinned_mem = cupy.cuda.alloc_pinned_memory(nbytes)
        pinned = np.frombuffer(pinned_mem, np.float32, n)
        pinned[...] = 1
        dev = cupy.empty(n, np.float32)

        def copy(src):
            dev.set(src, stream=stream)
            stream.synchronize()

        pinned_s = median_time(lambda: copy(pinned), repeat)
        pageable_s = median_time(lambda: copy(pageable), repeat)
        label = size_label(nbytes)
        rows.append(result(BENCH, f"H2D CuPy pinned, {label}", pinned_s, "CuPy pinned",
                           pinned_s, bytes=nbytes, gb_per_s=nbytes / pinned_s / 1e9))
        rows.append(result(BENCH, f"H2D numpy pageable, {label}", pageable_s, "CuPy pinned",
                           pinned_s, bytes=nbytes, gb_per_s=nbytes / pageable_s / 1e9))
    x = cupy.ones(1024, np.float32)

    def direct():
        cupy.mean(x)
        cupy.cuda.Device().synchronize()

    direct_s = median_time(direct, repeat, warmup=20)
    rows.append(result(BENCH, "direct CuPy call (mean of 1024)", direct_s, "itself", direct_s))
    return rows
