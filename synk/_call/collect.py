"""Combining the ranks' outputs in the master.

Small outputs come back inside the reply and are combined by the master. An output of at
least ``inline_output_bytes`` is left in its rank's shared-memory scratch block and only its
``OutRef`` travels. With up to four ranks the master combines such outputs itself, reading
the blocks in place. From five ranks (``SYNK_PARALLEL_REDUCE_RANKS``, read in ``settings``)
array ops run as a second, parallel phase: the flat result is cut into one chunk per rank
and every rank combines its chunk of all the ranks' blocks into the master's result block
(a shared-memory reduce-scatter). Gather reads the blocks directly into the concatenated result.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import _tree
from .._reduction import combine_into, combine_partials, partial, result_dtype, weights_of
from .._wire import protocol as P, shm as _shm
from .._wire.arrays import dtype_token, wrap_output
from .._wire.shm import ATTACHED
from . import ops as _ops
from .ops import DONE, Share
from .profile import COLLECTIVES
from .rows import split_bounds

_ALIGN = 64
# Combining is bound by memory bandwidth. The master alone reads every rank's block once and
# writes the result once: (n + 1) passes. The parallel phase two costs every rank a share
# of that, but the master must first copy its own output into shared memory and then copy
# the result out of it: about 4 + (n + 1) / n passes on the master. It pays from 5 ranks
# (the default of SYNK_PARALLEL_REDUCE_RANKS).


class OutRef(NamedTuple):
    """An output left in shared memory: where it is and what it is."""

    name: str
    offset: int
    shape: tuple
    dtype: str


class HostPartial(NamedTuple):
    """Under MPI, in the place of a host's first rank: its host's ranks' outputs combined
    there (``_reduction.partial``); the host's other ranks hold an ``Absorbed``."""

    array: np.ndarray
    dtypes: tuple  # the dtypes of the outputs it combines

    @property
    def shape(self) -> tuple:
        return self.array.shape


class Absorbed(NamedTuple):
    """An output that its host's first rank combined into a ``HostPartial``."""

    shape: tuple
    dtype: str


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def export(share: Share, ops, scratch: _shm.Scratch, limit: int, pack=wrap_output) -> tuple:
    """``share`` ready to send to the master as a plain tuple: outputs of at least ``limit``
    bytes (array ops and gather) moved into ``scratch`` and sent as ``OutRef``, the other
    array outputs passed through ``pack``."""
    big = [
        i for i, ((kind, value), op) in enumerate(zip(share.outputs, ops))
        if op is not None and kind != DONE and value.nbytes >= limit
    ]
    outputs = [(kind, pack(value) if op is not None and kind != DONE else value)
               for (kind, value), op in zip(share.outputs, ops)]
    if big:
        shm = scratch.ensure(sum(_aligned(share.outputs[i][1].nbytes) for i in big))
        offset = 0
        for i in big:
            kind, value = share.outputs[i]
            _shm.ndarray(shm, value.shape, value.dtype, offset)[...] = value
            outputs[i] = (kind, OutRef(shm.name, offset, value.shape, dtype_token(value.dtype)))
            offset += _aligned(value.nbytes)
    return (share.weight, share.multi, tuple(outputs))


def export_master(group, fname: str, reduce, share: Share) -> Share:
    """Move rank 0's large outputs into shared memory while the workers do the same with
    theirs, rather than after (the parallel phase two needs every rank's in shared memory)."""
    if group.size < group.parallel_reduce_ranks:
        return share  # the master combines alone, reading its own outputs where they are
    ops = _ops.share_ops(reduce, share.multi, len(share.outputs), fname)
    if not any(op is not None and k != DONE and v.nbytes >= group.inline_output_bytes
               for (k, v), op in zip(share.outputs, ops)):
        return share
    scratch = group.scratch.setdefault(
        "share", _shm.Scratch(group.prefix, "r0-share", "rank 0's outputs"))
    share = Share(*export(share, ops, scratch, group.inline_output_bytes, pack=lambda v: v))
    retire(group, scratch.take_retired())
    return share


def _view(ref: OutRef) -> np.ndarray:
    return ATTACHED.array(ref.name, ref.shape, ref.dtype, ref.offset)


def _shape(value) -> tuple:
    return tuple(getattr(value, "shape", ()))  # (a number: a 0-d output, see wrap_output)


def collect(group, fname: str, reduce, shares: dict, profile=None, combined=None):
    """The call's result from each rank's ``Share`` (None for ranks that had no rows).
    ``group`` None: rank 0's share alone, computed without a group (``Function.local``).
    ``combined``: {output index: result} of the outputs combined on the devices already."""
    ranks = [r for r in sorted(shares) if shares[r] is not None]
    ranked = [shares[r] for r in ranks]
    first = ranked[0]
    n_out = len(first.outputs)
    for share in ranked:
        if share.multi != first.multi or len(share.outputs) != n_out:
            _ops.check_same_outputs(fname, {r: (shares[r].multi, len(shares[r].outputs))
                                            for r in ranks})
    ops = _ops.share_ops(reduce, first.multi, n_out, fname)
    results, parallel = [], []
    for i, op in enumerate(ops):
        outs = [share.outputs[i] for share in ranked]
        values = [value for _, value in outs]
        if op is None:
            results.append(values if group is not None else values[0])
            continue
        if combined is not None:
            results.append(combined[i])
            continue
        kind = max([k for k, _ in outs])
        shapes = [_shape(v) for v in values]
        if op == "gather" or shapes.count(shapes[0]) != len(shapes):
            _ops.check_shapes(op, {f"rank {r}": s for r, s in zip(ranks, shapes)}, i, fname)
        types = set(map(type, values))
        if HostPartial in types:
            results.append(_by_host(op, kind, [share.weight for share in ranked], values))
        elif (op != "gather" and group is not None and group.size >= group.parallel_reduce_ranks
                and len(values) > 1 and OutRef in types):
            results.append(None)
            parallel.append((i, op, kind))
        else:
            parts = [(share.weight, _as_array(v)) for share, v in zip(ranked, values)]
            results.append(_ops.combine_output(op, parts, kind))
    if parallel:
        _reduce_in_parallel(group, shares, ranks, parallel, results, profile)
    if isinstance(first.multi, tuple):  # structured outputs: leaves back in their places
        multi, templates = first.multi
        leaves = iter(results)
        results = [_tree.rebuild(t, leaves) for t in templates]
        return tuple(results) if multi else results[0]
    return tuple(results) if first.multi else results[0]


