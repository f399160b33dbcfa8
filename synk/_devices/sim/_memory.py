"""Simulated device memory: host memory (numpy buffers) at fake device addresses, so that code
passing raw pointers (NCCL) is checked as CUDA would check them, allocated as CuPy's default
memory pool allocates it."""
from __future__ import annotations

import bisect
import collections
import weakref

import numpy as np

from . import _core
from ._core import LOCK
from ._errors import cuda_error

UNIT = 512  # cupy/cuda/memory.pyx: _allocation_unit_size
POISON = 0xFF  # bytes of memory not yet written: NaN for floats, -1 for signed ints
CAPACITY = 1 << 30  # bytes per simulated device (getDeviceProperties' totalGlobalMem)
KEEP_FREE = 256 << 20  # free bytes a device's pool keeps; beyond, wholly free blocks go back
# (CuPy keeps them all until free_all_blocks or an allocation fails; here they are host
# memory of the test process. A block given back is never reused, so no race is hidden.)


def round_size(nbytes: int) -> int:
    """CuPy's ``_round_size``: up to a multiple of the allocation unit."""
    return -(-int(nbytes) // UNIT) * UNIT


class _Segment:
    """One cudaMalloc: the pool's unit of real memory, cut into chunks."""

    __slots__ = ("base", "buf", "device", "arena")

    def __init__(self, base: int, size: int, device: int, arena: tuple) -> None:
        self.base, self.device, self.arena = base, device, arena
        self.buf = np.empty(size, np.uint8)
        self.buf.fill(POISON)


class _Chunk:
    """A piece of a segment: in use by one ``Allocation``, or free in its arena. ``prior``:
    the accesses (stream key -> seq) of its earlier owners, what a new owner must not race."""

    __slots__ = ("segment", "offset", "size", "free", "prev", "next", "writer", "readers",
                 "prior")

    def __init__(self, segment, offset: int, size: int) -> None:
        self.segment, self.offset, self.size = segment, offset, size
        self.free = False
        self.prev = self.next = None
        self.writer: tuple | None = None
        self.readers: dict = {}
        self.prior: dict = {}

    @property
    def ptr(self) -> int:
        return 0 if self.segment is None else self.segment.base + self.offset


class Allocation:
    """Device memory in use: a flat uint8 buffer of exactly the requested size, its device,
    its device address, and who last wrote or read it on which stream."""

    __slots__ = ("buf", "device", "ptr", "_chunk", "__weakref__")

    def __init__(self, chunk: _Chunk, nbytes: int, device: int) -> None:
        self._chunk, self.device = chunk, device
        seg = chunk.segment
        self.buf = (np.empty(0, np.uint8) if seg is None
                    else seg.buf[chunk.offset:chunk.offset + nbytes])
        self.ptr = chunk.ptr

    writer = property(lambda self: self._chunk.writer,
                      lambda self, v: setattr(self._chunk, "writer", v))
    readers = property(lambda self: self._chunk.readers,
                       lambda self, v: setattr(self._chunk, "readers", v))
    prior = property(lambda self: self._chunk.prior,
                     lambda self, v: setattr(self._chunk, "prior", v))

    @property
    def size(self) -> int:
        """Bytes the pool gave (CuPy's ``Memory.size``: rounded to the allocation unit)."""
        return self._chunk.size

    @property
    def host_ptr(self) -> int:
        return self.buf.__array_interface__["data"][0]


# ---------------------------------------------------------------- the pool

_ARENAS: dict = {}  # (device, stream key) -> [free chunks]
_SEGMENTS: dict = {}  # device -> [segments]
_SEGMENT_BYTES: dict = {}  # device -> bytes of its segments (kept, not summed per allocation)
_FREED: collections.deque = collections.deque()  # chunks of collected Allocations
_LIVE_STARTS: list = []  # sorted device addresses of live allocations
_LIVE: dict = {}  # address -> weakref to its Allocation
_next_base: dict = {}  # device -> next fresh address offset
_USED: dict = {}  # device -> bytes in live chunks
_free_bytes: dict = {}  # device -> about the bytes free in its arenas (checked past KEEP_FREE)


def allocate(nbytes: int) -> Allocation:
    """``nbytes`` of device memory on the current device, from the arena of its current stream,
    as CuPy 14's ``SingleDeviceMemoryPool`` (cupy/cuda/memory.pyx): sizes rounded up to
    ``UNIT``; a freed block goes back to the arena of the stream that allocated it at once, with
    no event, for that stream alone (best fit, split, merged with free neighbours of the same
    segment). 0 bytes give pointer 0 (``malloc(0)``). Fresh memory holds ``POISON``; reused
    memory keeps the old bytes and the streams that still used it (``_Chunk.prior``): the new
    owner's first write from a stream that has not seen that work finish raises ``RaceError``,
    as on a GPU the old work would read or write the new data."""
    device = _core.check_device(_core.current_device())
    _core.check_sticky(device)  # cudaMalloc returns the sticky error too
    nbytes = int(nbytes)
    if nbytes <= 0:
        return Allocation(_Chunk(None, 0, 0), 0, device)
    size = round_size(nbytes)
    with LOCK:
        _drain()
        arena = (device, _core.current_state().key)
        chunk = _take(arena, size)
        if chunk is None:
            chunk = _grow(device, arena, size)
        _USED[device] = _USED.get(device, 0) + chunk.size
        alloc = Allocation(chunk, nbytes, device)
        ref = weakref.ref(alloc, lambda _: _FREED.append(chunk))
        start = alloc.ptr
        if start not in _LIVE:
            bisect.insort(_LIVE_STARTS, start)
        _LIVE[start] = ref
        return alloc


def _take(arena: tuple, size: int) -> _Chunk | None:
    free = _ARENAS.get(arena)
    if not free:
        return None
    # best fit, latest freed first (in one pass: the arena may hold thousands of chunks)
    best = min(((c.size, -i) for i, c in enumerate(free) if c.size >= size), default=None)
    if best is None:
        return None
    chunk = free.pop(-best[1])
    _free_bytes[arena[0]] -= size
    chunk.free = False
    if chunk.size > size:  # split: the rest stays free in the arena
        rest = _Chunk(chunk.segment, chunk.offset + size, chunk.size - size)
        rest.free, rest.prior = True, dict(chunk.prior)
        rest.prev, rest.next = chunk, chunk.next
        if chunk.next is not None:
            chunk.next.prev = rest
        chunk.next, chunk.size = rest, size
        free.append(rest)
    chunk.writer, chunk.readers = None, {}
    return chunk


def _grow(device: int, arena: tuple, size: int) -> _Chunk:
    total = _SEGMENT_BYTES.get(device, 0)
    if total + size > CAPACITY:  # as CuPy on cudaErrorMemoryAllocation: free the free blocks
        _release_free(device, None)  # and try again
        total = _SEGMENT_BYTES.get(device, 0)
        if total + size > CAPACITY:
            raise cuda_error(2, f"out of memory: {size} bytes more on simulated device "
                                f"{device}, which holds {CAPACITY} bytes and has {total} in use")
    base = ((device + 1) << 40) + _next_base.get(device, 0)
    _next_base[device] = _next_base.get(device, 0) + size + UNIT  # a gap between segments
    segment = _Segment(base, size, device, arena)
    _SEGMENTS.setdefault(device, []).append(segment)
    _SEGMENT_BYTES[device] = total + size
    return _Chunk(segment, 0, size)


def _drain() -> None:
    """Give the chunks of collected allocations back to their arenas (merging neighbours)."""
    while _FREED:
        chunk = _FREED.popleft()
        start = chunk.ptr
        ref = _LIVE.get(start)
        if ref is not None and ref() is None:
            del _LIVE[start]
            i = bisect.bisect_left(_LIVE_STARTS, start)
            if i < len(_LIVE_STARTS) and _LIVE_STARTS[i] == start:
                del _LIVE_STARTS[i]
        seg = chunk.segment
        _USED[seg.device] -= chunk.size
        prior = dict(chunk.prior)
        if chunk.writer is not None:
            _core.advance(prior, *chunk.writer)
        for key, seq in chunk.readers.items():
            _core.advance(prior, key, seq)
        chunk.prior, chunk.writer, chunk.readers, chunk.free = prior, None, {}, True
        free = _ARENAS.setdefault(seg.arena, [])
        _free_bytes[seg.device] = _free_bytes.get(seg.device, 0) + chunk.size
        for neighbour in (chunk.next, chunk.prev):
            if neighbour is not None and neighbour.free:
                free.remove(neighbour)
                chunk = _merge(neighbour, chunk) if neighbour is chunk.prev else _merge(
                    chunk, neighbour)
        free.append(chunk)
        if _free_bytes[seg.device] > KEEP_FREE:
            _release_free(seg.device, None)


def _merge(first: _Chunk, second: _Chunk) -> _Chunk:
    first.size += second.size
    first.next = second.next
    if second.next is not None:
        second.next.prev = first
    for key, seq in second.prior.items():
        _core.advance(first.prior, key, seq)
    return first


def _release_free(device: int, arena) -> None:
    """Drop the segments of ``device`` (in ``arena``, or any) that are wholly free."""
    segments = _SEGMENTS.get(device, [])
    for seg in list(segments):
        if arena is not None and seg.arena != arena:
            continue
        free = _ARENAS.get(seg.arena, [])
        whole = [c for c in free if c.segment is seg and c.offset == 0 and c.size == len(seg.buf)]
        if whole:
            free.remove(whole[0])
            segments.remove(seg)
            _free_bytes[device] -= len(seg.buf)
            _SEGMENT_BYTES[device] -= len(seg.buf)


def stats(device: int) -> dict:
    """The pool of ``device``: bytes in use, free in arenas, blocks free."""
    with LOCK:
        _drain()
        free = [c for (d, _), chunks in _ARENAS.items() if d == device for c in chunks]
        used = _USED.get(device, 0)
        return {"used": used, "free": sum(c.size for c in free), "n_free": len(free)}


def free_all_blocks(device: int, stream_key=None) -> None:
    with LOCK:
        _drain()
        arena = None if stream_key is None else (device, stream_key)
        _release_free(device, arena)


# ---------------------------------------------------------------- addresses

def resolve(ptr: int, nbytes: int) -> tuple[Allocation, int]:
    """The live allocation holding ``nbytes`` at device address ``ptr``, and the offset;
    ``CUDARuntimeError(700)`` (an illegal address) if there is none."""
    with LOCK:
        i = bisect.bisect_right(_LIVE_STARTS, ptr) - 1
        ref = _LIVE.get(_LIVE_STARTS[i]) if i >= 0 else None
        alloc = ref() if ref is not None else None
        if alloc is None or not ptr < alloc.ptr + max(alloc.buf.nbytes, 1):
            raise cuda_error(700, f"{ptr:#x} is not inside live simulated device memory")
        offset = ptr - alloc.ptr
        if offset + nbytes > alloc.buf.nbytes:
            past = offset + nbytes - alloc.buf.nbytes
            raise cuda_error(700, f"{nbytes} bytes at {ptr:#x} run {past} "
                                  f"bytes past the end of its {alloc.buf.nbytes}-byte allocation")
        return alloc, offset
