"""Shared-memory segments: creation, attachment, release and leak sweeping.

Every segment synk creates is named ``synk-<master pid>-<random token>-<tag>-<random>`` and
created owner-only (mode 0600) with O_EXCL, so no other user can read or write it and nobody
can plant a segment under a name synk is about to use. The naming lets the master sweep all
of its group's segments on ``close()`` (including ones a crashed worker created and never
reported), and lets the next ``fork()`` on the machine recognise and reclaim segments left
behind by a master that died.

The creator owns destruction (``unlink``); everyone else only maps and unmaps. CPython's
``resource_tracker`` is kept out of it: before 3.13 it would start a tracker process in every
worker and unlink segments that workers merely attached when they exit.
"""
from __future__ import annotations

import os
import secrets
import sys
import threading
from contextlib import contextmanager
from multiprocessing import resource_tracker, shared_memory

import numpy as np

PREFIX = "synk-"
SHM_DIR = "/dev/shm"
_untracked_lock = threading.Lock()


def session_prefix() -> str:
    """A fresh, unguessable name prefix for one process's segments."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}-"


@contextmanager
def _untracked():
    if sys.version_info >= (3, 13):
        yield
        return
    with _untracked_lock:
        register, unregister = resource_tracker.register, resource_tracker.unregister
        resource_tracker.register = resource_tracker.unregister = lambda *a, **k: None
        try:
            yield
        finally:
            resource_tracker.register, resource_tracker.unregister = register, unregister


def _open(name: str, create: bool, size: int) -> shared_memory.SharedMemory:
    kwargs = {"track": False} if sys.version_info >= (3, 13) else {}
    with _untracked():
        shm = shared_memory.SharedMemory(name, create=create, size=size, **kwargs)
    # Only the mapping is used: keeping the descriptor would hold one fd per segment.
    os.close(shm._fd)
    shm._fd = -1
    return shm


def create(name: str, size: int) -> shared_memory.SharedMemory:
    """Create a new owner-only (0600) segment of at least ``size`` bytes, named ``name``
    plus a random suffix (use ``.name``); never one that already exists."""
    for attempt in range(8):
        try:
            return _open(f"{name}-{secrets.token_hex(8)}", True, max(int(size), 1))
        except FileExistsError:
            if attempt == 7:
                raise


def attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment."""
    return _open(name, False, 0)


def release(shm: shared_memory.SharedMemory) -> None:
    """Drop this process's handle on ``shm``; the mapping goes with the last view of it.

    ``SharedMemory.close()`` would unmap at once, and numpy arrays built on ``shm.buf`` do
    not hold a buffer export that would stop it, so a later read through such an array
    would crash. Instead we let go of the mmap and let reference counting unmap it.
    """
    shm._buf = None
    shm._mmap = None
    if shm._fd >= 0:
        os.close(shm._fd)
        shm._fd = -1


def unlink(name: str) -> None:
    """Remove a segment's name; missing names are ignored."""
    try:
        with _untracked():
            shared_memory._posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


def destroy(shm: shared_memory.SharedMemory) -> None:
    """Unmap and unlink a segment this process created."""
    name = shm.name
    release(shm)
    unlink(name)


def _names(prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []


def sweep(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix``; returns the names removed."""
    removed = _names(prefix)
    for name in removed:
        unlink(name)
    return removed


def sweep_orphans() -> list[str]:
    """Unlink segments left by synk masters that are no longer alive."""
    removed = []
    for name in _names(PREFIX):
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            unlink(name)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ndarray(shm: shared_memory.SharedMemory, shape, dtype, offset: int = 0) -> np.ndarray:
    """A numpy view of ``shm`` starting at ``offset`` bytes."""
    return np.ndarray(shape, dtype=dtype, buffer=shm.buf, offset=offset)


class Attachments:
    """Segments mapped by name in this process, kept until released."""

    def __init__(self) -> None:
        self._maps: dict[str, shared_memory.SharedMemory] = {}

    def get(self, name: str) -> shared_memory.SharedMemory:
        shm = self._maps.get(name)
        if shm is None:
            shm = self._maps[name] = attach(name)
        return shm

    def array(self, name: str, shape, dtype, offset: int = 0) -> np.ndarray:
        return ndarray(self.get(name), shape, dtype, offset)

    def release(self, name: str) -> None:
        shm = self._maps.pop(name, None)
        if shm is not None:
            release(shm)

    def release_all(self, prefix: str = "") -> None:
        """Release every mapping whose name starts with ``prefix``."""
        for name in [n for n in self._maps if n.startswith(prefix)]:
            self.release(name)


class Scratch:
    """A reusable segment that this process owns and regrows on demand.

    Growing creates a new segment under a new name; the old name is unlinked at once and
    reported by ``take_retired()`` so that other processes can unmap it.
    """

    def __init__(self, prefix: str, tag: str) -> None:
        self._prefix, self._tag = prefix, tag
        self._shm: shared_memory.SharedMemory | None = None
        self._count = 0
        self._retired: list[str] = []

    def ensure(self, nbytes: int) -> shared_memory.SharedMemory:
        if self._shm is None or self._shm.size < nbytes:
            if self._shm is not None:
                self._retired.append(self._shm.name)
                destroy(self._shm)
            size = max(int(nbytes * 1.25), 4096)
            self._count += 1
            self._shm = create(f"{self._prefix}{self._tag}{self._count}", size)
        return self._shm

    def take_retired(self) -> list[str]:
        retired, self._retired = self._retired, []
        return retired

    def destroy(self) -> None:
        if self._shm is not None:
            destroy(self._shm)
            self._shm = None


#: Blocks this process has mapped by name (in workers: everything the master sent).
ATTACHED = Attachments()
