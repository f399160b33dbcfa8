"""A rank's share of a call, the same code on the master (rank 0) and on every worker: enter
the call's ``synk.comm`` context, run ``fn`` on the rank's rows piece by piece, and hand the
outputs on to be combined (``run``). Scattered inputs arrive whole; the task's *plan* says
which rows make up the call and how they are split among the ranks::

    ShareTask -> run -> this rank's rows of the plan, in pieces (rows)
        a CPU rank: views of shared memory ---------------> run_piece(fn), each piece
        a GPU rank: rows onto the device (run_pieces) -----> run_piece(fn), each piece
                    its writes into a Data landed back (WriteBack)
    -> finish_outputs: to the OutputSink (the replies), or combined by collectives (NCCL, MPI)
"""
from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from .. import _arrays, _tree
from .._process import PROCESS
from .._wire import shm as _shm
from ..comm import context as _context
from ..comm.autograd import callback_errors as _callback_errors
from ..comm.communicators import communicator_class
from ..errors import DeviceFailedError, add_note, stamp_failure
from . import collect as _collect, frames as _frames, kept as _kept, ops as _ops, replica_tensors
from .kept import Resident
from .ops import plain_output, share_ops
from .records import FunctionSpec, Marks, Share, ShareResult, ShareTask
from .rows import Plan, Rows, most_rows, pieces, rank_rows, take_rows

# -- one piece -------------------------------------------------------------------------------------

QUIET = object()  # what a piece that counts for nothing gives


def run_piece(fn, args, kwargs, counts: bool):
    """``fn(*args, **kwargs)``; a piece that does not count (a rank runs ``fn`` on no rows to
    take part in the others' collectives) runs with warnings silenced and gives ``QUIET``; its
    error before any collective is not the call's (the other ranks' waits end with
    ``CommAborted``, ``_context.left``); one after is."""
    context = _context.current
    context.in_fn = True
    if _callback_errors.KEPT:
        _callback_errors.clear()
    failed = False
    try:
        if counts:
            return fn(*args, **kwargs)
        ops = context.ops
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn(*args, **kwargs)
        except Exception as exc:
            if context.ops == ops:  # no collective yet: nobody has this rank's messages
                _context.left(exc)
                return QUIET
            add_note(exc, "synk: this rank had no rows for this piece of the call; it runs "
                          "the function on 0 rows all the same, so that it takes part in the "
                          "collectives of the call (what it returns counts for nothing): "
                          "make the function accept 0 rows")
            raise
        return QUIET
    except Exception as exc:  # (synk.comm's own exception under jax.jit, as itself)
        failed = True
        kept = _callback_errors.original(exc) if _callback_errors.KEPT else None
        if kept is None:
            raise
        raise kept  # noqa: B904 (JAX's error stays chained as its __context__)
    finally:
        context.in_fn = False
        if failed or _callback_errors.KEPT:  # (JAX's next computations would raise it again)
            _callback_errors.forget_failed_tokens()
        if _callback_errors.KEPT:
            _callback_errors.clear()


# -- a GPU rank's writes into a Data ---------------------------------------------------------------

class WriteBack:
    """The device copies of writable host memory given to one piece of ``fn`` (or to every piece,
    for broadcast inputs), and where each came from. CuPy cannot make a copy of a ``Data``
    read-only, so each is kept beside a snapshot and only the elements whose bytes differ are copied
    back, so that ranks writing different elements do not overwrite each other. Rows picked by an
    index are not written back (copies on CPU ranks too); a call that raises writes nothing back."""

    __slots__ = ("device", "watched")

    def __init__(self, device) -> None:
        self.device = device
        self.watched: list = []  # (device array, its snapshot, host target)

    def watch(self, copy, target) -> None:
        """``copy`` (a C-contiguous device array) came from ``target``, a writable numpy
        array of its shape."""
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


# -- a GPU rank's share ----------------------------------------------------------------------------

def _writable_shared(value) -> bool:
    """Whether ``value`` is a writable view of shared memory (a ``Data`` on one host): a
    CPU rank's writes to it land in the ``Data``, so a GPU rank's are written back."""
    return (type(value) is np.ndarray and value.flags.writeable and value.nbytes > 0
            and _shm.mapping_of(value.__array_interface__["data"][0], value.nbytes)
            is not None)


