"""``synk.comm``'s exchanges in which every rank sends a part to every rank, written once for
every communicator: ``alltoall`` and the prefix reductions built on it (``scan``,
``exscan``).

::

    each rank's parts -> over the host: shapes and dtypes (_agree, _check_scan_heads)
      -> the arrays' communicator, alltoall(parts, specs): the host mesh, one NCCL group
         of sends and receives, or the host-staged one
      -> the parts received (scan's: combined in rank order)
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ... import _reduction
from ..._shares import split_bounds
from ..._wire.arrays import dtype_token
from .. import context as _context, route as _route
from ..handle import then
from . import fused as _fused, loc as _loc


def _listing(items: dict) -> str:
    return ", ".join(f"rank {r}: {s}" for r, s in sorted(items.items()))


def _agree(comm, host, parts: list, listed: bool, what: str) -> list:
    """Every rank's (on device, listed, [(shape, dtype) of its part for each rank]), checked
    to agree on where the arrays are and on the form. Told over the host communicator before
    the arrays move, so that a mismatch raises the same error on every rank and every
    communicator knows the sizes it receives (NCCL needs them)."""
    heads = host.allgather_objects(
        (comm is not host, listed, [(tuple(p.shape), dtype_token(p.dtype)) for p in parts]),
        what)
    where = {r: "device" if h[0] else "host" for r, h in enumerate(heads)}
    if len(set(where.values())) > 1:
        raise TypeError(f"synk.comm.{what}: some ranks passed device arrays and others host "
                        f"arrays ({_listing(where)}); pass them all on the device or all "
                        "as numpy arrays")
    forms = {r: "a list" if h[1] else "an array" for r, h in enumerate(heads)}
    if len(set(forms.values())) > 1:
        raise ValueError(f"synk.comm.{what}: some ranks passed a list of parts and others an "
                         f"array to split ({_listing(forms)}); every rank passes the same form")
    return [h[2] for h in heads]


def split_rows(x, counts, size: int, what: str) -> Sequence[int]:
    """``x`` cut along axis 0 into ``size`` parts of ``counts`` rows (None: as synk splits
    rows); the part boundaries."""
    if counts is None:
        return split_bounds(len(x), size)
    counts = list(counts)
    if len(counts) != size or any(
            not isinstance(c, (int, np.integer)) or c < 0 for c in counts):
        raise ValueError(f"synk.comm.{what}: counts gives each of the {size} ranks its rows "
                         f"(integers >= 0); got {counts}")
    if sum(counts) != len(x):
        raise ValueError(f"synk.comm.{what}: counts {counts} add up to {sum(counts)} rows, but "
                         f"x has {len(x)}")
    return [int(b) for b in np.cumsum([0, *counts])]


def reduce_scatter_bounds(x, counts, what: str) -> Sequence[int] | None:
    """The one check, for every communicator, that ``x`` has an axis 0 to split, and the
    part boundaries of ``counts`` (None: synk's split), agreed by every rank."""
    ndim = x.ndim if hasattr(x, "ndim") else np.ndim(_route.as_array(x, what))  # (device
    if ndim == 0:  # arrays: their own; a Python number: 0)
        raise ValueError(f"synk.comm.{what} splits x along axis 0, so x needs at least 1 "
                         "dimension (got a 0-d value); reshape it, e.g. x.reshape(1)")
    if counts is None:
        return None
    bounds = split_rows(x, counts, _context.require(what).size, what)
    said = _route.host(what).allgather_objects(bounds, what)
    if any(b != bounds for b in said):
        listing = ", ".join(f"rank {r}: {np.diff(b).tolist()}" for r, b in enumerate(said))
        raise ValueError(f"synk.comm.{what}: the ranks passed different counts ({listing}); "
                         "pass the same list on every rank")
    return bounds


def alltoall(x, counts, wait: bool = True):
    """Rank r's ``x[p]`` (a list, one array per rank) or rows ``p`` of ``x`` (an array, split
    by ``counts``) on rank p: the list of what each rank sent, or those rows joined."""
    what = "alltoall" if wait else "ialltoall"
    c = _context.require(what)  # (counted as a collective by _route)
    host = _route.host(what)
    listed = isinstance(x, (list, tuple))
    if listed:
        if len(x) != c.size:
            raise ValueError(f"synk.comm.{what}: pass a list of one array per rank "
                             f"({c.size}); got {len(x)}")
        if counts is not None:
            raise ValueError(f"synk.comm.{what}: counts= splits an array; a list already "
                             "has one part per rank")
        for p, part in enumerate(x):
            _route.check_carried(part, what, f"x[{p}]")
        comm = _route.for_arrays(list(x), what)
        parts = [comm.xp.asarray(p, order="C") for p in x]
    else:
        comm = _route.for_array(x, what)
        x = comm.xp.asarray(x, order="C")
        if x.ndim == 0:
            raise ValueError(f"synk.comm.{what} splits x along axis 0, so x needs at least "
                             "1 dimension (got a 0-d value); pass a list for one value per "
                             "rank")
        bounds = split_rows(x, counts, c.size, what)
        parts = [x[bounds[p]:bounds[p + 1]] for p in range(c.size)]
    sent = _agree(comm, host, parts, listed, what)
    specs = [sent[r][c.rank] for r in range(c.size)]
    if not listed:
        tails = {r: tuple(s[0][1:]) for r, s in enumerate(specs)}
        if len(set(tails.values())) > 1:
            raise ValueError(f"synk.comm.{what} joins the rows it receives along axis 0, so "
                             f"the other dimensions must agree; got {_listing(tails)}")

    def finish(got: list):
        if listed:
            return got
        dtype = np.result_type(*[np.dtype(s[1]) for s in specs])
        return comm.xp.concatenate([g.astype(dtype, copy=False) for g in got], axis=0)

    return then((comm.alltoall if wait else comm.ialltoall)(parts, specs), finish, wait)


def scan(x, op: str, exclusive: bool, wait: bool = True):
    """``x`` combined with ``op`` over ranks 0..r (``exclusive``: 0..r-1, None on rank 0) on
    each rank r, in rank order: every rank sends its ``x`` to the ranks above it."""
    what = ("exscan" if exclusive else "scan") if wait else (
        "iexscan" if exclusive else "iscan")
    located = op in _reduction.LOC_OPS
    if located and isinstance(x, (list, tuple, dict)):
        raise TypeError(f"synk.comm.{what}: op {op!r} takes one array or number, not a "
                        f"{type(x).__name__}; call it once per array")
    numbers = None if located else _fused.python_ints(x)
    if numbers is not None:
        x = _fused.past_ints_as_zero(x, numbers)
    comm = _route.numbers(x, what, op)
    c = _context.require(what)
    host = _route.host(what)
    kind = _reduction.kind_of(x)
    xp = comm.xp
    x = xp.asarray(_route.as_array(x, what))
    heads = host.allgather_objects((comm is not host, tuple(x.shape), x.dtype.str, op,
                                    numbers),
                                   what)
    _check_scan_heads(heads, op, what, range(c.size - 1) if exclusive else range(c.size))
    dtype = x.dtype
    _reduction.check_dtype(op, dtype, f"synk.comm.{what}")  # (every rank alike)
    nothing = xp.empty(0, x.dtype)
    parts = [x if p > c.rank else nothing for p in range(c.size)]
    specs = [(x.shape if r < c.rank else (0,), x.dtype.str) for r in range(c.size)]

    def finish(got: list):
        values = got[:c.rank] if exclusive else [*got[:c.rank], x]
        if not values:
            return None
        if located:  # (values are in rank order from 0, so a position is a rank)
            return _loc.pick(xp, xp.stack(values), op, kind)
        result = xp.array(_reduction.combine(op, [(1, v) for v in values], xp), copy=True)
        return _reduction.restore_kind(result, kind)

    return then((comm.alltoall if wait else comm.ialltoall)(parts, specs), finish, wait)


def _check_scan_heads(heads: list, op: str, what: str, ends: range) -> None:
    """Raise, alike on every rank, where the ranks' scan headers disagree, or their ints
    leave int64 (``check_python_ints``' ``ends``)."""
    where = {r: "device" if h[0] else "host" for r, h in enumerate(heads)}
    if len(set(where.values())) > 1:
        raise TypeError(f"synk.comm.{what}: some ranks passed device arrays and others host "
                        f"arrays ({_listing(where)})")
    ops = {r: h[3] for r, h in enumerate(heads)}
    if len(set(ops.values())) > 1:
        raise ValueError(f"synk.comm.{what}: the ranks passed different ops ({_listing(ops)});"
                         " every rank must pass the same op")
    _reduction.check_same(op, {r: (h[1], h[2]) for r, h in enumerate(heads)})
    _fused.check_python_ints([h[4] for h in heads], op, what, ends)
