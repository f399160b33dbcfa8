"""The host's fused allreduce (``Communicator.allreduce_many``): every rank's head and
buffers (``communicator.Packed``) combined buffer by buffer, each part packed straight where
its message goes.

::

    bytes read from the peers <= ONE_ROUND_TIMES * ONE_SHOT_BYTES
        one round: on the board, else one message to every peer       _one_round
    else, one buffer (one dtype: a model's gradients): heads inside
        the reduce-scatter's messages, chunks into the allgather's    _two_rounds_one_buffer
    else, the heads, then each buffer's reduce-scatter and allgather  two_rounds
"""
from __future__ import annotations

import functools

import numpy as np

from ... import _reduction
from ..._shares import split_bounds
from ..communicator import WRITTEN
from . import host_collectives as _c
from .host_collectives import (
    POST,
    Part,
    Views,
    board_post,
    everyones,
    post_chunk,
    reduce_local,
    two_rounds,
    wait_all,
)

_BYTES = np.dtype(np.uint8)  # what a message is, to the mesh

# The fused allreduce keeps its one round up to twice the bytes of one array's
# (``host_collectives.ONE_SHOT_BYTES``): its message is packed once, straight where the
# peers read it, where the two rounds pack every chunk apart. On 2 ranks a list of four
# float32 arrays is a quarter to a third faster in one round up to 8 MiB, summed or as a
# weighted mean (whose factor makes a buffer of 4 MiB one element longer), where one
# array's two rounds tie with one round from 6 MiB (docs/performance.md, "How the ranks
# exchange").
ONE_ROUND_TIMES = 2


def allreduce_many(mesh, rank: int, size: int, tag: tuple, packed, op: str, agree,
                   ticket=POST) -> list:
    """``Communicator.allreduce_many``, by one of the ways above (``ticket``: as
    ``allreduce``'s). The first exchange of every way goes under the collective's own tag,
    so ranks whose structures differ, and took different ways, meet there and raise
    (``_check_sizes``; the board's ``check_sends``) rather than wait for each other."""
    try:
        return _allreduce_many(mesh, rank, size, tag, packed, op, agree, ticket)
    except ValueError as error:
        if not _reduction.is_disagreement(error):
            raise
        mine = None if packed.passed is None else packed.passed()
        raise _c.named(mesh, rank, size, tag, error, mine) from None


def _allreduce_many(mesh, rank: int, size: int, tag: tuple, packed, op: str, agree,
                    ticket) -> list:
    if size == 1:
        buffers = packed.buffers  # (packed first: the head says how)
        weights = agree([packed.head])
        return [reduce_local(op, [b], weights) for b in buffers]
    one_round = _one_round_fits(packed, size)
    if ticket is POST:  # (before ``packed.buffers``: it may pack into the board)
        ticket = _post(mesh, tag, packed) if one_round else None
    if one_round:
        return _one_round(mesh, rank, size, tag, packed, op, agree, ticket)
    if packed.pack_part is not None and len(packed.buffer_bytes) == 1 and \
            _reduction.result_dtype(op, packed.dtypes) == packed.dtypes[0]:
        return [_two_rounds_one_buffer(mesh, rank, size, tag, packed, op, agree)]
    # (a mean's buffers are packed before the heads go: its head says whether they were
    # scaled)
    whole = packed.pack_part is None or op == _reduction.SCALED_SUM
    buffers = packed.buffers if whole else None
    heads = everyones(mesh, rank, size, tag, packed.head)
    if any(h.nbytes != packed.head.nbytes for h in heads):  # (a peer's other round)
        _check_sizes([h.nbytes for h in heads])
    weights = agree(heads)
    if buffers is not None:
        return [_c.allreduce(mesh, rank, size, tag + (i,), b, op, weights)
                for i, b in enumerate(buffers)]
    results = []  # (each rank's chunk of each buffer packed where its message goes)
    for g, (nbytes, dtype) in enumerate(zip(packed.buffer_bytes, packed.dtypes)):
        n = nbytes // dtype.itemsize
        bounds = split_bounds(n, size)
        chunks: list = [Part((bounds[p + 1] - bounds[p],), dtype,
                             functools.partial(packed.pack_part, g, bounds[p], bounds[p + 1]))
                        for p in range(size)]
        chunks[rank] = chunks[rank].array()
        results.append(two_rounds(mesh, rank, size, tag + (g,), chunks, bounds, (n,), op,
                                   weights))
    return results