def _broadcast(args, kwargs, spos, skeys, f) -> tuple:
    """``args`` and ``kwargs`` with ``f`` applied to every value but the scattered ones."""
    scattered, keys = set(spos), set(skeys)
    args = [a if i in scattered else f(a) for i, a in enumerate(args)]
    kwargs = {k: v if k in keys else f(v) for k, v in kwargs.items()}
    return args, kwargs


def _scattered(args, kwargs, spos, skeys, f) -> tuple:
    """``args`` and ``kwargs`` with ``f`` applied to the scattered values alone."""
    if spos:
        args = list(args)
        for i in spos:
            args[i] = f(args[i])
    if skeys:
        kwargs = dict(kwargs)
        for key in skeys:
            kwargs[key] = f(kwargs[key])
    return args, kwargs


def broadcast_to_device(device, args: list | tuple, kwargs: dict, spos, skeys,
                        watch: WriteBack) -> tuple:
    """``args`` and ``kwargs`` with every broadcast numpy array (not the scattered ones,
    which move piece by piece) copied to ``device``, nested in lists, tuples and dicts too
    (``_tree.map_leaves``), and resident Data replaced by the rank's device copy; anything
    else as it is. The copies of a ``Data`` are ``watch``ed (written back after ``fn``)."""
    def leaf_moved(leaf):
        kind = type(leaf)
        if kind is np.ndarray:  # (of a dtype CuPy cannot hold: stays numpy, as on CPU ranks)
            return device.to_device(leaf) if device.can_hold(leaf.dtype) else leaf
        return _kept.whole(device, leaf) if kind is Resident else leaf

    def moved(value):
        copy = _tree.map_leaves(value, leaf_moved)
        if copy is not value and _writable_shared(value):
            watch.watch(copy, value)
        return copy

    return _broadcast(args, kwargs, spos, skeys, moved)


def _row_items(arr: np.ndarray, rows: Rows):
    """What the device copies for ``rows`` of ``arr``: a view of them, or the source and the
    index for rows gathered by index."""
    if rows.index is not None:
        return arr, np.asarray(rows.index, np.intp)
    return arr[rows.start:rows.start + rows.count * rows.step:rows.step]


class _Piece:
    """The scattered inputs of one piece, on their way to the device (rows of resident Data
    are picked on the device when the piece runs)."""

    __slots__ = ("weight", "rows", "upload", "spos", "skeys", "where")

    def __init__(self, device, args, kwargs, spos, skeys, rows: Rows | None, where) -> None:
        self.spos, self.skeys, self.rows, self.where = spos, skeys, rows, where
        self.weight = 1 if rows is None else rows.count
        self.upload = None
        if rows is not None and (spos or skeys):
            values = [args[i] for i in spos] + [kwargs[k] for k in skeys]
            items = [_row_items(v, rows) for v in values
                     if type(v) is not Resident and device.can_hold(v.dtype)]
            if items:
                self.upload = device.upload(items)

    def arguments(self, device, args, kwargs, watch: WriteBack) -> tuple:
        """The call's arguments with this piece's rows (the rank's stream waits for them);
        the rows of a ``Data`` are ``watch``ed (written back after ``fn``)."""
        if self.rows is None or not (self.spos or self.skeys):
            return args, kwargs
        arrays = iter(self.upload.ready() if self.upload is not None else ())
        indices: dict = {}

        def rows_of(value):
            if type(value) is Resident:
                return _kept.rows(device, value, self.rows, *self.where, indices)
            if not device.can_hold(value.dtype):  # (strings, objects...: numpy, as on CPUs)
                return take_rows(value, self.rows)
            copy = next(arrays)
            if self.rows.index is None and _writable_shared(value):
                watch.watch(copy, _row_items(value, self.rows))  # (rows picked by an index
            return copy  # are a copy on CPU ranks too: nothing lands there)

        return _scattered(args, kwargs, self.spos, self.skeys, rows_of)


_ON_HOST = contextlib.nullcontext()


def on_device(device, rank: int):
    """``with``: a rank's work in a call; on a GPU rank, with its device and stream current
    throughout, and an error after which the device's context is broken (a sticky CUDA
    error) becomes ``DeviceFailedError`` naming the rank and the CUDA status."""
    if device is None or device.is_host:
        return _ON_HOST  # (the CPU path: nothing to do, at no cost)
    return _OnDevice(device, rank)


