"""The CUDA and NCCL simulator that synk's GPU back end runs on where there is no GPU.

``SYNK_SIMULATE_GPUS=N`` (set before ``synk.fork``) gives every process of the program N
simulated devices, filtered by ``CUDA_VISIBLE_DEVICES`` as CUDA does: CuPy's API and NCCL,
backed by numpy and shared memory, run by the same processes a GPU group has. It fails
where a GPU would, and louder: device arrays refuse implicit conversion to numpy, work is
ordered per stream and memory used across streams without an event in between raises
``RaceError``, memory not yet written holds NaN, NCCL collectives whose ranks disagree raise
instead of hanging ([Developing without a GPU](gpu.md#developing-without-a-gpu-the-cuda-simulator)).

This module is what a program, or its tests, reads of the simulator:

* ``synk.simulator.cupy``: the module that stands in for ``cupy`` (what ``synk.xp``
  returns for a simulated device's array), for code that makes device arrays of its own;
* the bytes copied between host and devices (``transfer_counts``), page-locking
  (``page_lock_counts``, ``page_locked``), a sticky CUDA error to inject
  (``inject_cuda_error``), and the state to reset between tests (``reset_thread``,
  ``clear_sticky_errors``);
* the errors it raises where a GPU would give a wrong number or wait for ever.

Each process counts its own copies: inside a synk function they are the rank's.
"""
from __future__ import annotations

from types import ModuleType

from ._devices.sim import (
    CUDARuntimeError,
    NcclError,
    NotModelled,
    RaceError,
    SimulatedHang,
    SimulatorError,
    clear_sticky_errors,
    device_count,
    enabled,
    inject_cuda_error,
    page_lock_counts,
    page_locked,
    pinned_transfer_counts,
    reset_thread,
    reset_transfer_counts,
    transfer_counts,
)

__all__ = ["enabled", "device_count", "transfer_counts", "pinned_transfer_counts",
           "reset_transfer_counts", "page_lock_counts", "page_locked", "inject_cuda_error",
           "clear_sticky_errors", "reset_thread", "SimulatorError", "RaceError",
           "SimulatedHang", "NotModelled", "CUDARuntimeError", "NcclError"]


def __getattr__(name: str) -> ModuleType:
    # (``cupy`` is imported when first asked for: its namespace is CuPy's whole API)
    if name == "cupy":
        from ._devices.sim import cupy

        return cupy
    raise AttributeError(f"module 'synk.simulator' has no attribute {name!r}")
