"""Combining the ranks' outputs on one host: left in shared memory and combined by the
master, or combined on the devices with the communicator's collectives::

    a rank's outputs -- small --> in its reply ----------------------------> Combiner
                     -- large --> its scratch block (export), an OutRef in    (the master;
                                  the reply; read there in place              from five ranks
                                                                              a chunk a rank)
    on GPU ranks (NCCL) --------> finish: reduced or gathered into rank 0 on the devices
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from .. import _reduction, _tree
from .._reduction import (
    KINDS,
    NUMBER_OPS,
    PY,
    Kind,
    combine_into,
    combine_numbers,
    restore_kind,
    result_dtype,
    widest,
)
from .._wire import shm as _shm
from .._wire.arrays import dtype_token, wrap_output
from .._wire.shm import ATTACHED
from ..comm import context as _context
from ..comm.host import host_collectives as _collectives
from . import frames as _frames, ops as _ops
from .port import Blocks
from .records import DONE_OUTPUT, OutRef, Share
from .rows import split_bounds

# -- outputs left in shared memory -----------------------------------------------------------------

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
    and gather) moved into ``scratch`` and sent as ``OutRef`` (the master reads them there
    in place), the other array outputs passed through ``pack``."""
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
        refs = _place(scratch, [share.outputs[i][1] for i in big])
        for i, ref in zip(big, refs):
            outputs[i] = (share.outputs[i][0], ref)
    return share.replace_outputs(outputs)


def _place(scratch: _shm.Scratch, values: list) -> list:
    """The ``OutRef`` of each of ``values``, copied one after another into ``scratch``."""
    shm = scratch.ensure(sum(aligned(value.nbytes) for value in values))
    refs, offset = [], 0
    for value in values:
        _shm.ndarray(shm, value.shape, value.dtype, offset)[...] = value
        refs.append(OutRef(shm.name, offset, value.shape, dtype_token(value.dtype)))
        offset += aligned(value.nbytes)
    return refs


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
    one's), on the host: not combined on the devices inside the share (``pipelined``: the
    share does not wait for the others')."""

    collective = False
    pipelined = True

    @staticmethod
    def export(share: Share, ops: tuple) -> Share:
        return export(share, ops, None, math.inf)


class OwnOutputs:
    """Rank 0's outputs of a submitted call: left where they are, on its device too (its
    next share must not write over them), and combined on the master alone once the
    replies are read (``pipelined``)."""

    collective = False
    pipelined = True

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


# -- outputs combined on the devices ---------------------------------------------------------------

#: Outputs up to this size travel to rank 0 with their description and are combined on the
#: host: below it a device collective costs more (its launch, NCCL's latency, the waits)
#: than copying the value out on every rank.
SMALL_OUTPUT_BYTES = 4096


def _meta(device, share: Share | None, ops) -> tuple | None:
    """What this rank's outputs are (kind, shape, dtype and, for a small one, its value on
    the host), for the other ranks."""
    if share is None:
        return None
    outs = tuple(None if op is None else (
        int(kind), tuple(value.shape), value.dtype.str,
        _on_host(device, value) if value.nbytes <= SMALL_OUTPUT_BYTES else None)
        for (kind, value), op in zip(share.outputs, ops))
    return share.weight, share.layout(), outs


def _on_host(device, value) -> np.ndarray:
    return device.to_host(value) if device.is_device_array(value) else np.asarray(value)


def finish(device, context, share: Share | None, reduce, fname: str) -> tuple:
    """(the share to reply with, ``DONE_OUTPUT`` in place of the outputs combined on the devices,
    {output index: combined result} on rank 0 or None), where the communicator combines outputs with
    collectives. Every rank calls it, with rows or not. The ranks exchange their outputs' kinds and
    rows over the host mesh, so that each checks the shapes and plans the same collectives without
    the master. Arrays are reduced (a rank without rows sends the identity; means weighted by rows)
    or gathered into rank 0; ops the communicator cannot reduce for a dtype are gathered and
    combined by numpy's rules. Outputs up to ``SMALL_OUTPUT_BYTES`` on every rank ride the exchange:
    a scalar costs no collective."""
    device_comm = context.device_comm
    ops = None if share is None else _ops.share_ops(reduce, share, fname)
    metas = _collectives.allgather_objects(
        context.mesh, context.rank, context.size, _context.next_tag("synk outputs"),
        _meta(device, share, ops))
    have = [r for r, m in enumerate(metas) if m is not None]
    first = metas[have[0]]
    _ops.check_same_outputs(fname, {r: metas[r][1] for r in have})
    multi, templates, n_outputs = first[1]
    ops = _ops.share_ops(reduce, Share(0, multi, (None,) * n_outputs, templates), fname)
    combined, on_device = _combined_outputs(device, context, share, ops, metas, have, fname)
    if on_device:
        device_comm.synchronize()  # the buffers of the combining operations are let go
    if share is not None:
        share = share.replace_outputs(
            DONE_OUTPUT if op is not None else out for out, op in zip(share.outputs, ops))
    return share, (combined if context.rank == 0 else None)


