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

Host arrays, small in all: one round. Every rank sends every other one message holding the
digest, its weight and all its buffers, and combines what it gets in rank order (the same
bits on every rank). Larger: the digests and weights are exchanged first, then each buffer
goes through ``_collectives.allreduce`` (one round or reduce-scatter + allgather by size).
Device arrays (GPU ranks): the digests and weights go over the host transport, the buffers
are fused on the device and reduced on NCCL.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np

from .. import _reduction
from . import _collectives as _c

_HEAD = 2  # int64 words ahead of a rank's message: the structure's digest, its weight


def flatten(tree, path: tuple = ()):
    """(leaves, a description of the structure): lists, tuples and dicts are walked (dicts
    in their order), anything else is a leaf."""
    if isinstance(tree, dict):
        leaves, shapes = [], []
        for key, value in tree.items():
            sub, shape = flatten(value, path + (key,))
            leaves += sub
            shapes.append((repr(key), shape))
        return leaves, ("dict", tuple(shapes))
    if isinstance(tree, (list, tuple)):
        leaves, shapes = [], []
        for i, value in enumerate(tree):
            sub, shape = flatten(value, path + (i,))
            leaves += sub
            shapes.append(shape)
        return leaves, (type(tree).__name__, tuple(shapes))
    return [tree], None


