"""Collectives over the host's point-to-point messages, for one call's ranks: each takes the
mesh, this rank, the group size and a tag that every rank derived alike, so the ranks'
messages match whatever order they arrive in."""
from __future__ import annotations

import contextlib
import pickle
from collections.abc import Callable

import numpy as np

from ... import _reduction
from ..._shares import split_bounds
from ..._wire.arrays import dumps
from .. import passed as _passed
from ..communicator import usable

NUMBERS = "biufc"  # the dtype kinds a reduction takes: bool, integers, floats, complex
_NOT_NUMBERS = {"U": "strings", "S": "bytes", "O": "Python objects", "V": "records",
                "M": "datetimes", "m": "timedeltas"}


def check_numbers(x, what: str, op: str | None = None) -> None:
    """The one dtype rule of every reducing collective: ``x`` (an array, a device array or
    a scalar) must hold numbers, and numbers that ``op`` takes, else TypeError."""
    if type(x) is int and not -(1 << 63) <= x < 1 << 63:
        raise OverflowError(f"synk.comm.{what}: the Python int {x} is past the range of "
                            "int64, in which synk combines Python ints; pass a float")
    dtype = getattr(x, "dtype", None)
    if not isinstance(dtype, np.dtype):
        dtype = np.asarray(x).dtype
    if op is not None and dtype.kind in NUMBERS:
        _reduction.check_dtype(op, dtype, f"synk.comm.{what}")
    if dtype.kind not in NUMBERS:
        raise TypeError(
            f"synk.comm.{what}: reductions take numbers (bool, integers, floats, complex), "
            f"not dtype {dtype} ({_NOT_NUMBERS.get(dtype.kind, 'not numbers')}); convert the "
            "array to a numeric dtype, or move it unchanged with broadcast, allgather or send")


def _specs(parts: list) -> dict:
    return {r: (p.shape, p.dtype) for r, p in enumerate(parts)}


# An allreduce exchanges whole arrays (one round; every rank reads every array) while the
# bytes each rank reads from its peers stay under this; past it, a reduce-scatter then an
# allgather (two rounds; each rank reads about two arrays' worth whatever the ranks).
# On 2 ranks one round is faster up to 4 MiB (half the time at 4 KiB, 5% less at 1 MiB),
# two rounds from 16 MiB.
ONE_SHOT_BYTES = 4 << 20


class Views:
    """Messages taken without a copy (views of the senders' shared memory for large ones),
    handed back to their senders together."""

    def __init__(self, mesh) -> None:
        self.mesh = mesh
        self._done: list[Callable[[], None]] = []  # each view's hand-back

    def take(self, source: int, tag: tuple) -> np.ndarray:
        view, done = self.mesh.take_view(source, tag)
        self._done.append(done)
        return view

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        for done in self._done:
            done()


def wait_all(mesh, sends) -> None:
    for s in sends:
        mesh.wait_sent(s)


def everyones(mesh, rank: int, size: int, tag: tuple, x: np.ndarray) -> list:
    """Every rank's ``x``, in rank order."""
    return take_all(mesh, rank, size, tag, x, post_all(mesh, rank, size, tag, x))


def post_all(mesh, rank: int, size: int, tag: tuple, x: np.ndarray) -> list:
    """``x`` posted to every other rank (``everyones``' first half): the sends."""
    return [mesh.post(p, tag, x) for p in range(size) if p != rank]


def take_all(mesh, rank: int, size: int, tag: tuple, x: np.ndarray, sends: list) -> list:
    """Every rank's ``x``, in rank order, once ``post_all`` posted this rank's."""
    parts = [x if r == rank else mesh.take(r, tag) for r in range(size)]
    wait_all(mesh, sends)
    return parts


def allgather_objects(mesh, rank: int, size: int, tag: tuple, obj,
                      what: str = "synk.comm") -> list:
    """Every rank's ``obj`` (small, picklable), in rank order; pickled as every object
    synk sends to another rank (``dumps``: by cloudpickle where pickle cannot)."""
    if size == 1:
        return [obj]
    mine = np.frombuffer(dumps(obj, f"synk.comm.{what}'s object"), np.uint8)
    return [obj if r == rank else pickle.loads(part.tobytes())
            for r, part in enumerate(everyones(mesh, rank, size, tag, mine))]


