"""The strict CUDA simulator behind ``SYNK_SIMULATE_GPUS=N``: CuPy's API (what synk uses, and
every other name of CuPy 14 for the functions run on it, served from numpy or refused with
``NotModelled``) and NCCL, backed by numpy and shared memory (TCP between hosts), run by real
processes, and failing where a GPU would, louder (``_errors``)::

    cupy (the stand-in) --+--> _core: devices, streams, ordering, sticky errors
                          +--> _memory: device memory in CuPy's pool, races on reuse
    cupy.cuda.nccl --> _nccl_rules (NCCL's checks) --> _nccl_ops --+--> _board (shared memory)
                                                                   +--> _net, _netboard (TCP)
"""
from __future__ import annotations

from ... import _settings
from . import _core
from ._errors import (
    CUDARuntimeError,
    NcclError,
    NotModelled,
    RaceError,
    SimulatedHang,
    SimulatorError,
)

__all__ = ["enabled", "device_count", "transfer_counts", "pinned_transfer_counts",
           "page_lock_counts", "page_locked", "reset_thread", "clear_sticky_errors",
           "reset_transfer_counts", "inject_cuda_error",
           "set_segment_prefix", "CUDARuntimeError", "NcclError", "SimulatorError", "RaceError",
           "SimulatedHang", "NotModelled"]


def enabled() -> bool:
    """True when ``SYNK_SIMULATE_GPUS`` asks for simulated devices."""
    return _settings.simulate_gpus() > 0


def device_count() -> int:
    """Simulated devices visible to this process (0 if none)."""
    return len(_core.visible())


def transfer_counts() -> dict:
    """Bytes this process copied host->device (``"h2d"``) and device->host (``"d2h"``)."""
    with _core.LOCK:
        return dict(_core.COUNTERS)


def pinned_transfer_counts() -> dict:
    """Of ``transfer_counts()``, the bytes copied from or to page-locked host memory."""
    with _core.LOCK:
        return dict(_core.PINNED_COUNTERS)


def page_lock_counts() -> dict:
    """This process's page-locking so far: ``cudaHostRegister`` calls, the bytes they
    locked (in all, counting a range locked twice twice), ``cudaHostUnregister`` calls."""
    with _core.LOCK:
        return dict(_core.REGISTRATIONS)


def page_locked() -> dict:
    """The host ranges this process has page-locked (``cudaHostRegister``) and not yet
    unlocked: base address -> bytes."""
    with _core.LOCK:
        return dict(_core.REGISTERED)


def reset_thread() -> None:
    """This thread's current device and streams back to a new thread's: device 0, its null
    stream current (between tests that change them)."""
    _core._tls.__dict__.clear()


def clear_sticky_errors() -> None:
    """Forget every device's sticky error (``inject_cuda_error``) in this process. A GPU
    keeps one until the process ends; this is for tests that inject one and go on."""
    with _core.LOCK:
        _core.STICKY.clear()


def reset_transfer_counts() -> None:
    """Set this process's ``transfer_counts()`` and ``pinned_transfer_counts()`` to 0."""
    with _core.LOCK:
        for counters in (_core.COUNTERS, _core.PINNED_COUNTERS):
            for key in counters:
                counters[key] = 0


def inject_cuda_error(status: int = 700, device: int | None = None) -> None:
    """Corrupt ``device``'s context (default: the current device) with the sticky CUDA
    error ``status`` (700: an illegal address in a kernel), as a faulting kernel does: its
    queries never return cudaSuccess again and later calls raise ``CUDARuntimeError``.
    For tests of code that must survive it; ``SYNK_SIM_FAULTS="cuda_error:rank=R"`` does it
    inside an NCCL operation."""
    _core.set_sticky(_core.current_device() if device is None else device, status)


def set_segment_prefix(prefix: str | None) -> None:
    """Name the shared memory of communicators made from ids this process creates from now
    on with ``prefix`` (e.g. a synk group's, so that its ``close()`` sweeps them)."""
    from .cupy.cuda import nccl

    nccl._prefix_override[:] = [] if prefix is None else [prefix]