def _by_host(op, kind: int, weights: list, values: list):
    """An output that other hosts combined in part (``HostPartial``): the master's own
    parts (its host's ranks', and those of hosts of one rank) as one partial, in rank
    order, then the hosts' partials, in host order (``_reduction.partial``)."""
    total = 0.0
    if op == "mean":  # (the hosts' partials were made with these weights too)
        weights, total = weights_of([(w, None) for w in weights])
    mine = [(w, _as_array(v)) for w, v in zip(weights, values)
            if type(v) not in (HostPartial, Absorbed)]
    partials = [v for v in values if type(v) is HostPartial]
    dtype = result_dtype(op, [v.dtype for _, v in mine]
                         + [np.dtype(d) for p in partials for d in p.dtypes])
    arrays = [p.array for p in partials]
    if mine:
        arrays.insert(0, partial(op, mine, dtype))
    return _ops.restore_kind(combine_partials(op, arrays, total, dtype), kind)


def _as_array(value) -> np.ndarray:
    if type(value) is np.ndarray:
        return value
    if isinstance(value, OutRef):
        return _view(value)
    return value if isinstance(value, np.ndarray) else np.asarray(value)


def _reduce_in_parallel(group, shares, ranks, parallel, results, profile) -> None:
    """Phase two: every rank combines one chunk of each large output into the result block."""
    staged = _stage_master_values(group, shares, ranks, parallel)
    layout, total = [], 0
    for i, op, kind in parallel:
        refs = [staged.get((r, i)) or shares[r].outputs[i][1] for r in ranks]
        dtype = result_dtype(op, [np.dtype(ref.dtype) for ref in refs])
        layout.append((i, op, kind, refs, dtype, total))
        total += _aligned(int(np.prod(refs[0].shape, dtype=np.int64)) * dtype.itemsize)
    result = group.scratch.setdefault(
        "result", _shm.Scratch(group.prefix, "r0-result", "the combined outputs"))
    shm = result.ensure(total)
    retire(group, result.take_retired())
    tasks = {rank: [] for rank in range(group.size)}
    for _i, op, _kind, refs, dtype, offset in layout:
        n = int(np.prod(refs[0].shape, dtype=np.int64))
        bounds = split_bounds(n, group.size)
        srcs = [(ref.name, ref.offset, ref.dtype, shares[r].weight) for r, ref in zip(ranks, refs)]
        for rank in range(group.size):
            lo, hi = bounds[rank], bounds[rank + 1]
            if hi > lo:
                tasks[rank].append((op, (shm.name, offset, dtype.str, n), srcs, lo, hi))
    rid = group.next_round()
    for rank in group.workers:
        group.send((rank,), P.request(P.REDUCE, tasks[rank]), "while combining outputs", rid)
    error = None
    try:
        run_tasks(tasks[0])
    except Exception as exc:
        error = exc
    replies = group.recv(group.workers, "while combining outputs")
    if error is not None:
        raise error
    for rank, reply in sorted(replies.items()):
        failed = P.failure(reply, rank)
        if failed is not None:
            raise failed
        if profile is not None:
            profile.add(rank, COLLECTIVES, reply[1])
    for i, _op, kind, refs, dtype, offset in layout:
        view = _shm.ndarray(shm, refs[0].shape, dtype, offset)
        results[i] = _ops.restore_kind(view.copy(), kind)


def _stage_master_values(group, shares, ranks, parallel) -> dict:
    """Put outputs that are not yet in shared memory (the master's own, small ones) there."""
    todo = [
        (r, i) for i, _, _ in parallel for r in ranks
        if not isinstance(shares[r].outputs[i][1], OutRef)
    ]
    if not todo:
        return {}
    scratch = group.scratch.setdefault(
        "out", _shm.Scratch(group.prefix, "r0-out", "rank 0's outputs"))
    shm = scratch.ensure(sum(_aligned(shares[r].outputs[i][1].nbytes) for r, i in todo))
    retire(group, scratch.take_retired())
    staged, offset = {}, 0
    for r, i in todo:
        value = shares[r].outputs[i][1]
        _shm.ndarray(shm, value.shape, value.dtype, offset)[...] = value
        staged[(r, i)] = OutRef(shm.name, offset, value.shape, dtype_token(value.dtype))
        offset += _aligned(value.nbytes)
    return staged


def retire(group, names) -> None:
    """Blocks replaced by larger ones: unmap them here, and have every rank unmap them with
    its next message (any rank may have mapped them while combining outputs)."""
    for name in names:
        ATTACHED.release(name)
    group.retired.extend(names)


def run_tasks(tasks) -> None:
    """Combine chunks ``[lo, hi)`` of large outputs; run by every rank in phase two."""
    for op, (name, offset, dtype, n), srcs, lo, hi in tasks:
        out = ATTACHED.array(name, (n,), dtype, offset)
        views = [(w, ATTACHED.array(s, (n,), sd, so)[lo:hi]) for s, so, sd, w in srcs]
        combine_into(op, views, out[lo:hi])