class _OnDevice:
    __slots__ = ("device", "rank", "scope")

    def __init__(self, device, rank: int) -> None:
        self.device, self.rank, self.scope = device, rank, device.scope()

    def __enter__(self):
        self.scope.__enter__()
        self.device.drop_released()  # (blocks let go since the last share: a freed Data...)
        return self

    def __exit__(self, kind, exc, tb):
        self.scope.__exit__(kind, exc, tb)
        if isinstance(exc, Exception) and not isinstance(exc, DeviceFailedError):
            status = self.device.failure()
            if status:
                raise DeviceFailedError(self.rank, status,
                                        f"({type(exc).__name__}: {exc})") from exc
        return False


def settle(device) -> None:
    """Wait for everything this rank launched in the call: its streams, and the NCCL operations of
    ``synk.comm`` (non-blocking ones never waited on included), whose buffers are then let go."""
    device_comm = _context.current.device_comm
    if device_comm is not None and hasattr(device_comm, "synchronize"):
        device_comm.synchronize()
    device.synchronize()


def settle_failed(device, exc: BaseException) -> None:
    """``settle`` after ``fn`` (or synk's work) raised ``exc``, then a wait for every stream of
    the device (``fn``'s own streams may still read memory CuPy's pool hands on), unless an NCCL
    operation may never end. An interrupted share aborts its communicator first (its operations
    may wait for peers that never launch theirs). Errors here are dropped."""
    device_comm = _context.current.device_comm
    if not isinstance(exc, Exception) and hasattr(device_comm, "abort"):
        with contextlib.suppress(Exception):
            device_comm.abort(f"rank {_context.current.rank}'s share was interrupted "
                              f"({type(exc).__name__})")
    with contextlib.suppress(Exception):
        settle(device)
    with contextlib.suppress(Exception):
        if device_comm is None or not hasattr(device_comm, "quiet") or device_comm.quiet():
            device.synchronize_all()


def _pin_share(device, args, kwargs, spos, skeys, parts: Sequence) -> None:
    """Page-lock, once, the rows of each scattered shared-memory input that this rank reads
    in the call (all its pieces): only its part of the block, and no piece's copy has to
    grow the locked range."""
    rows = [p for p in parts if p is not None and p.index is None and p.step == 1 and p.count]
    if not rows:
        return
    lo, hi = min(r.start for r in rows), max(r.start + r.count for r in rows)
    for value in [args[i] for i in spos] + [kwargs[k] for k in skeys]:
        if type(value) is np.ndarray and value.flags.c_contiguous:
            device.pin(value[lo:hi])


def run_pieces(spec: FunctionSpec, task: ShareTask, parts: Sequence, counted: Sequence,
               device, marks: Marks | None, rank: int = 0, size: int = 1) -> Share | None:
    """Run ``spec``'s function on each of ``parts`` (``Rows``, or (None,)) on a GPU rank; the
    rank's ``Share``, its array outputs on the device, or None if no piece counted. The rows of
    piece k + 1 are copied on the copy stream, from page-locked memory, while ``fn`` computes
    piece k; the rank's device and stream are made current again after each call of ``fn``."""
    results = []
    where = (rank, size)
    spos, skeys = task.spos, task.skeys
    try:
        with device.scope():
            _pin_share(device, task.args, task.kwargs, spos, skeys, parts)
            whole = WriteBack(device)  # (the Data broadcast whole: after every piece)
            args, kwargs = broadcast_to_device(device, task.args, task.kwargs, spos, skeys,
                                               whole)
            piece = _Piece(device, args, kwargs, spos, skeys, parts[0], where)
            if marks is not None:
                marks.taken = time.perf_counter()
            for k in range(len(parts)):
                rows = WriteBack(device)  # (this piece's rows of a scattered Data)
                a, kw = piece.arguments(device, args, kwargs, rows)
                copies: list = []  # (torch tensors given as copies of device arrays)
                if task.frames is not None:  # (torch tensors, JAX arrays: as such)
                    a, kw = _frames.framed_arguments(a, kw, task.frames, device, copies)
                weight = piece.weight
                if k + 1 < len(parts):  # copied while fn computes this piece
                    piece = _Piece(device, args, kwargs, spos, skeys, parts[k + 1], where)
                try:
                    with _arrays.on_stream(device):  # (torch's work on the rank's stream)
                        out = run_piece(spec.fn, a, kw, counted[k])
                finally:
                    device.resume()  # whatever device and stream fn left current
                if task.frames is not None:  # tensors given as copies: their updates in
                    _frames.write_back(device)  # place back before the next piece copies
                    for given, target in copies:  # them again (a Data's: then landed in it)
                        if rows.watches(target) or whole.watches(target):
                            _frames.copy_into(target, given, device)
                if k + 1 < len(parts):
                    rows.finish()  # (before they go: the pieces' rows bound the memory)
                else:
                    whole.take(rows)  # (checked once the streams are idle: no wait of its own)
                if out is not QUIET:
                    results.append((weight, out))
            share = _frames.framed_share(results, spec.reduce, spec.name, task.plan.num_slices > 1,
                                         _ops.DeviceValues(device)) if results else None
    except BaseException as exc:
        settle_failed(device, exc)
        raise
    if not task.inline_outputs:  # (a submitted call's share goes on; one of many steps
        settle(device)  # settles once, at the call's end)
    with device.scope():
        whole.finish()
    if marks is not None:
        marks.computed = time.perf_counter()
    return share


