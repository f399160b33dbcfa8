"""The CPU device: numpy arrays, no copies, nothing to synchronise."""
from __future__ import annotations

import numpy as np

from .base import Device


class CpuDevice(Device):
    """A CPU rank: transfers are the identity, so the hot path costs nothing."""

    name, device_id, xp, is_host = "cpu", None, np, True

    def bind(self, current: bool = True) -> None:
        pass

    def to_device(self, host_array, stream=None):
        return host_array

    def to_host(self, array, out: np.ndarray | None = None, stream=None) -> np.ndarray:
        if out is None:
            return array
        out[...] = array
        return out

    def is_device_array(self, x) -> bool:
        return isinstance(x, np.ndarray)

    def synchronize(self) -> None:
        pass

    def register(self, buffer) -> bool:
        return False  # host memory needs no page-locking to be read by the CPU

    def unregister(self, buffer) -> None:
        pass

