"""A function's outputs and their reduce ops: the ops' names (``gather`` and None besides the
array ops of ``synk._reduction``), the checks, what kind of value the caller gets, and a
rank's slices combined where they were computed, on the host (``HostValues``) or on a GPU
rank's device (``DeviceValues``).
"""
from __future__ import annotations

import numbers

import numpy as np

from .. import _reduction, _tree
from .._reduction import (
    ARR,
    NP,
    OPS as ARRAY_OPS,
    PY,
    Kind,
    canonical,
    check_dtype,
    combine,
    kind_of,
    restore_kind,
    ruled,
    widest,
)
from .records import Share

# -- outputs and reduce ops ------------------------------------------------------------------------

# outputs no framework owns, which need no look for frames (``frames.native_outputs``)
PLAIN_OUTPUTS = frozenset([np.ndarray, float, int, bool, type(None), np.float64, np.float32])


def check_op(op):
    """Return the canonical name of reduce op ``op`` or raise ValueError."""
    try:
        return canonical(op, ARRAY_OPS + ("gather", None), rule=False)  # (ruled per call:
        # a Function outlives the group whose SYNK_MEAN it was made in, ``ops_for``)
    except ValueError:
        raise ValueError(
            f"unknown reduce op {op!r}; use one of 'mean' (or 'avg'), 'sum', 'prod', 'max', "
            "'min', 'band', 'bor', 'bxor', 'land', 'lor', 'lxor', 'gather', or None for a "
            "list of each rank's result"
        ) from None


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
        return (ruled(reduce),) * n_outputs
    if len(reduce) != n_outputs:
        raise ValueError(
            f"{fname} returned {n_outputs} output(s) but reduce gives {len(reduce)} ops "
            f"{reduce!r}; give one op per output, or a single op for all"
        )
    return tuple(ruled(op) for op in reduce)


def leaf_ops(ops, templates) -> tuple:
    """One op per leaf of outputs whose structures are ``templates`` (None: a leaf)."""
    return tuple(op for op, template in zip(ops, templates)
                 for _ in range(_tree.count(template)))


def _slice_outputs(value, multi: bool, n_out: int, fname: str) -> tuple:
    """A slice's value as the tuple of its ``n_out`` outputs; one that disagrees raises."""
    outs = value if multi else (value,)
    if isinstance(value, tuple) != multi or len(outs) != n_out:
        raise ValueError(f"{fname} returned a different number of outputs on different slices")
    return outs


def flatten_structures(results, multi: bool, ops, fname: str):
    """Each slice's outputs with their structures flattened into leaves: (results as
    tuples of leaves, each output's template, one op per leaf)."""
    flat, layout = [], None
    for weight, value in results:
        outs = _slice_outputs(value, multi, len(ops), fname)
        leaves: list = []
        templates: list = []
        for v, op in zip(outs, ops):
            if op is None or not isinstance(v, (list, tuple, dict)):
                leaves.append(v)
                templates.append(None)
            else:
                sub, template = _tree.flatten(v)
                leaves += sub
                templates.append(template)
        this = tuple(templates)
        if layout is not None and this != layout:
            raise ValueError(f"{fname} returned outputs of different structures on different "
                             "slices; return the same lists, tuples and dicts every time")
        layout = this
        flat.append((weight, tuple(leaves)))
    return flat, layout, leaf_ops(ops, layout)


def check_same_outputs(fname: str, layouts: dict) -> None:
    """The ranks returned outputs of one structure: ``layouts`` maps each rank that had
    rows to its share's ``Share.layout()``."""
    ranks = sorted(layouts)
    first = layouts[ranks[0]]
    for r in ranks:
        if first[1] is not None and layouts[r][1] != first[1]:
            raise ValueError(
                f"{fname} returned outputs of different structures on rank {ranks[0]} and "
                f"rank {r}; return the same lists, tuples and dicts on every rank"
            )
        if layouts[r] != first:
            raise ValueError(
                f"{fname} returned {first[2]} output(s) on rank {ranks[0]} but "
                f"{layouts[r][2]} on rank {r}; return the same structure everywhere"
            )


