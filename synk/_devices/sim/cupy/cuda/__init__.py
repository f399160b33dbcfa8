"""Simulated ``cupy.cuda``: devices, streams, events and device memory pointers."""
from __future__ import annotations

import itertools
import mmap
import weakref

from ... import _core, _memory
from ..._core import LOCK
from ..._errors import cuda_error
from . import nccl, runtime

__all__ = ["Device", "Stream", "Event", "MemoryPointer", "MemoryPool", "get_current_stream",
           "get_device_id", "is_available", "runtime", "nccl", "alloc_pinned_memory"]


class Device:
    """A simulated CUDA device (``with Device(i):`` makes it current for the block)."""

    def __init__(self, device=None):
        self._id = _core.current_device() if device is None else int(device)
        self._saved: list = []

    @property
    def id(self):
        return self._id

    def use(self):
        """Make this device current; returns it (cupy/cuda/device.pyx ``use``: ``return
        self``)."""
        _core.set_device(self._id)
        return self

    def synchronize(self):
        _core.synchronize_device(_core.check_device(self._id))

    def __enter__(self):
        self._saved.append(_core.current_device())
        _core.set_device(self._id)
        return self

    def __exit__(self, *args):
        _core.set_device(self._saved.pop())

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(("Device", self._id))

    def __int__(self):
        return self._id

    def __repr__(self):
        return f"<CUDA Device {self._id}>"


class Stream:
    """A simulated CUDA stream; ``non_blocking=True`` does not synchronise with the null stream
    (``Stream.null``), as in CUDA. Made current as CuPy 14 does it (cupy/cuda/stream.pyx; see
    ``_core``'s per-thread current streams: ``use()`` does not push, ``with`` does)."""

    null: Stream  # the null stream (set below)

    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        if ptds:
            raise _core.not_modelled("the per-thread default stream (Stream(ptds=True))")
        if null:
            self.ptr, self.device_id, self._own = 0, -1, None
        else:
            _core.check_device(_core.current_device())
            self._own = _core.new_stream(non_blocking, 0 if priority is None else int(priority))
            self.ptr, self.device_id = self._own.ptr, self._own.device

    @property
    def _state(self):
        return self._own if self._own is not None else _core.null_state(_core.current_device())

    def _device_match(self) -> int:
        """CuPy's ``check_stream_device_match``: the stream's device, which must be the
        current one (-1, a null stream: the current one)."""
        current = _core.current_device()
        if self.device_id not in (-1, current):
            raise RuntimeError(f"The device that the stream is created on ({self.device_id}) "
                               f"does not match with the current device ({current})")
        return current

    def use(self):
        """Make this stream current (not pushed: leaving an enclosing ``with`` forgets it)."""
        _core.set_current_stream(self, self._device_match())
        return self

    def __enter__(self):
        _core.push_stream(self, self._device_match())
        return self

    def __exit__(self, *args):
        _core.pop_stream()

    @property
    def done(self):
        """True if all work launched on this stream has finished
        (``runtime.streamQuery(ptr) == 0``: never after a sticky error)."""
        return runtime.streamQuery(self.ptr) == 0

    @property
    def is_non_blocking(self):
        """True if the stream does not synchronise with the null stream."""
        return not self._state.blocking

    @property
    def priority(self):
        return self._state.priority

    def synchronize(self):
        _core.wait(self._state, what="Stream.synchronize()")

    def record(self, event=None):
        if event is None:
            event = Event()
        event.record(self)
        return event

    def launch_host_func(self, callback, arg):
        """Call ``callback(arg)`` on the host once the work launched so far on this stream
        is done (cudaLaunchHostFunc, cupy/cuda/stream.pyx): queued in stream order, run
        when the stream reaches it (here: as something waits for or queries the stream);
        never after a sticky error, whose queued work never completes."""
        state = self._state
        with LOCK:
            _core.begin(state)
        _core.enqueue(state, _HostFunc(callback, arg))

    def wait_event(self, event):
        """Work launched on this stream from now on runs after ``event``, and so after
        everything the event's stream was ordered after when it was recorded (ordering is
        transitive, as on a GPU)."""
        state = self._state
        _core.check_sticky(state.device)
        if event._at is None:
            return
        key, seq = event._at
        with LOCK:
            for other, other_seq in ((key, seq), *event._seen.items()):
                _core.advance(state.seen, other, other_seq)

    def __eq__(self, other):
        return isinstance(other, Stream) and self.ptr == other.ptr

    def __hash__(self):
        return self.ptr

    def __repr__(self):
        return f"<Stream {self.ptr} (device {self.device_id})>"


Stream.null = Stream(null=True)
_event_ptrs = itertools.count(0xE000)
_EVENTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # ptr -> Event


