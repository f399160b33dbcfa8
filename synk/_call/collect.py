"""Combining the ranks' outputs in the master.

Small outputs come back inside the reply and are combined by the master (``Combiner``). An
output of at least ``inline_output_bytes`` is left in its rank's shared-memory scratch
block and only its ``OutRef`` travels (``exports``). With up to four ranks the master
combines such outputs itself, reading the blocks in place. From five ranks
(``SYNK_PARALLEL_REDUCE_RANKS``, read in ``settings``) array ops run as a second, parallel
phase: the flat result is cut into one chunk per rank and every rank combines its chunk of
all the ranks' blocks into the master's result block (a shared-memory reduce-scatter; the
master's call runs that round: ``MasterCall``). Gather reads the blocks directly into the
concatenated result.
"""
from __future__ import annotations

import numpy as np

from .. import _tree
from .._reduction import (
    KINDS,
    NUMBER_OPS,
    PY,
    combine_into,
    combine_numbers,
    restore_kind,
    result_dtype,
    widest,
)
from .._wire import shm as _shm
from .._wire.arrays import dtype_token
from .._wire.shm import ATTACHED
from . import frames as _frames, ops as _ops
from .exports import aligned
from .port import Blocks
from .records import OutRef
from .rows import split_bounds

# Combining is bound by memory bandwidth. The master alone reads every rank's block once and
# writes the result once: (n + 1) passes. The parallel phase two costs every rank a share
# of that, but the master must first copy its own output into shared memory and then copy
# the result out of it: about 4 + (n + 1) / n passes on the master. It pays from 5 ranks
# (the default of SYNK_PARALLEL_REDUCE_RANKS).


_F64 = np.dtype(np.float64)


def _view(ref: OutRef) -> np.ndarray:
    return ATTACHED.array(ref.name, ref.shape, ref.dtype, ref.offset)


def _shape(value) -> tuple:
    return tuple(getattr(value, "shape", ()))  # (a number: a 0-d output, see wrap_output)


class Combiner:
    """The call's result from each rank's ``Share`` (None for ranks that had no rows).

    ``size`` 0: rank 0's share alone, computed without a group (``Function.local``): an
    output with op None is its value itself, not a list. ``combined``: {output index:
    result} of the outputs combined already, inside the shares (on the devices, or by MPI
    across hosts). From ``parallel_reduce_ranks``
    ranks, large outputs are combined in a second round (``parallel``), in which every rank
    runs its ``parallel_tasks``; ``result()`` then reads them."""

    def __init__(self, size: int, fname: str, reduce, shares: dict,
                 combined: dict | None = None, parallel_reduce_ranks: int = 1 << 30) -> None:
        self.shares = shares
        self.size = size
        self.parallel: list = []  # (output index, op, kind) combined in the second round
        self._layout: list = []  # the parallel outputs' places in the result block
        self._block: _shm.Scratch | None = None
        # (plain loops rather than comprehensions, and the usual cases of one output in
        # short: this runs in every call)
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
        self.ops = ops = _ops.share_ops(reduce, first, fname)
        if len(ops) == 1:
            op = ops[0]
            if op is None:  # one output, each rank's value as it is
                values = []
                for share in ranked:
                    values.append(share.outputs[0][1])
                self.results = [values if size else values[0]]
                return
            if op in NUMBER_OPS and not combined:
                number = _one_number(op, ranked)
                if number is not None:  # one number from every rank
                    self.results = [number]
                    return
        self.results = self._combined(fname, ranked, combined,
                                      size >= parallel_reduce_ranks and len(ranked) > 1)

    def _combined(self, fname: str, ranked: list, combined: dict | None,
                  in_parallel: bool) -> list:
        """Each output combined with its op (None for one left to the second round)."""
        ranks, size = self.ranks, self.size
        weights = [share.weight for share in ranked]
        results: list = []
        for i, op in enumerate(self.ops):
            kinds: list = []
            values: list = []
            for share in ranked:
                kind, value = share.outputs[i]
                kinds.append(kind)
                values.append(value)
            if op is None:
                results.append(values if size else values[0])
                continue
            if combined is not None and i in combined:
                results.append(combined[i])
                continue
            kind = widest(kinds)
            parts: list = []
            if _numbers(values):  # (a worker's float64 number travels as one)
                for w, v in zip(weights, values):
                    parts.append((w, float(v)))
                if op in NUMBER_OPS:  # (the usual case, in short)
                    results.append(_ops.number_as(combine_numbers(op, parts), kind))
                    continue
            else:
                shape = _shape(values[0])
                if op == "gather" or not _same_shape(values, shape):
                    _ops.check_shapes(op, {f"rank {r}": _shape(v) for r, v in zip(ranks, values)},
                                      i, fname)
                if op != "gather" and in_parallel and kind != PY and \
                        OutRef in set(map(type, values)):  # (Python numbers: here, checked)
                    results.append(None)
                    self.parallel.append((i, op, kind))
                    continue
                for w, v in zip(weights, values):
                    parts.append((w, _as_array(v)))
            results.append(_ops.combine_output(op, parts, kind))
        return results

    def parallel_tasks(self, blocks: Blocks) -> dict:
        """{rank: its tasks} of the second round: every rank combines one chunk of each
        large output into the result block (the master's own outputs put in shared memory
        first)."""
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


def _one_number(op: str, ranked: list):
    """The one output of ``ranked`` combined with ``op`` (of ``NUMBER_OPS``) where every
    rank's is a number: a Python float or a 0-d float64 array (combined as Python floats,
    as ``_combined`` does), or a 0-d array of one other float dtype (float32: a loss;
    combined as its numpy scalars, in that dtype); else None."""
    first = ranked[0].outputs[0][1]
    dtype = None
    if type(first) is np.ndarray and first.dtype.kind == "f" and first.dtype != _F64 \
            and first.dtype.isnative:
        dtype = first.dtype
    parts = []
    kind = 0
    for share in ranked:
        k, v = share.outputs[0]
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


def _numbers(values: list) -> bool:
    """Whether every value is a number (a float, or a 0-d float64 array)."""
    for v in values:
        if type(v) is not float and not (type(v) is np.ndarray and v.dtype == _F64
                                         and not v.ndim):
            return False
    return True


def _same_shape(values: list, shape: tuple) -> bool:
    """Whether every value has ``shape``."""
    for v in values:
        if _shape(v) != shape:
            return False
    return True


def _as_array(value) -> np.ndarray:
    if type(value) is np.ndarray:
        return value
    if isinstance(value, OutRef):
        return _view(value)
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
    shm = scratch.ensure(sum(aligned(shares[r].outputs[i][1].nbytes) for r, i in todo))
    blocks.retire(scratch.take_retired())
    staged, offset = {}, 0
    for r, i in todo:
        value = shares[r].outputs[i][1]
        _shm.ndarray(shm, value.shape, value.dtype, offset)[...] = value
        staged[(r, i)] = OutRef(shm.name, offset, value.shape, dtype_token(value.dtype))
        offset += aligned(value.nbytes)
    return staged


def run_tasks(tasks) -> None:
    """Combine chunks ``[lo, hi)`` of large outputs; run by every rank in phase two."""
    for op, (name, offset, dtype, n), srcs, lo, hi in tasks:
        out = ATTACHED.array(name, (n,), dtype, offset)
        views = [(w, ATTACHED.array(s, (n,), sd, so)[lo:hi]) for s, so, sd, w in srcs]
        combine_into(op, views, out[lo:hi])
