"""Reduce ops: their names, checks, and how parts (from slices or ranks) are combined.

A *part* is ``(weight, value)``: the rows a rank or slice processed and what ``fn`` returned
for them. The same ``combine`` joins a rank's slices and, for small outputs, the ranks' results
in the master; large outputs are combined chunk-wise by every rank with the same function.
"""
from __future__ import annotations

import functools
import numbers
from typing import NamedTuple

import numpy as np

ARRAY_OPS = ("mean", "sum", "prod", "max", "min")
OPS = ARRAY_OPS + ("gather", None)
_ALIASES = {"avg": "mean"}
_ELEMENTWISE = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}

# Kinds of output, to give back what fn returned: a Python number, a numpy scalar, an array.
# DONE: combined already (on the devices); the value is the result, or None on a worker.
PY, NP, ARR, DONE = 0, 1, 2, 3


class Share(NamedTuple):
    """What one rank computed: rows processed, whether fn returned a tuple, the outputs."""

    weight: int
    multi: bool
    outputs: tuple  # one (kind, value) per output


def check_op(op):
    """Return the canonical name of reduce op ``op`` or raise ValueError."""
    if isinstance(op, str):
        op = _ALIASES.get(op.lower(), op.lower())
    if op not in OPS:
        raise ValueError(
            f"unknown reduce op {op!r}; use one of 'mean' (or 'avg'), 'sum', 'prod', 'max', "
            "'min', 'gather', or None for a list of each rank's result"
        )
    return op


def check_reduce(reduce):
    """Canonical form of a function's ``reduce``: one op, or a tuple with one op per output."""
    if isinstance(reduce, (list, tuple)):
        if not reduce:
            raise ValueError("reduce=() gives no op; give one op, or one per output")
        return tuple(check_op(op) for op in reduce)
    return check_op(reduce)


def ops_for(reduce, n_outputs: int, fname: str) -> tuple:
    """The op of each of ``n_outputs`` outputs."""
    if not isinstance(reduce, tuple):
        return (reduce,) * n_outputs
    if len(reduce) != n_outputs:
        raise ValueError(
            f"{fname} returned {n_outputs} output(s) but reduce gives {len(reduce)} ops "
            f"{reduce!r}; give one op per output, or a single op for all"
        )
    return reduce


def layout_ops(ops, layout) -> tuple:
    """One op per leaf of a share whose outputs have ``layout`` ``(multi, templates)``."""
    from .tree import count

    return tuple(op for op, template in zip(ops, layout[1])
                 for _ in range(1 if template is None else count(template)))


def outputs_by_slice(results, multi, n_out: int, fname: str) -> list:
    """Each slice's outputs as a tuple of ``n_out``; slices that disagree raise."""
    per_slice = []
    for _, value in results:
        outs = value if multi else (value,)
        if isinstance(value, tuple) != bool(multi) or len(outs) != n_out:
            raise ValueError(f"{fname} returned a different number of outputs on different slices")
        per_slice.append(outs)
    return per_slice


def flatten_structures(results, multi: bool, ops, fname: str):
    """Each slice's outputs with their structures flattened into leaves: (results as
    tuples of leaves, the layout, one op per leaf)."""
    from .tree import flatten

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
                sub, template = flatten(v)
                leaves += sub
                templates.append(template)
        this = (multi, tuple(templates))
        if layout is not None and this != layout:
            raise ValueError(f"{fname} returned outputs of different structures on different "
                             "slices; return the same lists, tuples and dicts every time")
        layout = this
        flat.append((weight, tuple(leaves)))
    return flat, layout, layout_ops(ops, layout)


def share_ops(reduce, multi, n_outputs: int, fname: str) -> tuple:
    """The op of each of a share's ``n_outputs`` outputs (leaves, when ``multi`` is a
    layout of structured outputs)."""
    if isinstance(multi, tuple):
        return layout_ops(ops_for(reduce, len(multi[1]), fname), multi)
    return ops_for(reduce, n_outputs, fname)


def kind_of(value) -> int:
    if isinstance(value, np.ndarray):
        return ARR
    if isinstance(value, np.generic):
        return NP
    return PY


def as_array(value, op, index: int, fname: str) -> np.ndarray:
    """``value`` as a numeric array for ``op``, or a clear error."""
    if op == "gather" and isinstance(value, np.ndarray) and not value.dtype.hasobject:
        return value
    if isinstance(value, (np.ndarray, np.generic, numbers.Number)):
        arr = np.asarray(value)
        if arr.dtype.kind in "biufc":
            return arr
    raise TypeError(
        f"output {index} of {fname} is a {type(value).__name__}"
        + (f" of dtype {np.asarray(value).dtype}" if isinstance(value, np.ndarray) else "")
        + f"; reduce op {op!r} needs numbers or numeric arrays. "
        "Return arrays, or use reduce=None to get each rank's result as it is"
    )