def _combined_outputs(device, context, share: Share | None, ops: tuple, metas: list,
                      have: list, fname: str) -> tuple:
    """({output index: combined result} on rank 0, whether some were combined on the
    devices) of ``finish``: small outputs on the host, the others by the communicator."""
    combined: dict = {}
    on_device = False
    for i, op in enumerate(ops):
        if op is None:
            continue
        described = {r: metas[r][2][i] for r in have}
        _ops.check_shapes(op, {f"rank {r}": d[1] for r, d in described.items()}, i, fname)
        kind = widest([d[0] for d in described.values()])
        if all(d[3] is not None for d in described.values()):  # small everywhere: on the host
            if context.rank == 0:
                combined[i] = _ops.combine_output(
                    op, [(metas[r][0], described[r][3]) for r in have], kind)
            continue
        on_device = True
        mine = None if share is None else share.outputs[i][1]
        result = _combine(context.device_comm, op, mine, described,
                          {r: metas[r][0] for r in have}, context.size)
        if context.rank == 0:
            host = device.result_to_host(result) if device.is_device_array(result) else result
            combined[i] = host if op == "gather" else _ops.restore_kind(np.asarray(host), kind)
    return combined, on_device


def _combine(comm, op: str, mine, described: dict, weights: dict, size: int):
    """Output ``mine`` (None on a rank without rows) combined over the ranks with the
    communicator's ``reduce`` or ``gather``, on rank 0."""
    xp = comm.xp
    if mine is not None and not comm.device.is_device_array(mine):  # (small here, not
        mine = comm.device.to_device(np.asarray(mine))  # on another rank: on the devices)
    dtypes = [np.dtype(d[2]) for d in described.values()]
    shape = tuple(next(iter(described.values()))[1])
    if op == "gather":
        dtype = np.result_type(*dtypes)
        counts = [(described[r][1][0] if described[r][1] else 1) if r in described else 0
                  for r in range(size)]
        part = None if mine is None else xp.atleast_1d(mine).astype(dtype, copy=False)
        return comm.gather(part, counts, root=0, tail=shape[1:], dtype=dtype)
    dtype = _reduction.result_dtype(op, dtypes)
    if comm.supports(dtype, op):
        part = (xp.full(shape, _reduction.identity(op, dtype), dtype) if mine is None
                else mine.astype(dtype, copy=False))
        if op not in _reduction.MEANS:
            return comm.reduce(part, op, root=0)
        ranks = sorted(described)  # a rank without rows weighs nothing
        factors = dict(zip(ranks, _reduction.weights_of([(weights[r], None) for r in ranks])[0]))
        return comm.reduce(part, op, root=0, weights=[factors.get(r, 0) for r in range(size)])
    # the communicator cannot combine these (NCCL: complex prod/max/min, bitwise, logical):
    # gather the parts and combine them on rank 0, by the rule of every back end
    counts = [1 if r in described else 0 for r in range(size)]
    common = np.result_type(*dtypes)
    part = None if mine is None else mine.astype(common).reshape((1,) + shape)
    stacked = comm.gather(part, counts, root=0, tail=shape, dtype=common)
    if stacked is None:
        return None
    host = comm.to_host(stacked)
    parts = [(weights[r], host[j]) for j, r in enumerate(sorted(described))]
    return np.asarray(_reduction.combine(op, parts))


# -- outputs combined by the master ----------------------------------------------------------------