_HEAD_BYTES = 64  # ahead of a reduce-scatter chunk: the head, padded to a cache line


def _two_rounds_one_buffer(mesh, rank: int, size: int, tag: tuple, packed, op: str,
                           agree) -> np.ndarray:
    """``packed``'s one buffer allreduced in two rounds, each chunk copied as few times as
    it can be: each reduce-scatter message is the head and the peer's chunk, packed into
    its shared memory (the heads need no round of their own); the reduced chunk (in rank
    order) is written into the allgather's message, and copied from there into the
    result."""
    dtype = packed.dtypes[0]
    n = packed.buffer_bytes[0] // dtype.itemsize
    bounds = split_bounds(n, size)
    head = packed.head.view(np.uint8)
    peers = [p for p in range(size) if p != rank]

    def rs_chunk(p: int) -> Part:
        def fill(view):  # (the head each chunk goes with: see ``Packed.pack_part``)
            sent = packed.pack_part(0, bounds[p], bounds[p + 1], view[_HEAD_BYTES:].view(dtype))
            view[:head.nbytes] = sent.view(np.uint8)
        return Part((_HEAD_BYTES + (bounds[p + 1] - bounds[p]) * dtype.itemsize,), _BYTES,
                    fill)

    ag = tag + ("ag",)  # (the reduce-scatter under ``tag`` itself: see ``allreduce_many``)
    sends = [post_chunk(mesh, p, tag, rs_chunk(p)) for p in peers]
    result = np.empty(n, dtype)
    own = result[bounds[rank]:bounds[rank + 1]]
    own_head = packed.pack_part(0, bounds[rank], bounds[rank + 1], own)
    with Views(mesh) as views:
        got = {r: views.take(r, tag) for r in peers}
        expected = _HEAD_BYTES + own.nbytes
        if any(m.nbytes != expected for m in got.values()):
            _check_sizes([expected if r == rank else got[r].nbytes for r in range(size)])
        weights = agree([own_head if r == rank else got[r][:head.nbytes].view(
            packed.head.dtype) for r in range(size)])
        parts = [own if r == rank else got[r][_HEAD_BYTES:].view(dtype) for r in range(size)]
        weighted = list(zip(weights or [1] * size, parts))

        def reduce_into(view) -> None:  # (not into ``own`` itself: it is one of the parts)
            _reduction.combine_into(op, weighted, view)
            own[...] = view  # (before the message is out: nobody writes it meanwhile)

        filled = getattr(mesh, "post_filled", None)
        first = None if filled is None else filled(peers[0], ag, own.shape, dtype, reduce_into)
        if first is None:
            reduce_into(np.empty_like(own))
            first = (mesh.post(peers[0], ag, own), None)
    wait_all(mesh, sends)
    sends = [first[0]] + [mesh.post(p, ag, own) for p in peers[1:]]
    _take_chunks(mesh, ag, peers, bounds, result)
    wait_all(mesh, sends)
    return result


def _take_chunks(mesh, tag: tuple, peers: list, bounds: tuple, result: np.ndarray) -> None:
    """Each peer's reduced chunk (under ``tag``) copied into its place in ``result``."""
    dtype = result.dtype
    with Views(mesh) as views:
        for r in peers:
            part = views.take(r, tag)
            if part.shape != (bounds[r + 1] - bounds[r],) or part.dtype != dtype:
                raise _reduction.disagreement(
                    f"rank {r} sent an allgather chunk of {part.shape} {part.dtype}, not "
                    f"({bounds[r + 1] - bounds[r]},) {dtype}")
            result[bounds[r]:bounds[r + 1]] = part