# -- a CPU rank's share ----------------------------------------------------------------------------

_READ_ONLY_NOTE = (
    "synk: plain numpy inputs reach a synk function read-only on every rank (the ranks share "
    "them, so a write by one would change what the others see). Copy one to change it "
    "(x = x.copy()), or pass a synk.Data, shared memory that every rank may write."
)


_HOSTS_NOTE = (
    "synk: this job spans several hosts (MPI): shared-memory inputs, a synk.Data included, "
    "reach synk functions read-only on every rank, since each host other than the master's "
    "reads its own copy of the rows (a write would not reach the others). Copy the array to "
    "change it (x = x.copy()) and return what the master should get; the master changes a "
    "synk.Data with d[...] = value or set_value."
)


def run_share(spec: FunctionSpec, task: ShareTask, rank: int, marks: Marks | None = None,
              device=None) -> Share | None:
    """Run this rank's share of ``task``: a ``Share``, or None if the rank has no rows (it still
    ran ``fn``, see ``run_piece``). ``marks`` (profiling) gets the share's start, when its rows
    were taken and when ``fn`` was done."""
    if marks is not None:
        marks.share = time.perf_counter()
    plan = task.plan
    parts, counted = _share_parts(plan, rank)
    args, kwargs = task.args, task.kwargs
    try:
        if device is not None and not device.is_host:
            size = 1 if plan.bounds is None else len(plan.bounds) - 1
            return run_pieces(spec, task, parts, counted, device, marks, rank, size)
        if _any_resident(args, kwargs):  # resident Data broadcast whole: copies of their
            # own, as GPU ranks get them (the scattered ones' rows: copies in ``_select``)
            args, kwargs = _broadcast(args, kwargs, task.spos, task.skeys, _kept.host_whole)
        if len(parts) == 1:  # (the usual case, in short)
            weight, value = _run_one_piece(spec.fn, task, args, kwargs, parts[0], counted[0],
                                           marks)
            if plan.num_slices == 1:
                share = None if value is QUIET else (
                    plain_output(weight, value, spec.reduce, spec.name)
                    or _frames.framed_share([(weight, value)], spec.reduce, spec.name, False))
                if marks is not None:
                    marks.computed = time.perf_counter()
                return share
            results = [(weight, value)]
        else:
            results = _run_host_pieces(spec.fn, task, args, kwargs, parts, counted, marks)
    except ValueError as err:
        if "read-only" in str(err):
            add_note(err, _HOSTS_NOTE if PROCESS.spans_hosts else _READ_ONLY_NOTE)
        raise
    results = [r for r in results if r[1] is not QUIET]
    share = _frames.framed_share(results, spec.reduce, spec.name,
                                 plan.num_slices > 1) if results else None
    if marks is not None:
        marks.computed = time.perf_counter()
    return share


