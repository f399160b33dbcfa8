"""Staging blocks: the shared memory that carries a function's plain-array arguments, one
block per function and argument label, reused from call to call and regrown when too small.
"""
from __future__ import annotations

from .._process import PROCESS
from .._wire import shm as _shm
from .._wire.arrays import SharedArray, dtype_token

# the most blocks a function keeps, unless its current call uses more (``trim``): a function
# called with ``*args`` of changing length would otherwise collect one per position
MAX_PER_FUNCTION = 8


class Staging:
    """The staging blocks of one group's functions: fid -> {label: Scratch}, least recent
    first. Blocks beyond ``MAX_PER_FUNCTION`` (``trim``) and all of a collected function's
    (``forget_collected``) are unlinked at once and named in ``retired``, which the next call
    takes to the workers so that they unmap them."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._blocks: dict[int, dict[str, _shm.Scratch]] = {}
        self._count = 0
        # (fid, label) -> (segment, shape, dtype, the view of it, its SharedArray) of the
        # last call, which the next call of the same shape reuses
        self._views: dict[tuple, tuple] = {}

    def stage(self, fid: int, label: str, arr, what: str, retired: list) -> tuple:
        """``arr`` copied into function ``fid``'s block for ``label``: (its
        ``SharedArray``, the view of the block holding it)."""
        shm = self.block(fid, label, arr.nbytes, what, retired)
        key = (fid, label)
        made = self._views.get(key)
        if made is None or made[0] is not shm or made[1] != arr.shape or made[2] != arr.dtype:
            view = _shm.ndarray(shm, arr.shape, arr.dtype)
            made = self._views[key] = (shm, arr.shape, arr.dtype, view,
                                       SharedArray(shm.name, arr.shape, dtype_token(arr.dtype)))
        made[3][...] = arr
        return made[4], made[3]

    def block(self, fid: int, label: str, nbytes: int, what: str, retired: list):
        """Function ``fid``'s block for ``label``, holding at least ``nbytes``."""
        blocks = self._blocks.setdefault(fid, {})
        scratch = blocks.pop(label, None)
        if scratch is None:
            self._count += 1
            scratch = _shm.Scratch(self._prefix, f"f{fid}-{self._count}-", what)
        blocks[label] = scratch  # now the most recently used
        try:
            return scratch.ensure(nbytes)
        finally:
            if scratch.has_retired():
                retired.extend(scratch.take_retired())

    def trim(self, fid: int, in_use: int, retired: list) -> None:
        """Give up function ``fid``'s least recently used blocks beyond the limit, never one
        of the ``in_use`` most recent (those of the call being prepared)."""
        blocks = self._blocks.get(fid)
        while blocks and len(blocks) > max(MAX_PER_FUNCTION, in_use):
            label = next(iter(blocks))
            self._views.pop((fid, label), None)
            self._give_up(blocks.pop(label), retired)

    def forget_collected(self, retired: list) -> None:
        """Give up every block of the functions collected since the last call."""
        dropped = PROCESS.staging_dropped
        while dropped:
            fid = dropped.pop()
            for label, scratch in self._blocks.pop(fid, {}).items():
                self._views.pop((fid, label), None)
                self._give_up(scratch, retired)

    @staticmethod
    def _give_up(scratch: _shm.Scratch, retired: list) -> None:
        name = scratch.name
        scratch.destroy()
        retired.extend(scratch.take_retired())
        if name is not None:
            retired.append(name)

    def destroy(self) -> None:
        self._views.clear()
        for blocks in self._blocks.values():
            for scratch in blocks.values():
                scratch.destroy()
        self._blocks.clear()


def upkeep(blocks, fid: int) -> None:
    """For a call that stages nothing, what staging its arguments does to the group's
    staging blocks (``blocks``: the group's ``collect.GroupBlocks``): those of collected
    functions, and function ``fid``'s beyond its limit, given up."""
    staging = blocks.scratch.get("in")
    if staging is not None:
        staging.forget_collected(blocks.retired)
        staging.trim(fid, 0, blocks.retired)
    elif PROCESS.staging_dropped:  # nothing was ever staged: no block to give up
        PROCESS.staging_dropped.clear()