def share_ops(reduce, share: Share, fname: str) -> tuple:
    """The op of each of a share's outputs (of each leaf, when some are structures)."""
    if type(reduce) is not tuple and share.templates is None:  # (the usual case, in short)
        return (ruled(reduce),) * len(share.outputs)
    if share.templates is not None:
        return leaf_ops(ops_for(reduce, len(share.templates), fname), share.templates)
    return ops_for(reduce, len(share.outputs), fname)


_NUMBERS = frozenset([float, int, bool, complex, np.float64, np.float32, np.int64])
_INT64 = 1 << 63


def as_array(value, op, index: int, fname: str) -> np.ndarray:
    """``value`` as a numeric array for ``op``, or a clear error."""
    kind = type(value)
    if op not in _reduction.PICKY:  # (the usual cases, in short)
        if kind is np.ndarray and value.dtype.kind in "biufc":
            return value
        if kind in _NUMBERS and (kind is not int or -_INT64 <= value < _INT64):
            arr = np.asarray(value)
            if arr.dtype.kind in "biufc":
                return arr
    if op == "gather" and isinstance(value, np.ndarray) and not value.dtype.hasobject:
        return value
    if kind is int and op is not None and not -_INT64 <= value < _INT64:
        raise OverflowError(
            f"output {index} of {fname} is the Python int {value}, past the range of int64, "
            "in which synk combines Python ints; return a float, or use reduce=None to get "
            "each rank's int as it is")
    if isinstance(value, (np.ndarray, np.generic, numbers.Number)):
        arr = np.asarray(value)
        if arr.dtype.kind in "biufc":
            if op in _reduction.PICKY:
                _reduction.check_dtype(op, arr.dtype, f"output {index} of {fname}")
            return arr
    raise TypeError(
        f"output {index} of {fname} is a {type(value).__name__}"
        + (f" of dtype {np.asarray(value).dtype}" if isinstance(value, np.ndarray) else "")
        + f"; reduce op {op!r} needs numbers or numeric arrays. "
        "Return arrays, or use reduce=None to get each rank's result as it is"
    )


def combine_output(op, parts, kind: Kind):
    """One output combined over the ranks' ``parts`` (``[(weight, array), ...]``) as the
    caller gets it: ``gather`` joined along axis 0, an array op's result in the kind the
    ranks returned (a Python number, a numpy scalar or an array)."""
    if op == "gather":
        return combine_parts(op, parts)
    if kind == PY:
        check_python_ints(op, parts)
    result = combine(op, parts)
    if kind == ARR and type(result) is np.ndarray:
        return result
    if type(result) is float:  # (numbers combined as numbers: float64)
        return number_as(result, kind)
    return restore_kind(np.asarray(result), kind)


def check_python_ints(op, parts) -> None:
    """``OverflowError`` where the sum or product of Python ints (``parts``: their 0-d
    arrays, as they travel) leaves the range of int64, in which they travel and combine:
    Python's ints do not wrap, numpy's do."""
    if op not in ("sum", "prod"):
        return
    values = [v for _, v in parts]
    dtype = _reduction.result_dtype(op, [v.dtype for v in values])
    if dtype.kind not in "iu" or any(v.dtype.kind not in "iu" for v in values):
        return
    exact = 0 if op == "sum" else 1
    for v in values:
        exact = exact + int(v) if op == "sum" else exact * int(v)
    info = np.iinfo(dtype)
    if not info.min <= exact <= info.max:
        raise OverflowError(
            f"the {op} of the Python ints the ranks returned is {exact}, past the range of "
            f"{dtype}, in which synk combines them; return floats (or a numpy array of "
            "dtype object with reduce=None, combined by hand) for numbers that large")


def number_as(number: float, kind: Kind):
    """``number``, combined from the ranks' numbers, as the widest ``kind`` of value they
    returned: the number, a numpy float64, or a 0-d array."""
    if kind == PY:
        return number
    return np.float64(number) if kind == NP else np.asarray(number)


