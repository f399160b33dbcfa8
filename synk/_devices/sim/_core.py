"""The simulated CUDA runtime of one process: its devices, their streams, the ordering of the
work launched on them (so that memory used across streams without ordering raises
``RaceError``) and sticky errors.
"""
from __future__ import annotations

import collections
import itertools
import os
import threading
import time
import weakref

import numpy as np

from ... import _settings
from ._errors import NotModelled, RaceError, SimulatedHang, cuda_error

LOCK = threading.RLock()
_tls = threading.local()


# ---------------------------------------------------------------- devices

_visible_cache: dict = {}


def visible() -> list[int]:
    """Physical ordinals visible to this process, filtered by ``CUDA_VISIBLE_DEVICES`` as
    CUDA does: a comma-separated list of indices, read up to the first invalid or repeated
    entry (so "" and "-1" hide every device)."""
    key = (_settings.raw("SYNK_SIMULATE_GPUS"), os.environ.get("CUDA_VISIBLE_DEVICES"))
    found = _visible_cache.get(key)
    if found is None:
        found = _visible_cache[key] = _visible()
    return list(found)


def _visible() -> list[int]:
    n = _settings.simulate_gpus()
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


# ---------------------------------------------------------------- sticky errors

# An illegal memory access (cudaErrorIllegalAddress, 700) corrupts the device's context: from
# then on queries return the error and never cudaSuccess, synchronisations and launches raise
# it, and no queued work completes (CUDA Runtime API, "Error Handling": such errors are
# "sticky" and persist until the process ends).
STICKY: dict = {}  # device -> the cudaError_t that corrupted its context


def sticky(device: int) -> int:
    """The sticky error of ``device``'s context, 0 if none."""
    return STICKY.get(device, 0)


def check_sticky(device: int) -> None:
    """Raise the device's sticky error, as every later CUDA call on it returns it."""
    status = STICKY.get(device)
    if status:
        raise cuda_error(status, f"device {device}'s context was corrupted by an earlier "
                                 "error (a sticky error: it persists until the process ends)")


def set_sticky(device: int, status: int = 700) -> None:
    """Corrupt ``device``'s context with ``status`` (what an illegal address in a kernel
    does); its queued work never completes."""
    with LOCK:
        STICKY.setdefault(device, int(status))


# ---------------------------------------------------------------- streams

class StreamState:
    """One stream's queue and ordering knowledge. Work is numbered (``seq``); kernels run at once
    (numpy) after the stream's earlier deferred work; deferred work (copies with page-locked
    host memory, NCCL operations) runs when something waits for it (a synchronisation, an event
    query, later work that depends on it). ``seen[stream key] = seq`` is what the stream may
    assume finished, learnt from ``wait_event``, host synchronisation (work launched after the
    host saw a stream finish) and the legacy null stream's barriers; touching an allocation from
    a stream that has not seen its last writer and readers is a race (``access``)."""

    __slots__ = ("key", "device", "ptr", "null", "blocking", "priority", "seq", "done_seq",
                 "seen", "pending", "__weakref__")

    def __init__(self, key: int, device: int, ptr: int, null: bool, blocking: bool,
                 priority: int = 0) -> None:
        self.key, self.device, self.ptr, self.null, self.blocking = key, device, ptr, null, blocking
        self.priority = priority
        self.seq = self.done_seq = 0
        self.seen: dict = {}
        self.pending: collections.deque = collections.deque()

    def describe(self) -> str:
        return (f"the null stream of device {self.device}" if self.null
                else f"stream {self.ptr:#x} of device {self.device}")

    def __del__(self) -> None:
        try:  # (its work is all done: a stream with queued work is kept in _BUSY)
            RETIRED[self.key] = (self.device, self.seq)
        except (NameError, TypeError):  # (at interpreter exit)
            pass


_STREAMS: weakref.WeakValueDictionary[int, StreamState] = weakref.WeakValueDictionary()
_NULLS: dict = {}
_ptrs = itertools.count(0x5000)
HOST_SEEN: dict = {}  # what the host has seen finish: {stream key: seq}
# Destroyed streams. cudaStreamDestroy returns at once, "the resources associated with
# stream will be released automatically once the device has completed all work in stream"
# (CUDA Runtime API): a stream with queued work stays here until it is done, and what a
# gone one launched is known to the host at the next device synchronisation.
_BUSY: set = set()
RETIRED: dict = {}  # destroyed streams' keys -> (device, seq), until the device is synchronised


def new_stream(non_blocking: bool, priority: int = 0) -> StreamState:
    with LOCK:
        check_sticky(current_device())
        ptr = next(_ptrs) * 0x10
        state = StreamState(ptr, current_device(), ptr, False, not non_blocking, priority)
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


def state_of_key(key: int) -> StreamState | None:
    if key < 0:
        return _NULLS.get(-key - 1)
    return _STREAMS.get(key)


def all_states():
    return list(_STREAMS.values()) + list(_NULLS.values())


