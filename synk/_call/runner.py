"""One rank's share of a call: pick its rows, run ``fn`` slice by slice, combine the slices.

Master (rank 0) and workers run exactly this code. Scattered inputs arrive whole (numpy
views of shared memory); the *plan* says which rows of them make up the call and how they
are split among ranks.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from .._process import PROCESS
from ..comm import context as _context
from ..errors import add_note
from . import frames as _frames, piece, placement, residency
from .ops import combine_slices, plain_output
from .records import FunctionSpec, Marks, Share, ShareTask
from .residency import Resident
from .rows import Plan, Rows, most_rows, pieces, rank_rows, take_rows

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


def share_pieces(plan: Plan, rank: int) -> list:
    """The pieces of rows ``rank`` runs ``fn`` on, in order, in a call that scatters some
    inputs. Every rank runs as many as the others, empty ones included (see ``piece``), so
    that the collectives inside ``fn`` match across ranks: ``num_slices``, or fewer when no
    rank has that many rows."""
    n = plan.num_slices if plan.num_slices == 1 else min(plan.num_slices, most_rows(plan))
    return pieces(rank_rows(plan, rank), max(n, 1))


def run_share(spec: FunctionSpec, task: ShareTask, rank: int, marks: Marks | None = None,
              device=None) -> Share | None:
    """Run this rank's share of ``task``; returns a ``Share``, or None if the rank has no
    rows (it still ran ``fn``, quietly: see ``piece``).

    ``device``: the rank's device; on a GPU rank the inputs move to it and the outputs stay
    there (see ``placement``). When profiling, ``marks`` gets the share's start, when its
    rows were taken and when ``fn`` was done."""
    if marks is not None:
        marks.share = time.perf_counter()
    plan = task.plan
    parts: Sequence
    counted: Sequence
    if plan.bounds is None:  # nothing scattered: once, with the whole arguments
        parts, counted = _WHOLE, _COUNTS
    else:
        parts = share_pieces(plan, rank)
        if plan.num_slices > 1:
            _context.current.sliced = plan.num_slices  # (synk.comm refuses to be sliced)
        counted = [piece.counts(plan, rank, k, rows) for k, rows in enumerate(parts)]
    args, kwargs, spos, skeys = task.args, task.kwargs, task.spos, task.skeys
    try:
        if device is not None and not device.is_host:
            size = 1 if plan.bounds is None else len(plan.bounds) - 1
            return placement.run_pieces(spec, task, parts, counted, device, marks, rank, size)
        if _any_resident(args, kwargs):
            args, kwargs = _resident_on_host(args, kwargs, spos, skeys)
        frames = task.frames  # (torch tensors, JAX arrays: each piece's as such)
        fn = spec.fn
        if len(parts) == 1:  # (the usual case, in short)
            one: Rows | None = parts[0]
            if one is None:
                weight, a, k = 1, args, kwargs
            else:
                weight = one.count
                a, k = _select(args, kwargs, spos, skeys, one)
            if frames is not None:
                a, k = _frames.framed_arguments(a, k, frames)
            if marks is not None:
                marks.taken = time.perf_counter()
            value = piece.run(fn, a, k, counted[0])
            if plan.num_slices == 1:
                share = None if value is piece.QUIET else (
                    plain_output(weight, value, spec.reduce, spec.name)
                    or _frames.framed_share([(weight, value)], combine_slices, spec.reduce,
                                            spec.name, False))
                if marks is not None:
                    marks.computed = time.perf_counter()
                return share
            results = [(weight, value)]
        else:
            runs = [(rows.count, *_select(args, kwargs, spos, skeys, rows)) for rows in parts]
            if marks is not None:
                marks.taken = time.perf_counter()
            results = []
            for (weight, a, k), c in zip(runs, counted):
                if frames is not None:  # just before the piece runs: a JAX replica as the
                    a, k = _frames.framed_arguments(a, k, frames)  # last piece assigned it
                results.append((weight, piece.run(fn, a, k, c)))
    except ValueError as err:
        if "read-only" in str(err):
            add_note(err, _HOSTS_NOTE if PROCESS.spans_hosts else _READ_ONLY_NOTE)
        raise
    results = [r for r in results if r[1] is not piece.QUIET]
    share = _frames.framed_share(results, combine_slices, spec.reduce, spec.name,
                                 plan.num_slices > 1) if results else None
    if marks is not None:
        marks.computed = time.perf_counter()
    return share


_WHOLE, _COUNTS = (None,), (True,)  # the one piece of a call that scatters nothing


def _any_resident(args, kwargs) -> bool:
    for v in args:
        if type(v) is Resident:
            return True
    if kwargs:
        for v in kwargs.values():
            if type(v) is Resident:
                return True
    return False


def _resident_on_host(args, kwargs, spos, skeys) -> tuple:
    """On CPU ranks, resident Data broadcast whole as copies of their own (the scattered
    ones give their rows as copies in ``_select``), as GPU ranks get them (residency)."""
    scattered, keys = set(spos), set(skeys)
    args = [a if i in scattered else residency.host_whole(a) for i, a in enumerate(args)]
    kwargs = {k: v if k in keys else residency.host_whole(v) for k, v in kwargs.items()}
    return args, kwargs


def _rows_of(value, rows: Rows):
    if type(value) is Resident:
        return residency.host_rows(value, rows)
    return take_rows(value, rows)


def _select(args, kwargs, spos, skeys, rows: Rows):
    if spos:
        args = list(args)
        for i in spos:
            args[i] = _rows_of(args[i], rows)
    if skeys:
        kwargs = dict(kwargs)
        for key in skeys:
            kwargs[key] = _rows_of(kwargs[key], rows)
    return args, kwargs