def combine_parts(op, parts, xp=np):
    """``parts`` (``[(weight, array), ...]`` of module ``xp``; weight: the rows processed)
    combined with an array op by ``synk._reduction.combine``, or for ``"gather"`` joined along
    axis 0 (0-d parts one row each)."""
    if op == "gather":
        return xp.concatenate([xp.atleast_1d(v) for _, v in parts], axis=0)
    return combine(op, parts, xp)


def check_shapes(op, shapes: dict, index: int, fname: str) -> None:
    """Array ops need one shape everywhere, gather the same trailing dimensions; ``shapes``
    maps a label ("rank 2", "slice 1") to the shape produced there."""
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


def _kept(value):
    """An output with op None, as the master gets it."""
    return value


class HostValues:
    """What a CPU rank makes of the values ``fn`` returns: numpy arrays, combined by numpy.
    A GPU rank's counterpart (``DeviceValues``) keeps arrays on its device."""

    kind_of = staticmethod(kind_of)
    as_array = staticmethod(as_array)
    kept = staticmethod(_kept)

    @staticmethod
    def together(arrays: list) -> tuple:
        """(``arrays``, their array module) to combine them with."""
        return arrays, np


HOST = HostValues()


def combine_slices(results, reduce, fname, listed: bool = False, values=HOST) -> Share:
    """Normalise each slice's return value and combine the slices output by output, the
    same on CPU and GPU ranks (``values`` says how a rank holds its arrays). Outputs with
    reduce op None are kept as they are (a list of the slices' when ``listed``); a list,
    tuple or dict of arrays is combined leaf by leaf (its structure in ``templates``)."""
    weight, first = results[0]
    multi = isinstance(first, tuple)
    if not multi:
        first = (first,)
    ops = ops_for(reduce, len(first), fname)
    if len(results) == 1 and not listed:  # one slice (the usual case): nothing to combine
        return _one_slice(weight, multi, first, ops, fname, values)
    templates = None
    for v, op in zip(first, ops):
        if op is not None and isinstance(v, (list, tuple, dict)):
            results, templates, ops = flatten_structures(results, multi, ops, fname)
            break
    per_slice = [leaves for _, leaves in results] if templates is not None else [
        _slice_outputs(value, multi, len(ops), fname) for _, value in results]
    outputs = _slices_combined(results, per_slice, ops, listed, values, fname)
    return Share(sum(w for w, _ in results), multi, tuple(outputs), templates)


def _slices_combined(results, per_slice: list, ops: tuple, listed: bool, values,
                     fname: str) -> list:
    """``combine_slices``' outputs, (kind, value) each: ``per_slice``'s outputs (each
    slice's, of ``results``) combined output by output with ``ops``."""
    outputs = []
    for i, op in enumerate(ops):
        got = [outs[i] for outs in per_slice]
        if op is None:
            kept = [values.kept(v) for v in got]
            outputs.append((PY, kept if listed else kept[0]))
            continue
        kind = widest([values.kind_of(v) for v in got])
        arrays = [values.as_array(v, op, i, fname) for v in got]
        if len(arrays) > 1:
            check_shapes(op, {f"slice {j}": a.shape for j, a in enumerate(arrays)}, i, fname)
            if kind == PY:  # (Python numbers: host arrays on every rank)
                check_python_ints(op, [(0, a) for a in arrays])
            arrays, xp = values.together(arrays)
            value = combine_parts(op, [(w, a) for (w, _), a in zip(results, arrays)], xp)
        else:
            value = arrays[0]
        outputs.append((kind, value))
    return outputs


def plain_output(weight: int, value, reduce, fname: str) -> Share | None:
    """``combine_slices`` of one slice on a CPU rank where ``fn`` returned one output of a
    ``PLAIN_OUTPUTS`` kind and ``reduce`` is one op (the usual call, in short); None otherwise."""
    if type(value) not in PLAIN_OUTPUTS or type(reduce) is tuple:
        return None
    return _one_slice(weight, False, (value,), (reduce,), fname, HOST)