# CuPy's per-thread current streams (cupy/cuda/stream.pyx, _ThreadLocal): the Stream objects
# themselves are kept (``get_current_stream()`` returns the very object made current). Each
# device has a current stream and a stack whose base is the null stream; ``Stream.use()``
# sets the current stream without pushing, ``with stream:`` pushes and, on leaving, pops back
# to the top of the stack (a stream made current by ``use()`` inside the block is forgotten:
# CuPy's ``test_mix_use_context``).

def _thread_streams():
    t = _tls
    if getattr(t, "current", None) is None:
        t.current, t.stacks, t.device_stack = {}, {}, []
    return t


def current_stream_object(device: int | None = None):
    """The Stream object current on ``device`` in this thread (None: never set, i.e. the
    null stream)."""
    t = _thread_streams()
    return t.current.get(current_device() if device is None else device)


def set_current_stream(stream, device: int) -> None:
    """``Stream.use()``: make ``stream`` current for ``device`` without pushing it."""
    _thread_streams().current[device] = stream


def push_stream(stream, device: int) -> None:
    """``Stream.__enter__``: push ``stream`` on ``device``'s stack and make it current."""
    t = _thread_streams()
    t.stacks.setdefault(device, [None]).append(stream)
    t.device_stack.append(device)
    t.current[device] = stream


def pop_stream() -> None:
    """``Stream.__exit__``: pop the last pushed stream; the top of that device's stack (its
    base: the null stream) becomes current, whatever ``use()`` made current meanwhile."""
    t = _thread_streams()
    device = t.device_stack.pop()
    stack = t.stacks[device]
    stack.pop()
    t.current[device] = stack[-1]


def current_state() -> StreamState:
    stream = current_stream_object()
    if stream is None or stream.ptr == 0:
        return null_state(current_device())
    return stream._state


def advance(known: dict, key: int, seq: int) -> None:
    """Record in ``known`` ({stream key: seq}) that the work of stream ``key`` up to ``seq``
    is ordered before (or, for ``HOST_SEEN``, seen by) its holder: what is known only grows."""
    if known.get(key, 0) < seq:
        known[key] = seq


def _order(state: StreamState) -> None:
    """Knowledge a stream gains when work is launched on it."""
    seen = state.seen
    for key, seq in HOST_SEEN.items():
        advance(seen, key, seq)
    if state.null:  # the legacy null stream waits for every blocking stream of its device
        for other in list(_STREAMS.values()):
            if other.device == state.device and other.blocking:
                advance(seen, other.key, other.seq)
    elif state.blocking:
        null = _NULLS.get(state.device)
        if null is not None:
            advance(seen, null.key, null.seq)


def _check_launch(state: StreamState) -> None:
    if state.device != current_device():
        raise cuda_error(400, f"work launched on {state.describe()} while device "
                              f"{current_device()} is current")
    check_sticky(state.device)


def sees(state: StreamState, access) -> bool:
    key, seq = access
    return key == state.key or state.seen.get(key, 0) >= seq


# ---------------------------------------------------------------- pinned host memory

REGISTERED: dict = {}  # host base -> size (cudaHostRegister)
REGISTRATIONS = {"calls": 0, "bytes": 0, "unregistered": 0}  # page-locking so far, in all
PINNED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # base -> owner


def is_pinned(ptr: int, nbytes: int) -> bool:
    with LOCK:
        ranges = [*REGISTERED.items(), *((b, o.pinned_size) for b, o in list(PINNED.items()))]
    return any(base <= ptr and ptr + nbytes <= base + size for base, size in ranges)


def host_ptr(array) -> int:
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
        """Why this op will never finish until its communicator is aborted (None: it may)."""
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
        for key, pseq in alloc.prior.items():
            if not sees(state, (key, pseq)):
                raise RaceError(_reuse_race(alloc, state, (key, pseq)))
    for alloc in reads:
        alloc.readers[state.key] = seq
    for alloc in writes:
        alloc.writer = (state.key, seq)
        alloc.readers = {}
        if alloc.prior:
            alloc.prior = {}


def _where(key: int) -> str:
    other = state_of_key(key)
    return other.describe() if other is not None else "a stream now destroyed"


def _race(what: str, alloc, state: StreamState, other: tuple) -> str:
    last = "written" if what == "read" else "used"
    return (f"race: device memory at {alloc.ptr:#x} (device {alloc.device}) is {what} on "
            f"{state.describe()}, but was last {last} on {_where(other[0])} and nothing orders "
            "the two (on a GPU the result would depend on timing). Record an event on the "
            "first stream and call wait_event(event) on the second, or synchronize the first "
            "stream before.")


def _reuse_race(alloc, state: StreamState, other: tuple) -> str:
    return (f"race: device memory at {alloc.ptr:#x} (device {alloc.device}) was freed while "
            f"work on {_where(other[0])} could still use it, and CuPy's memory pool handed it "
            f"back at once (no event) to a new array, now written on {state.describe()} "
            "(cupy/cuda/memory.pyx: a freed block is reused on the stream it was allocated "
            "on). Keep the array alive until that work is done (an event, or a "
            "synchronisation).")


