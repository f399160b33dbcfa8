"""The CUDA device: CuPy arrays on one GPU, copies on the rank's own non-blocking stream. Every
call here goes through ``self.xp`` (the real ``cupy``, or the simulator's stand-in under
``SYNK_SIMULATE_GPUS``) by a name listed in ``cuda_api``.
"""
from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

import numpy as np

from . import cuda_host, device_dtypes
from .base import Device


class Upload:
    """Host data being copied to a device on its copy stream: ``arrays`` (device arrays,
    not to be read before ``ready()``) and the event that marks the copies done."""

    __slots__ = ("arrays", "_done", "_stream")

    def __init__(self, arrays: list, done, stream) -> None:
        self.arrays, self._done, self._stream = arrays, done, stream

    def ready(self) -> list:
        """Order the rank's stream after the copies (no host wait); the arrays."""
        self._stream.wait_event(self._done)
        return self.arrays


class StreamScope:
    """``with``: a device and a stream current in this thread, both pushed (CuPy's stream stack), so
    that leaving restores whatever the thread had. In a thread's outermost scope, where its current
    stream (in the master the user's, the legacy null stream by default) is not ``stream``,
    ``stream`` waits for it on entering and it for ``stream`` on leaving, by an event each way (as
    CuPy's collectives do; the thread's events, recorded again each time). A worker's thread has the
    rank's stream current already."""

    __slots__ = ("_owner", "_device", "_stream", "_caller")

    def __init__(self, owner: CudaDevice, stream) -> None:
        self._owner, self._stream = owner, stream
        self._device = owner.xp.cuda.Device(owner.device_id)
        self._caller: Any = None  # the thread's stream ordered with (outermost scope only)

    def __enter__(self):
        local = self._owner._thread
        depth = getattr(local, "depth", 0)
        self._device.__enter__()
        try:
            if not depth:
                self._caller = self._owner._after_caller(self._stream, local)
            self._stream.__enter__()
        except BaseException:
            self._caller = None
            self._device.__exit__(None, None, None)
            raise
        local.depth = depth + 1
        return self

    def __exit__(self, *exc):
        local = self._owner._thread
        try:
            self._stream.__exit__(*exc)
            caller, self._caller = self._caller, None
            if caller is not None:
                try:
                    local.after.record(self._stream)
                    caller.wait_event(local.after)
                except Exception:
                    if exc[0] is None:  # (leaving on an error: that error is the one to see)
                        raise
            self._device.__exit__(*exc)
        finally:
            local.depth -= 1


