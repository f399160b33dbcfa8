"""Which backend and devices this process can use, and opening a rank's device."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import ModuleType

import numpy as np

from .. import _settings
from ..errors import SynkError, sticky_cuda_error
from .base import Device

INSTALL = 'pip install "synk[gpu]"'
_SIM_ARRAY_MODULE = "synk._devices.sim.cupy"


class GpuUnavailableError(SynkError):
    """The GPU backend was asked for, but no usable CUDA device is there."""


class GpuSettingError(GpuUnavailableError, ValueError):
    """``SYNK_SIMULATE_GPUS`` is set, but not to a number of devices: the GPU backend can be
    neither used nor ruled out (so ``backend="auto"`` does not fall back to the CPU). A
    ``ValueError`` too, as ``fork()`` raises for any bad ``SYNK_*`` variable."""


@dataclass(frozen=True)
class GpuStatus:
    """What the GPU backend would run on: ``kind`` "cuda" (CuPy), "sim" (the simulator) or
    None, the visible device ordinals, and why there are none; ``bad_setting``: because
    ``SYNK_SIMULATE_GPUS`` is not valid (``reason`` says how)."""

    kind: str | None
    devices: list = field(default_factory=list)
    reason: str | None = None
    xp: ModuleType | None = None
    bad_setting: bool = False

    @property
    def available(self) -> bool:
        return bool(self.devices)


def _visible_note() -> str:
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if spec is None else f" (CUDA_VISIBLE_DEVICES={spec!r})"


_probed: dict = {}


def gpu_status() -> GpuStatus:
    """Probe the GPU backend without raising (once per setting of the environment)."""
    key = (_settings.raw("SYNK_SIMULATE_GPUS"), os.environ.get("CUDA_VISIBLE_DEVICES"))
    status = _probed.get(key)
    if status is None:
        status = _probed[key] = _probe()
    return status


def _probe() -> GpuStatus:
    """``SYNK_SIMULATE_GPUS=N`` gives the CUDA simulator (N simulated devices, filtered by
    ``CUDA_VISIBLE_DEVICES``); otherwise the GPU backend needs CuPy and a CUDA driver that
    sees at least one device (``CUDA_VISIBLE_DEVICES`` honoured through CuPy itself)."""
    from . import sim

    try:
        simulated = sim.enabled()
    except ValueError as err:  # names SYNK_SIMULATE_GPUS, its value and the valid range
        return GpuStatus("sim", reason=str(err), bad_setting=True)
    if simulated:
        from .sim import cupy as sim_cupy

        count = sim.device_count()
        if not count:
            return GpuStatus("sim", reason=f"no simulated CUDA device visible{_visible_note()}",
                             xp=sim_cupy)
        return GpuStatus("sim", list(range(count)), xp=sim_cupy)
    try:
        import cupy
    except ImportError as err:
        missing = getattr(err, "name", None) == "cupy"
        return GpuStatus(None, reason=f"CuPy is not installed ({INSTALL})" if missing
                         else f"CuPy could not be imported ({err}); reinstall it: {INSTALL}")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as err:
        if err.status == 100:  # cudaErrorNoDevice
            return GpuStatus("cuda", reason=f"no CUDA device visible{_visible_note()}", xp=cupy)
        return GpuStatus("cuda", reason=f"CuPy found no CUDA driver ({err})", xp=cupy)
    except Exception as err:  # a broken installation (missing runtime libraries, ...)
        return GpuStatus("cuda", reason=f"CuPy cannot use CUDA ({type(err).__name__}: {err})",
                         xp=cupy)
    if count < 1:
        return GpuStatus("cuda", reason=f"no CUDA device visible{_visible_note()}", xp=cupy)
    return GpuStatus("cuda", list(range(count)), xp=cupy)


def require_gpu() -> GpuStatus:
    """The GPU status, or ``GpuUnavailableError`` saying what is missing and what to do."""
    status = gpu_status()
    _refuse_bad_setting(status)
    if not status.available:
        raise GpuUnavailableError(
            f"the GPU backend is not available: {status.reason}. Use backend='cpu' (or "
            "'auto', which falls back to the CPU), or set SYNK_SIMULATE_GPUS=N to develop "
            "on the CUDA simulator.")
    return status


def _refuse_bad_setting(status: GpuStatus) -> None:
    if status.bad_setting:
        raise GpuSettingError(
            "SYNK_SIMULATE_GPUS must be a number of simulated devices (or unset) for synk to "
            f"choose a backend: {status.reason}")


def resolve_backend(backend: str) -> str:
    """``backend`` ("auto", "cpu" or "gpu") resolved to "cpu" or "gpu": "auto" is "gpu"
    when a CUDA device (or a simulated one) is visible; "gpu" without one raises
    ``GpuUnavailableError``. "auto" and "gpu" raise ``GpuSettingError`` (a ``ValueError``)
    when ``SYNK_SIMULATE_GPUS`` is set but not valid, rather than falling back."""
    if backend not in ("auto", "cpu", "gpu"):
        raise ValueError(f"unknown backend {backend!r}; use 'auto', 'cpu' or 'gpu'")
    if backend == "cpu":
        return "cpu"
    if backend == "gpu":
        require_gpu()
        return "gpu"
    status = gpu_status()
    _refuse_bad_setting(status)
    return "gpu" if status.available else "cpu"


def describe() -> str:
    """One line saying what ``backend="auto"`` picks here, and why."""
    status = gpu_status()
    if status.bad_setting:
        return f"none: synk.fork() raises ValueError ({status.reason})"
    if status.available:
        assert status.xp is not None  # (found with the devices)
        what = ("simulated CUDA devices (SYNK_SIMULATE_GPUS)" if status.kind == "sim"
                else f"CUDA devices (CuPy {status.xp.__version__})")
        return f"backend 'gpu': {len(status.devices)} {what}"
    return f"backend 'cpu': no GPU ({status.reason})"


def open(backend: str, device_id: int | None = None) -> Device:  # noqa: A001 (devices.open)
    """The ``Device`` of a rank: ``open("cpu")`` or ``open("cuda", i)`` (also "gpu")."""
    if backend == "cpu":
        from .cpu import CpuDevice

        return CpuDevice()
    if backend in ("cuda", "gpu"):
        status = require_gpu()
        if not isinstance(device_id, int) or device_id not in status.devices:
            raise ValueError(f"device_id must be one of the visible CUDA devices "
                             f"{status.devices}, got {device_id!r}")
        from .cuda import CudaDevice

        assert status.xp is not None  # (found with the devices)
        return CudaDevice(device_id, status.xp)
    raise ValueError(f"unknown device backend {backend!r}; use 'cpu' or 'cuda'")


def bind(device: Device) -> None:
    """``device.bind(current=False)`` for the master's rank; a CUDA context that an earlier
    sticky CUDA error left unusable (it stays so until the process ends) raises
    ``GpuUnavailableError`` saying so and what to do, not CUDA's own error."""
    try:
        device.bind(current=False)
    except Exception as err:
        status = getattr(err, "status", None)
        name = sticky_cuda_error(status)
        if name is None:
            raise
        raise GpuUnavailableError(
            f"this process's CUDA context failed earlier with CUDA error {status} ({name}), "
            "which leaves it unusable until the process ends: no GPU group can start in it; "
            "restart the program (synk.fork(backend='cpu') still works)") from err


