"""The blocks of this process's ``synk.Data``: their name prefix (and its lock), and what
happens when a block goes. The live ``Data`` and the prefix's owner are ``PROCESS``'s."""
from __future__ import annotations

import itertools
import os
from multiprocessing.shared_memory import SharedMemory

from ._process import PROCESS
from ._wire import shm as _shm
from ._wire.shm import ATTACHED

_numbers = itertools.count()


def new_name() -> str:
    """The name (before its random suffix) of a new block."""
    return f"{_shm.process_prefix()}d{next(_numbers)}"


def free_all() -> None:
    """Free every live ``Data`` of this process and give up their name prefix (used by
    ``synk.close()``; a later ``Data`` takes a new one)."""
    for d in list(PROCESS.live_data):
        d.free()
    owner = PROCESS.data_prefix
    if owner is not None:
        owner.release()  # (safe to repeat if interrupted)
        PROCESS.data_prefix = None


def gone(shm: SharedMemory, pid: int) -> None:
    """A ``Data``'s block is freed, replaced or collected: its maker removes it and has every
    rank, on every host, let go of it (a child made by ``os.fork()`` only unmaps it)."""
    _shm.destroy_if_made_by(shm, pid)
    if os.getpid() == pid:
        ATTACHED.release(shm.name)  # handles unpickled in this process, if any
        PROCESS.released.append(shm.name)
