"""The simulated CUDA runtime of one process: devices, streams, events, device memory.

Device memory is host memory (numpy buffers) tagged with its device and given a fake
device address, so that code passing raw pointers (NCCL) is checked like CUDA would.

Ordering model. Each stream numbers the work launched on it (``seq``). Kernels run at once
(numpy), after any earlier deferred work of their stream; deferred work (copies to or from
page-locked host memory, NCCL operations) runs when something waits for it: a
synchronisation, an event query, or later work that depends on it. What each stream may
assume finished is tracked as happens-before knowledge: ``seen[stream] = seq``, gained from
``wait_event``, from host synchronisation (work launched after the host saw a stream finish
is ordered after it) and from the legacy null stream's implicit barriers. Each allocation
remembers its last writer and its readers; touching it from a stream that has not "seen"
them is a race, and raises ``RaceError`` instead of giving timing-dependent numbers.
"""
from __future__ import annotations

import bisect
import collections
import itertools
import os
import threading
import time
import weakref

import numpy as np

from ._errors import NotModelled, RaceError, SimulatedHang, cuda_error

LOCK = threading.RLock()
_tls = threading.local()
POISON = 0xFF  # bytes of memory not yet written: NaN for floats, -1 for signed ints


# ---------------------------------------------------------------- devices

def physical_count() -> int:
    """Simulated devices in the machine: ``SYNK_SIMULATE_GPUS`` (0 when unset)."""
    raw = os.environ.get("SYNK_SIMULATE_GPUS", "").strip()
    if not raw:
        return 0
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"SYNK_SIMULATE_GPUS must be a number of devices, got {raw!r}") from None
    if n < 0:
        raise ValueError(f"SYNK_SIMULATE_GPUS must be >= 0, got {n}")
    return n


_visible_cache: dict = {}


def visible() -> list[int]:
    """Physical ordinals visible to this process, filtered by ``CUDA_VISIBLE_DEVICES`` as
    CUDA does: a comma-separated list of indices, read up to the first invalid or repeated
    entry (so "" and "-1" hide every device)."""
    key = (os.environ.get("SYNK_SIMULATE_GPUS"), os.environ.get("CUDA_VISIBLE_DEVICES"))
    found = _visible_cache.get(key)
    if found is None:
        found = _visible_cache[key] = _visible()
    return list(found)


def _visible() -> list[int]:
    n = physical_count()
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(n))
    seen: list[int] = []
    for token in spec.split(","):
        try:
            i = int(token.strip())
        except ValueError:
            break
        if not 0 <= i < n or i in seen:
            break
        seen.append(i)
    return seen