POST = object()  # a collective's ``ticket``: post on the board now (blocking forms)


def board_post(mesh, tag: tuple, x: np.ndarray | None, inline: bool):
    """This rank's post of ``x`` on the mesh's board (``shm_board``), made where the
    collective starts (a non-blocking one's, before its lane runs it), or None where the
    collective takes messages (not ``inline``, past a slot, no board: MPI's mesh, a
    sub-group's)."""
    board = getattr(mesh, "board", None)
    return None if board is None else board.post(tag, x, inline)


def _gathered(mesh, ticket):
    """Every rank's post of ``ticket``'s collective (``shm_board.Posted``: each rank's
    shape, dtype and array), read inside the ``with``; None where there is no ticket."""
    return contextlib.nullcontext() if ticket is None else mesh.board.gather(ticket)


def allreduce_post(mesh, size: int, tag: tuple, x: np.ndarray):
    """``allreduce``'s ticket (``board_post``)."""
    return board_post(mesh, tag, x, x.nbytes * (size - 1) <= ONE_SHOT_BYTES)


def _one_shot(mesh, rank: int, size: int, tag: tuple, x: np.ndarray, op: str,
              weights=None, out=None) -> np.ndarray:
    """allreduce in one round: every rank sends its whole array to every other and
    combines them all, in rank order (so every rank gets the same bits), reading the
    large ones where their senders put them."""
    sends = [mesh.post(p, tag, x) for p in range(size) if p != rank]
    with Views(mesh) as views:
        parts = [x if r == rank else views.take(r, tag) for r in range(size)]
        for c in parts:
            if c.shape != x.shape or c.dtype != x.dtype:
                _reduction.check_same(op, _specs(parts))
        result = _combined(op, parts, x, weights, out)
    wait_all(mesh, sends)
    return result


def _combined(op: str, parts: list, x: np.ndarray, weights, out) -> np.ndarray:
    """Every rank's array (``parts``, of ``x``'s shape, in rank order) combined, into
    ``out`` where it fits."""
    weighted = list(zip(weights or [1] * len(parts), parts))
    if x.size <= 4096 and out is None:  # (the usual case, in short)
        return np.asarray(_reduction.combine(op, weighted))
    dtype = _reduction.result_dtype(op, [c.dtype for c in parts])
    result = out if usable(out, x.shape, dtype, (x,)) else np.empty(x.shape, dtype)
    _reduction.combine_into(op, weighted, result)
    return result


def allgather(mesh, rank: int, size: int, tag: tuple, x, out=None) -> np.ndarray:
    x = np.asarray(x)
    if size == 1:
        return np.atleast_1d(x).copy()
    sends = [mesh.post(p, tag, x) for p in range(size) if p != rank]
    with Views(mesh) as views:  # each part is copied once: into the joined array
        parts = [np.atleast_1d(x if r == rank else views.take(r, tag)) for r in range(size)]
        tails = {tuple(p.shape[1:]) for p in parts}
        if len(tails) > 1 or any(p.dtype != parts[0].dtype for p in parts):
            listing = ", ".join(f"rank {r}: {p.shape} {p.dtype}" for r, p in enumerate(parts))
            raise ValueError(f"allgather joins along axis 0, so the other dimensions must "
                             f"agree, and the dtypes; got {listing}")
        shape = (sum(len(p) for p in parts),) + tuple(tails.pop())
        if usable(out, shape, np.result_type(*parts), (x,)):
            joined = np.concatenate(parts, axis=0, out=out)
        else:
            joined = np.concatenate(parts, axis=0)
    wait_all(mesh, sends)
    return joined


_NOTHING = np.empty(0, np.uint8)


def barrier(mesh, rank: int, size: int, tag: tuple, ticket=POST) -> None:
    """Return once every rank has called it: on the board, or an empty message to and
    from every rank."""
    if ticket is POST:
        ticket = board_post(mesh, tag, None, True)
    if ticket is not None:
        with _gathered(mesh, ticket):
            return
    everyones(mesh, rank, size, tag, _NOTHING)


