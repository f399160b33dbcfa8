"""Where a rank leaves its large outputs for the master (the ``outputs.OutputSink`` of a rank
on the master's host), and the group's blocks that calls reuse.

An output of at least ``inline_output_bytes`` (array ops and gather) is copied into the
rank's scratch block of shared memory and only its ``OutRef`` travels in the reply; the
master reads it there in place (``collect``). Rank 0 moves its own large outputs there too,
while the workers do, when the outputs are combined in parallel (from
``parallel_reduce_ranks`` ranks: every rank then reads every rank's block). A submitted
call's outputs never go there (``InlineOutputs``, ``OwnOutputs``): the ranks may run the
next call before the master reads them.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

from .._reduction import Kind
from .._wire import shm as _shm
from .._wire.arrays import dtype_token, wrap_output
from .._wire.shm import ATTACHED
from .records import OutRef, Share

ALIGN = 64


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class GroupBlocks:
    """The master's blocks of a group that calls reuse (staging, output scratch...:
    ``scratch``, key -> an object with ``destroy()``), and the names of blocks replaced
    since the last request (``retired``), which every rank unmaps with the next one."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.scratch: dict = {}
        self.retired: list[str] = []

    def retire(self, names: Iterable[str]) -> None:
        """Blocks replaced by larger ones: unmap them here, and have every rank unmap them
        with its next message (any rank may have mapped them while combining outputs)."""
        for name in names:
            ATTACHED.release(name)
            self.retired.append(name)

    def scratch_block(self, key: str, tag: str, what: str) -> _shm.Scratch:
        """The group's reusable block ``key`` (made on first use)."""
        block = self.scratch.get(key)
        if block is None:
            block = self.scratch[key] = _shm.Scratch(self.prefix, tag, what)
        return block

    def destroy(self) -> None:
        for block in self.scratch.values():
            block.destroy()
        self.scratch.clear()


def export(share: Share, ops, scratch: _shm.Scratch | None, limit: float,
           pack=wrap_output) -> Share:
    """``share`` ready to send to the master: outputs of at least ``limit`` bytes (array ops
    and gather) moved into ``scratch`` and sent as ``OutRef``, the other array outputs
    passed through ``pack``."""
    done = Kind.DONE
    if len(ops) == 1:  # one output (the usual case, in short)
        kind, value = share.outputs[0]
        op = ops[0]
        if op is None or kind == done:
            return share
        if value.nbytes < limit:
            return share.replace_outputs(((kind, pack(value)),))
    big: list = []
    outputs: list | None = None  # (None while every output goes as it is)
    for i, ((kind, value), op) in enumerate(zip(share.outputs, ops)):
        if op is None or kind == done:
            if outputs is not None:
                outputs.append((kind, value))
            continue
        if outputs is None:
            outputs = list(share.outputs[:i])
        if value.nbytes >= limit:
            big.append(i)
        outputs.append((kind, pack(value)))
    if outputs is None:  # (outputs kept as they are: reduce=None, or done on the devices)
        return share
    if big:
        assert scratch is not None  # (``limit`` finite)
        shm = scratch.ensure(sum(aligned(share.outputs[i][1].nbytes) for i in big))
        offset = 0
        for i in big:
            kind, value = share.outputs[i]
            _shm.ndarray(shm, value.shape, value.dtype, offset)[...] = value
            outputs[i] = (kind, OutRef(shm.name, offset, value.shape, dtype_token(value.dtype)))
            offset += aligned(value.nbytes)
    return share.replace_outputs(outputs)


class ScratchOutputs:
    """A worker on the master's host: large outputs into its scratch block."""

    collective = False

    def __init__(self, scratch: _shm.Scratch, limit: int) -> None:
        self.scratch, self.limit = scratch, limit

    def export(self, share: Share, ops: tuple) -> Share:
        return export(share, ops, self.scratch, self.limit)


class InlineOutputs:
    """A worker's outputs of a submitted call: each rides the reply, whatever its size (the
    worker's scratch block may be written by the next call before the master reads this
    one's)."""

    collective = False

    @staticmethod
    def export(share: Share, ops: tuple) -> Share:
        return export(share, ops, None, math.inf)


class OwnOutputs:
    """Rank 0's outputs of a submitted call: left where they are (its next share must not
    write over them), and combined on the master alone."""

    collective = False

    @staticmethod
    def export(share: Share, ops: tuple) -> Share:
        return share


class MasterOutputs:
    """Rank 0: its large outputs into shared memory while the workers do the same with
    theirs, when the outputs are combined in parallel (phase two needs every rank's there);
    else left where they are, for the master combines them alone."""

    collective = False

    def __init__(self, blocks: GroupBlocks, size: int, parallel_reduce_ranks: int,
                 limit: int) -> None:
        self.blocks, self.limit = blocks, limit
        self.parallel = size >= parallel_reduce_ranks

    def export(self, share: Share, ops: tuple) -> Share:
        if not self.parallel or not any(
                op is not None and k != Kind.DONE and v.nbytes >= self.limit
                for (k, v), op in zip(share.outputs, ops)):
            return share
        scratch = self.blocks.scratch_block("share", "r0-share", "rank 0's outputs")
        share = export(share, ops, scratch, self.limit, pack=lambda v: v)
        self.blocks.retire(scratch.take_retired())
        return share
