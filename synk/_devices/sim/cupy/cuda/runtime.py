"""Simulated ``cupy.cuda.runtime``: the device count and page-locking of host memory."""
from __future__ import annotations

from ... import _core
from ..._core import LOCK
from ..._errors import CUDARuntimeError, cuda_error

__all__ = ["CUDARuntimeError", "getDeviceCount", "getDevice", "setDevice", "deviceSynchronize",
           "getDeviceProperties", "eventQuery", "streamQuery", "eventSynchronize",
           "streamSynchronize",
           "hostRegister", "hostUnregister", "runtimeGetVersion", "driverGetVersion"]

_VERSION = 12090  # what the simulator reports as the CUDA runtime and driver version


def getDeviceCount():
    """Simulated devices visible to this process (``SYNK_SIMULATE_GPUS`` filtered by
    ``CUDA_VISIBLE_DEVICES``); raises cudaErrorNoDevice when there are none."""
    return _core.device_count()


def getDevice():
    return _core.current_device()


def setDevice(device):
    _core.set_device(device)


def deviceSynchronize():
    _core.synchronize_device(_core.current_device())


def getDeviceProperties(device):
    """A few of CUDA's device properties (the keys CuPy's dict has), for a simulated
    device: its name says it is one."""
    count = _core.device_count()
    if not isinstance(device, int) or not 0 <= device < count:
        raise cuda_error(101, f"device {device!r} of {count}")  # cudaErrorInvalidDevice
    return {"name": f"synk simulated CUDA device {device}".encode(), "totalGlobalMem": 1 << 30,
            "major": 0, "minor": 0, "multiProcessorCount": 1,
            # an x86 host with discrete GPUs (see hostRegister)
            "pageableMemoryAccess": 0, "pageableMemoryAccessUsesHostPageTables": 0}


def eventQuery(event):
    """cudaEventQuery: 0 (cudaSuccess) once the work before the event is done, 600
    (cudaErrorNotReady) before, the sticky error (e.g. 700) once the device has one; never
    raises (CuPy 14.2's ``eventQuery`` returns the status, cupy_backends/cuda/api/
    runtime.pyx)."""
    from . import _EVENTS

    found = _EVENTS.get(int(event))
    if found is None:
        return 400  # cudaErrorInvalidResourceHandle
    return found._query()


def streamQuery(stream):
    """cudaStreamQuery: 0 once all work launched on the stream is done, 600 before, the
    sticky error once the device has one; never raises (as ``eventQuery``)."""
    try:
        state = _core.state_of_ptr(int(stream))
    except CUDARuntimeError as err:
        return err.status
    return _core.query(state)


def eventSynchronize(event):
    """cudaEventSynchronize: wait for the work before the event; raises the sticky error of
    a broken device (cupy_backends/cuda/api/runtime.pyx checks its status)."""
    from . import _EVENTS

    found = _EVENTS.get(int(event))
    if found is None:
        raise cuda_error(400, f"{int(event):#x} is not a live event of this process")
    found.synchronize()


def streamSynchronize(stream):
    """cudaStreamSynchronize: wait for all work launched on the stream; raises the sticky
    error of a broken device."""
    _core.wait(_core.state_of_ptr(int(stream)), what="streamSynchronize()")


def runtimeGetVersion():
    return _VERSION


def driverGetVersion():
    return _VERSION


_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly (driver_types.h)


def hostRegister(ptr, size, flags):
    """Page-lock ``size`` bytes of host memory at ``ptr``. Raises
    cudaErrorHostMemoryAlreadyRegistered (712) if any of it is registered already, and
    cudaErrorInvalidValue (1) for pages mapped read-only (``/proc/self/maps``, not numpy's
    ``writeable``) unless ``flags`` has cudaHostRegisterReadOnly (8), which "is required" on
    platforms without cudaDevAttrPageableMemoryAccessUsesHostPageTables (CUDA Runtime API,
    ``cudaHostRegister``), as the simulated x86 hosts with discrete GPUs are."""
    ptr, size = int(ptr), int(size)
    if size <= 0 or ptr == 0:
        raise cuda_error(1, f"hostRegister(ptr={ptr:#x}, size={size})")
    _core.device_count()
    _core.check_sticky(_core.current_device())
    if not int(flags) & _HOST_REGISTER_READ_ONLY:
        found = _read_only_mapping(ptr, size)
        if found is not None:
            raise cuda_error(1, f"hostRegister(ptr={ptr:#x}, size={size}, flags={int(flags)}):"
                                f" the pages at {found} are mapped read-only; on an x86 host "
                                "with a discrete GPU registering them needs the flag "
                                "cudaHostRegisterReadOnly (8)")
    with LOCK:
        for base, length in _core.REGISTERED.items():
            if base < ptr + size and ptr < base + length:
                raise cuda_error(712, f"[{ptr:#x}, +{size}) overlaps the range registered at "
                                      f"{base:#x} (+{length})")
        _core.REGISTERED[ptr] = size
        _core.REGISTRATIONS["calls"] += 1
        _core.REGISTRATIONS["bytes"] += size


def hostUnregister(ptr):
    """Undo ``hostRegister`` of the range starting at ``ptr``; raises
    cudaErrorHostMemoryNotRegistered (713) for any other pointer."""
    ptr = int(ptr)
    with LOCK:
        if _core.REGISTERED.pop(ptr, None) is None:
            raise cuda_error(713, f"{ptr:#x} is not the start of a registered range")
        _core.REGISTRATIONS["unregistered"] += 1


def _read_only_mapping(ptr: int, size: int) -> str | None:
    """The first mapping of this process overlapping ``[ptr, ptr + size)`` that is not
    writable ("start-end perms"), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split(None, 2)[:2]
                start, end = (int(x, 16) for x in span.split("-"))
                if start < ptr + size and ptr < end and "w" not in perms:
                    return f"{start:#x}-{end:#x} ({perms})"
    except OSError:  # (no /proc: nothing to check)
        return None
    return None
