"""Shared-memory segments: creation, attachment, release and leak sweeping. Every segment synk
creates is named under the prefix of an ``Owner`` (a group, or a process's ``Data``), whose
lock says it is in use; the creator owns destruction (``unlink``), everyone else only maps and
unmaps.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import sys
import threading
import weakref
from contextlib import contextmanager, suppress
from multiprocessing import resource_tracker, shared_memory
from typing import Protocol, cast

import numpy as np

from .._process import PROCESS
from ..errors import ShmSpaceError

PREFIX = "synk-"
SHM_DIR = "/dev/shm"
LOCK = "lock"  # <prefix>lock: the file whose flock says the prefix's owner is alive
_untracked_lock = threading.Lock()
_release_lock = threading.RLock()
_log = logging.getLogger("synk")
_reported: set = set()  # segments the sweep could not remove, said once each


class Internals(Protocol):
    """The private fields of CPython's ``SharedMemory`` (3.10-3.13) this package relies on on
    purpose: the descriptor (closed once mapped), the buffer and the mmap behind ``buf``."""
    _fd: int
    _buf: memoryview | None
    _mmap: mmap.mmap | None


def internals(shm: shared_memory.SharedMemory) -> Internals:
    """``shm`` seen through its private fields (see ``Internals``)."""
    return cast(Internals, shm)


def session_prefix() -> str:
    """A fresh, unguessable name prefix for one process's segments, ``synk-<pid>-<random
    token>-``: a segment's full name is ``<prefix><tag>-<random>`` (``create``)."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}-"


@contextmanager
def _untracked():
    """CPython's ``resource_tracker`` kept out of a segment's opening: before 3.13 it would
    start a tracker process in every worker, and unlink at their exit the segments that
    workers merely attached."""
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


def free_bytes() -> int | None:
    """Bytes free in /dev/shm for this user, or None if unknown (or a tmpfs without limit)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    if not st.f_blocks:  # size=0: tmpfs reports no blocks at all, not "full"
        return None
    return st.f_bavail * st.f_frsize


MEMINFO = "/proc/meminfo"
MAX_BYTES = sys.maxsize  # the largest segment (and numpy array) there can be


def memory() -> tuple[int, int] | None:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo, or None if unknown."""
    found = {}
    try:
        with open(MEMINFO, "rb") as f:
            for line in f:
                key, _, rest = line.partition(b":")
                if key in (b"MemTotal", b"MemAvailable"):
                    found[key] = int(rest.split()[0]) * 1024  # (always in kB)
                    if len(found) == 2:
                        return found[b"MemTotal"], found[b"MemAvailable"]
    except (OSError, ValueError, IndexError):
        pass
    return None


