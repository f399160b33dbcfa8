"""The CUDA and NCCL simulator that synk's GPU back end runs on where there is no GPU:
``SYNK_SIMULATE_GPUS=N`` (set before ``synk.fork``) gives every process of the program N
simulated devices, filtered by ``CUDA_VISIBLE_DEVICES`` as CUDA does, with CuPy's API and
NCCL backed by numpy and shared memory and run by the same processes a GPU group has. It
fails where a GPU would, and louder: device arrays refuse implicit conversion to numpy,
memory used across streams without an event in between raises ``RaceError``, memory not yet
written holds NaN, NCCL collectives whose ranks disagree raise instead of hanging
([Developing without a GPU](gpu.md#developing-without-a-gpu-the-cuda-simulator)). This
module is what a program, or its tests, read of it: the entries below, and
``synk.simulator.cupy``, the module that stands in for ``cupy`` (what ``synk.xp`` returns
for a simulated device's array); each process counts its own copies, so inside a synk
function they are the rank's."""
from __future__ import annotations

from dataclasses import dataclass
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
           "clear_sticky_errors", "reset_thread", "nccl_communicator", "NcclRecord", "queued",
           "SimulatorError", "RaceError",
           "SimulatedHang", "NotModelled", "CUDARuntimeError", "NcclError"]


@dataclass(frozen=True)
class NcclRecord:
    """What the simulator recorded of one rank's NCCL communicator, when read
    (``nccl_communicator``).

    Attributes:
        name: the communicator's name (from its unique id): a renewed communicator has
            another.
        operations: the NCCL operations launched on it so far (collectives, sends and
            receives, each counted once).
        bytes_given: per collective, by NCCL's name (``"allReduce"``, ``"broadcast"``,
            ``"reduceScatter"``...), the bytes
            this rank gave it so far: the count times the datatype's size, what a GPU's
            NCCL would move for it.
        settings: the ``NCCL_*`` variables as this process's NCCL read them (once, at its
            first communicator, as NCCL does).
    """

    name: str
    operations: int
    bytes_given: dict
    settings: dict


def nccl_communicator() -> NcclRecord:
    """Inside a synk function on simulated GPUs: the running rank's NCCL communicator (the
    one ``synk.comm``'s collectives on device arrays use), as recorded now. Read it before
    and after a step to count the NCCL operations and bytes the step made.

    Raises:
        RuntimeError: outside a synk function, or on ranks that are not simulated GPUs.
    """
    comm = _rank_nccl()
    return NcclRecord(comm._prefix, comm._ops, dict(comm.bytes_given), dict(comm._params))


def queued(stream: str = "copy") -> int:
    """Inside a synk function on simulated GPUs: the operations launched on one of the
    running rank's streams that have not run yet. ``stream``: ``"copy"``, where synk copies
    the next piece's inputs to the device while this one computes (``num_slices``), or
    ``"nccl"``, where the rank's NCCL operations run.

    Raises:
        RuntimeError: outside a synk function, or on ranks that are not simulated GPUs.
        ValueError: another ``stream``.
    """
    if stream not in ("copy", "nccl"):
        raise ValueError(f"stream must be 'copy' or 'nccl', not {stream!r}")
    from .comm import context

    device = context.current.device
    if stream == "nccl":
        _rank_nccl()
        state = context.current.device_comm.comm_stream._state
    elif device is None or getattr(device, "copy_stream", None) is None or not enabled():
        raise RuntimeError("synk.simulator.queued() reads a simulated GPU rank's streams: "
                           "call it inside a synk function of a group forked with "
                           "SYNK_SIMULATE_GPUS")
    else:
        state = device.copy_stream._state
    return len(state.pending)


def _rank_nccl():
    """The simulator's NCCL communicator of the running rank."""
    from .comm import context

    device_comm = context.current.device_comm
    guard = getattr(device_comm, "guard", None)
    comm = getattr(guard, "comm", None)
    if comm is None or not hasattr(comm, "bytes_given"):
        raise RuntimeError("synk.simulator reads a simulated GPU rank's NCCL communicator: "
                           "call it inside a synk function of a group forked with "
                           "SYNK_SIMULATE_GPUS and backend='gpu'")
    return comm


def __getattr__(name: str) -> ModuleType:
    # (``cupy`` is imported when first asked for: its namespace is CuPy's whole API)
    if name == "cupy":
        from ._devices.sim import cupy

        return cupy
    raise AttributeError(f"module 'synk.simulator' has no attribute {name!r}")
