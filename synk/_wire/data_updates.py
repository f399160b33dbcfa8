"""What the ranks must hear of ``synk.Data`` with the master's next message: the blocks to
unmap (freed or replaced), where each changed ``Data`` lives now, and which ``Data`` left
the devices; and, on a rank, the latest place of every ``Data`` the master changed.

``synk.data`` records the changes here; the call path takes them into its next request
(``take_updates``) and each rank applies them (``apply_updates``) before it runs anything.
"""
from __future__ import annotations

import os

from .shm import ATTACHED

# Master: what the ranks must hear at their next message.
released: list[str] = []  # blocks freed or replaced: unmap them
moved: dict[int, tuple] = {}  # key -> ref of each Data whose block, shape or dtype changed
left_devices: list[int] = []  # keys of Data no longer resident on the devices: drop the copies
# Master: called with the key of a Data that leaves the devices (the master's own copy goes).
left_device_hooks: list = []
# Worker: the latest ref of every Data the master has changed.
current: dict[int, tuple] = {}


def take_updates() -> tuple:
    """(block names to unmap, refs of changed Data, keys of Data whose device copies to
    drop) since the last call, for the ranks."""
    if not (released or moved or left_devices):
        return (), (), ()  # the usual case
    taken = tuple(released), tuple(moved.values()), tuple(left_devices)
    forget()
    return taken


def restore_updates(names, refs, left=()) -> None:
    """Put back updates taken for a message that could not be sent."""
    released[:0] = names
    for ref in refs:
        moved.setdefault(ref[0], ref)  # a newer change since then wins
    left_devices[:0] = left


def left_device(key: int) -> None:
    """A Data's device copies are to go (``to_host``, ``free``, or the Data was collected):
    the ranks hear of it with the next message, the master's own copy goes now."""
    left_devices.append(key)
    for hook in left_device_hooks:
        hook(key)


def apply_updates(names, refs) -> None:
    """On a rank: unmap the blocks ``names`` and note where changed Data live now (the
    device copies of Data that left the devices are dropped by the caller)."""
    for name in names:
        ATTACHED.release(name)
    for ref in refs:
        current[ref[0]] = ref


def forget() -> None:
    """Drop every pending update (taken, or in a child made by ``os.fork()``, whose
    parent's Data are not its own)."""
    del released[:]
    moved.clear()
    del left_devices[:]


os.register_at_fork(after_in_child=forget)
