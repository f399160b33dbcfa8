"""The reduce ops on device arrays (GPU ranks): combining a rank's slices where they were
computed, and what their outputs are.

The rules are ``synk._reduction``'s, the same as on the host, run with the device's array
module.
"""
from __future__ import annotations

import numpy as np

from .. import _reduction
from . import ops as _ops
from .ops import ARR, NP, PY, Share


def kind_of(device, value) -> int:
    """Like ``ops.kind_of``; a 0-d device array comes back as a numpy scalar (as numpy's
    reductions give), a larger one as an array."""
    if device.is_device_array(value):
        return ARR if value.ndim else NP
    return _ops.kind_of(value)


def as_device_array(device, value, op, index: int, fname: str):
    """``value`` as a device array fit for ``op`` (host numbers are copied over), or the
    error ``ops.as_array`` gives."""
    if device.is_device_array(value):
        if value.dtype.kind in "biufc" or (op == "gather" and not value.dtype.hasobject):
            return value
        raise TypeError(f"output {index} of {fname} is a device array of dtype {value.dtype}; "
                        f"reduce op {op!r} needs numbers or numeric arrays")
    return device.to_device(np.asarray(_ops.as_array(value, op, index, fname)))


def to_host(device, value):
    """``value`` with device arrays copied back to numpy (also inside tuples, lists and
    dicts); a 0-d array becomes a numpy scalar. Other values unchanged."""
    if device.is_device_array(value):
        host = device.to_host(value)
        return host[()] if host.ndim == 0 else host
    if isinstance(value, tuple):
        return tuple(to_host(device, v) for v in value)
    if isinstance(value, list):
        return [to_host(device, v) for v in value]
    if isinstance(value, dict):
        return {k: to_host(device, v) for k, v in value.items()}
    return value


def combine(xp, op, parts):
    """``ops.combine_parts`` on device arrays: ``parts`` is ``[(weight, array), ...]``."""
    if op == "gather":
        return xp.concatenate([xp.atleast_1d(v) for _, v in parts], axis=0)
    return _reduction.combine(op, parts, xp)


def combine_slices(device, results, reduce, fname, listed: bool) -> Share:
    """``runner.combine_slices`` for a GPU rank: array outputs stay on the device,
    combined there; outputs with op None come back to the host."""
    multi = isinstance(results[0][1], tuple)
    n_out = len(results[0][1]) if multi else 1
    ops = _ops.ops_for(reduce, n_out, fname)
    first = results[0][1] if multi else (results[0][1],)
    if any(op is not None and isinstance(v, (list, tuple, dict)) for v, op in zip(first, ops)):
        results, multi, ops = _ops.flatten_structures(results, multi, ops, fname)
        n_out = len(ops)
    per_slice = _ops.outputs_by_slice(results, multi, n_out, fname)
    outputs = []
    for i, op in enumerate(ops):
        values = [outs[i] for outs in per_slice]
        if op is None:
            hosts = [to_host(device, v) for v in values]
            outputs.append((PY, hosts if listed else hosts[0]))
            continue
        kind = max(kind_of(device, v) for v in values)
        arrays = [as_device_array(device, v, op, i, fname) for v in values]
        if len(arrays) > 1:
            _ops.check_shapes(op, {f"slice {j}": a.shape for j, a in enumerate(arrays)}, i,
                              fname)
            value = combine(device.xp, op, [(w, a) for (w, _), a in zip(results, arrays)])
        else:
            value = arrays[0]
        outputs.append((kind, value))
    return Share(sum(w for w, _ in results), multi, tuple(outputs))
