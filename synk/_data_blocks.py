"""The blocks of this process's ``synk.Data``: their name prefix (and its lock), the live
``Data``, and what happens when a block goes."""
from __future__ import annotations

import itertools
import os
import threading
import weakref
from multiprocessing.shared_memory import SharedMemory

from ._wire import data_updates as _updates, shm as _shm
from ._wire.shm import ATTACHED

_prefix_owner: _shm.Owner | None = None  # the name prefix (and its lock) of this process's blocks
_owner_lock = threading.Lock()
_keys = itertools.count()  # a Data's identity, kept across its blocks
_numbers = itertools.count()
live: weakref.WeakSet = weakref.WeakSet()  # every Data of this process not yet freed


def new_key() -> int:
    """A new ``Data``'s identity."""
    return next(_keys)


def new_name() -> str:
    """The name (before its random suffix) of a new block."""
    return f"{_prefix()}d{next(_numbers)}"


def free_all() -> None:
    """Free every live ``Data`` of this process and give up their name prefix (used by
    ``synk.close()``; a later ``Data`` takes a new one)."""
    global _prefix_owner
    for d in list(live):
        d.free()
    if _prefix_owner is not None:
        _prefix_owner.release()  # (safe to repeat if interrupted)
        _prefix_owner = None


def gone(shm: SharedMemory, pid: int) -> None:
    """A ``Data``'s block is freed, replaced or collected: its maker removes it and has every
    rank, on every host, let go of it (a child made by ``os.fork()`` only unmaps it)."""
    _shm.destroy_if_made_by(shm, pid)
    if os.getpid() == pid:
        ATTACHED.release(shm.name)  # handles unpickled in this process, if any
        _updates.released.append(shm.name)


def _prefix() -> str:
    global _prefix_owner
    with _owner_lock:
        if _prefix_owner is None:
            _prefix_owner = _shm.Owner()
        return _prefix_owner.prefix


def _forget_parent_blocks() -> None:
    """In a child made by ``os.fork()``: the parent's Data are not this process's to free
    (it may still read them), and its own blocks take a name prefix of their own."""
    global _prefix_owner, _owner_lock
    live.clear()  # (the pending updates are forgotten by data_updates)
    _prefix_owner, _owner_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_parent_blocks)
