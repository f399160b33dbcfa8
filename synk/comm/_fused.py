"""``allreduce`` of a structure of arrays (a list, tuple or dict, nested), fused, and the
weighted mean.

The leaves are packed into one buffer per dtype, as Horovod's tensor fusion and PyTorch
DDP's buckets do, so that a model's gradients cost one collective per dtype rather than one
per array. Every rank must pass the same structure (keys, shapes, dtypes): a digest of it
travels with the data, and ranks whose structures differ raise ``ValueError`` on every rank
rather than combine arrays that do not belong together.

``weight=`` (``op="mean"`` only) is this rank's share of the average, typically its row
count: the result is sum(w_r * x_r) / sum(w_r), so that uneven shares average exactly as one
process over all the rows would. A rank with weight 0 contributes nothing.

Written once, for any communicator: the leaves are fused with its array module and handed to
its ``allreduce_many`` with a header (the digest, this rank's weight). The host communicator
sends small ones in one round (each rank's header and buffers in one message, combined in
rank order: the same bits on every rank); the device ones send the headers through the host
and reduce each buffer on the devices.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from .. import _reduction, _tree
from . import _loc
from ._handle import Handle

_HEAD = 2  # int64 words ahead of a rank's message: the structure's digest, its weight


def _digest(structure, arrays) -> int:
    """A 63-bit digest of the structure, shapes and dtypes, equal on ranks that agree."""
    return _hash(repr((structure, [(a.shape, a.dtype.str) for a in arrays])))


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


_DTYPES = {np.dtype(c).num: np.dtype(c) for c in "?bBhHiIlLqQefdgFDG"}


def agree_on_array(comm, x, op: str, what: str):
    """``x`` once every rank has told the others its shape and dtype, for a communicator
    whose collectives do not check them (NCCL: counts that differ hang or overrun the
    buffers; equal counts over different shapes combine unrelated elements): the same
    ``ValueError`` on every rank when the shapes differ, and ``x`` in the dtype numpy's
    promotion gives over every rank's (as the host communicator combines them). One round
    of three words over the host; the shapes themselves go round only when they differ.
    (The one check of a single array's structure: what the fused buffers' digest is to a
    structure.)"""
    head = np.empty(3, np.int64)
    head[0] = _hash(repr(tuple(x.shape)))
    head[1], head[2] = x.dtype.num, x.dtype.itemsize
    heads = comm.host.allgather_heads(head)
    if len({int(h[0]) for h in heads}) > 1:
        shapes = comm.host.allgather_objects(tuple(x.shape), what)
        listing = ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
        raise ValueError(f"synk.comm.{what}: the ranks passed arrays of different shapes "
                         f"({listing}); op {op!r} needs the same shape on every rank")
    dtypes = {(int(h[1]), int(h[2])) for h in heads}
    if len(dtypes) > 1:
        common = np.result_type(*[_DTYPES.get(num, x.dtype) for num, _ in dtypes])
        x = x.astype(common, copy=False)
    return x


def check_weight(weight, op: str):
    if weight is None:
        return None
    if op != "mean":
        raise ValueError(f"weight= averages with op='mean'; op {op!r} takes no weight")
    try:
        w = float(weight)
    except (TypeError, ValueError):
        raise TypeError(f"weight must be a number (this rank's rows), not {weight!r}") from None
    if not (math.isfinite(w) and w >= 0) or isinstance(weight, bool):
        raise ValueError(f"weight must be a finite number >= 0 (this rank's rows), not {weight!r}")
    return w


def _groups(arrays) -> dict:
    """dtype -> indices of the leaves of that dtype, in order of first appearance."""
    groups: dict = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.dtype, []).append(i)
    return groups


def _header(digest: int, weight) -> np.ndarray:
    head = np.empty(_HEAD, np.int64)
    head[0] = digest
    head[1:2].view(np.float64)[0] = np.nan if weight is None else weight
    return head


def _agree(heads) -> list | None:
    """Check the ranks' headers; the weights (None when no rank gave one)."""
    digests = {int(h[0]) for h in heads}
    if len(digests) > 1:
        raise ValueError("the ranks passed different structures to allreduce (their keys, "
                         "shapes or dtypes differ); every rank must pass the same structure")
    weights = [float(h[1:2].view(np.float64)[0]) for h in heads]
    return agreed_weights([None if math.isnan(w) else w for w in weights], "allreduce")


def agreed_weights(weights: list, what: str) -> list | None:
    """Every rank's ``weight=`` of a mean (None where not given), checked: all or none
    given, not all 0. The weights, or None when no rank gave one."""
    given = [w is not None for w in weights]
    if not any(given):
        return None
    if not all(given):
        missing = [r for r, g in enumerate(given) if not g]
        raise ValueError(f"{what}: rank(s) {missing} gave no weight= while others did; "
                         "give every rank its weight (0 for a rank with no rows)")
    if not sum(weights) > 0:
        raise ValueError(f"{what}: the weights sum to 0 on every rank, so there is nothing "
                         "to average")
    return weights


def allreduce(comm, tree, op: str, weight, wait: bool = True, out=None):
    """``tree`` (an array or a structure of them) reduced with ``op`` on ``comm``, the
    communicator of its arrays (``weight``: this rank's, of a mean). ``wait=False``: a
    Handle of the result (launched at once where the transport overlaps). ``maxloc`` and
    ``minloc``: ``(values, ranks)`` of one array (``_loc``). ``out``: where an array's
    result may go (the caller delivers it there, ``_out``)."""
    if op in _reduction.LOC_OPS:
        return _loc.locate(comm, comm.host, tree, op, wait=wait)
    if weight is None and op != "mean" and (type(tree) is np.ndarray or (
            _reduction.kind_of(tree) == _reduction.ARR
            and not isinstance(tree, (list, tuple, dict)))):
        if not comm.checks_shapes:
            tree = agree_on_array(comm, tree, op, "iallreduce" if not wait else "allreduce")
        if wait:
            return comm.allreduce(tree, op, out=out)
        return comm.iallreduce(tree, op, out=out)
    leaves, structure = _tree.flatten(tree)
    xp = comm.xp
    arrays = [xp.asarray(x) for x in leaves]  # (their dtypes checked by synk.comm.allreduce)
    groups = _groups(arrays)
    head = _header(_digest(structure, arrays), weight)
    buffers = [_fuse(xp, [arrays[i] for i in idx]) for idx in groups.values()]

    def agree(heads: list):
        return _agree(heads)

    def finish(results: list):
        out: list = [None] * len(arrays)
        for idx, result in zip(groups.values(), results):
            for i, part in zip(idx, _split(result, [arrays[i] for i in idx])):
                # (a number stays one)
                out[i] = _reduction.restore_kind(part, _reduction.kind_of(leaves[i]))
        return out[0] if structure is None else _tree.rebuild(structure, iter(out))

    results = comm.allreduce_many(head, buffers, op, agree, wait)
    if wait:
        return finish(results)
    return Handle(lambda: finish(results.wait()))


def _fuse(xp, arrays: list):
    if len(arrays) == 1:
        return xp.ascontiguousarray(arrays[0]).reshape(-1)
    return xp.concatenate([a.reshape(-1) for a in arrays])


def _split(flat, arrays: list) -> list:
    """``flat`` cut back into arrays shaped as ``arrays`` (views of it)."""
    parts, at = [], 0
    for a in arrays:
        parts.append(flat[at:at + a.size].reshape(a.shape))
        at += a.size
    return parts