def usable_memory(total: int, available: int) -> int:
    """The most one new segment may take of ``available`` memory: all of it less 1/16 of
    the machine's memory, kept for the processes themselves (the value being copied in,
    numpy's temporaries, the workers), but never less than half of it."""
    return max(available - total // 16, available // 2)


def check_room(size: int, what: str) -> None:
    """``ShmSpaceError`` before anything is made if the machine's memory or /dev/shm has no room
    for ``size`` bytes (existing segments are counted already). Memory too, since a tmpfs as
    large as the memory would accept a block the OOM killer then answers."""
    if not 0 <= size <= MAX_BYTES:
        raise ValueError(f"a shared-memory segment of {size:,} bytes is impossible: the "
                         f"size must be between 0 and {MAX_BYTES:,}")
    free = free_bytes()
    mem = memory()
    if mem is not None:
        usable = usable_memory(*mem)
        if size > usable:
            raise ShmSpaceError(what, size, free, mem[1], usable)
    if free is not None and size > free:
        raise ShmSpaceError(what, size, free)


def _reserve(fd: int, size: int) -> None:
    """Allocate the segment's pages now, so that a full /dev/shm fails here (ENOSPC) and
    not with SIGBUS at the first write into a sparse segment."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise  # (unsupported: the segment stays sparse, as it was before)


def _open(name: str, create: bool, size: int, what: str = "a shared-memory block",
          reserve: bool = True) -> shared_memory.SharedMemory:
    kwargs = {"track": False} if sys.version_info >= (3, 13) else {}
    try:
        with _untracked():
            shm = shared_memory.SharedMemory(name, create=create, size=size, **kwargs)
    except FileExistsError:
        raise  # (not ours: never unlink it)
    except BaseException:
        if create:  # SharedMemory unlinks only after an OSError, and leaves the name else
            unlink(name)
        raise
    fields = internals(shm)
    if create and reserve:
        try:
            _reserve(fields._fd, shm.size)
        except BaseException as err:
            shm.close()
            unlink(shm.name)
            if isinstance(err, OSError) and err.errno == errno.ENOSPC:
                raise ShmSpaceError(what, size, free_bytes()) from None
            raise
    # Only the mapping is used: keeping the descriptor would hold one fd per segment.
    os.close(fields._fd)
    fields._fd = -1
    if shm.size:
        _MAPPED[_address(shm)] = shm.size
    return shm


# Where this process has segments mapped (address -> size), so that a device can page-lock the
# whole mapping that holds an array it copies from, and see when synk let one go (a GPU rank
# holds a mapping it page-locked until it has undone that: ``_devices.cuda_host``).
_MAPPED: dict[int, int] = {}


def _address(shm: shared_memory.SharedMemory) -> int:
    assert shm.buf is not None  # (mapped: only a released segment has no buffer)
    return np.frombuffer(shm.buf, np.uint8, 1).__array_interface__["data"][0]


def mapping_of(address: int, nbytes: int) -> tuple[int, int] | None:
    """(base address, size) of this process's segment mapping that holds the ``nbytes`` at
    ``address``, or None if they are not inside one."""
    for base, size in _MAPPED.items():
        if base <= address and address + nbytes <= base + size:
            return base, size
    return None


def create(name: str, size: int,
           what: str = "a shared-memory block") -> shared_memory.SharedMemory:
    """Create a new owner-only (0600) segment of at least ``size`` bytes, named ``name`` plus a
    random suffix (use ``.name``), with O_EXCL, so nobody can read it or plant one under that
    name. ``ShmSpaceError`` (naming ``what``) if there is no room (``check_room``)."""
    size = max(int(size), 1)
    check_room(size, what)
    for _attempt in range(7):
        with suppress(FileExistsError):
            return _open(f"{name}-{secrets.token_hex(8)}", True, size, what)
    return _open(f"{name}-{secrets.token_hex(8)}", True, size, what)  # (the 8th: or raise)


def attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment."""
    return _open(name, False, 0)


def release(shm: shared_memory.SharedMemory) -> None:
    """Drop this process's handle on ``shm``; the mapping goes with the last view of it
    (``close()`` would unmap at once, under numpy arrays on ``shm.buf``, which hold no buffer
    export, and a later read would crash)."""
    fields = internals(shm)
    if fields._buf is not None and shm.size:
        _MAPPED.pop(_address(shm), None)
    fields._buf = None
    fields._mmap = None
    if fields._fd >= 0:
        os.close(fields._fd)
        fields._fd = -1


def unlink(name: str) -> None:
    """Remove a segment's name; missing names are ignored."""
    try:  # what shm_unlink() does on Linux; resource_tracker hears nothing of it
        os.unlink(f"{SHM_DIR}/{name}")
    except FileNotFoundError:
        pass


def destroy(shm: shared_memory.SharedMemory) -> None:
    """Unmap and unlink a segment this process created."""
    name = shm.name
    release(shm)
    unlink(name)


def destroy_if_made_by(shm: shared_memory.SharedMemory, pid: int) -> None:
    """A block's finalizer: unlink it only in the process ``pid`` that made it, else only
    unmap it (a child made by ``os.fork()`` shares its parent's blocks: it must not remove
    them when it exits)."""
    if os.getpid() == pid:
        destroy(shm)
    else:
        release(shm)


def _names(prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return []


def sweep(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix`` (not its owner's lock file);
    returns the names removed."""
    removed = [n for n in _names(prefix) if n != prefix + LOCK]
    for name in removed:
        unlink(name)
    return removed


class Owner:
    """A name prefix for segments, with the lock that says it is in use: an flock on
    ``<prefix>lock`` in /dev/shm, held until ``release()`` or the process ends (the kernel drops
    it however it dies). Workers create segments under their group's prefix, covered by the
    master's lock, so ``close()`` sweeps a crashed worker's too, and the next ``fork()``
    reclaims a dead owner's (``sweep_orphans``). A lock, not a pid, so that it holds in every
    pid namespace sharing ``/dev/shm``."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        for _ in range(8):
            prefix = session_prefix()
            try:
                fd = os.open(f"{SHM_DIR}/{prefix}{LOCK}",
                             os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                             0o600)
            except FileExistsError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_nlink:  # else a sweep took it for an orphan's and removed it
                    break
            except BlockingIOError:  # a sweep holds it for a moment, and will remove it
                pass
            os.close(fd)
        else:
            raise FileExistsError(f"could not create a lock file in {SHM_DIR}")
        self.prefix, self._fd = prefix, fd
        _owners.add(self)

    def release(self) -> None:
        """Remove every segment under the prefix, then the lock file (idempotent). In a
        child made by ``os.fork()``, only let go of the inherited descriptor."""
        with _release_lock:  # (a dying worker's watch thread and its main thread may race)
            if self._fd < 0:
                return
            if os.getpid() == self.pid:  # (safe to repeat if interrupted: nothing is lost)
                sweep(self.prefix)
                unlink(self.prefix + LOCK)
            fd, self._fd = self._fd, -1
            os.close(fd)

    def forget(self) -> None:
        """Close this process's copy of the lock's descriptor, keeping the lock file: after
        ``os.fork()``, the lock stays the parent's (it ends when the parent's copy closes)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


_owners: weakref.WeakSet[Owner] = weakref.WeakSet()


def release_owners() -> None:
    """Release every ``Owner`` of this process: for a process about to die, whose groups
    may be half started or half closed."""
    for owner in list(_owners):
        owner.release()


def _forget_owners_in_child() -> None:
    for owner in list(_owners):
        owner.forget()


os.register_at_fork(after_in_child=_forget_owners_in_child)


def _claim(prefix: str) -> tuple[str, int]:
    """Whether ``prefix``'s owner is ``"alive"``, ``"gone"`` (then its lock is taken and
    its descriptor returned, for the caller to close once the segments are removed),
    ``"unlocked"`` (no lock file: an older synk, or an owner that just released it) or
    ``"unknown"`` (another user's lock, which this process may not open)."""
    try:
        fd = os.open(SHM_DIR + "/" + prefix + LOCK, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "unlocked", -1
    except OSError:
        return "unknown", -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: its owner holds it
        os.close(fd)
        return "alive", -1
    return "gone", fd


def sweep_orphans() -> list[str]:
    """Unlink segments left by synk processes that are gone; returns the names removed. An owner
    is gone when its lock can be taken (without a lock file, older versions: when no process has
    the pid in the names). Another user's segments are skipped, said once at debug level."""
    owners: dict[str, list[str]] = {}
    for name in _names(PREFIX):
        parts = name.split("-", 3)
        if len(parts) == 4 and parts[1].isdigit():
            owners.setdefault("-".join(parts[:3]) + "-", []).append(name)
    removed, skipped = [], []
    for prefix, names in owners.items():
        state, fd = _claim(prefix)
        if state == "unknown":
            skipped += names
            continue
        if state == "alive" or (state == "unlocked" and _alive(int(prefix.split("-")[1]))):
            continue
        try:
            lock = prefix + LOCK
            for name in sorted(set(names) | set(_names(prefix)), key=lambda n: n == lock):
                try:
                    unlink(name)  # the lock file last
                    removed.append(name)
                except PermissionError:
                    skipped.append(name)
        finally:
            if fd >= 0:
                os.close(fd)
    _report_skipped(skipped)
    return removed


def _report_skipped(names: list) -> None:
    new = [n for n in names if n not in _reported]
    if new:
        _reported.update(new)
        _log.debug("synk: left %d segment(s) of another user in %s, which this process may "
                   "not judge or remove: %s", len(new), SHM_DIR, ", ".join(sorted(new)))


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
        return self._maps.get(name) or self.adopt(name, name)

    def array(self, name: str, shape, dtype, offset: int = 0) -> np.ndarray:
        return ndarray(self.get(name), shape, dtype, offset)

    def adopt(self, key: str, name: str) -> shared_memory.SharedMemory:
        """Segment ``name``, mapped and kept under ``key`` (``release(key)`` unmaps it): a
        host's copy of the master's block ``key`` (see ``hosts``)."""
        shm = self._maps.get(key)
        if shm is None:
            shm = self._maps[key] = attach(name)
        return shm

    def release(self, name: str) -> None:
        shm = self._maps.pop(name, None)
        if shm is not None:
            release(shm)

    def release_all(self, prefix: str = "") -> None:
        """Release every mapping whose name starts with ``prefix``."""
        for name in [n for n in self._maps if n.startswith(prefix)]:
            self.release(name)


class Scratch:
    """A reusable segment that this process owns and regrows on demand, under a new name; the old
    name is unlinked at once and reported by ``take_retired()`` for other processes to unmap."""

    def __init__(self, prefix: str, tag: str, what: str = "a shared-memory block") -> None:
        self._prefix, self._tag, self._what = prefix, tag, what
        self._shm: shared_memory.SharedMemory | None = None
        self._count = 0
        self._retired: list[str] = []

    @property
    def name(self) -> str | None:
        return None if self._shm is None else self._shm.name

    def ensure(self, nbytes: int) -> shared_memory.SharedMemory:
        """The segment, regrown to hold at least ``nbytes``; ``ShmSpaceError`` when
        /dev/shm or memory has no room for that (the old segment is gone then too)."""
        if self._shm is None or self._shm.size < nbytes:
            if self._shm is not None:  # first make room: the new one may only fit without it
                self._retired.append(self._shm.name)
                destroy(self._shm)
                self._shm = None
            self._count += 1
            name = f"{self._prefix}{self._tag}{self._count}"
            try:  # with room to grow, so that similar sizes reuse it
                self._shm = create(name, max(int(nbytes * 1.25), 4096), self._what)
            except ShmSpaceError:
                self._shm = create(name, nbytes, self._what)  # it may fit without the room
        return self._shm

    def take_retired(self) -> list[str]:
        retired, self._retired = self._retired, []
        return retired

    def has_retired(self) -> bool:
        return bool(self._retired)

    def destroy(self) -> None:
        if self._shm is not None:
            destroy(self._shm)
            self._shm = None


#: Blocks this process has mapped by name (in workers: everything the master sent).
ATTACHED = Attachments()

_process_lock = threading.Lock()


def process_prefix() -> str:
    """The name prefix of this process's blocks that outlive a group (``PROCESS``'s
    ``data_prefix``: a ``Data``'s, the ranks' copies of their replicas), made if there is
    none; ``synk.close()`` releases it."""
    with _process_lock:
        if PROCESS.data_prefix is None:
            PROCESS.data_prefix = Owner()
        return PROCESS.data_prefix.prefix


def _new_lock_in_child() -> None:
    """In a child made by ``os.fork()`` (which forgets the parent's blocks: ``PROCESS``),
    a lock another thread of the parent may have held is unlocked."""
    global _process_lock
    _process_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_lock_in_child)
