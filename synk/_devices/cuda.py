"""The CUDA device: CuPy arrays on one GPU, copies on the rank's own non-blocking stream.

Every call here is a CuPy API call through ``self.xp`` (the real ``cupy``, or the simulator's
stand-in under ``SYNK_SIMULATE_GPUS``); the names used are listed in ``cuda_api`` and
checked against the real library by the contract tests.
"""
from __future__ import annotations

import mmap
import threading
import warnings
from types import ModuleType

import numpy as np

from .base import Device

_PAGE = mmap.PAGESIZE
_registered: dict = {}  # page-aligned host base -> length, for this process
_registered_lock = threading.Lock()
_warned: list = []


def _span(buffer) -> tuple[int, int]:
    """Page-aligned (base, length) covering ``buffer``'s memory."""
    view = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, np.uint8)
    start = view.__array_interface__["data"][0]
    base = start - start % _PAGE
    end = start + view.nbytes
    return base, -(-(end - base) // _PAGE) * _PAGE


class CudaDevice(Device):
    """A GPU rank on CUDA device ``device_id`` (an ordinal after CUDA_VISIBLE_DEVICES)."""

    name, is_host = "cuda", False

    def __init__(self, device_id: int, xp: ModuleType) -> None:
        super().__init__()
        self.device_id, self.xp = int(device_id), xp
        self._device = xp.cuda.Device(self.device_id)
        self.stream = None

    def bind(self) -> None:
        cuda = self.xp.cuda
        self._device.use()
        self.stream = cuda.Stream(non_blocking=True)
        self.stream.use()

    def _ready(self):
        if self.stream is None:
            raise RuntimeError(f"{self!r} is not bound: call bind() first")
        return self.stream

    def to_device(self, host_array):
        xp = self.xp
        if isinstance(host_array, xp.ndarray):
            if host_array.device.id == self.device_id:
                return host_array
            raise ValueError(f"the array is on CUDA device {host_array.device.id}, this rank's "
                             f"device is {self.device_id}")
        host = np.ascontiguousarray(host_array)
        stream = self._ready()
        with self._device:
            out = xp.empty(host.shape, host.dtype)
            out.set(host, stream=stream)
        self.counters.h2d += host.nbytes
        return out

    def to_host(self, array, out: np.ndarray | None = None) -> np.ndarray:
        if not isinstance(array, self.xp.ndarray):
            host = np.asarray(array)
            if out is None:
                return host
            out[...] = host
            return out
        stream = self._ready()
        with self._device:
            host = array.get(stream=stream, out=out)  # blocking: the stream is synchronised
        self.counters.d2h += array.nbytes
        return host

    def scope(self):
        from ..comm.nccl import _Scope

        return _Scope(self.xp, self.device_id, self._ready())

    def is_device_array(self, x) -> bool:
        return isinstance(x, self.xp.ndarray)

    def synchronize(self) -> None:
        self._ready().synchronize()

    def register(self, buffer) -> bool:
        base, length = _span(buffer)
        with _registered_lock:
            if any(b <= base and base + length <= b + n for b, n in _registered.items()):
                return True  # this block (or the mapping holding it) is registered already
            runtime = self.xp.cuda.runtime
            try:
                runtime.hostRegister(base, length, 0)
            except runtime.CUDARuntimeError as err:
                if not _warned:
                    _warned.append(True)
                    warnings.warn(f"synk: page-locking {length} bytes of shared memory failed "
                                  f"({err}); copies from it stay pageable (slower)",
                                  RuntimeWarning, stacklevel=2)
                return False
            _registered[base] = length
            return True

    def unregister(self, buffer) -> None:
        base, _ = _span(buffer)
        with _registered_lock:
            if _registered.pop(base, None) is None:
                return
            runtime = self.xp.cuda.runtime
            try:
                runtime.hostUnregister(base)
            except runtime.CUDARuntimeError as err:
                warnings.warn(f"synk: un-page-locking shared memory failed ({err})",
                              RuntimeWarning, stacklevel=2)

    def make_comm_id(self) -> bytes:
        from ..comm.nccl import make_id

        return make_id(self.xp)

    def communicator(self, comm_id: bytes, size: int, rank: int, *, deadline: float,
                     should_stop=None):
        from ..comm.nccl import NcclTransport

        return NcclTransport.from_id(self, comm_id, size, rank, deadline=deadline,
                                        should_stop=should_stop)

    def close(self) -> None:
        with _registered_lock:
            bases = list(_registered)
        for base in bases:
            with _registered_lock:
                if _registered.pop(base, None) is None:
                    continue
            try:
                self.xp.cuda.runtime.hostUnregister(base)
            except self.xp.cuda.runtime.CUDARuntimeError:
                pass