def _one_slice(weight, multi: bool, outs: tuple, ops: tuple, fname: str, values) -> Share:
    """``combine_slices`` of one slice: its outputs normalised, structures taken apart
    into leaves (as ``flatten_structures`` does)."""
    if len(outs) == 1:  # one output (the usual case), in short
        v, op = outs[0], ops[0]
        if op is None:
            return Share(weight, multi, ((PY, values.kept(v)),))
        if not isinstance(v, (list, tuple, dict)):
            return Share(weight, multi, ((values.kind_of(v), values.as_array(v, op, 0, fname)),))
    outputs: list = []
    templates: list | None = None
    for n, (v, op) in enumerate(zip(outs, ops)):
        if op is None:
            outputs.append((PY, values.kept(v)))
            template = None
        elif isinstance(v, (list, tuple, dict)):
            leaves, template = _tree.flatten(v)
            for leaf in leaves:
                outputs.append((values.kind_of(leaf),
                                values.as_array(leaf, op, len(outputs), fname)))
        else:
            outputs.append((values.kind_of(v), values.as_array(v, op, len(outputs), fname)))
            template = None
        if template is not None and templates is None:
            templates = [None] * n
        if templates is not None:
            templates.append(template)
    return Share(weight, multi, tuple(outputs), None if templates is None else tuple(templates))


# -- a GPU rank's outputs --------------------------------------------------------------------------

#: Host outputs up to this size (a Python number, a numpy scalar, a small array) stay on the
#: host: they are combined there (``collect``: small on every rank), so a copy to
#: the device and back would cost two copies and a wait for nothing.
HOST_OUTPUT_BYTES = 4096


def to_host(device, value):
    """``value`` with device arrays copied back to numpy (also inside tuples, lists and
    dicts); a 0-d array becomes a numpy scalar. Other values unchanged."""
    if device.is_device_array(value):
        host = device.to_host(value)
        return host[()] if host.ndim == 0 else host
    if isinstance(value, (tuple, list)):
        items = [to_host(device, v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value  # (nothing on the device inside: the value itself, of its type)
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        moved = {k: to_host(device, v) for k, v in value.items()}
        return value if all(moved[k] is v for k, v in value.items()) else moved
    return value


class DeviceValues:
    """What a GPU rank makes of the values ``fn`` returns (see ``ops.HostValues``): arrays
    on its device, combined there by ``synk._reduction``'s rules, the same as on the host,
    run with the device's array module; outputs with op None copied back to the host."""

    def __init__(self, device) -> None:
        self.device, self.xp = device, device.xp

    def kind_of(self, value) -> int:
        """Like ``ops.kind_of``; a 0-d device array comes back as a numpy scalar (as numpy's
        reductions give), a larger one as an array."""
        if self.device.is_device_array(value):
            return ARR if value.ndim else NP
        return kind_of(value)

    def as_array(self, value, op, index: int, fname: str):
        """``value`` as an array fit for ``op``: a device array, or a small host value kept on
        the host (``HOST_OUTPUT_BYTES``; larger ones are copied over), or the error
        ``ops.as_array`` gives."""
        if self.device.is_device_array(value):
            if value.dtype.kind in "biufc":
                check_dtype(op, value.dtype, f"output {index} of {fname}")
            if value.dtype.kind in "biufc" or (op == "gather" and not value.dtype.hasobject):
                return value
            raise TypeError(f"output {index} of {fname} is a device array of dtype "
                            f"{value.dtype}; reduce op {op!r} needs numbers or numeric arrays")
        host = np.asarray(as_array(value, op, index, fname))
        return host if host.nbytes <= HOST_OUTPUT_BYTES else self.device.to_device(host)

    def together(self, arrays: list) -> tuple:
        """(``arrays``, their array module): numpy when all are on the host, else all on the
        device."""
        if not any(self.device.is_device_array(a) for a in arrays):
            return arrays, np
        return [a if self.device.is_device_array(a) else self.device.to_device(a)
                for a in arrays], self.xp

    def kept(self, value):
        return to_host(self.device, value)
