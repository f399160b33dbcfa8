"""What the ranks must hear of ``synk.Data`` with the master's next message (blocks to unmap,
where each changed ``Data`` lives now, which left the devices), and, on a rank, the latest
place of every ``Data`` the master changed::

    synk.data (master) -> PROCESS (released, moved, left_devices) -> take_updates (next
    request) -> apply_updates (each rank, before it runs anything)
"""
from __future__ import annotations

from .._process import PROCESS
from .shm import ATTACHED


def take_updates() -> tuple:
    """(block names to unmap, refs of changed Data, keys of Data whose device copies to
    drop) since the last call, for the ranks."""
    p = PROCESS
    if not (p.released or p.moved or p.left_devices):
        return (), (), ()  # the usual case
    taken = tuple(p.released), tuple(p.moved.values()), tuple(p.left_devices)
    p.forget_updates()
    return taken


def restore_updates(names, refs, left=()) -> None:
    """Put back updates taken for a message that could not be sent."""
    PROCESS.released[:0] = names
    for ref in refs:
        PROCESS.moved.setdefault(ref[0], ref)  # a newer change since then wins
    PROCESS.left_devices[:0] = left


def apply_updates(names, refs) -> None:
    """On a rank: unmap the blocks ``names`` and note where changed Data live now (the
    device copies of Data that left the devices are dropped by the caller)."""
    for name in names:
        ATTACHED.release(name)
    for ref in refs:
        PROCESS.data_places[ref[0]] = ref
