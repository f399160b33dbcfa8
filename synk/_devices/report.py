"""What this machine offers synk: versions, CUDA devices, MPI, shared memory
(``python -m synk info``)."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys

from .._settings import raw
from .discovery import describe, gpu_status
from .host_threads import cpu_count


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cuda_lines() -> list[str]:
    """The CUDA runtime, driver, NCCL and devices the GPU backend finds; under the CUDA
    simulator each of its figures says "(simulated)"."""
    status = gpu_status()
    xp = status.xp
    if xp is None:
        return [f"CUDA: not used ({status.reason})"]
    runtime = xp.cuda.runtime
    lines: list[str] = []
    for what, get in (("runtime", runtime.runtimeGetVersion), ("driver", runtime.driverGetVersion)):
        try:
            v = get()
            lines.append(f"CUDA {what}: {v // 1000}.{v % 1000 // 10}" if v else
                         f"CUDA {what}: none found")
        except Exception as err:  # no driver: say why
            lines.append(f"CUDA {what}: unavailable ({type(err).__name__}: {err})")
    try:
        from .cuda_api import nccl_module

        nccl = nccl_module(xp)
        v = nccl.get_version()
        lines.append(f"NCCL: {v // 10000}.{v % 10000 // 100}.{v % 100}")
    except Exception as err:
        lines.append(f"NCCL: unavailable ({type(err).__name__}: {err})")
    for i in status.devices:
        try:
            props = runtime.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            lines.append(f"device {i}: {name}, {props['totalGlobalMem'] / 2**30:.1f} GiB")
        except Exception as err:
            lines.append(f"device {i}: ({type(err).__name__}: {err})")
    if status.kind == "sim":
        lines = [f"{line} (simulated)" for line in lines]
    return lines


def mpiexec() -> str | None:
    """The MPI launcher for this Python: the ``mpiexec`` beside it (where the ``mpi`` extra's
    Open MPI installs it, in a virtualenv's ``bin/`` that need not be on PATH), else
    ``mpiexec`` or ``mpirun`` on PATH; None when there is none."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec") or shutil.which("mpirun")


def _mpi_lines() -> list[str]:
    launcher = mpiexec()
    if launcher is None:
        where = "not found (beside this Python or on PATH)"
    elif shutil.which(os.path.basename(launcher)) == launcher:
        where = launcher
    else:
        where = f"{launcher} (beside this Python; not on PATH)"
    return [f"mpi4py: {_version('mpi4py')}", f"mpiexec: {where}"]


def _shm_line() -> str:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as err:
        return f"/dev/shm: unavailable ({err})"
    return (f"/dev/shm: {st.f_frsize * st.f_blocks / 2**30:.1f} GiB, "
            f"{st.f_frsize * st.f_bavail / 2**30:.1f} GiB free")


def info_lines() -> list[str]:
    """The report, one fact per line."""
    cupy = next((_version(d) for d in ("cupy-cuda12x", "cupy-cuda13x", "cupy")
                 if _version(d) != "not installed"), "not installed")
    status = gpu_status()
    simulator = []
    if status.kind == "sim" and status.xp is not None:  # (set, and valid)
        simulator = [f"the CUDA simulator is on (SYNK_SIMULATE_GPUS="
                     f"{raw('SYNK_SIMULATE_GPUS')}): no real GPU is used"]
    return [
        f"synk: {_version('synk')}",
        f"Python: {sys.version.split()[0]} ({platform.platform()})",
        f"numpy: {_version('numpy')}, cloudpickle: {_version('cloudpickle')}, "
        f"threadpoolctl: {_version('threadpoolctl')}",
        f"CuPy: {cupy}",
        *cuda_lines(),
        *simulator,
        *_mpi_lines(),
        f"CPU cores available: {cpu_count()}",
        _shm_line(),
        f"synk.fork(backend='auto') here: {describe()}",
    ]