def use_group_prefix(prefix: str) -> None:
    """Name the simulator's communicator segments with a synk group's prefix, so that the
    group's ``close()`` (and the sweep of a dead master's segments) removes them."""
    from . import sim

    if gpu_status().kind == "sim":
        sim.set_segment_prefix(prefix)


def device_ids(n: int | None, devices) -> list:
    """The CUDA device of each rank of a GPU group: ``devices`` (a subset of the visible
    ones, in that order) or all visible ones; ``n`` ranks (default: one per device), placed
    round-robin when there are more ranks than devices."""
    visible = require_gpu().devices
    if devices is None:
        chosen = list(visible)
    else:
        try:
            chosen = [int(d) for d in devices]
        except (TypeError, ValueError):
            raise TypeError(f"devices must be a list of CUDA device numbers, got {devices!r}"
                            ) from None
        unknown = [d for d in chosen if d not in visible]
        if unknown or len(set(chosen)) != len(chosen) or not chosen:
            raise ValueError(f"devices={devices!r} must name distinct visible CUDA devices, "
                             f"from {visible}{_visible_note()}")
    if n is None:
        n = len(chosen)
    return [chosen[r % len(chosen)] for r in range(n)]


def visible_entries(spec: str | None) -> list | None:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names, in order (indices, UUIDs or MIG
    names, as text), read as CUDA reads it: up to the first empty, negative or repeated
    entry. None where the variable is unset (every device visible)."""
    if spec is None:
        return None
    entries: list = []
    for token in spec.split(","):
        token = token.strip()
        if not token or token.startswith("-") or token in entries:
            break
        entries.append(token)
    return entries


def job_device_ids(hosts: list, visible: list, devices=None,
                   counts: list | None = None) -> tuple[list, bool]:
    """Each rank's CUDA device in a job whose launcher decides what each process sees (MPI,
    Slurm), and whether ranks of a host share a GPU. ``hosts[r]``, ``visible[r]``
    (``CUDA_VISIBLE_DEVICES``, None: unset), ``counts[r]`` (devices seen, None: unknown): rank
    r's; ``devices``: ``fork(devices=)`` by place on the host. Else the ranks of a host that
    see the same devices take them round-robin: one device seen (``--gpus-per-task=1``) is
    used, a node's all (``--gpus-per-node``) one each, more ranks than devices share."""
    ids, physical = [], []
    places: dict = {}
    for host, spec, count in zip(hosts, visible, counts or [None] * len(hosts)):
        entries = visible_entries(spec)
        among = host if devices is not None else (host, None if entries is None
                                                   else tuple(entries))
        place = places[among] = places.get(among, -1) + 1
        if devices is not None:
            if place >= len(devices):
                raise ValueError(f"host {host!r} has more ranks than the devices "
                                 f"{list(devices)} given")
            ordinal = int(devices[place])
        elif entries:
            ordinal = place % len(entries)
        elif count:  # unset: every device of the host
            ordinal = place % count
        else:  # (nothing visible, or not counted: opening the device says so)
            ordinal = place
        ids.append(ordinal)
        physical.append((host, entries[ordinal] if entries and ordinal < len(entries)
                         else str(ordinal)))
    return ids, len(set(physical)) < len(physical)


def simulated(xp) -> bool:
    """Whether the array module ``xp`` is the CUDA simulator's stand-in for CuPy."""
    return getattr(xp, "__name__", None) == _SIM_ARRAY_MODULE


def array_module(x) -> ModuleType:
    """The array module of ``x``: numpy for numpy arrays and host values, ``cupy`` for CuPy
    arrays, the simulator's cupy for simulated device arrays."""
    cls = type(x)
    if cls is np.ndarray:
        return np
    module = cls.__module__
    if module == _SIM_ARRAY_MODULE:
        return sys.modules[_SIM_ARRAY_MODULE]
    if module.split(".", 1)[0] == "cupy":
        import cupy

        return cupy
    return np