def enqueue(state: StreamState, op: Op) -> Op:
    """Queue deferred work on ``state`` (its accesses were recorded by the caller)."""
    op.stream, op.seq, op.deps = state, state.seq, dict(state.seen)
    state.pending.append(op)
    with LOCK:
        _BUSY.add(state)  # (its work runs even if the stream is destroyed meanwhile)
    if op.eager:
        progress(state, op.seq)
    return op


def _deps_done(op: Op) -> bool:
    for key, seq in op.deps.items():
        other = state_of_key(key)
        if other is not None and other.done_seq < seq and other is not op.stream:
            if not progress(other, seq):
                return False
    return True


def progress(state: StreamState, until: int | None = None) -> bool:
    """Run what can run of ``state``'s deferred work up to ``until`` without waiting;
    True when everything up to it is done (never, on a device with a sticky error)."""
    with LOCK:
        until = state.seq if until is None else until
        if STICKY.get(state.device) and state.done_seq < until:
            return False
        while state.pending and state.pending[0].seq <= until:
            op = state.pending[0]
            if not op.started:
                if not _deps_done(op):
                    return False
                op.started = True
                op.start()
            if STICKY.get(state.device) or not op.progress():
                return False
            state.pending.popleft()
        if not state.pending:
            _BUSY.discard(state)
        if state.done_seq < until:
            state.done_seq = until
        return True


def query(state: StreamState, until: int | None = None) -> int:
    """cudaStreamQuery / cudaEventQuery: 0 when the work up to ``until`` is done, 600
    (cudaErrorNotReady) while it is not, the sticky error once the device has one. Never
    raises (cupy_backends/cuda/api/runtime.pyx: ``eventQuery`` returns the status)."""
    status = STICKY.get(state.device)
    if status:
        return status
    until = state.seq if until is None else until
    if not progress(state, until):
        return STICKY.get(state.device) or 600
    with LOCK:
        advance(HOST_SEEN, state.key, until)
    return 0


def wait(state: StreamState, until: int | None = None, what: str = "synchronize",
         host: bool = True) -> None:
    """Block until ``state`` has done its work up to ``until`` (bounded: a wait that would
    never return on a GPU raises ``SimulatedHang``); ``host``: the host learns that it
    finished (a synchronisation), rather than the simulator merely running it. A sticky
    error raises ``CUDARuntimeError``, as cudaStreamSynchronize returns it."""
    until = state.seq if until is None else until
    deadline = time.monotonic() + _settings.sim_hang_timeout()
    pause = 0.0002
    while not progress(state, until):
        check_sticky(state.device)
        with LOCK:
            op = state.pending[0] if state.pending else None
        failure = op.failure() if op is not None else None
        if op is not None and failure is not None:
            raise SimulatedHang(f"{what} on {state.describe()} would never return on a GPU: "
                                f"{op.describe()}: {failure}")
        if time.monotonic() > deadline:
            raise SimulatedHang(
                f"{what} on {state.describe()} would hang forever on a GPU: "
                f"{op.describe() if op is not None else 'earlier work'} has not finished after "
                f"{_settings.sim_hang_timeout():g} s (SYNK_SIM_HANG_TIMEOUT)")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    check_sticky(state.device)
    if not host:
        return
    with LOCK:
        advance(HOST_SEEN, state.key, until)


def ready(state: StreamState) -> None:
    """Before a kernel runs on ``state`` (whose seen was just updated): its own earlier
    deferred work and what it waits on must have run."""
    if state.pending:
        wait(state, state.seq - 1, "a kernel launch", host=False)
    for key, seq in list(state.seen.items()):
        other = state_of_key(key)
        if other is not None and other.done_seq < seq and other is not state:
            wait(other, seq, "a kernel launch waiting on an event", host=False)


def synchronize_device(device: int) -> None:
    """cudaDeviceSynchronize: "Blocks until the device has completed all preceding requested
    tasks" (CUDA Runtime API), those of streams destroyed since included: afterwards every
    stream of the device is ordered after all of it."""
    check_sticky(device)
    for state in all_states():
        if state.device == device:
            wait(state, what="Device.synchronize()")
    with LOCK:
        for key, (where, seq) in RETIRED.copy().items():  # (a copy: __del__ may add to it)
            if where == device:
                RETIRED.pop(key, None)
                advance(HOST_SEEN, key, seq)


def not_modelled_name(qualname: str, why: str) -> NotModelled:
    """The error for a name real CuPy has and the simulator does not model."""
    return NotModelled(f"the CUDA simulator does not model {qualname} (real CuPy has it: "
                       f"{why}); run it on a real GPU, or use what the simulator models "
                       "(numpy's functions on device arrays, ElementwiseKernel and "
                       "ReductionKernel with simple expressions)")


def not_modelled(what: str) -> NotModelled:
    return NotModelled(f"the CUDA simulator does not model {what} (CuPy may support it); "
                       "use an operation it models, or run on a real GPU")
