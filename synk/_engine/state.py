"""Process-wide state: the running group (in the master) and this process's rank."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from ..errors import NotForkedError, ReentrantCallError

if TYPE_CHECKING:
    from .group import Group

group: Group | None = None  # the master's running group, or None
generation = 0  # bumped by every fork(), so functions know where they were shipped
functions: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # fid -> Function
forgotten: list[int] = []  # fids of collected functions, for the workers to drop
rank, size = 0, 1
worker = False  # this process is a worker (synk functions are called from the master only)


def set_rank(r: int, n: int) -> None:
    global rank, size
    rank, size = r, n


def require_group():
    """The running group, or a clear error saying how to get one."""
    if worker:
        raise ReentrantCallError(
            f"a synk function (or distribute, a collective...) was called on rank {rank}, "
            "inside a synk function: the ranks are busy with that call. Call synk functions "
            "from the master only, or use synk.comm inside the function to talk to the "
            "other ranks"
        )
    if group is None:
        raise NotForkedError(
            "no synk group is running: call synk.fork() before calling or distributing "
            "synk functions" + (" (the last group was closed)" if generation else "")
        )
    return group
