"""Simulated ``cupy.cuda.runtime``: the device count and page-locking of host memory."""
from __future__ import annotations

from ... import _core
from ..._core import LOCK
from ..._errors import CUDARuntimeError, cuda_error

__all__ = ["CUDARuntimeError", "getDeviceCount", "getDevice", "setDevice", "deviceSynchronize",
           "getDeviceProperties",
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
            "major": 0, "minor": 0, "multiProcessorCount": 1}


def runtimeGetVersion():
    return _VERSION


def driverGetVersion():
    return _VERSION


def hostRegister(ptr, size, flags):
    """Page-lock ``size`` bytes of host memory at ``ptr``. Raises
    cudaErrorHostMemoryAlreadyRegistered (712) if any of it is registered already."""
    ptr, size = int(ptr), int(size)
    if size <= 0 or ptr == 0:
        raise cuda_error(1, f"hostRegister(ptr={ptr:#x}, size={size})")
    _core.device_count()
    with LOCK:
        for base, length in _core.REGISTERED.items():
            if base < ptr + size and ptr < base + length:
                raise cuda_error(712, f"[{ptr:#x}, +{size}) overlaps the range registered at "
                                      f"{base:#x} (+{length})")
        _core.REGISTERED[ptr] = size


def hostUnregister(ptr):
    """Undo ``hostRegister`` of the range starting at ``ptr``; raises
    cudaErrorHostMemoryNotRegistered (713) for any other pointer."""
    ptr = int(ptr)
    with LOCK:
        if _core.REGISTERED.pop(ptr, None) is None:
            raise cuda_error(713, f"{ptr:#x} is not the start of a registered range")