class CudaDevice(Device):
    """A GPU rank on CUDA device ``device_id`` (an ordinal after CUDA_VISIBLE_DEVICES). Two
    non-blocking streams: ``stream``, where the rank computes (current while its function runs), and
    ``copy_stream``, where inputs for the next piece of work are copied meanwhile. Host data is
    copied from page-locked memory where it can be (``cuda_host``)."""

    name, is_host = "cuda", False

    def __init__(self, device_id: int, xp: ModuleType) -> None:
        super().__init__()
        self.device_id, self.xp = int(device_id), xp
        self._device = xp.cuda.Device(self.device_id)
        self.stream: Any = None  # the rank's CuPy stream, once bound
        self.copy_stream: Any = None
        self._bound_in: int | None = None  # the thread whose stream stack holds the stream
        self._thread = threading.local()  # this thread's scopes entered and events (below)
        self._staging: cuda_host.Staging | None = None

    def bind(self, current: bool = True) -> None:
        """The rank's streams, made on its device. ``current``: a worker's binding, the device and
        stream current in this thread for the process's life; else (the master) this thread's CUDA
        state is left as the user's: synk's work runs inside ``scope()``."""
        cuda = self.xp.cuda
        if current:
            self._device.use()
        with self._device:  # (restores the thread's device on leaving: the master's)
            self.stream = cuda.Stream(non_blocking=True)
            self.copy_stream = cuda.Stream(non_blocking=True)
            self._staging = cuda_host.Staging(self.xp)
        if not current:
            return
        # Pushed, not use()d: CuPy pops back to the top of its stream stack when any `with
        # stream:` block ends (cupy/cuda/stream.pyx), so a stream made current by use() would
        # be forgotten after the first one, and later work would land on the null stream.
        self.stream.__enter__()
        self._bound_in = threading.get_ident()

    def _ready(self):
        if self.stream is None:
            raise RuntimeError(f"{self!r} is not bound: call bind() first")
        return self.stream

    # ------------------------------------------------------------ host -> device
    def to_device(self, host_array, stream=None):
        xp = self.xp
        if isinstance(host_array, xp.ndarray):
            if host_array.device.id == self.device_id:
                return host_array
            raise ValueError(f"the array is on CUDA device {host_array.device.id}, this rank's "
                             f"device is {self.device_id}")
        with self.scope(stream):  # (allocations come from the pool's arena of that stream)
            return self._copy_in(np.asarray(host_array), self.stream if stream is None else stream)

    def can_hold(self, dtype) -> bool:
        return device_dtypes.on_device(dtype) is not None

    @staticmethod
    def _device_dtype(dtype) -> np.dtype:
        """``dtype`` on the device (a big-endian number's in native byte order), or a clear
        ``TypeError`` for what CuPy cannot hold (it would raise ValueError in cupy.empty)."""
        target = device_dtypes.on_device(dtype)
        if target is None:
            raise TypeError(f"synk: {device_dtypes.why_not(dtype)}; on GPU ranks keep such "
                            "arrays on the host (inputs of such dtypes arrive as numpy), or "
                            "convert them to numbers first")
        return target

    def _copy_in(self, host: np.ndarray, stream):
        """``host`` on this device, copied on ``stream``: straight from its shared-memory
        block (page-locked once), through page-locked staging buffers, or from pageable
        memory when small."""
        dtype = self._device_dtype(host.dtype)
        if dtype != host.dtype:  # big-endian: the same numbers, in the device's byte order
            host = host.astype(dtype)
        out = self.xp.empty(host.shape, host.dtype)
        if host.nbytes:
            if host.flags.c_contiguous and self.pin(host):
                self._copy_pinned(host, out, stream)
            elif host.nbytes <= cuda_host.SMALL or self._staging is None:
                out.set(host if host.flags.c_contiguous else host.copy(), stream=stream)
            else:
                self._staging.upload(host, out, stream)
        self.h2d += host.nbytes
        return out

    def _copy_pinned(self, host: np.ndarray, out, stream) -> None:
        """``host`` (in a page-locked shared-memory block) into ``out``, one copy per chunk of
        the block it spans (each within one registration)."""
        pieces = cuda_host.pinned_pieces(host)
        if len(pieces) == 1:
            out.set(host, stream=stream)
            return
        with self.scope(stream):  # (a view of device memory is work on the current stream)
            flat = out.reshape(-1).view(self.xp.uint8)
        src = host.reshape(-1).view(np.uint8)
        for lo, hi in pieces:
            with self.scope(stream):
                part = flat[lo:hi]
            part.set(src[lo:hi], stream=stream)

    def upload(self, items) -> Upload:
        """Copy ``items`` to this device on the copy stream: host arrays, or ``(source, index)``
        pairs for the rows ``source[index]`` (gathered into page-locked memory). Nothing is waited
        for; ``Upload.ready()`` orders the rank's stream after the copies."""
        xp, stream, copy = self.xp, self._ready(), self.copy_stream
        arrays = []
        with self.scope():  # allocated on the rank's stream, written on the copy stream:
            before = xp.cuda.Event(disable_timing=True)  # after what the rank's stream did
            before.record(stream)  # (reused memory included)
            copy.wait_event(before)
            for item in items:
                if isinstance(item, tuple):
                    source, index = item
                    if self._device_dtype(source.dtype) != source.dtype:
                        arrays.append(self._copy_in(source[index], copy))
                        continue
                    out = xp.empty((len(index),) + source.shape[1:], source.dtype)
                    if out.nbytes:
                        assert self._staging is not None  # (made by bind, as the stream)
                        self._staging.gather_rows(source, index, out, copy)
                    self.h2d += out.nbytes
                    arrays.append(out)
                else:
                    arrays.append(self._copy_in(np.asarray(item), copy))
        done = xp.cuda.Event(disable_timing=True)
        done.record(copy)
        return Upload(arrays, done, stream)

    # ------------------------------------------------------------ device -> host
    def to_host(self, array, out: np.ndarray | None = None, stream=None) -> np.ndarray:
        if not isinstance(array, self.xp.ndarray):
            host = np.asarray(array)
            if out is None:
                return host
            out[...] = host
            return out
        with self.scope(stream):
            host = array.get(stream=self.stream if stream is None else stream, out=out)  # blocking
        self.d2h += array.nbytes
        return host

    def result_to_host(self, array) -> np.ndarray:
        """A large result copied into page-locked memory of its own (CuPy's pinned memory pool: the
        copy runs at the bus's speed, where pageable memory makes the driver stage it; the memory
        goes back to the pool when the array is collected); a small one as ``to_host``."""
        if not isinstance(array, self.xp.ndarray) or array.nbytes < cuda_host.PINNED_RESULT:
            return self.to_host(array)
        with self.scope():
            if not array.flags.c_contiguous:
                array = self.xp.ascontiguousarray(array)
            memory = self.xp.cuda.alloc_pinned_memory(array.nbytes)
        out = np.ndarray(array.shape, array.dtype, buffer=memory)
        return self.to_host(array, out=out)

    def scope(self, stream=None):
        """This device and ``stream`` (by default the rank's) current in the calling thread,
        both pushed (``StreamScope``)."""
        return StreamScope(self, self._ready() if stream is None else stream)

    def _after_caller(self, stream, local):
        """In a thread's outermost scope (this device current): order ``stream`` after the thread's
        current stream on this device, when that is another; that stream, or None."""
        cuda = self.xp.cuda
        caller = cuda.get_current_stream(self.device_id)
        if caller == stream:
            return None
        before = getattr(local, "before", None)
        if before is None:
            before = local.before = cuda.Event(disable_timing=True)
            local.after = cuda.Event(disable_timing=True)
        before.record(caller)
        stream.wait_event(before)
        return caller

    def current_stream(self):
        return self.xp.cuda.get_current_stream(self.device_id)

    def resume(self) -> None:
        """After user code ran inside ``scope()``: this device and the rank's stream current
        again, the rank's stream ordered after the work the code left on another stream
        (it may have called ``Device.use()`` or ``Stream.use()``)."""
        cuda = self.xp.cuda
        if cuda.runtime.getDevice() != self.device_id:
            self._device.use()
        current = cuda.get_current_stream()
        if current != self.stream:
            left = cuda.Event(disable_timing=True)
            left.record(current)
            self.stream.wait_event(left)
            self.stream.use()

    def failure(self) -> int | None:
        """The CUDA error that broke this device's context (a sticky one, such as 700), or
        None: ``cudaStreamQuery`` returns it from then on, and never raises."""
        if self.stream is None:
            return None
        status = self.xp.cuda.runtime.streamQuery(self.stream.ptr)
        return None if status in (0, 600) else int(status)

    def is_device_array(self, x) -> bool:
        return isinstance(x, self.xp.ndarray)

    def synchronize(self) -> None:
        with self.scope():
            self._ready().synchronize()
            self.copy_stream.synchronize()

    def synchronize_all(self) -> None:
        with self.scope():
            self._device.synchronize()  # cudaDeviceSynchronize: every stream of the device

    # ------------------------------------------------------------ page-locking
    def register(self, buffer) -> bool:
        return cuda_host.register(self.xp, *cuda_host.span(buffer))

    def unregister(self, buffer) -> None:
        cuda_host.unregister(self.xp, cuda_host.span(buffer)[0])

    def pin(self, rows: np.ndarray) -> bool:
        """Page-lock the chunks of a shared-memory block holding ``rows`` (what this rank
        reads of it), each once; False where it cannot."""
        return cuda_host.pin_rows(self.xp, rows)

    def drop_released(self) -> None:
        """Undo the page-locking of shared-memory blocks this process has let go of (their
        mappings were kept until now: ``cuda_host``)."""
        cuda_host.drop_released(self.xp)

    def close(self) -> None:
        cuda = self.xp.cuda
        if (self.stream is not None and self._bound_in == threading.get_ident()
                and cuda.get_current_stream(self.device_id) == self.stream):
            with self._device:
                self.stream.__exit__()  # this thread no longer computes on the rank's stream
        if self._staging is not None:
            self._staging.close()
            self._staging = None
        cuda_host.unregister_all(self.xp)
