"""Large messages between ranks through shared memory: one of ``SHM_FROM`` bytes and up
(``ring_shm_from`` beside a ring) goes into a segment its sender owns, only a reference on
the socket; the receiver reads the bytes in place.

::

    sender     Outbox.put: a free segment of its pool for dest, flag set -> ShmRef
    receiver   Inbox.view: the bytes in place; Inbox.done: flag cleared
    sender     reuses only segments whose flag is clear (Outbox._take)
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..._wire import ring as _ring, shm as _shm

SHM_FROM = 64 << 10  # bytes; smaller messages are cheaper inline (on a ring: see shm_mesh)
_GRAIN = 1 << 20  # segments are sized in whole MiB, so that similar sizes reuse them
_HEAD = 64  # the flag word, padded to a cache line; the message follows


def ring_shm_from(size: int) -> int:
    """In a group of ``size``, the least bytes of a message between two ranks joined by a
    ring that go through a shared-memory segment rather than the ring (to a rank without
    one: ``SHM_FROM``)."""
    return max(SHM_FROM, _ring.mesh_ring_bytes(size) // 8)


def _flag(shm) -> np.ndarray:
    """The flag word at the head of a segment, set by the sender while it holds a message
    not yet consumed, cleared by the receiver after its reads (x86 is total-store-ordered):
    handing a segment back costs no message and no wake-up."""
    return np.ndarray(1, np.uint64, buffer=shm.buf)


class ShmRef(NamedTuple):
    """Where a message's bytes are (its segment), and the segments this sender has given
    up since its last message to this receiver (which it may still have mapped: it unmaps
    them, ``Inbox.forget``)."""

    name: str
    retired: tuple


class Outbox:
    """The segments this rank sends through, per destination rank: as many as it has had
    messages out to it at once, each regrown when too small. Segments carry the group's
    name prefix, so the group's sweep removes them even when the rank that made them
    crashed."""

    def __init__(self, prefix: str, rank: int) -> None:
        self._prefix, self._rank = prefix, rank
        self._lock = threading.Lock()
        self._pools: dict = {}  # dest -> [segment]
        self._retired: dict = {}  # dest -> [name]
        self._calls: dict = {}  # name -> (call id, dest, segment) of messages put since
        # reclaimed
        self._count = 0

    def put(self, dest: int, data: np.ndarray, call_id: int) -> ShmRef:
        """Copy ``data`` (flat uint8), a message of call ``call_id``, into a free segment
        for ``dest``."""
        return self.put_filled(dest, data.nbytes, data.dtype, (data.nbytes,), call_id,
                               lambda view: view.__setitem__(Ellipsis, data))[0]

    def put_filled(self, dest: int, nbytes: int, dtype, shape: tuple, call_id: int,
                   fill) -> tuple:
        """A message of call ``call_id`` for ``dest`` that ``fill(view)`` writes into a free
        segment (``view``: an array of ``shape`` and ``dtype`` over it, ``nbytes``): its
        ``ShmRef``, and the view (read it only before this rank's next message to
        ``dest``)."""
        with self._lock:
            shm = self._take(dest, nbytes)
            self._calls[shm.name] = (call_id, dest, shm)
            retired = tuple(self._retired.pop(dest, ()))
        view = np.ndarray(shape, dtype, buffer=shm.buf, offset=_HEAD)
        fill(view)
        return ShmRef(shm.name, retired), view

    def _take(self, dest: int, nbytes: int):
        pool = self._pools.setdefault(dest, [])
        free = [s for s in pool if not _flag(s)[0]]
        fits = [s for s in free if s.size - _HEAD >= nbytes]
        if fits:
            shm = min(fits, key=lambda s: s.size)
        else:
            if free:  # too small for this: give the largest up, rather than pile up
                old = max(free, key=lambda s: s.size)
                pool.remove(old)
                self._calls.pop(old.name, None)
                self._retired.setdefault(dest, []).append(old.name)
                _shm.destroy(old)
            self._count += 1
            size = -(-(nbytes + _HEAD) // _GRAIN) * _GRAIN
            shm = _shm.create(f"{self._prefix}r{self._rank}-msg{self._count}", size,
                              f"a synk.comm message from rank {self._rank} to rank {dest}")
            pool.append(shm)
        _flag(shm)[0] = 1
        return shm

    def reclaim(self, call_id: int, ended: Callable[[int, int], bool]) -> None:
        """Free the segments of messages of calls before ``call_id`` whose receiver is done
        with their call (``ended(dest, call)``), received or not; the others wait (the master
        may run ahead of the workers). Only the sender frees a segment: receivers drop old
        calls' messages without touching the flag."""
        if not self._calls:
            return
        with self._lock:
            for name, (call, dest, shm) in list(self._calls.items()):
                if call < call_id and ended(dest, call):
                    _flag(shm)[0] = 0
                    del self._calls[name]

    def destroy(self) -> None:
        with self._lock:
            segments = [s for pool in self._pools.values() for s in pool]
            self._pools.clear()
            self._calls.clear()
        for shm in segments:
            _shm.destroy(shm)


class Parcel:
    """A message that arrived by reference: its bytes are in the sender's segment."""

    __slots__ = ("ref", "dtype", "shape")

    def __init__(self, ref: ShmRef, dtype: str, shape: tuple) -> None:
        self.ref, self.dtype, self.shape = ref, dtype, shape


class Inbox:
    """The other ranks' segments this rank has mapped."""

    def __init__(self) -> None:
        self._maps = _shm.Attachments()
        self._lock = threading.Lock()

    def view(self, parcel: Parcel) -> np.ndarray:
        """The message as an array over the sender's segment (valid until released)."""
        with self._lock:
            shm = self._maps.get(parcel.ref.name)
        count = int(np.prod(parcel.shape, dtype=np.int64))
        buf = shm.buf
        assert buf is not None  # (mapped by the attachments until they forget it)
        return np.frombuffer(buf, parcel.dtype, count, _HEAD).reshape(parcel.shape)

    def done(self, parcel: Parcel) -> None:
        """Hand the message's segment back to its sender (after the last read of it)."""
        with self._lock:
            shm = self._maps.get(parcel.ref.name)
        _flag(shm)[0] = 0

    def forget(self, names) -> None:
        with self._lock:
            for name in names:
                self._maps.release(name)

    def close(self) -> None:
        with self._lock:
            self._maps.release_all()
