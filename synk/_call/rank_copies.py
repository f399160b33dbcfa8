"""Every worker's copies of its replicas, kept where a replacement group can read them
(``fork(restarts=N)``), so that a new group gets back each rank's own values, not rank 0's.
A worker copies each replica a request touched into a slot tagged with the request's id
(``Copies.keep``); the master installs on each new rank the newest slot tagged before the
first failed request (``restored``, ``kept.reinstall``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._process import PROCESS
from .._wire import shm as _shm

_MAX_AXES = 64  # numpy's
_WORDS = 2 + _MAX_AXES  # a slot's header: its tag, ndim, then the shape (8-byte words)
_DTYPE = _WORDS * 8  # then the dtype's ``str`` (16 bytes)
_HEADER = 1024  # bytes before the replica's


class Keep(NamedTuple):
    """What a request tells a worker about keeping copies (None: the group has no restart
    left, so none is kept)."""

    prefix: str  # the segments' name prefix
    generation: int  # the group's (its slots are told apart from an older group's)
    committed: int  # the newest request whose every reply the master has read


def keep_for(port) -> Keep | None:
    """The ``Keep`` of a request to the workers of ``port``'s group now."""
    if not port.restarts_left or port.size < 2:
        return None
    return Keep(_shm.process_prefix(), port.generation, port.clock.settled)


class Slot:
    """One copy of one replica on one rank: a segment ``<prefix>g<generation>k<variable>r<rank>-``
    under this process's ``Data`` prefix (swept at ``close()``): a header (tag, dtype, shape),
    then the bytes. ``write`` sets the tag to -1 first and writes it last, so that a slot its
    rank died writing is never read."""

    __slots__ = ("shm", "tag", "capacity")

    def __init__(self, shm, capacity: int) -> None:
        self.shm, self.capacity, self.tag = shm, capacity, -1

    def write(self, tag: int, value: np.ndarray) -> None:
        buf = self.shm.buf
        words = np.ndarray((_WORDS,), np.int64, buf)
        words[0] = -1  # (torn while being written: never read)
        words[1] = value.ndim
        words[2:2 + value.ndim] = value.shape
        buf[_DTYPE:_DTYPE + 16] = value.dtype.str.encode().ljust(16, b"\0")
        np.ndarray(value.shape, value.dtype, buf, _HEADER)[...] = value
        words[0] = tag
        self.tag = tag


def read_slot(name: str) -> tuple[int, np.ndarray | None]:
    """(tag, value) of the slot ``name`` (-1, None: torn or gone)."""
    try:
        shm = _shm.attach(name)
    except (FileNotFoundError, ValueError):  # (gone, or empty: its rank died between
        return -1, None  # making it and sizing it)
    buf = shm.buf
    assert buf is not None
    try:
        if len(buf) < _HEADER:  # (not sized yet)
            return -1, None
        words = np.ndarray((_WORDS,), np.int64, buf)
        tag, ndim = int(words[0]), int(words[1])
        if tag <= 0:  # (torn, or never written: request ids start at 1)
            return -1, None
        shape = tuple(int(n) for n in words[2:2 + ndim])
        dtype = np.dtype(bytes(buf[_DTYPE:_DTYPE + 16]).rstrip(b"\0").decode())
        return tag, np.ndarray(shape, dtype, buf, _HEADER).copy()
    finally:
        _shm.release(shm)


def touch_arguments(args, kwargs) -> None:
    """Note the replicas among a task's arguments as touched (a bound step's, which a
    worker holds, are not looked up again)."""
    given = {id(v) for v in args} | {id(v) for v in kwargs.values()}
    PROCESS.touched.update(sid for sid, replica in PROCESS.replicas.items()
                           if id(replica) in given)


class Copies:
    """A worker's slots, by variable (see the module)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slots: dict[int, list[Slot]] = {}

    def keep(self, keep: Keep | None, tag: int, device) -> None:
        """Copy the replicas the request ``tag`` touched into slots (nothing without ``keep``)."""
        touched, PROCESS.touched = PROCESS.touched, set()
        if keep is None:
            return
        for sid in sorted(touched):
            replica = PROCESS.replicas.get(sid)
            if replica is None:
                continue
            value = replica if isinstance(replica, np.ndarray) else device.to_host(replica)
            self._slot(keep, sid, value.nbytes).write(tag, value)

    def _slot(self, keep: Keep, sid: int, nbytes: int) -> Slot:
        """A slot for a copy of ``nbytes``: one no longer needed, or a new one. A slot
        tagged ``t`` holds the replica as it was once request ``t`` ended; it is reused only
        when the master has settled a later request (``committed``: the newest slot at or
        before it stays, every slot after it too)."""
        slots = self.slots.setdefault(sid, [])
        settled = [s for s in slots if 0 <= s.tag <= keep.committed]
        needed = max(settled, key=lambda s: s.tag) if settled else None
        for slot in slots:
            if slot is not needed and slot.tag <= keep.committed:
                if slot.capacity >= nbytes:
                    return slot
                slots.remove(slot)
                _shm.destroy(slot.shm)
                break
        size = _HEADER + nbytes
        name = f"{keep.prefix}g{keep.generation}k{sid}r{self.rank}"
        slot = Slot(_shm.create(name, size, "a copy of a replica"), nbytes)
        slots.append(slot)
        return slot

    def forget(self, sids) -> None:
        """The variables ``sids`` were collected: their slots go."""
        for sid in sids:
            for slot in self.slots.pop(sid, ()):
                _shm.destroy(slot.shm)

    def close(self) -> None:
        """Unmap the slots (their names stay: the master removes them)."""
        for slots in self.slots.values():
            for slot in slots:
                _shm.release(slot.shm)
        self.slots.clear()


def restored(generation: int, size: int, before: int | None) -> dict:
    """{(variable, rank): value}: each worker's replica as it was once the newest request
    before request ``before`` ended (None: the newest request), from the slots of
    group ``generation``; the slots are removed."""
    found: dict = {}
    base = f"{_shm.process_prefix()}g{generation}k"
    for name in _shm._names(base):
        sid, rank = (int(part) for part in name[len(base):].split("-")[0].split("r"))
        tag, value = read_slot(name)
        _shm.unlink(name)
        if value is None or rank >= size or (before is not None and tag >= before):
            continue
        if (sid, rank) not in found or found[sid, rank][0] < tag:
            found[sid, rank] = (tag, value)
    return {key: value for key, (_tag, value) in found.items()}
