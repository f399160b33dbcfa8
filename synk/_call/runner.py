"""One rank's share of a call: pick its rows, run ``fn`` slice by slice, combine the slices.

Master (rank 0) and workers run exactly this code. Scattered inputs arrive whole (numpy
views of shared memory); the *plan* says which rows of them make up the call and how they
are split among ranks.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from ..errors import add_note
from . import ops as _ops, placement, tree

_READ_ONLY_NOTE = (
    "synk: plain numpy inputs reach a synk function read-only on every rank (the ranks share "
    "them, so a write by one would change what the others see). Copy one to change it "
    "(x = x.copy()), or pass a synk.Data, shared memory that every rank may write."
)


class Plan(NamedTuple):
    """How a call's scattered rows are chosen and split.

    selection: None (all rows), ``(start, step)`` for a slice, or an index array.
    bounds: positions in the selection where each rank's share starts, plus the end;
            None when the function has no scattered inputs (every rank runs it once).
    """

    selection: object
    bounds: tuple | None
    num_slices: int


class Share(NamedTuple):
    """What one rank computed: rows processed, whether fn returned a tuple, the outputs."""

    weight: int
    multi: bool | tuple  # fn returned a tuple; or a layout of structured outputs
    outputs: tuple  # one (kind, value) per output (per leaf of structured ones)


def split_bounds(n_rows: int, n_ranks: int) -> tuple:
    """Start of each rank's share and the end; shares differ by at most one row."""
    base, extra = divmod(n_rows, n_ranks)
    bounds, pos = [0], 0
    for r in range(n_ranks):
        pos += base + (r < extra)
        bounds.append(pos)
    return tuple(bounds)


def take_rows(arr, selection, a: int, b: int):
    """Rows at positions ``[a, b)`` of ``selection`` of ``arr``."""
    if selection is None:
        return arr[a:b]
    if isinstance(selection, tuple):
        start, step = selection
        return arr[start + a * step : start + b * step : step]
    return np.take(arr, selection[a:b], axis=0)


def pieces(lo: int, hi: int, num_slices: int) -> list:
    """Cut ``[lo, hi)`` into up to ``num_slices`` non-empty consecutive pieces (never more
    pieces than rows)."""
    if num_slices == 1:
        return [(lo, hi)]
    bounds = split_bounds(hi - lo, max(1, min(num_slices, hi - lo)))
    return [(lo + a, lo + b) for a, b in zip(bounds, bounds[1:]) if b > a]


def run_share(fn, fname, reduce, args, kwargs, spos, skeys, plan: Plan, rank: int,
              marks: list | None = None, device=None):
    """Run this rank's share; returns a ``Share``, or None if the rank has no rows.

    ``device``: the rank's device; on a GPU rank the inputs move to it and the outputs come
    back as numpy (see ``placement``). When profiling, ``marks`` gets three times appended:
    start, rows taken, fn done."""
    if marks is not None:
        marks.append(time.perf_counter())
    on_device = device is not None and not device.is_host
    if on_device:
        args, kwargs = placement.broadcast_to_device(device, args, kwargs, spos, skeys)
    if plan.bounds is None:
        runs = [(1, args, kwargs)]
    else:
        lo, hi = plan.bounds[rank], plan.bounds[rank + 1]
        if hi == lo:
            if plan.bounds[-1] != 0 or rank != 0:
                if marks is not None:
                    marks += marks[-1:] * 2
                return None
            runs = [(0, *_select(args, kwargs, spos, skeys, plan.selection, lo, hi))]
        else:
            runs = [
                (b - a, *_select(args, kwargs, spos, skeys, plan.selection, a, b))
                for a, b in pieces(lo, hi, plan.num_slices)
            ]
    if marks is not None:
        marks.append(time.perf_counter())
    results = []
    try:
        for weight, a, k in runs:
            if on_device:
                with device.scope():
                    a, k = placement.rows_to_device(device, a, k, spos, skeys)
                    results.append((weight, placement.to_host(device, fn(*a, **k))))
            else:
                results.append((weight, fn(*a, **k)))
    except ValueError as err:
        if "read-only" in str(err):
            add_note(err, _READ_ONLY_NOTE)
        raise
    share = combine_slices(results, reduce, fname, listed=plan.num_slices > 1)
    if marks is not None:
        marks.append(time.perf_counter())
    return share