def broadcast(mesh, rank: int, size: int, tag: tuple, x, root: int, out=None):
    """Rank ``root``'s ``x`` on every rank (read into ``out`` where it fits)."""
    check_root(root, size)
    if rank == root:
        x = np.asarray(x)
        wait_all(mesh, [mesh.post(p, tag, x) for p in range(size) if p != rank])
        return x
    if out is None:
        return mesh.take(root, tag)
    with Views(mesh) as views:
        got = views.take(root, tag)
        if not usable(out, got.shape, got.dtype):
            return got.copy()
        np.copyto(out, got)
    return out


_FOLDS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def reduce_local(op: str, parts: list, weights, out: np.ndarray | None = None) -> np.ndarray:
    """``parts`` combined with ``op`` in rank order (``weights``: a mean's). ``out``: an
    array of the result's shape, none of ``parts``' memory, to write it into (returned)."""
    result = _reduced(op, parts, weights, out)
    if out is not None and result is not out:
        np.copyto(out, result)
        return out
    return result


def _reduced(op: str, parts: list, weights, out) -> np.ndarray:
    if op == _reduction.SCALED_SUM and weights is None:  # (every part scaled already)
        op = "sum"
    fold = _FOLDS.get(op)
    if fold is not None and weights is None and len(parts) > 1:  # (the usual case, in short:
        first = parts[0]  # numbers of one dtype, folded in rank order as ``combine_into`` does)
        dtype = first.dtype
        same = dtype.kind in "iufc"
        for p in parts:  # (a loop rather than all(): this runs in every reduction)
            if p.dtype != dtype:
                same = False
                break
        if same:
            if out is not None and out.dtype == dtype:
                result = fold(first, parts[1], out=out)
            else:
                result = fold(first, parts[1])
            if type(result) is not np.ndarray:  # (0-d parts: numpy gives a scalar)
                result = np.asarray(result)
            for p in parts[2:]:
                fold(result, p, out=result)
            if op in _reduction.EXTREMA:
                return _reduction.extremum_rule(op, parts, result)
            return result
    return _reduced_generally(op, parts, weights, out)


def _reduced_generally(op: str, parts: list, weights, out) -> np.ndarray:
    """``_reduced`` off its fast path: weighted, mixed dtypes, or one part."""
    weights = weights or [1.0] * len(parts)
    if len(parts) == 1 and op not in _reduction.MEANS and op != _reduction.SCALED_SUM:  # (in
        # the op's dtype: a logical op's is bool)
        result = parts[0].astype(_reduction.result_dtype(op, [parts[0].dtype]))
        if op in _reduction.EXTREMA:
            return _reduction.extremum_rule(op, parts, result)
        return result
    dtype = _reduction.result_dtype(op, [p.dtype for p in parts])
    if out is not None and out.dtype == dtype:
        result = out
    else:
        result = np.empty(parts[0].shape, dtype)
    _reduction.combine_into(op, list(zip(weights, parts)), result)
    return result


def reduce(mesh, rank: int, size: int, tag: tuple, x, op: str, root: int,
           weights: list | None = None):
    """``x`` combined over the ranks with ``op`` on rank ``root`` (read in place from the
    senders' shared memory), None elsewhere."""
    check_root(root, size)
    x = np.asarray(x)
    if rank != root:
        wait_all(mesh, [mesh.post(root, tag, x)])
        return None
    with Views(mesh) as views:
        parts = [x if r == rank else views.take(r, tag) for r in range(size)]
        _reduction.check_same(op, _specs(parts))
        return reduce_local(op, parts, weights)


