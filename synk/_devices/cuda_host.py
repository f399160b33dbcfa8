"""Page-locked host memory of a CUDA rank, for copies the GPU can run on its own (DMA); where
the driver refuses to page-lock, copies stay pageable::

    rows in a shared-memory block --pin_rows: its chunks, locked once--> copy to the device
    other host data ----Staging: page-locked buffers, reused in turns--> copy to the device
"""
from __future__ import annotations

import mmap
import threading
import warnings
from typing import Any

import numpy as np

from .._wire import shm as _shm

PAGE = mmap.PAGESIZE
SMALL = 64 << 10  # bytes: copied straight from pageable memory (a staging copy costs more)
CHUNK = 4 << 20  # bytes per turn of a large staged copy
PIN_CHUNK = 4 << 20  # bytes: shared-memory blocks are page-locked in chunks of this size
PINNED_RESULT = 1 << 20  # bytes: a call's result from this size lands in page-locked memory

_registered: dict = {}  # page-aligned host base -> length (registration is process-wide in CUDA)
_held: dict = {}  # base -> a view of the shared-memory block registered there (its mapping)
_lock = threading.Lock()
_warned: list = []
problems: list = []  # un-page-locking that failed (a bug if it ever happens): for the tests


def span(buffer) -> tuple[int, int]:
    """Page-aligned (base, length) covering ``buffer``'s memory."""
    view = buffer if isinstance(buffer, np.ndarray) else np.frombuffer(buffer, np.uint8)
    start = view.__array_interface__["data"][0]
    base = start - start % PAGE
    end = start + view.nbytes
    return base, -(-(end - base) // PAGE) * PAGE


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def register(xp, base: int, length: int) -> bool:
    """Page-lock ``length`` bytes from ``base`` unless they already are (no error 712);
    False (after one warning per process, never an error) when the driver refuses (no
    support, limits): copies from there stay pageable."""
    with _lock:
        return _register(xp, base, length)


def _register(xp, base: int, length: int) -> bool:
    if any(b <= base and base + length <= b + n for b, n in _registered.items()):
        return True
    runtime = xp.cuda.runtime
    try:
        runtime.hostRegister(base, length, 0)
    except runtime.CUDARuntimeError as err:
        if not _warned:
            _warned.append(True)
            warnings.warn(f"synk: page-locking {length} bytes of host memory failed "
                          f"({err}); copies from it stay pageable (slower)",
                          RuntimeWarning, stacklevel=4)
        return False
    _registered[base] = length
    return True


def unregister(xp, base: int) -> None:
    """Undo ``register`` of the range starting at ``base`` (nothing if it is not
    registered: no error 713)."""
    with _lock:
        _unregister(xp, base)


def _unregister(xp, base: int) -> None:
    if _registered.pop(base, None) is None:
        return
    _held.pop(base, None)  # (after the unregistering below: the mapping may go then)
    runtime = xp.cuda.runtime
    try:
        runtime.hostUnregister(base)
    except runtime.CUDARuntimeError as err:
        problems.append(str(err))
        warnings.warn(f"synk: un-page-locking host memory failed ({err})", RuntimeWarning,
                      stacklevel=4)


def drop_released(xp) -> None:
    """Undo the registrations in shared-memory blocks that this process has let go of
    (``shm.release``): the views held of them kept their mappings until now."""
    if not _held:
        return
    with _lock:
        for base in [b for b in _held if _shm.mapping_of(b, 1) is None]:
            _unregister(xp, base)


def unregister_all(xp) -> None:
    with _lock:
        bases = list(_registered)
    for base in bases:
        unregister(xp, base)


def pin_rows(xp, array: np.ndarray) -> bool:
    """Page-lock, each once, the chunks of a shared-memory block that hold ``array`` (C-contiguous
    rows); False if ``array`` is in no such block or the driver refused. Chunks are ``PIN_CHUNK``
    bytes from the block's start, registered when first read and never again: n ranks lock a block
    about once between them (growing one registration would be quadratic over consecutive ``batch=``
    slices). A registration holds a view of its block (``_held``); once ``shm.release`` lets the
    block go, ``drop_released`` unregisters its chunks at the next share or page-locking, and only
    then is the memory unmapped."""
    drop_released(xp)  # (first: a new block may lie where a released one was)
    found = _shm.mapping_of(address(array), array.nbytes)
    if found is None or not array.nbytes:
        return False
    with _lock:
        for base, length in _chunks(found, address(array), array.nbytes):
            if base not in _registered:
                if not _register(xp, base, length):
                    return False
                _held[base] = array  # (its block's mapping stays while registered)
    return True


def _chunks(mapping: tuple, start: int, nbytes: int) -> list:
    """The (base, length) of ``mapping``'s chunks that hold ``nbytes`` from ``start``."""
    block, size = mapping
    limit = block + -(-size // PAGE) * PAGE
    first = (start - block) // PIN_CHUNK
    last = (start + nbytes - 1 - block) // PIN_CHUNK
    return [(block + k * PIN_CHUNK, min(PIN_CHUNK, limit - block - k * PIN_CHUNK))
            for k in range(first, last + 1)]


def pinned_pieces(array: np.ndarray) -> list:
    """Byte ranges of ``array`` (in a shared-memory block) that each lie in one chunk, hence
    one registration: a copy from page-locked memory is cut there."""
    start = address(array)
    found = _shm.mapping_of(start, array.nbytes)
    if found is None:
        return [(0, array.nbytes)]
    cuts = [max(base, start) - start for base, _ in _chunks(found, start, array.nbytes)]
    return list(zip(cuts, cuts[1:] + [array.nbytes]))


class _Slot:
    __slots__ = ("memory", "base", "size", "event")

    def __init__(self, xp, nbytes: int) -> None:
        self.size = max(-(-nbytes // PAGE) * PAGE, PAGE)
        self.memory = mmap.mmap(-1, self.size)
        self.base = address(np.frombuffer(self.memory, np.uint8, 1))
        self.event: Any = None  # (a CuPy event)
        register(xp, self.base, self.size)

    @property
    def free(self) -> bool:
        return self.event is None or self.event.done

    def view(self, nbytes: int) -> np.ndarray:
        return np.frombuffer(self.memory, np.uint8, nbytes)


class Staging:
    """A rank's page-locked buffers for host data in no shared-memory block (a one-rank group's
    arguments, index-gathered or strided rows), registered once and reused. A buffer is refilled
    only after the copy that read it finished (an event); large arrays alternate two buffers,
    chunk by chunk, so that filling one overlaps the copy out of the other."""

    MAX_SLOTS = 4

    def __init__(self, xp) -> None:
        self.xp = xp
        self._slots: list[_Slot] = []

    def _slot(self, nbytes: int, avoid: _Slot | None = None) -> _Slot:
        """A buffer of at least ``nbytes`` whose last copy has finished, but not ``avoid``
        (the one just filled): a free one, a new one, or the oldest once its copy is done."""
        candidates = [s for s in self._slots if s is not avoid]
        for slot in candidates:
            if slot.size >= nbytes and slot.free:
                return slot
        if len(self._slots) < self.MAX_SLOTS:
            slot = _Slot(self.xp, nbytes)
            self._slots.append(slot)
            return slot
        slot = candidates[0]
        if slot.event is not None:
            slot.event.synchronize()
        if slot.size < nbytes:
            self._drop(slot)
            slot = _Slot(self.xp, nbytes)
            self._slots.append(slot)
        else:  # now the most recently used
            self._slots.remove(slot)
            self._slots.append(slot)
        return slot

    def _drop(self, slot: _Slot) -> None:
        self._slots.remove(slot)
        if slot.event is not None:
            slot.event.synchronize()
        unregister(self.xp, slot.base)
        slot.memory.close()

    def upload(self, host: np.ndarray, out, stream) -> None:
        """Copy ``host`` into the device array ``out`` (same shape and dtype, contiguous) on
        ``stream`` through page-locked buffers, in chunks when it is large and contiguous."""
        nbytes = host.nbytes
        with stream:  # (a view of device memory is work on the current stream to the simulator)
            flat_out = out.reshape(-1).view(self.xp.uint8)
        if not host.flags.c_contiguous:  # strided rows: gathered into one buffer
            slot = self._slot(nbytes)
            np.copyto(slot.view(nbytes).view(host.dtype).reshape(host.shape), host)
            self._copy(slot, slot.view(nbytes), flat_out, stream)
            return
        src = host.reshape(-1).view(np.uint8)
        chunk = nbytes if nbytes <= 2 * CHUNK else CHUNK
        last = None
        for lo in range(0, nbytes, chunk):
            hi = min(lo + chunk, nbytes)
            slot = self._slot(hi - lo, avoid=last)
            staged = slot.view(hi - lo)
            staged[...] = src[lo:hi]
            with stream:
                part = flat_out[lo:hi]
            self._copy(slot, staged, part, stream)
            last = slot

    def gather_rows(self, source: np.ndarray, index: np.ndarray, out, stream) -> None:
        """Rows ``source[index]`` into the device array ``out`` on ``stream``, gathered
        straight into a page-locked buffer (the gather's copy is needed anyway)."""
        nbytes = out.nbytes
        slot = self._slot(nbytes)
        staged = slot.view(nbytes).view(source.dtype).reshape(out.shape)
        np.take(source, index, axis=0, out=staged, mode="clip")  # indices checked already
        self._copy(slot, staged, out, stream)

    def _copy(self, slot: _Slot, staged: np.ndarray, out, stream) -> None:
        out.set(staged, stream=stream)
        if slot.event is None:
            slot.event = self.xp.cuda.Event(disable_timing=True)
        slot.event.record(stream)

    def close(self) -> None:
        for slot in list(self._slots):
            self._drop(slot)