def combine_output(op, parts, kind: int):
    """One output combined over the ranks' ``parts`` (``[(weight, array), ...]``) as the
    caller gets it: ``gather`` joined along axis 0, an array op's result in the kind the
    ranks returned (a Python number, a numpy scalar or an array)."""
    if op == "gather":
        return combine(op, parts)
    return restore_kind(np.asarray(combine(op, parts)), kind)


def restore_kind(result: np.ndarray, kind: int):
    if kind == PY:
        return result.item()
    if kind == NP:
        return result[()]
    return result


def check_shapes(op, shapes: dict, index: int, fname: str) -> None:
    """Array ops need one shape everywhere; gather needs the same trailing dimensions.

    ``shapes`` maps a label ("rank 2", "slice 1") to the shape produced there.
    """
    if op == "gather":
        tails = {tuple(s[1:]) for s in shapes.values()}
        if len(tails) > 1:
            raise ValueError(
                f"output {index} of {fname} cannot be gathered along axis 0: its shapes "
                f"{_listing(shapes)} differ beyond axis 0"
            )
    elif len({tuple(s) for s in shapes.values()}) > 1:
        raise ValueError(
            f"output {index} of {fname} has different shapes ({_listing(shapes)}); reduce "
            f"op {op!r} needs the same shape everywhere. Use reduce='gather' or None for "
            "outputs whose shape depends on the rows"
        )


def _listing(shapes: dict) -> str:
    return ", ".join(f"{label}: {tuple(shape)}" for label, shape in shapes.items())


def mean_dtype(dtypes) -> np.dtype:
    dtype = np.result_type(*dtypes)
    return dtype if dtype.kind in "fc" else np.dtype(np.float64)


def result_dtype(op, dtypes) -> np.dtype:
    """The dtype of ``op`` over parts of ``dtypes``, on every path and back end: numpy's
    promotion over all of them (whichever rank returned which); booleans sum and multiply
    as counts (``int_``), as numpy's ``sum`` does."""
    if op == "mean":
        return mean_dtype(dtypes)
    dtype = np.result_type(*dtypes)
    return np.dtype(np.int_) if op in ("sum", "prod") and dtype.kind == "b" else dtype


def combine(op, parts, out: np.ndarray | None = None):
    """Combine ``parts`` (``[(weight, array), ...]``) with array op or ``"gather"``."""
    if op == "gather":
        return np.concatenate([np.atleast_1d(v) for _, v in parts], axis=0)
    values = [v for _, v in parts]
    if out is None and values[0].size > _BLOCK and len({v.shape for v in values}) == 1:
        # Large: block by block into the result, so that no temporary (a float64
        # accumulator for mean) is ever the size of the whole array.
        out = np.empty(values[0].shape, result_dtype(op, [v.dtype for v in values]))
        combine_into(op, parts, out)
        return out
    if op == "mean":
        dtype = mean_dtype([v.dtype for v in values])
        acc_dtype = np.promote_types(dtype, np.float64)
        total = float(sum(w for w, _ in parts))
        if total and any(w == 0 for w, _ in parts):  # weight 0: no rows, so nothing (not
            parts = [(w, v) for w, v in parts if w]  # even a NaN of a mean over no rows)
            values = [v for _, v in parts]
        weights = [w for w, _ in parts] if total else [1] * len(parts)
        total = total or len(parts)
        # sum(w * x) / sum(w): with whole weights (rows), as exact as one process's mean
        acc = np.multiply(values[0], weights[0], dtype=acc_dtype)
        for w, v in zip(weights[1:], values[1:]):
            acc += np.multiply(v, w, dtype=acc_dtype)
        acc /= total
        result = acc.astype(dtype, copy=False)
    else:  # in the dtype numpy's promotion gives over every part (booleans sum as counts)
        dtype = result_dtype(op, [v.dtype for v in values])
        values = [v.astype(dtype, copy=False) for v in values]
        result = functools.reduce(_ELEMENTWISE[op], values)
    if out is not None:
        out[...] = result
        return out
    return result


_BLOCK = 1 << 16  # elements combined at a time, so that temporaries stay in cache


def combine_into(op, parts, out: np.ndarray) -> None:
    """``combine(op, parts)`` written into ``out``, which has the parts' shape (array ops
    only): in one pass for elementwise ops, else block by block."""
    values = [v for _, v in parts]
    ufunc = _ELEMENTWISE.get(op)
    if ufunc is not None and all(v.dtype != bool for v in values):
        if len(values) == 1:
            np.copyto(out, values[0])
        else:
            ufunc(values[0], values[1], out=out)
        for v in values[2:]:
            ufunc(out, v, out=out)
        return
    flat = [(w, v.reshape(-1)) for w, v in parts]
    out = out.reshape(-1)
    for a in range(0, out.size, _BLOCK):
        b = min(a + _BLOCK, out.size)
        combine(op, [(w, v[a:b]) for w, v in flat], out=out[a:b])
