"""Which rows of the scattered inputs each rank takes, and in which pieces::

    batch=, local_batch=  (rows_chosen, local_positions)
      -> Plan             chosen by the master, the same message for every rank
      -> Rows             the rows one rank takes (rank_rows)
      -> pieces           cut for num_slices (pieces)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .. import _arrays
from .._shares import split_bounds


class Plan(NamedTuple):
    """How a call's scattered rows are chosen and split; the same message for every rank.
    ``selection``: None (all rows), ``(start, step)``, or an index array. ``bounds``: where each
    rank's share starts in the selection, plus the end; None with no scattered inputs. ``local``
    (``local_batch=``): None, or per rank ``(start, step, count)`` or positions. ``total``: the rows
    used over all ranks."""

    selection: Any
    bounds: Any  # a tuple, or None
    num_slices: int
    local: tuple | None = None
    total: int = 0


class Rows:
    """Rows of the scattered inputs: ``index`` (an array of row numbers) or, when it is
    None, ``count`` rows from ``start`` every ``step``."""

    __slots__ = ("start", "step", "index", "count")

    def __init__(self, start: int, step: int, index: Any, count: int) -> None:
        self.start, self.step, self.index, self.count = start, step, index, count

    def __repr__(self) -> str:
        return f"Rows(start={self.start}, step={self.step}, index={self.index!r}, " \
               f"count={self.count})"


def rank_rows(plan: Plan, rank: int) -> Rows:
    """The rows ``rank`` takes in a call with scattered inputs."""
    lo, hi = plan.bounds[rank], plan.bounds[rank + 1]
    local, sel = plan.local, plan.selection
    if local is None:  # (the common case, first: this is on every call's path)
        if sel is None:
            return Rows(lo, 1, None, hi - lo)
        if type(sel) is tuple:
            return Rows(sel[0] + lo * sel[1], sel[1], None, hi - lo)
        return Rows(0, 1, sel[lo:hi], hi - lo)
    local = local[rank]
    if isinstance(local, tuple):
        first, step, count = local
        first += lo
        if sel is None:
            return Rows(first, step, None, count)
        if isinstance(sel, tuple):
            return Rows(sel[0] + first * sel[1], step * sel[1], None, count)
        return Rows(0, 1, sel[first:first + step * count:step], count)
    positions = lo + local
    if sel is None:
        return Rows(0, 1, positions, len(positions))
    if isinstance(sel, tuple):
        return Rows(0, 1, sel[0] + positions * sel[1], len(positions))
    return Rows(0, 1, sel[positions], len(positions))


def take_rows(arr, rows: Rows):
    """``rows`` of ``arr`` (a view for a slice; a copy for an index)."""
    if rows.index is not None:
        if type(arr) is np.ndarray:
            return arr.take(rows.index, axis=0)  # (numpy's function adds a call around it)
        return np.take(arr, rows.index, axis=0)
    start, step = rows.start, rows.step
    return arr[start:start + rows.count * step:step]


def most_rows(plan: Plan) -> int:
    """The most rows any rank takes in the call."""
    if plan.local is None:
        return max(b - a for a, b in zip(plan.bounds, plan.bounds[1:]))
    return max(part[2] if isinstance(part, tuple) else len(part) for part in plan.local)


def pieces(rows: Rows, num_slices: int) -> list:
    """Cut ``rows`` into ``num_slices`` consecutive pieces, as even as they can be; pieces
    past the rows are empty."""
    if num_slices == 1:
        return [rows]
    bounds = split_bounds(rows.count, num_slices)
    out = []
    for a, b in zip(bounds, bounds[1:]):
        if rows.index is not None:
            out.append(Rows(0, 1, rows.index[a:b], b - a))
        else:
            out.append(Rows(rows.start + a * rows.step, rows.step, None, b - a))
    return out


def local_positions(local_batch, bounds: tuple) -> tuple:
    """``local_batch`` as one entry per rank, each checked against that rank's share:
    ``(start, step, count)`` or an array of positions within the share."""
    size = len(bounds) - 1
    if isinstance(local_batch, (list, tuple)):
        if len(local_batch) != size:
            raise ValueError(
                f"local_batch is a list of {len(local_batch)} entries but there are {size} "
                "ranks: give one entry per rank (an int, a slice, an index array or None), "
                "or pass positions as a numpy array to use them on every rank")
        specs = list(local_batch)
    else:
        specs = [local_batch] * size
    return tuple(_local_entry(spec, bounds[r + 1] - bounds[r], r) for r, spec in enumerate(specs))


def _local_entry(spec, rows: int, rank: int):
    """One rank's ``local_batch`` entry over its ``rows`` rows (None: all of them)."""
    if spec is None:
        return (0, 1, rows)
    return rows_chosen(spec, rows, lambda: f"local_batch for rank {rank} (which has {rows} rows)")


def rows_chosen(spec, rows: int, named: Callable[[], str]):
    """The rows of ``rows`` that ``spec`` (``batch=`` or a rank's ``local_batch=``) picks:
    ``(start, step, count)`` for an int (the first ``spec`` rows) or a slice, else an
    array of positions (from an index array, negative ones counted from the end, or a
    boolean mask). ``named()`` names the option in errors (made only for one)."""
    spec = _arrays.to_numpy(spec)  # (an index tensor)
    if isinstance(spec, slice):
        start, stop, step = spec.indices(rows)
        if step < 0:
            raise ValueError(f"{named()}: the slice {spec} has a negative step; use a positive "
                             "step")
        return (start, step, len(range(start, stop, step)))
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        if not 0 <= spec <= rows:
            raise ValueError(f"{named()}: {spec} rows are out of range; give 0 to {rows}")
        return (0, 1, int(spec))
    idx = spec if type(spec) is np.ndarray else _arrays.as_array(
        spec, named(), "give an int, a slice, a 1-d integer index array or a boolean mask")
    if idx.size == 0:
        idx = idx.astype(np.intp)  # [] is float to numpy
    if idx.dtype == bool and idx.ndim == 1:
        if len(idx) != rows:
            raise ValueError(f"{named()}: a boolean mask needs {rows} entries, got {len(idx)}")
        idx = np.flatnonzero(idx)
    if idx.ndim != 1 or idx.dtype.kind not in "iu":
        raise TypeError(f"{named()}: give an int, a slice, a 1-d integer index array or a "
                        f"boolean mask; got {idx.ndim}-d {idx.dtype}")
    if len(idx):
        if len(idx) <= 256:  # (a minibatch: Python's min and max of its few are faster)
            values = idx.tolist()
            lo, hi = min(values), max(values)
        else:
            lo, hi = idx.min(), idx.max()
        if lo < -rows or hi >= rows:
            raise IndexError(f"{named()}: positions must lie in [-{rows}, {rows}); got min "
                             f"{lo}, max {hi}")
        if lo < 0:
            idx = np.where(idx < 0, idx + rows, idx)
    return idx.astype(np.intp, copy=False)


def named_option(name: str, spec) -> str:
    """``name=spec`` for an error message; an array by its shape and dtype past a few values."""
    if isinstance(spec, (slice, int, np.integer)):
        return f"{name}={spec}"
    try:
        arr = np.asarray(spec)
    except ValueError:  # (a ragged nested sequence: the error says so itself)
        return name
    if arr.ndim == 1 and arr.size <= 8:
        return f"{name}={arr.tolist()}"
    return f"{name} (a {arr.ndim}-d {arr.dtype} array of shape {arr.shape})"