def gather(mesh, rank: int, size: int, tag: tuple, x, counts: list, root: int, tail: tuple,
           dtype) -> np.ndarray | None:
    """Every rank's rows (``counts[r]`` rows of shape ``tail`` from rank r; ``x`` None where
    there are none) joined along axis 0 in rank order, on rank ``root``; None elsewhere."""
    check_root(root, size)
    dtype = np.dtype(dtype)
    mine = np.empty((0,) + tuple(tail), dtype) if x is None else np.asarray(x, dtype)
    if rank != root:
        wait_all(mesh, [mesh.post(root, tag, mine)])
        return None
    out = np.empty((sum(counts),) + tuple(tail), dtype)
    at = 0
    with Views(mesh) as views:
        for r in range(size):
            part = mine if r == rank else views.take(r, tag)
            if part.shape != (counts[r],) + tuple(tail):
                raise ValueError(f"gather: rank {r} has {part.shape}, the plan says "
                                 f"{counts[r]} rows of {tuple(tail)}")
            out[at:at + counts[r]] = part
            at += counts[r]
    return out


def scatter(mesh, rank: int, size: int, tag: tuple, parts, root: int) -> np.ndarray:
    """Rank ``root``'s ``parts[r]`` on each rank r."""
    check_root(root, size)
    if rank == root:
        wait_all(mesh, [mesh.post(p, tag, np.asarray(parts[p])) for p in range(size)
                         if p != rank])
        return np.asarray(parts[rank])
    return mesh.take(root, tag)


def check_root(root: int, size: int) -> None:
    """``ValueError`` unless ``root`` is a rank of a group of ``size``."""
    if not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"root must be a rank, 0..{size - 1}; got {root}")


def _reduce_chunks(mesh, rank, size, tag, chunks: list, op: str, make_out=np.empty,
                   weights=None, agree=None):
    """Send ``chunks[p]`` to every rank p and combine what they send for ours: this rank's
    part of a reduce-scatter, read in place from the senders' shared memory, written into
    ``make_out(shape, dtype)``. ``agree()``: a check of every rank's whole array, made once
    the chunks have come (a rank whose chunks differ raises first: the others' checks
    then still find what they wait for)."""
    sends = [post_chunk(mesh, p, tag, chunks[p]) for p in range(size) if p != rank]
    with Views(mesh) as views:
        mine = [chunks[rank] if r == rank else views.take(r, tag) for r in range(size)]
        _reduction.check_same(op, _specs(mine))
        if agree is not None:
            agree()
        dtype = _reduction.result_dtype(op, [c.dtype for c in mine])
        out = make_out(mine[0].shape, dtype)
        _reduction.combine_into(op, list(zip(weights or [1] * size, mine)), out)
    wait_all(mesh, sends)
    return out


def named(mesh, rank: int, size: int, tag: tuple, error: ValueError, mine) -> ValueError:
    """The error of ranks that disagree on the collective of ``tag``, found here as
    ``error`` (``_reduction.disagreement``): every rank's ``mine`` (``passed.Passed``)
    exchanged under that tag, and named (``passed.named``)."""
    return _passed.named(error, mine, lambda m: allgather_objects(
        mesh, rank, size, tag + (PASSED,), m, "passed"))


PASSED = "passed"  # the last part of the tag of the exchange of what the ranks passed


def reduce_scatter(mesh, rank: int, size: int, tag: tuple, x, op: str,
                   bounds=None, out=None, ticket=POST) -> np.ndarray:
    """Split ``x`` along axis 0 into ``size`` parts (rows ``bounds[r]:bounds[r + 1]``;
    None: as synk splits rows); rank r gets part r combined over every rank with ``op``.
    ``ticket``: as ``allreduce``'s."""
    return _naming(_reduce_scatter, "reduce_scatter", mesh, rank, size, tag, np.asarray(x), op,
                   bounds, out, ticket)  # (x at least 1-d: checked in synk.comm)


def _naming(run, what: str, mesh, rank: int, size: int, tag: tuple, x: np.ndarray, op: str,
            *args):
    """``run(mesh, rank, size, tag, x, op, *args)``, the collective ``what``, where the ranks
    that disagree raise the error that names what each passed (``named``)."""
    try:
        return run(mesh, rank, size, tag, x, op, *args)
    except ValueError as error:
        if not _reduction.is_disagreement(error):
            raise
        raise named(mesh, rank, size, tag, error, _passed.of_array(what, op, x)) from None