def rebuild(tree, leaves: list):
    """``tree``'s structure with ``leaves`` (consumed from the front) in place of its own."""
    if isinstance(tree, dict):
        return {key: rebuild(value, leaves) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [rebuild(value, leaves) for value in tree]
        if isinstance(tree, list):
            return items
        if hasattr(tree, "_fields"):  # a named tuple
            return type(tree)(*items)
        return type(tree)(items)
    return leaves.pop(0)


def _digest(structure, arrays) -> int:
    """A 63-bit digest of the structure, shapes and dtypes, equal on ranks that agree."""
    text = repr((structure, [(a.shape, a.dtype.str) for a in arrays]))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


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


def _agree(heads, size: int) -> list | None:
    """Check the ranks' headers; the weights (None when no rank gave one)."""
    digests = {int(h[0]) for h in heads}
    if len(digests) > 1:
        raise ValueError("the ranks passed different structures to allreduce (their keys, "
                         "shapes or dtypes differ); every rank must pass the same structure")
    weights = [float(h[1:2].view(np.float64)[0]) for h in heads]
    given = [not math.isnan(w) for w in weights]
    if not any(given):
        return None
    if not all(given):
        missing = [r for r in range(size) if not given[r]]
        raise ValueError(f"allreduce: rank(s) {missing} gave no weight= while others did; "
                         "give every rank its weight (0 for a rank with no rows)")
    if not sum(weights) > 0:
        raise ValueError("allreduce: the weights sum to 0 on every rank, so there is nothing "
                         "to average")
    return weights


def allreduce(mesh, rank: int, size: int, tag: tuple, tree, op: str, weight):
    """The host form: ``tree`` (an array or a structure of them) reduced with ``op``."""
    leaves, structure = flatten(tree)
    arrays = [np.asarray(x) for x in leaves]  # (their dtypes checked by synk.comm.allreduce)
    groups = _groups(arrays)
    head = _header(_digest(structure, arrays), weight)
    buffers = [_fuse([arrays[i] for i in idx]) for idx in groups.values()]
    total = sum(b.nbytes for b in buffers)
    if size == 1:
        weights = _agree([head], 1)
        results = [_reduce_local(op, [b], weights) for b in buffers]
    elif total * (size - 1) <= _c.ONE_SHOT_BYTES:
        results = _one_round(mesh, rank, size, tag, head, buffers, op)
    else:
        heads = _c._everyones(mesh, rank, size, tag + ("head",), head)
        weights = _agree(heads, size)
        results = [_c.allreduce(mesh, rank, size, tag + (i,), b, op, weights)
                   for i, b in enumerate(buffers)]
    out: list = [None] * len(arrays)
    for idx, result in zip(groups.values(), results):
        for i, part in zip(idx, _split(result, [arrays[i] for i in idx])):
            # (a number stays one)
            out[i] = _reduction.restore_kind(part, _reduction.kind_of(leaves[i]))
    if structure is None:
        return out[0]
    return rebuild(tree, out)


def _fuse(arrays: list) -> np.ndarray:
    if len(arrays) == 1:
        return np.ascontiguousarray(arrays[0]).reshape(-1)
    return np.concatenate([a.reshape(-1) for a in arrays])


def _split(flat, arrays: list) -> list:
    """``flat`` cut back into arrays shaped as ``arrays`` (views of it)."""
    parts, at = [], 0
    for a in arrays:
        parts.append(flat[at:at + a.size].reshape(a.shape))
        at += a.size
    return parts


def _reduce_local(op: str, parts: list, weights) -> np.ndarray:
    weights = weights or [1.0] * len(parts)
    if len(parts) == 1 and op != "mean":
        return parts[0].copy()
    result = np.empty(parts[0].shape, _reduction.result_dtype(op, [p.dtype for p in parts]))
    _reduction.combine_into(op, list(zip(weights, parts)), result)
    return result


def _one_round(mesh, rank, size, tag, head, buffers, op) -> list:
    """Every rank's header and buffers in one message to every other rank."""
    chunks, offsets, at = [head.view(np.uint8)], [], head.nbytes
    for b in buffers:
        pad = -at % 16
        if pad:
            chunks.append(np.zeros(pad, np.uint8))
        at += pad
        offsets.append(at)
        chunks.append(b.view(np.uint8) if b.size else np.empty(0, np.uint8))
        at += b.nbytes
    message = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
    sends = [mesh.post(p, tag, message) for p in range(size) if p != rank]
    with _c._Views(mesh) as views:
        raw = [message if r == rank else views.take(r, tag) for r in range(size)]
        if any(m.nbytes != message.nbytes for m in raw):
            bad = [r for r, m in enumerate(raw) if m.nbytes != message.nbytes]
            raise ValueError(f"the ranks passed different structures to allreduce (rank(s) "
                             f"{bad} sent other sizes); every rank must pass the same "
                             "structure")
        heads = [np.frombuffer(m, np.int64, _HEAD) for m in raw]
        weights = _agree(heads, size)
        results = []
        for b, offset in zip(buffers, offsets):
            parts = [np.frombuffer(m, b.dtype, b.size, offset) for m in raw]
            results.append(_reduce_local(op, parts, weights))
    _c._wait_all(mesh, sends)
    return results


def _mean_of(weight_sum: float, dtype):
    """What makes a weighted mean of the summed terms."""
    return lambda total: _reduction.mean_finish(total, weight_sum, dtype)


class _Later:
    """A non-blocking fused reduction: ``wait()`` waits on its NCCL operations and
    returns the structure."""

    def __init__(self, finish) -> None:
        self.wait = finish


def allreduce_device(context, tag: tuple, tree, op: str, weight, wait: bool = True):
    """The device form (GPU ranks): fused on the device, reduced on NCCL; the digests and
    weights go over the host transport first. ``wait=False``: the NCCL operations are
    launched on the transport's stream and a handle is returned (see ``_Later``)."""
    from . import _device

    device = context.device
    xp = device.xp
    leaves, structure = flatten(tree)
    if not all(device.is_device_array(x) for x in leaves):
        raise TypeError("allreduce got a mix of device and host arrays; pass all of them on "
                        "the device (or all as numpy arrays)")
    arrays = leaves
    head = _header(_digest(structure, arrays), weight)
    if context.size > 1:
        heads = _c._everyones(context.mesh, context.rank, context.size, tag + ("head",), head)
    else:
        heads = [head]
    weights = _agree(heads, context.size)
    groups = _groups(arrays)
    out: list = [None] * len(arrays)
    launched = []
    for idx in groups.values():
        group = [arrays[i] for i in idx]
        flat = group[0].reshape(-1) if len(group) == 1 else xp.concatenate(
            [a.reshape(-1) for a in group])
        if weights is not None:  # the rule of every back end (synk._reduction)
            term = _reduction.mean_term(xp, flat, weights[context.rank])
            result = _device.allreduce(context, term, "sum", wait=wait)
            done = _mean_of(sum(weights), _reduction.mean_dtype([flat.dtype]))
        else:
            result = _device.allreduce(context, flat, op, wait=wait)
            done = None
        launched.append((idx, group, result, done))

    def finish():
        for idx, group, result, done in launched:
            total = result if wait else result.wait()
            if done is not None:
                total = done(total)
            for i, part in zip(idx, _split(total, group)):
                out[i] = part
        return out[0] if structure is None else rebuild(tree, out)

    return finish() if wait else _Later(finish)