def _share_parts(plan: Plan, rank: int) -> tuple[Sequence, Sequence]:
    """(the pieces of rows ``rank`` runs ``fn`` on, in order, whether each counts: see
    ``run_piece``) in a call of ``plan``. Every rank runs as many pieces as the others, empty
    ones included, so that the collectives inside ``fn`` match across ranks: ``num_slices``,
    or fewer when no rank has that many rows. A piece counts when it has rows, or is rank 0's
    first when the call selects no rows at all (the result keeps its form)."""
    if plan.bounds is None:  # nothing scattered: once, with the whole arguments
        return _WHOLE, _COUNTS
    n = plan.num_slices if plan.num_slices == 1 else min(plan.num_slices, most_rows(plan))
    parts = pieces(rank_rows(plan, rank), max(n, 1))
    if plan.num_slices > 1:
        _context.current.sliced = plan.num_slices  # (synk.comm refuses to be sliced)
    return parts, [rows.count > 0 or (plan.total == 0 and rank == 0 and k == 0)
                   for k, rows in enumerate(parts)]


def _run_one_piece(fn, task: ShareTask, args, kwargs, one: Rows | None, counted: bool,
                   marks: Marks | None) -> tuple:
    """(its weight, ``fn``'s value) of a CPU rank's one piece ``one`` (None: the whole
    arguments)."""
    if one is None:
        weight, a, k = 1, args, kwargs
    else:
        weight = one.count
        a, k = _select(args, kwargs, task.spos, task.skeys, one)
    if task.frames is not None:  # (torch tensors, JAX arrays: as such)
        a, k = _frames.framed_arguments(a, k, task.frames)
    if marks is not None:
        marks.taken = time.perf_counter()
    return weight, run_piece(fn, a, k, counted)


def _run_host_pieces(fn, task: ShareTask, args, kwargs, parts: Sequence, counted: Sequence,
                     marks: Marks | None) -> list:
    """[(its weight, ``fn``'s value), ...] of each of a CPU rank's ``parts``, in order."""
    spos, skeys, frames = task.spos, task.skeys, task.frames
    runs = [(rows.count, *_select(args, kwargs, spos, skeys, rows)) for rows in parts]
    if marks is not None:
        marks.taken = time.perf_counter()
    results = []
    for (weight, a, k), c in zip(runs, counted):
        if frames is not None:  # just before the piece runs: a JAX replica as the
            a, k = _frames.framed_arguments(a, k, frames)  # last piece assigned it
        results.append((weight, run_piece(fn, a, k, c)))
    return results


_WHOLE, _COUNTS = (None,), (True,)  # the one piece of a call that scatters nothing


def _any_resident(args, kwargs) -> bool:
    return any(type(v) is Resident for v in args) or any(
        type(v) is Resident for v in kwargs.values())


def _select(args, kwargs, spos, skeys, rows: Rows):
    return _scattered(args, kwargs, spos, skeys, lambda value: _kept.host_rows(value, rows)
                      if type(value) is Resident else take_rows(value, rows))


# -- the end of a share ----------------------------------------------------------------------------

_HOST = communicator_class("host")


class OutputSink(Protocol):
    """Where a rank puts its share's large outputs for the master to read, when its output
    communicator's ``combines_outputs`` is ``"replies"``: left in the rank's shared memory, only
    their place in the reply (``collect.ScratchOutputs``, ``collect.MasterOutputs``). Across
    hosts every rank ends its share in a collective sink (``mpi_collect.MpiOutputs``)."""

    collective: bool  # every rank's share ends in its ``finish`` (``mpi_collect.MpiOutputs``)

    def export(self, share: Share, ops: tuple) -> Share:
        """``share`` with its large outputs put where the master reads them, replaced by
        where they are."""