def _reduce_scatter(mesh, rank: int, size: int, tag: tuple, x: np.ndarray, op: str,
                    bounds, out, ticket) -> np.ndarray:
    if size == 1:
        return np.asarray(_reduction.combine(op, [(1, x)]))
    if bounds is None:
        bounds = split_bounds(len(x), size)
    chunks = [x[bounds[p]:bounds[p + 1]] for p in range(size)]

    def into(shape, dtype):
        return out if usable(out, shape, dtype, (x,)) else np.empty(shape, dtype)

    # Every rank checks every rank's whole shape and dtype: the parts one rank receives can
    # agree while another's do not (5 rows and 4 split over 2 ranks: 3+2 and 2+2), and the
    # ranks that raise must be all of them. On the board the whole arrays are posted (each
    # rank reads its rows of them); else the shapes go beside the parts, in the same round.
    if ticket is POST:
        ticket = allreduce_post(mesh, size, tag, x)
    if ticket is not None:
        with _gathered(mesh, ticket) as posted:
            _reduction.check_same(op, dict(enumerate(posted.specs)))
            rows = [part[bounds[rank]:bounds[rank + 1]] for part in posted.parts]
            result = into(rows[0].shape, _reduction.result_dtype(op, [r.dtype for r in rows]))
            _reduction.combine_into(op, [(1, r) for r in rows], result)
            return result
    said = np.frombuffer(dumps((x.shape, x.dtype.str), "synk.comm.reduce_scatter's shape"),
                         np.uint8)
    specs_tag = tag + ("specs",)
    told = post_all(mesh, rank, size, specs_tag, said)
    return _reduce_chunks(mesh, rank, size, tag, chunks, op, into,
                          agree=lambda: _reduction.check_same(op, dict(enumerate(
                              pickle.loads(part.tobytes()) for part in
                              take_all(mesh, rank, size, specs_tag, said, told)))))


def alltoall(mesh, rank: int, size: int, tag: tuple, parts: list, specs: list) -> list:
    """Each ``parts[p]`` to rank p; what every rank sent this one, in rank order, checked
    against ``specs`` (each rank's (shape, dtype), agreed beforehand)."""
    sends = [mesh.post(p, tag, parts[p]) for p in range(size) if p != rank]
    got = [np.array(parts[r]) if r == rank else mesh.take(r, tag) for r in range(size)]
    wait_all(mesh, sends)
    for r, (part, (shape, dtype)) in enumerate(zip(got, specs)):
        if part.shape != tuple(shape) or part.dtype != np.dtype(dtype):
            raise ValueError(f"alltoall: rank {r} sent {part.shape} {part.dtype}, it said "
                             f"{tuple(shape)} {np.dtype(dtype)}")
    return got


def allreduce(mesh, rank: int, size: int, tag: tuple, x, op: str,
              weights: list | None = None, out=None, ticket=POST) -> np.ndarray:
    """``x`` combined over the ranks with ``op``; ``weights``: each rank's weight in a
    mean (None: equal); ``ticket``: this rank's post of it on the board, made where a
    non-blocking one started (``allreduce_post``)."""
    return _naming(_allreduce, "allreduce", mesh, rank, size, tag, np.asarray(x), op, weights,
                   out, ticket)


def _allreduce(mesh, rank: int, size: int, tag: tuple, x: np.ndarray, op: str, weights,
               out, ticket) -> np.ndarray:
    if size == 1:
        return np.asarray(_reduction.combine(op, [(1, x)]))
    if ticket is POST:
        ticket = allreduce_post(mesh, size, tag, x)
    if ticket is not None:
        board = mesh.board
        try:  # (``Board.gather``, without a generator's cost: this runs every step)
            posted = board.collect(ticket)
            _reduction.check_same(op, dict(enumerate(posted.specs)))
            return _combined(op, posted.parts, x, weights, out)
        finally:
            board.finished(ticket)
    if x.nbytes * (size - 1) <= ONE_SHOT_BYTES:
        return _one_shot(mesh, rank, size, tag, x, op, weights, out)
    flat = np.ascontiguousarray(x).reshape(-1)
    bounds = split_bounds(flat.size, size)
    chunks = [flat[bounds[p]:bounds[p + 1]] for p in range(size)]
    return two_rounds(mesh, rank, size, tag, chunks, bounds, x.shape, op, weights, out, x)