# Combining is bound by memory bandwidth. The master alone reads every rank's block once and
# writes the result once: (n + 1) passes. The parallel phase two costs every rank a share
# of that, but the master must first copy its own output into shared memory and then copy
# the result out of it: about 4 + (n + 1) / n passes on the master. It pays from 5 ranks
# (the default of SYNK_PARALLEL_REDUCE_RANKS).


_F64 = np.dtype(np.float64)


def _shape(value) -> tuple:
    return tuple(getattr(value, "shape", ()))  # (a number: a 0-d output, see wrap_output)


class Combiner:
    """The call's result from each rank's ``Share`` (None for ranks without rows). ``OutRef``
    outputs are read in place. From ``parallel_reduce_ranks`` ranks, array ops run in a second round
    (``parallel_tasks``): each rank combines one chunk into the master's result block. ``size`` 0:
    ``Function.local``, an op-None output is its value, not a list. ``combined``: {output index:
    result} of the outputs combined inside the shares."""

    def __init__(self, size: int, fname: str, reduce, shares: dict,
                 combined: dict | None = None, parallel_reduce_ranks: int = 1 << 30) -> None:
        self.shares = shares
        self.size = size
        self.parallel: list = []  # (output index, op, kind) combined in the second round
        self._layout: list = []  # the parallel outputs' places in the result block
        self._block: _shm.Scratch | None = None
        # (plain loops rather than comprehensions: this runs in every call)
        ranks: list = []
        ranked: list = []
        for r in sorted(shares):
            share = shares[r]
            if share is not None:
                ranks.append(r)
                ranked.append(share)
        self.ranks = ranks
        self.first = first = ranked[0]
        self.frames = first.frames
        outputs = first.outputs
        if len(ranked) > 1:
            multi, templates, n = first.multi, first.templates, len(outputs)
            for share in ranked:
                if share.multi != multi or share.templates != templates or \
                        len(share.outputs) != n:
                    _ops.check_same_outputs(fname, {r: shares[r].layout() for r in ranks})
                if self.frames is None:
                    self.frames = share.frames
        self.ops = _ops.share_ops(reduce, first, fname)
        self.results = self._combined(fname, ranked, combined,
                                      size >= parallel_reduce_ranks and len(ranked) > 1)

    def _combined(self, fname: str, ranked: list, combined: dict | None,
                  in_parallel: bool) -> list:
        """Each output combined with its op (None for one left to the second round)."""
        ranks, size = self.ranks, self.size
        results: list = []
        for i, op in enumerate(self.ops):
            values: list = []
            if op is None:  # each rank's value as it is
                for share in ranked:
                    values.append(share.outputs[i][1])
                results.append(values if size else values[0])
                continue
            if combined and i in combined:
                results.append(combined[i])
                continue
            if op in NUMBER_OPS:
                number = _one_number(op, ranked, i)
                if number is not None:  # one number from every rank
                    results.append(number)
                    continue
            kinds: list = []
            for share in ranked:
                kind, value = share.outputs[i]
                kinds.append(kind)
                values.append(value)
            kind = widest(kinds)
            shape = _shape(values[0])
            if op == "gather" or not _same_shape(values, shape):
                _ops.check_shapes(op, {f"rank {r}": _shape(v) for r, v in zip(ranks, values)},
                                  i, fname)
            if op != "gather" and in_parallel and kind != PY and \
                    OutRef in set(map(type, values)):  # (Python numbers: here, checked)
                results.append(None)
                self.parallel.append((i, op, kind))
                continue
            parts = [(share.weight, _as_array(v)) for share, v in zip(ranked, values)]
            results.append(_ops.combine_output(op, parts, kind))
        return results

    def parallel_tasks(self, blocks: Blocks) -> dict:
        """{rank: its tasks} of the second round: every rank combines one chunk of each large output
        into the result block (the master's own outputs put in shared memory first)."""
        shares, ranks = self.shares, self.ranks
        staged = _stage_master_values(blocks, shares, ranks, self.parallel)
        total = 0
        for i, op, kind in self.parallel:
            refs = [staged.get((r, i)) or shares[r].outputs[i][1] for r in ranks]
            dtype = result_dtype(op, [np.dtype(ref.dtype) for ref in refs])
            self._layout.append((i, op, kind, refs, dtype, total))
            total += aligned(int(np.prod(refs[0].shape, dtype=np.int64)) * dtype.itemsize)
        self._block = blocks.scratch_block("result", "r0-result", "the combined outputs")
        shm = self._block.ensure(total)
        blocks.retire(self._block.take_retired())
        tasks: dict = {rank: [] for rank in range(self.size)}
        for _i, op, _kind, refs, dtype, offset in self._layout:
            n = int(np.prod(refs[0].shape, dtype=np.int64))
            bounds = split_bounds(n, self.size)
            srcs = [(ref.name, ref.offset, ref.dtype, shares[r].weight)
                    for r, ref in zip(ranks, refs)]
            for rank in range(self.size):
                lo, hi = bounds[rank], bounds[rank + 1]
                if hi > lo:
                    tasks[rank].append((op, (shm.name, offset, dtype.str, n), srcs, lo, hi))
        return tasks

    def result(self):
        """The call's result, its outputs in the structures ``fn`` returned."""
        results = self.results
        if self._layout:
            shm = self._block.ensure(0)
            for i, _op, kind, refs, dtype, offset in self._layout:
                view = _shm.ndarray(shm, refs[0].shape, dtype, offset)
                results[i] = _ops.restore_kind(view.copy(), kind)
        if self.frames is not None:  # torch tensors, JAX arrays: given back as such
            results = _frames.restore_outputs(results, self.frames, self.ops)
        first = self.first
        if first.templates is not None:  # structured outputs: leaves back in their places
            leaves = iter(results)
            results = [_tree.rebuild(t, leaves) for t in first.templates]
        return tuple(results) if first.multi else results[0]