def finish_outputs(env: Any, share: Share | None, reduce, fname: str,
                   pipelined: bool = False) -> ShareResult:
    """After this rank's share (or one step of a call of many), once the rank's function is
    over (``env``: a ``RankEnv``): the share to reply with, and on rank 0 the outputs
    combined already (on the devices). ``pipelined`` (a submitted call's): never combined on the
    devices, which would wait for the other ranks' shares; rank 0's stay where they are
    (``collect.OwnOutputs``), the workers' go to the host, in their replies."""
    context = _context.current
    comm = context.device_comm or _HOST
    if context.size > 1 and comm.combines_outputs == "collectives" and not pipelined:
        began = time.perf_counter()
        share, combined = _collect.finish(env.device, context, share, reduce, fname)
        return ShareResult(share, combined, time.perf_counter() - began)
    device = env.device
    if share is not None and device is not None and not device.is_host and not (
            pipelined and context.rank == 0):
        share = on_host(device, share)
    if context.size > 1 and env.outputs.collective:  # every rank, with rows or not
        return env.outputs.finish(share, reduce, fname, context.call_id)
    if share is None:
        return _NOTHING
    if context.size > 1:
        share = env.outputs.export(share, share_ops(reduce, share, fname))
    return ShareResult(share, None, 0.0)


_NOTHING = ShareResult(None, None, 0.0)  # a share that had no rows


def on_host(device, share: Share) -> Share:
    """``share`` with its outputs on ``device`` (a GPU) copied to the host."""
    return share.replace_outputs(
        (kind, _ops.to_host(device, value)) for kind, value in share.outputs)


# -- a rank's whole share --------------------------------------------------------------------------

class RankEnv(NamedTuple):
    """Where a rank's share runs: the master's group, a worker's state, or ``ALONE``."""

    rank: int
    size: int
    device: Any  # the rank's Device (None: the master without a group)
    mesh: Any  # its end of the synk.comm mesh (None: alone)
    device_comm: Any  # its device communicator (NCCL, staged), if any
    outputs: Any  # where its large outputs go for the master (``OutputSink``)


ALONE = RankEnv(0, 1, None, None, None, None)  # ``Function.local``: rank 0 of 1, no group


def run(env: RankEnv, spec: FunctionSpec, task: ShareTask,
        marks: Marks | None = None):
    """This rank's share of the call (``run_share``): its ``ShareResult``, or one per step
    (``task.steps``). If it raises, the other ranks hear of it first, and the exception carries
    when it failed (``errors.stamp_failure``), which picks the error a call reports."""
    rank, device = env.rank, env.device
    copies = replica_tensors.point_at_replicas(device) if PROCESS.replica_tensors else ()
    _context.enter(env.mesh, task.call_id, rank, env.size, device, env.device_comm,
                       task.plan.total)
    ended = False  # (the share returned, rather than raised or was interrupted)
    try:
        if device is None or device.is_host:  # (nothing to make current: no ``with``)
            result = _run(env, spec, task, marks, rank, None)
        else:
            with on_device(device, rank):
                result = _run(env, spec, task, marks, rank, device)
        if copies:
            replica_tensors.write_back(copies, device)
        ended = True
        return result
    except Exception as exc:
        stamp_failure(exc)
        _context.fail(exc)
        raise
    finally:
        _context.leave(ended)


def _run(env: RankEnv, spec: FunctionSpec, task: ShareTask, marks: Marks | None, rank: int,
         device):
    if task.steps is not None:
        return _run_steps(env, spec, task, rank, device)
    share = run_share(spec, task, rank, marks, device)
    _context.settle()  # (the non-blocking operations fn did not wait for)
    _context.after_function()
    return finish_outputs(env, share, spec.reduce, spec.name,
                          getattr(env.outputs, "pipelined", False))


def _run_steps(env: RankEnv, spec: FunctionSpec, task: ShareTask, rank: int,
               device) -> list:
    """A call of many steps (``task.steps``): each step's share run as a call's (its
    non-blocking operations ended with it, means weighted by its rows), then each step's outputs
    handed on; one ``ShareResult`` per step. An error names its step: the steps before it took
    effect, the later ones do not run."""
    context = _context.current
    shares = []
    steps = task.steps
    assert steps is not None
    for j, plan in enumerate(steps):
        context.rows = plan.total
        try:
            shares.append(run_share(spec, task.step(plan), rank, None, device))
            _context.settle()
        except Exception as exc:
            add_note(exc, f"synk: in step {j} of the {len(steps)} of the call "
                          f"(batches[{j}])")
            raise
    if device is not None and not device.is_host:
        settle(device)  # (once, for every step: see ``run_pieces``)
    _context.after_function()
    return [finish_outputs(env, share, spec.reduce, spec.name) for share in shares]