def two_rounds(mesh, rank: int, size: int, tag: tuple, chunks: list, bounds: tuple,
                shape: tuple, op: str, weights=None, out=None, x=None) -> np.ndarray:
    """An allreduce of a flat array of ``shape`` cut at ``bounds`` into ``chunks`` (the
    others' arrays or ``Part``s): a reduce-scatter, then an allgather into ``out`` (not
    aliasing ``x``), each rank moving (n - 1) / n of the array per phase, the least any
    algorithm moves; each chunk is combined once, so every rank has the same bits. Unequal
    sizes show as chunks of unequal shapes."""
    into: list = []  # the result, once the ranks' dtypes are known (and out, if it is)

    def own_chunk(chunk_shape, dtype):
        if usable(out, shape, dtype, () if x is None else (x,)):
            into.extend([out.reshape(-1), out])
        else:
            into.append(np.empty(bounds[-1], dtype))
        return into[0][bounds[rank]:bounds[rank + 1]]

    # (the reduce-scatter under the collective's own tag, as a one-round exchange's
    # message: ranks that took different rounds (their arrays differ) see it and raise)
    ag = tag + ("ag",)
    try:
        own = _reduce_chunks(mesh, rank, size, tag, chunks, op, own_chunk, weights)
    except ValueError as err:
        # A rank's chunks can look right to it while another's do not (3 ranks, one with
        # an element more): this rank's error goes to the others in the second round, in
        # place of its chunk (a 2-d message, which no chunk is), so that they raise it too
        # rather than wait for the chunk (a disagreement as one: ``_RELAYED``).
        text = (_RELAYED if _reduction.is_disagreement(err) else "") + str(err)
        said = np.frombuffer(text.encode(), np.uint8).reshape(1, -1)
        for p in range(size):
            if p != rank:
                mesh.post(p, ag, said)
        raise
    result = into[0]
    sends = [mesh.post(p, ag, own) for p in range(size) if p != rank]
    with Views(mesh) as views:
        for r in range(size):
            if r != rank:
                part = views.take(r, ag)
                if part.ndim == 2:  # (rank r's error of the first round)
                    raise _relayed(part.tobytes().decode())
                if part.shape != (bounds[r + 1] - bounds[r],):
                    raise _reduction.disagreement(
                        f"rank {r} passed an array of a different size; op {op!r} needs the "
                        "same shape on every rank")
                result[bounds[r]:bounds[r + 1]] = part
    wait_all(mesh, sends)
    return into[1] if len(into) > 1 else result.reshape(shape)  # (into[1]: out)


_RELAYED = "\0"  # ahead of the text of a relayed error that is a disagreement


def _relayed(text: str) -> ValueError:
    """A peer's error of the first round of ``two_rounds``, raised here too."""
    if text.startswith(_RELAYED):
        return _reduction.disagreement(text[len(_RELAYED):])
    return ValueError(text)


class Part:
    """A chunk of a message not made yet: ``fill(view)`` writes its ``shape`` and ``dtype``
    into ``view``, straight into the shared memory its message takes where it takes some
    (``post_chunk``), so that it is copied once."""

    __slots__ = ("shape", "dtype", "fill")

    def __init__(self, shape: tuple, dtype: np.dtype, fill: Callable) -> None:
        self.shape, self.dtype, self.fill = shape, dtype, fill

    def array(self) -> np.ndarray:
        made = np.empty(self.shape, self.dtype)
        self.fill(made)
        return made


def post_chunk(mesh, dest: int, tag: tuple, chunk):
    """Post ``chunk`` (an array, or a ``Part``) to ``dest``."""
    if type(chunk) is Part:
        filled = getattr(mesh, "post_filled", None)
        got = None if filled is None else filled(dest, tag, chunk.shape, chunk.dtype,
                                                  chunk.fill)
        if got is not None:
            return got[0]
        chunk = chunk.array()
    return mesh.post(dest, tag, chunk)