def _select(args, kwargs, spos, skeys, selection, a, b):
    if spos:
        args = list(args)
        for i in spos:
            args[i] = take_rows(args[i], selection, a, b)
    if skeys:
        kwargs = dict(kwargs)
        for key in skeys:
            kwargs[key] = take_rows(kwargs[key], selection, a, b)
    return args, kwargs


def combine_slices(results, reduce, fname, listed: bool = False) -> Share:
    """Normalise each slice's return value and combine the slices output by output.

    Outputs with reduce op None are kept as they are, or as a list of the slices' results
    when ``listed`` (the call asked for several slices). An output that is a list, tuple or
    dict of arrays (with an array op) is combined leaf by leaf: the share's ``multi`` is
    then a layout (see ``_ops.layout_ops``) instead of a bool.
    """
    multi = isinstance(results[0][1], tuple)
    n_out = len(results[0][1]) if multi else 1
    ops = _ops.ops_for(reduce, n_out, fname)
    first = results[0][1] if multi else (results[0][1],)
    if any(op is not None and isinstance(v, (list, tuple, dict)) for v, op in zip(first, ops)):
        results, multi, ops = _flatten_structures(results, multi, ops, fname)
        n_out = len(ops)
    elif len(results) == 1 and not listed:  # one slice (the usual case): nothing to combine
        weight, value = results[0]
        outs = value if multi else (value,)
        return Share(weight, multi, tuple(
            (_ops.PY, v) if op is None else (_ops.kind_of(v), _ops.as_array(v, op, i, fname))
            for i, (v, op) in enumerate(zip(outs, ops))))
    per_slice = []
    for _, value in results:
        outs = value if multi else (value,)
        if isinstance(value, tuple) != bool(multi) or len(outs) != n_out:
            raise ValueError(f"{fname} returned a different number of outputs on different slices")
        per_slice.append(outs)
    outputs = []
    for i, op in enumerate(ops):
        values = [outs[i] for outs in per_slice]
        if op is None:
            outputs.append((_ops.PY, values if listed else values[0]))
            continue
        kind = max(_ops.kind_of(v) for v in values)
        arrays = [_ops.as_array(v, op, i, fname) for v in values]
        if len(arrays) > 1:
            _ops.check_shapes(
                op, {f"slice {j}": a.shape for j, a in enumerate(arrays)}, i, fname
            )
            value = _ops.combine(op, [(w, a) for (w, _), a in zip(results, arrays)])
        else:
            value = arrays[0]
        outputs.append((kind, value))
    return Share(sum(w for w, _ in results), multi, tuple(outputs))


def _flatten_structures(results, multi: bool, ops, fname):
    """Each slice's outputs with their structures flattened into leaves: (results as
    tuples of leaves, the layout, one op per leaf)."""
    flat, layout = [], None
    for weight, value in results:
        outs = value if multi else (value,)
        if isinstance(value, tuple) != multi or len(outs) != len(ops):
            raise ValueError(f"{fname} returned a different number of outputs on different slices")
        leaves, templates = [], []
        for v, op in zip(outs, ops):
            if op is None or not isinstance(v, (list, tuple, dict)):
                leaves.append(v)
                templates.append(None)
            else:
                sub, template = tree.flatten(v)
                leaves += sub
                templates.append(template)
        this = (multi, tuple(templates))
        if layout is not None and this != layout:
            raise ValueError(f"{fname} returned outputs of different structures on different "
                             "slices; return the same lists, tuples and dicts every time")
        layout = this
        flat.append((weight, tuple(leaves)))
    return flat, layout, _ops.layout_ops(ops, layout)