class Event:
    """A simulated CUDA event: a point in a stream's work."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        if interprocess and not disable_timing:
            raise ValueError("Timing must be disabled for interprocess events")
        self._device = _core.current_device()
        _core.check_sticky(self._device)  # cudaEventCreateWithFlags returns it too
        self.ptr = next(_event_ptrs) * 0x10
        self._at = None  # (stream key, seq) once recorded
        self._seen: dict = {}  # what that stream was ordered after then
        self._stream = None
        _EVENTS[self.ptr] = self

    def record(self, stream=None):
        """Record the event on ``stream`` (default: the *current* stream, as CuPy's). An event and a
        stream of different devices are cudaErrorInvalidResourceHandle (400) (CUDA C++ Programming
        Guide, "Stream and Event Behavior"; CUDA Runtime API ``cudaEventRecord``: "event and stream
        must be on the same CUDA context"), so ``stream.record()`` on a stream of a device that is
        not current fails: its new event is the current device's."""
        state = _stream_state(stream)
        _core.check_sticky(state.device)
        if state.device != self._device:
            raise cuda_error(400, f"cudaEventRecord: the event belongs to device "
                                  f"{self._device}, {state.describe()} to device "
                                  f"{state.device}")
        with LOCK:
            self._at, self._stream = (state.key, state.seq), state
            self._seen = dict(state.seen)

    @property
    def done(self):
        """True if the work before the event has finished
        (``runtime.eventQuery(ptr) == 0``: never after a sticky error)."""
        return runtime.eventQuery(self.ptr) == 0

    def _query(self) -> int:
        if self._at is None:  # (nothing to wait for: cudaSuccess, unless the device broke)
            return _core.sticky(self._device)
        return _core.query(self._stream, self._at[1])

    def synchronize(self):
        if self._at is None:
            _core.check_sticky(self._device)
            return
        _core.wait(self._stream, self._at[1], "Event.synchronize()")


class MemoryPool:
    """CuPy's memory pool, as the simulator's ``_memory`` runs it: per device, blocks filed
    under the stream current when they were allocated, reused on that stream once freed."""

    def __init__(self, allocator=None):
        if allocator is not None:
            raise _core.not_modelled("MemoryPool(allocator=...)")

    def used_bytes(self):
        return _memory.stats(_core.current_device())["used"]

    def free_bytes(self):
        return _memory.stats(_core.current_device())["free"]

    def total_bytes(self):
        found = _memory.stats(_core.current_device())
        return found["used"] + found["free"]

    def n_free_blocks(self):
        return _memory.stats(_core.current_device())["n_free"]

    def free_all_blocks(self, stream=None):
        """Release the free blocks (of ``stream``'s arena, or of every stream)."""
        key = None if stream is None else _stream_state(stream).key
        _memory.free_all_blocks(_core.current_device(), key)


_DEFAULT_POOL = MemoryPool()


class MemoryPointer:
    """A pointer into simulated device memory (``ndarray.data``)."""

    def __init__(self, mem, offset):
        self._mem, self._offset = mem, int(offset)

    @property
    def mem(self):
        return self._mem

    @property
    def ptr(self):
        return self._mem.ptr + self._offset

    @property
    def device_id(self):
        return self._mem.device

    @property
    def device(self):
        return Device(self._mem.device)


class _PinnedMemory(mmap.mmap):
    """Page-locked host memory from ``alloc_pinned_memory`` (a buffer, as CuPy's
    ``PinnedMemoryPointer`` is)."""


def alloc_pinned_memory(size):
    """``size`` bytes of page-locked host memory (freed when the last reference goes):
    copies from or to it run in stream order, as from memory page-locked by hostRegister."""
    import numpy as np

    memory = _PinnedMemory(-1, max(int(size), 1))
    memory.pinned_size = len(memory)
    base = np.frombuffer(memory, np.uint8, 1).__array_interface__["data"][0]
    with LOCK:
        _core.PINNED[base] = memory
    return memory


def get_current_stream(device_id=-1):
    """This thread's current stream on ``device_id`` (default: the current device): the
    very object last made current there, ``Stream.null`` if none."""
    stream = _core.current_stream_object(None if device_id == -1 else device_id)
    return Stream.null if stream is None else stream


def get_device_id():
    return _core.current_device()


def is_available():
    return len(_core.visible()) > 0


def _stream_state(stream):
    """The runtime state of ``stream`` (None: the current stream)."""
    if stream is None:
        return _core.current_state()
    if not isinstance(stream, Stream):
        raise TypeError(f"stream must be a cupy.cuda.Stream, not {type(stream)}")
    return stream._state


class _HostFunc(_core.Op):
    """A host function queued on a stream (``Stream.launch_host_func``)."""

    def __init__(self, callback, arg) -> None:
        self._callback, self._arg = callback, arg

    def start(self) -> None:
        self._callback(self._arg)

    def describe(self) -> str:
        return "a host function (launch_host_func)"


class _Copy(_core.Op):
    """A copy between device and host memory in stream order: to or from page-locked memory
    run when something waits for it (so that code that does not wait sees the poison); a
    staged one (``eager``) as soon as the stream gets to it."""

    def __init__(self, run, what: str, eager: bool = False) -> None:
        self._run, self._what, self.eager = run, what, eager

    def start(self) -> None:
        self._run()

    def describe(self) -> str:
        return self._what