def _one_number(op: str, ranked: list, index: int):
    """Output ``index`` of ``ranked`` combined with ``op`` (of ``NUMBER_OPS``) where every
    rank's is a number: a Python float or a 0-d float64 array (a worker's float64 number
    travels as one; combined as Python floats), or a 0-d array of one other float dtype
    (float32: a loss; combined as its numpy scalars, in that dtype, as on arrays); else
    None."""
    first = ranked[0].outputs[index][1]
    dtype = None
    if type(first) is np.ndarray and first.dtype.kind == "f" and first.dtype != _F64 \
            and first.dtype.isnative:
        dtype = first.dtype
    parts = []
    kind = 0
    for share in ranked:
        k, v = share.outputs[index]
        if dtype is not None:
            if type(v) is not np.ndarray or v.ndim or v.dtype != dtype:
                return None
            v = v[()]
        elif type(v) is not float:
            if type(v) is np.ndarray and v.dtype == _F64 and not v.ndim:
                v = float(v)
            else:
                return None
        parts.append((share.weight, v))
        if k > kind:
            kind = k
    number = combine_numbers(op, parts, dtype)
    if dtype is None:
        return _ops.number_as(number, KINDS[kind])
    return restore_kind(np.asarray(number), kind)


def _same_shape(values: list, shape: tuple) -> bool:
    """Whether every value has ``shape``."""
    for v in values:
        if _shape(v) != shape:
            return False
    return True


def _as_array(value) -> np.ndarray:
    if type(value) is np.ndarray:
        return value
    if isinstance(value, OutRef):  # (read in place)
        return ATTACHED.array(value.name, value.shape, value.dtype, value.offset)
    return value if isinstance(value, np.ndarray) else np.asarray(value)


def _stage_master_values(blocks: Blocks, shares, ranks, parallel) -> dict:
    """Put outputs that are not yet in shared memory (the master's own, small ones) there."""
    todo = [
        (r, i) for i, _, _ in parallel for r in ranks
        if not isinstance(shares[r].outputs[i][1], OutRef)
    ]
    if not todo:
        return {}
    scratch = blocks.scratch_block("out", "r0-out", "rank 0's outputs")
    refs = _place(scratch, [shares[r].outputs[i][1] for r, i in todo])
    blocks.retire(scratch.take_retired())
    return dict(zip(todo, refs))


def run_tasks(tasks) -> None:
    """Combine chunks ``[lo, hi)`` of large outputs; run by every rank in phase two."""
    for op, (name, offset, dtype, n), srcs, lo, hi in tasks:
        out = ATTACHED.array(name, (n,), dtype, offset)
        views = [(w, ATTACHED.array(s, (n,), sd, so)[lo:hi]) for s, so, sd, w in srcs]
        combine_into(op, views, out[lo:hi])
