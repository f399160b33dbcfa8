"""A GPU rank's writes into a ``Data``, landed where a CPU rank's land.

On CPU ranks a ``Data`` input (scattered rows, or the whole array broadcast) is a writable
view of shared memory, so the function's writes land in the ``Data`` at once. A GPU rank
gets device copies, which CuPy cannot make read-only: its writes would be lost without a
word. So each device copy of writable host memory (a ``Data`` on one host; plain numpy
inputs reach functions read-only, and so does a ``Data`` across hosts) is kept beside a
snapshot taken on the device, and when the function returns, the bytes that differ are
copied back into the ``Data``, element by element, so that ranks writing different elements
of one array (as on CPU ranks) do not overwrite each other. Rows picked by an index
(``batch=`` an index array, ``local_batch=``) are copies on CPU ranks too: not written back.
A call that raises writes nothing back. The cost, where a ``Data`` is an
input: a device-to-device copy of its rows, one comparison on the device and a 1-byte
device-to-host copy per piece (the last piece's, with the whole arrays', once the rank's
streams are idle at the end of its share: no wait of its own); the changed values' copy back
only when something changed.
"""
from __future__ import annotations

import numpy as np


class WriteBack:
    """The device copies of writable host memory given to one piece of ``fn`` (or to every
    piece, for broadcast inputs), and where each came from."""

    __slots__ = ("device", "watched")

    def __init__(self, device) -> None:
        self.device = device
        self.watched: list = []  # (device array, its snapshot, host target)

    def watch(self, copy, target) -> None:
        """``copy`` (a C-contiguous device array) came from ``target``, a writable numpy
        array of its shape (rows picked by an index are copies on CPU ranks too: not
        watched)."""
        if copy.size:
            self.watched.append((copy, copy.copy(), target))

    def watches(self, copy) -> bool:
        """Whether ``copy`` is one of the device copies watched here."""
        return any(c is copy for c, _, _ in self.watched)

    def take(self, other: WriteBack) -> None:
        """Check ``other``'s copies with these, at ``finish``."""
        self.watched += other.watched
        other.watched = []

    def finish(self) -> None:
        """Write back what ``fn`` changed (call after it returned, on the rank's stream)."""
        if not self.watched:
            return
        xp, device = self.device.xp, self.device
        masks = [_bytes(copy, xp) != _bytes(snapshot, xp) for copy, snapshot, _ in self.watched]
        changed = device.to_host(xp.stack([m.any() for m in masks]))
        for (copy, _, target), mask, written in zip(self.watched, masks, changed):
            if written:
                _land(device.to_host(copy), device.to_host(mask), target)
        self.watched.clear()


def _bytes(a, xp):
    return a.reshape(-1).view(xp.uint8)


def _land(values: np.ndarray, byte_mask: np.ndarray, target: np.ndarray) -> None:
    """The elements of ``values`` whose bytes ``byte_mask`` marks, into ``target``."""
    elements = byte_mask.reshape(values.shape + (values.dtype.itemsize,)).any(axis=-1)
    np.copyto(target, values, where=elements)
