"""Shared-memory segments that take memory only where they are written, each range reserved
before it is written (``reserve``): a host's copies of the master's blocks under MPI
(``_engine.hosts``), as large as the master's blocks but holding only the rows that host reads.
"""
from __future__ import annotations

import contextlib
import errno
import mmap
import os
from multiprocessing import shared_memory

import numpy as np

from ..errors import ShmSpaceError
from . import shm as _shm


def create(name: str, size: int, what: str) -> shared_memory.SharedMemory:
    """Create the segment ``name`` (exactly), of ``size`` bytes, none of them reserved:
    it takes memory only where it is written, and ``reserve`` must come before any write
    (a write into an unreserved page of a full /dev/shm is a SIGBUS)."""
    return _shm._open(name, True, max(int(size), 1), what, reserve=False)


def reserve(shm: shared_memory.SharedMemory, starts, ends, what: str, fresh: bool) -> None:
    """Reserve the pages of ``shm`` (made by ``create``) that hold the bytes
    ``[starts[i], ends[i])``: ``ShmSpaceError`` if there is no room. ``fresh``: none of
    them is reserved yet, so check the machine's memory for all of them first."""
    runs = page_runs(starts, ends)
    if fresh:
        _shm.check_room(sum(e - s for s, e in runs), what)
    if not runs:
        return
    fd = os.open(f"{_shm.SHM_DIR}/{shm.name}", os.O_RDWR)
    try:
        for start, end in runs:
            os.posix_fallocate(fd, start, end - start)
    except OSError as err:
        if err.errno == errno.ENOSPC:
            raise ShmSpaceError(what, sum(e - s for s, e in runs), _shm.free_bytes()) from None
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    finally:
        os.close(fd)


_MANY_RUNS = 1024  # more separate runs than this: reserve from the first to the last


def page_runs(starts, ends) -> list[tuple[int, int]]:
    """The byte ranges ``[starts[i], ends[i])`` widened to whole pages, sorted and joined
    where they touch (one run from the first to the last when there would be very many)."""
    starts = np.asarray(starts, np.int64).reshape(-1)
    ends = np.asarray(ends, np.int64).reshape(-1)
    keep = ends > starts
    starts, ends = starts[keep], ends[keep]
    if not len(starts):
        return []
    page = mmap.PAGESIZE
    starts = starts // page * page
    ends = -(-ends // page) * page
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], np.maximum.accumulate(ends[order])
    first = np.flatnonzero(np.concatenate(([True], starts[1:] > ends[:-1])))
    if len(first) > _MANY_RUNS:
        return [(int(starts[0]), int(ends[-1]))]
    last = np.concatenate((first[1:] - 1, [len(starts) - 1]))
    return [(int(s), int(e)) for s, e in zip(starts[first], ends[last])]


def clear(shm: shared_memory.SharedMemory) -> None:
    """Give back the memory of every page of ``shm`` (they read as zeros again); never
    while a device may have them page-locked, which would keep reading the old pages."""
    mapped = _shm.internals(shm)._mmap
    if mapped is None:  # (released)
        return
    with contextlib.suppress(OSError, AttributeError, ValueError):
        mapped.madvise(mmap.MADV_REMOVE)