def device_count() -> int:
    count = len(visible())
    if count == 0:
        raise cuda_error(100, "no simulated device is visible: set SYNK_SIMULATE_GPUS=N "
                              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    return count


def check_device(device: int) -> int:
    count = device_count()
    if not isinstance(device, (int, np.integer)) or not 0 <= device < count:
        raise cuda_error(101, f"device {device!r} of {count} simulated devices")
    return int(device)


def current_device() -> int:
    """This thread's current device (0 in a new thread, as in CUDA)."""
    return getattr(_tls, "device", 0)


def set_device(device: int) -> None:
    _tls.device = check_device(device)


# ---------------------------------------------------------------- streams

class StreamState:
    """One stream's queue and ordering knowledge."""

    __slots__ = ("key", "device", "ptr", "null", "blocking", "seq", "done_seq", "seen",
                 "pending", "__weakref__")

    def __init__(self, key: int, device: int, ptr: int, null: bool, blocking: bool) -> None:
        self.key, self.device, self.ptr, self.null, self.blocking = key, device, ptr, null, blocking
        self.seq = self.done_seq = 0
        self.seen: dict = {}
        self.pending: collections.deque = collections.deque()

    def describe(self) -> str:
        return (f"the null stream of device {self.device}" if self.null
                else f"stream {self.ptr:#x} of device {self.device}")


_STREAMS: weakref.WeakValueDictionary[int, StreamState] = weakref.WeakValueDictionary()
_NULLS: dict = {}
_ptrs = itertools.count(0x5000)
HOST_SEEN: dict = {}  # what the host has seen finish: {stream key: seq}


def new_stream(non_blocking: bool) -> StreamState:
    with LOCK:
        ptr = next(_ptrs) * 0x10
        state = StreamState(ptr, current_device(), ptr, False, not non_blocking)
        _STREAMS[ptr] = state
        return state


def null_state(device: int) -> StreamState:
    with LOCK:
        state = _NULLS.get(device)
        if state is None:
            state = _NULLS[device] = StreamState(-(device + 1), device, 0, True, True)
        return state


def state_of_ptr(ptr: int, device: int | None = None) -> StreamState:
    """The stream a raw handle names (0: the current device's null stream)."""
    if ptr == 0:
        return null_state(current_device() if device is None else device)
    state = _STREAMS.get(ptr)
    if state is None:
        raise cuda_error(400, f"{ptr:#x} is not a live stream of this process")
    return state


def all_states():
    return list(_STREAMS.values()) + list(_NULLS.values())


def set_current_stream(stream) -> None:
    """Make the Stream object ``stream`` current for its device in this thread."""
    streams = getattr(_tls, "streams", None)
    if streams is None:
        streams = _tls.streams = {}
    streams[current_device()] = stream


def current_stream_object(device: int | None = None):
    streams = getattr(_tls, "streams", None) or {}
    return streams.get(current_device() if device is None else device)


def current_state() -> StreamState:
    stream = current_stream_object()
    if stream is None or stream.ptr == 0:
        return null_state(current_device())
    return _STREAMS[stream.ptr]


def _order(state: StreamState) -> None:
    """Knowledge a stream gains when work is launched on it."""
    seen = state.seen
    for key, seq in HOST_SEEN.items():
        if seen.get(key, 0) < seq:
            seen[key] = seq
    if state.null:  # the legacy null stream waits for every blocking stream of its device
        for other in list(_STREAMS.values()):
            if (other.device == state.device and other.blocking
                    and seen.get(other.key, 0) < other.seq):
                seen[other.key] = other.seq
    elif state.blocking:
        null = _NULLS.get(state.device)
        if null is not None and seen.get(null.key, 0) < null.seq:
            seen[null.key] = null.seq


def _check_launch(state: StreamState) -> None:
    if state.device != current_device():
        raise cuda_error(400, f"work launched on {state.describe()} while device "
                              f"{current_device()} is current")


def sees(state: StreamState, access) -> bool:
    key, seq = access
    return key == state.key or state.seen.get(key, 0) >= seq


# ---------------------------------------------------------------- memory

class Allocation:
    """A block of simulated device memory: a flat uint8 numpy buffer, its device, its
    fake device address, and who last wrote or read it on which stream."""

    __slots__ = ("buf", "device", "ptr", "writer", "readers", "__weakref__")

    def __init__(self, buf: np.ndarray, device: int) -> None:
        self.buf, self.device = buf, device
        self.writer: tuple | None = None
        self.readers: dict = {}
        self.ptr = _register(self)

    @property
    def host_ptr(self) -> int:
        return self.buf.__array_interface__["data"][0]


_ALLOC_STARTS: list = []
_ALLOCS: dict = {}  # start -> weakref
_next_ptr = [0]


def _register(alloc: Allocation) -> int:
    with LOCK:
        base = (alloc.device + 1) << 40
        start = base + _next_ptr[0]
        _next_ptr[0] += -(-max(alloc.buf.nbytes, 1) // 512) * 512 + 512  # 512-aligned, with a gap
        _ALLOC_STARTS.append(start)
        _ALLOCS[start] = weakref.ref(alloc, lambda _, s=start: _forget(s))
        return start


def _forget(start: int) -> None:
    with LOCK:
        _ALLOCS.pop(start, None)
        i = bisect.bisect_left(_ALLOC_STARTS, start)
        if i < len(_ALLOC_STARTS) and _ALLOC_STARTS[i] == start:
            del _ALLOC_STARTS[i]


def resolve(ptr: int, nbytes: int) -> tuple[Allocation, int]:
    """The live allocation holding ``nbytes`` at device address ``ptr``, and the offset."""
    with LOCK:
        i = bisect.bisect_right(_ALLOC_STARTS, ptr) - 1
        alloc = _ALLOCS[_ALLOC_STARTS[i]]() if i >= 0 else None
        if alloc is None or not ptr < alloc.ptr + max(alloc.buf.nbytes, 1):
            raise cuda_error(700, f"{ptr:#x} is not inside live simulated device memory")
        offset = ptr - alloc.ptr
        if offset + nbytes > alloc.buf.nbytes:
            past = offset + nbytes - alloc.buf.nbytes
            raise cuda_error(700, f"{nbytes} bytes at {ptr:#x} run {past} "
                                  f"bytes past the end of its {alloc.buf.nbytes}-byte allocation")
        return alloc, offset


def new_buffer(nbytes: int) -> np.ndarray:
    """Fresh 'device' bytes, filled with the poison pattern (what a GPU's uninitialised
    memory may hold: NaN floats, -1 ints), so that reading them shows."""
    buf = np.empty(max(int(nbytes), 0), np.uint8)
    buf.fill(POISON)
    return buf


# ---------------------------------------------------------------- pinned host memory

REGISTERED: dict = {}  # host base -> size (cudaHostRegister)
PINNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # base -> owner


def is_pinned(ptr: int, nbytes: int) -> bool:
    with LOCK:
        for base, size in REGISTERED.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return True
        for base, owner in list(PINNED.items()):
            if base <= ptr and ptr + nbytes <= base + owner.pinned_size:
                return True
    return False


def host_ptr(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


# ---------------------------------------------------------------- transfer counters

COUNTERS = {"h2d": 0, "d2h": 0}
PINNED_COUNTERS = {"h2d": 0, "d2h": 0}  # of them, copies whose host side was page-locked


def count(kind: str, nbytes: int, pinned: bool = False) -> None:
    with LOCK:
        COUNTERS[kind] += int(nbytes)
        if pinned:
            PINNED_COUNTERS[kind] += int(nbytes)


# ---------------------------------------------------------------- work on streams

def hang_timeout() -> float:
    return float(os.environ.get("SYNK_SIM_HANG_TIMEOUT", "60"))


class Op:
    """Deferred work on a stream: started when it reaches the head of its stream and what it
    depends on is done; finished when ``progress()`` says so."""

    seq = 0
    stream: StreamState
    deps: dict
    started = False
    eager = True  # started when queued if it can be; else only when something waits for it

    def start(self) -> None:
        pass

    def progress(self) -> bool:
        return True

    def failure(self):
        """An error that means this op will never finish until its communicator is aborted."""
        return None

    def describe(self) -> str:
        return type(self).__name__


def begin(state: StreamState) -> int:
    """Launch bookkeeping: the seq of new work on ``state``."""
    _check_launch(state)
    _order(state)
    state.seq += 1
    return state.seq


def access(state: StreamState, seq: int, reads=(), writes=()) -> None:
    """Check and record memory accesses of work ``seq`` on ``state``."""
    for alloc in reads:
        if alloc.writer is not None and not sees(state, alloc.writer):
            raise RaceError(_race("read", alloc, state, alloc.writer))
    for alloc in writes:
        if alloc.writer is not None and not sees(state, alloc.writer):
            raise RaceError(_race("overwritten", alloc, state, alloc.writer))
        for key, rseq in alloc.readers.items():
            if not sees(state, (key, rseq)):
                raise RaceError(_race("overwritten while being read", alloc, state, (key, rseq)))
    for alloc in reads:
        alloc.readers[state.key] = seq
    for alloc in writes:
        alloc.writer = (state.key, seq)
        alloc.readers = {}


def _race(what: str, alloc: Allocation, state: StreamState, other: tuple) -> str:
    other_state = next((s for s in all_states() if s.key == other[0]), None)
    where = other_state.describe() if other_state is not None else "a stream now destroyed"
    last = "written" if what == "read" else "used"
    return (f"race: device memory at {alloc.ptr:#x} (device {alloc.device}) is {what} on "
            f"{state.describe()}, but was last {last} on {where} and nothing orders the two "
            "(on a GPU the result would depend on timing). Record an event on the first stream "
            "and call wait_event(event) on the second, or synchronize the first stream before.")


def enqueue(state: StreamState, op: Op) -> Op:
    """Queue deferred work on ``state`` (its accesses were recorded by the caller)."""
    op.stream, op.seq, op.deps = state, state.seq, dict(state.seen)
    state.pending.append(op)
    if op.eager:
        progress(state, op.seq)
    return op


def _deps_done(op: Op) -> bool:
    for key, seq in op.deps.items():
        other = next((s for s in all_states() if s.key == key), None)
        if other is not None and other.done_seq < seq and other is not op.stream:
            if not progress(other, seq):
                return False
    return True


def progress(state: StreamState, until: int | None = None) -> bool:
    """Run what can run of ``state``'s deferred work up to ``until`` without waiting;
    True when everything up to it is done."""
    with LOCK:
        until = state.seq if until is None else until
        while state.pending and state.pending[0].seq <= until:
            op = state.pending[0]
            if not op.started:
                if not _deps_done(op):
                    return False
                op.started = True
                op.start()
            if not op.progress():
                return False
            state.pending.popleft()
        if state.done_seq < until:
            state.done_seq = until
        return True


def wait(state: StreamState, until: int | None = None, what: str = "synchronize",
         host: bool = True) -> None:
    """Block until ``state`` has done its work up to ``until`` (bounded: a wait that would
    never return on a GPU raises ``SimulatedHang``); ``host``: the host learns that it
    finished (a synchronisation), rather than the simulator merely running it."""
    until = state.seq if until is None else until
    deadline = time.monotonic() + hang_timeout()
    pause = 0.0002
    while not progress(state, until):
        with LOCK:
            op = state.pending[0] if state.pending else None
        failure = op.failure() if op is not None else None
        if failure is not None:
            raise SimulatedHang(
                f"{what} on {state.describe()} would never return on a GPU: {op.describe()} "
                f"failed ({failure}). Poll the communicator's check_async_error() and abort() "
                "it instead of waiting on the stream.")
        if time.monotonic() > deadline:
            raise SimulatedHang(
                f"{what} on {state.describe()} would hang forever on a GPU: "
                f"{op.describe() if op is not None else 'earlier work'} has not finished after "
                f"{hang_timeout():g} s (SYNK_SIM_HANG_TIMEOUT)")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    if not host:
        return
    with LOCK:
        if HOST_SEEN.get(state.key, 0) < until:
            HOST_SEEN[state.key] = until


def ready(state: StreamState) -> None:
    """Before a kernel runs on ``state`` (whose seen was just updated): its own earlier
    deferred work and what it waits on must have run."""
    if state.pending:
        wait(state, state.seq - 1, "a kernel launch", host=False)
    for key, seq in list(state.seen.items()):
        other = next((s for s in all_states() if s.key == key), None)
        if other is not None and other.done_seq < seq and other is not state:
            wait(other, seq, "a kernel launch waiting on an event", host=False)


def synchronize_device(device: int) -> None:
    for state in all_states():
        if state.device == device:
            wait(state, what="Device.synchronize()")


def not_modelled(what: str) -> NotModelled:
    return NotModelled(f"the CUDA simulator does not model {what} (CuPy may support it); "
                       "use an operation it models, or run on a real GPU")