def many_post(mesh, size: int, tag: tuple, packed):
    """``allreduce_many``'s ticket (``board_post``): its one message, where it takes one
    round, packed straight into the board's slot where it can be."""
    return _post(mesh, tag, packed) if _one_round_fits(packed, size) else None


def _post(mesh, tag: tuple, packed):
    """``many_post`` of a collective that takes one round."""
    if packed.packs_into:  # (not packed yet: where the board does not take it, its message
        board = getattr(mesh, "board", None)  # will be packed where it goes)
        return None if board is None else board.post_into(tag, packed.nbytes, packed.pack_into)
    return board_post(mesh, tag, _message(packed), True)


def _one_round_fits(packed, size: int) -> bool:
    return sum(packed.buffer_bytes) * (size - 1) <= ONE_ROUND_TIMES * _c.ONE_SHOT_BYTES


def _message(packed) -> np.ndarray:
    """``packed``'s head and buffers as one message (``packed.message`` where it is)."""
    if packed.message is not None:
        return packed.message
    message = np.zeros(packed.nbytes, np.uint8)
    message[:packed.head.nbytes] = packed.head.view(np.uint8)
    for b, at in zip(packed.buffers, packed.offsets):
        message[at:at + b.nbytes] = b.reshape(-1).view(np.uint8)
    return message


def _check_sizes(sizes: list) -> None:
    """The ranks' fused messages' sizes (in rank order) must agree."""
    if len(set(sizes)) > 1:
        bad = [r for r, n in enumerate(sizes) if n != sizes[0]]
        raise _reduction.disagreement(
            f"the ranks passed different structures to allreduce (rank(s) {bad} sent other "
            "sizes: their keys, shapes or dtypes differ, or some gave weight= and others "
            "not); every rank must pass the same structure")


def _one_round(mesh, rank, size, tag, packed, op, agree, ticket) -> list:
    """Every rank's head and buffers in one message to every other rank (or on the
    board)."""
    if ticket is not None:  # (this rank's message is on the board: made by many_post)
        board = mesh.board
        try:
            return _combined_messages(board.collect(ticket).parts, packed, op, agree)
        finally:
            board.finished(ticket)
    peers = [p for p in range(size) if p != rank]
    sends: list = []
    if packed.packs_into:  # packed straight into the first peer's message where it can be
        sends = [post_chunk(mesh, peers[0], tag, Part((packed.nbytes,), _BYTES,
                                                      packed.pack_into))]
        peers = peers[1:]
    message = _message(packed)
    sends += [mesh.post(p, tag, message) for p in peers]
    with Views(mesh) as views:
        raw = [message if r == rank else views.take(r, tag) for r in range(size)]
        results = _combined_messages(raw, packed, op, agree)
    wait_all(mesh, sends)
    return results


def _combined_messages(raw: list, packed, op: str, agree) -> list:
    """Every rank's message (``raw``: uint8 arrays laid out as ``packed``'s, in rank
    order): the heads given to ``agree``, then each buffer combined over the ranks."""
    nbytes = raw[0].nbytes
    heads = []
    head = packed.head
    hbytes, hdtype = head.nbytes, head.dtype
    for m in raw:  # (plain loops rather than comprehensions: this runs in every call of it)
        if m.nbytes != nbytes:
            _check_sizes([m.nbytes for m in raw])
        heads.append(m[:hbytes].view(hdtype))
    weights = agree(heads)
    results: list = []
    into = packed.into
    for g, (dtype, at, n) in enumerate(zip(packed.dtypes, packed.offsets, packed.buffer_bytes)):
        parts = []
        for m in raw:
            parts.append(m[at:at + n].view(dtype))
        if into is None:
            results.append(reduce_local(op, parts, weights))
            continue
        for first, end, dest in into[g]:  # (straight into the caller's out= arrays)
            reduce_local(op, [p[first:end] for p in parts], weights, dest)
        results.append(WRITTEN)
    return results
