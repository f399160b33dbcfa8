"""The interface every rank uses for its arrays, whatever they live on: a rank opens its
``Device`` (``synk._devices.open(backend, device_id)``), calls ``bind()`` first thing, then
moves inputs with ``to_device`` and outputs with ``to_host``.
"""
from __future__ import annotations

import abc
import contextlib
from types import ModuleType

import numpy as np


class Device(abc.ABC):
    """One rank's device: its array module, copies on its stream, page-locking of host
    memory, and the factory of its collective communicator."""

    name: str  # "cpu" or "cuda"
    device_id: int | None  # the CUDA ordinal (after CUDA_VISIBLE_DEVICES); None on the CPU
    xp: ModuleType  # numpy, cupy, or the simulator's cupy
    is_host: bool  # True on the CPU: arrays are numpy, transfers the identity (callers skip them)

    def __init__(self) -> None:
        self.h2d = self.d2h = 0  # bytes this rank copied host->device and device->host so far

    @abc.abstractmethod
    def bind(self, current: bool = True) -> None:
        """Set up the rank's streams and, with ``current``, make this device and the rank's
        stream current in the calling thread; call it first thing in a worker, before any
        allocation, stream or communicator. The master binds with ``current=False``: its
        thread's device and stream stay the user's."""

    @abc.abstractmethod
    def to_device(self, host_array, stream=None) -> object:
        """``host_array`` on this device (copied on ``stream``, by default the rank's)."""

    @abc.abstractmethod
    def to_host(self, array, out: np.ndarray | None = None, stream=None) -> np.ndarray:
        """``array`` as a numpy array (copied on ``stream``, by default the rank's, which is
        synchronised before returning); into ``out`` when given."""

    def can_hold(self, dtype) -> bool:
        """Whether arrays of ``dtype`` can live on this device (a CUDA device holds none of
        CuPy's unsupported dtypes: ``device_dtypes``); inputs of other dtypes stay numpy."""
        return True

    def result_to_host(self, array) -> np.ndarray:
        """A call's combined result (on rank 0) as a numpy array of its own, which the
        caller keeps: a large one in page-locked memory on a GPU (``to_host`` elsewhere)."""
        return self.to_host(array)

    def current_stream(self):
        """The stream current on this device in the calling thread (what the caller's work is
        ordered on: synk.comm orders its operations after it and before it); None on the CPU."""
        return None

    @abc.abstractmethod
    def is_device_array(self, x) -> bool:
        """True if ``x`` is an array of this device's kind."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until the work launched on the rank's stream has finished."""

    def synchronize_all(self) -> None:
        """Wait until the work launched on every stream of this device has finished, the
        streams of the code that ran on it included (after a failed call)."""
        self.synchronize()

    @abc.abstractmethod
    def register(self, buffer) -> bool:
        """Page-lock the host memory of ``buffer`` (a whole mapping: mmap, memoryview or
        numpy array over it) from its page-aligned base, once; False if that failed (after
        one warning) or means nothing here, and copies stay pageable."""

    @abc.abstractmethod
    def unregister(self, buffer) -> None:
        """Undo ``register(buffer)`` (nothing if it was not registered)."""

    def pin(self, rows: np.ndarray) -> bool:
        """Page-lock the part of a shared-memory block holding ``rows`` (C-contiguous), the
        part this rank reads; False where it means nothing (CPU) or cannot be done."""
        return False

    def drop_released(self) -> None:  # noqa: B027 (optional: CPU devices lock nothing)
        """Undo the page-locking of shared-memory blocks this process has let go of (a GPU
        rank's, at the start of each share: see ``cuda_host``)."""

    def transfer_counts(self) -> dict:
        """``{"h2d": bytes, "d2h": bytes}`` copied by this rank so far."""
        return {"h2d": self.h2d, "d2h": self.d2h}

    def scope(self):
        """A context manager that makes this device (and the rank's stream) current in the
        calling thread for the work done inside it; nothing on the CPU."""
        return contextlib.nullcontext()

    def close(self) -> None:  # noqa: B027 (optional: most devices hold nothing)
        """Release what this device holds (page-locked registrations)."""

    def __repr__(self) -> str:
        where = "" if self.device_id is None else f" {self.device_id}"
        return f"<synk {self.name} device{where}>"
