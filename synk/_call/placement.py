"""A GPU rank's share of a call: inputs onto its device, ``fn`` piece by piece, outputs left
on the device.

Broadcast numpy arrays are copied to the device once per call. Inputs of dtypes CuPy cannot
hold (objects, strings, bytes, datetimes, long doubles: ``_devices.device_dtypes``) stay
numpy, as on CPU ranks; big-endian numbers arrive in the device's byte order. The rows of
the scattered inputs are copied piece by piece on the device's copy stream, from
page-locked memory (their shared-memory block, or a staging buffer: see
``_devices.cuda_host``): while ``fn`` computes piece k on the rank's stream, the rows of
piece k + 1 are already on their way.
Outputs stay on the device, the pieces combined there (``device_ops``); those with reduce
op None come back to the host. Everything runs with the rank's device and stream current
(``device.scope()``), made current again after each call of ``fn`` whatever ``fn`` left
current, so that no work of synk's lands on another stream (the null stream is unordered
with the rank's non-blocking streams). The rank's streams, and its communicator's, are
synchronised before the share ends, so that nothing launched in it outlives the call.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import numpy as np

from .. import _arrays
from .._wire import shm as _shm
from ..comm import context as _context
from ..errors import DeviceFailedError
from . import device_ops, frames as _frames, ops as _ops, piece as _piece, residency
from .records import FunctionSpec, Marks, Share, ShareTask
from .residency import Resident
from .rows import Rows, take_rows
from .write_back import WriteBack


def _whole(device, value):
    """A broadcast input on ``device``: a numpy array copied there, a resident Data's copy,
    and the arrays inside lists, tuples (named ones too) and dicts, nested, likewise (in
    new containers of the same kinds); anything else as it is."""
    kind = type(value)
    if kind is np.ndarray:  # (of a dtype CuPy cannot hold: stays numpy, as on CPU ranks)
        return device.to_device(value) if device.can_hold(value.dtype) else value
    if kind is Resident:
        return residency.whole(device, value)
    if kind is list:
        return [_whole(device, v) for v in value]
    if isinstance(value, tuple):
        items = [_whole(device, v) for v in value]
        return kind(*items) if hasattr(value, "_fields") else kind(items)
    if isinstance(value, dict):
        moved = value.copy()
        for key, v in value.items():
            moved[key] = _whole(device, v)
        return moved
    return value


def _writable_shared(value) -> bool:
    """Whether ``value`` is a writable view of shared memory (a ``Data`` on one host): a
    CPU rank's writes to it land in the ``Data``, so a GPU rank's are written back."""
    return (type(value) is np.ndarray and value.flags.writeable and value.nbytes > 0
            and _shm.mapping_of(value.__array_interface__["data"][0], value.nbytes)
            is not None)


def broadcast_to_device(device, args: list | tuple, kwargs: dict, spos, skeys,
                        watch: WriteBack | None = None) -> tuple:
    """``args`` and ``kwargs`` with every broadcast numpy array (not the scattered ones,
    which move piece by piece) copied to ``device``, nested in lists, tuples and dicts too,
    and resident Data replaced by the rank's device copy; the copies of a ``Data`` are
    ``watch``ed (written back after ``fn``)."""
    def moved(value):
        copy = _whole(device, value)
        if watch is not None and copy is not value and _writable_shared(value):
            watch.watch(copy, value)
        return copy

    scattered = set(spos)
    args = [a if i in scattered else moved(a) for i, a in enumerate(args)]
    keys = set(skeys)
    kwargs = {k: v if k in keys else moved(v) for k, v in kwargs.items()}
    return args, kwargs


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

    def arguments(self, device, args, kwargs, watch: WriteBack | None = None) -> tuple:
        """The call's arguments with this piece's rows (the rank's stream waits for them);
        the rows of a ``Data`` are ``watch``ed (written back after ``fn``)."""
        if self.rows is None or not (self.spos or self.skeys):
            return args, kwargs
        arrays = iter(self.upload.ready() if self.upload is not None else ())
        indices: dict = {}

        def rows_of(value):
            if type(value) is Resident:
                return residency.rows(device, value, self.rows, *self.where, indices)
            if not device.can_hold(value.dtype):  # (strings, objects...: numpy, as on CPUs)
                return take_rows(value, self.rows)
            copy = next(arrays)
            if watch is not None and self.rows.index is None and _writable_shared(value):
                watch.watch(copy, _row_items(value, self.rows))  # (rows picked by an index
            return copy  # are a copy on CPU ranks too: nothing lands there)

        if self.spos:
            args = list(args)
            for i in self.spos:
                args[i] = rows_of(args[i])
        if self.skeys:
            kwargs = dict(kwargs)
            for key in self.skeys:
                kwargs[key] = rows_of(kwargs[key])
        return args, kwargs


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
    """Wait for everything this rank launched in the call: its streams, and the NCCL
    operations of ``synk.comm`` (non-blocking ones never waited on included), whose buffers
    are then let go."""
    device_comm = _context.current.device_comm
    if device_comm is not None and hasattr(device_comm, "synchronize"):
        device_comm.synchronize()
    device.synchronize()


def settle_failed(device) -> None:
    """``settle`` after ``fn`` (or synk's work) raised, then a wait for every stream of the
    device: work the function queued on a stream of its own before raising (it never got to
    order that stream back) may still read memory that CuPy's pool hands, at once, to the
    next call's copies. Skipped where an NCCL operation may never end (stranded by an abort:
    the device-wide wait would never return). Errors here are dropped: the first error is
    the one to see."""
    with contextlib.suppress(Exception):
        settle(device)
    device_comm = _context.current.device_comm
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
    """Run ``spec``'s function on each of ``parts`` (``Rows``, or (None,) when nothing is
    scattered) on a GPU rank (``rank`` of ``size``); the rank's ``Share``, its array outputs
    on the device, or None if no piece counted (``counted``: see ``_call.piece``)."""
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
                        out = _piece.run(spec.fn, a, kw, counted[k])
                finally:
                    device.resume()  # whatever device and stream fn left current
                if task.frames is not None:  # tensors given as copies: their updates in
                    _frames.write_back(device)  # place back before the next piece copies
                    _frames.write_back_copies(  # them again (a Data's: then landed in it)
                        [c for c in copies if rows.watches(c[1]) or whole.watches(c[1])],
                        device)
                if k + 1 < len(parts):
                    rows.finish()  # (before they go: the pieces' rows bound the memory)
                else:
                    whole.take(rows)  # (checked once the streams are idle: no wait of its own)
                if out is not _piece.QUIET:
                    results.append((weight, out))
            share = _frames.framed_share(
                results, _ops.combine_slices, spec.reduce, spec.name,
                task.plan.num_slices > 1, device_ops.DeviceValues(device)) if results else None
    except BaseException:
        settle_failed(device)
        raise
    settle(device)
    with device.scope():
        whole.finish()
    if marks is not None:
        marks.computed = time.perf_counter()
    return share
