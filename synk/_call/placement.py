"""Where a rank's arrays live during its share: inputs moved to its device, outputs back.

On CPU ranks (a host device) nothing here runs: the runner skips it. On GPU ranks, numpy
inputs (the rank's rows of scattered inputs, and broadcast arrays, once per call) are copied
to the device on the rank's stream, ``fn`` runs with the rank's device and stream current,
and what it returns is copied back to numpy (arrays, and arrays inside tuples, lists and
dicts returned for reduce op None), so that outputs are combined on the host.
"""
from __future__ import annotations

import numpy as np


def broadcast_to_device(device, args: list, kwargs: dict, spos, skeys) -> tuple:
    """``args`` and ``kwargs`` with every broadcast numpy array (not the scattered ones,
    which move slice by slice) copied to ``device``."""
    scattered = set(spos)
    args = [a if i in scattered or type(a) is not np.ndarray else device.to_device(a)
            for i, a in enumerate(args)]
    keys = set(skeys)
    kwargs = {k: v if k in keys or type(v) is not np.ndarray else device.to_device(v)
              for k, v in kwargs.items()}
    return args, kwargs


def rows_to_device(device, args: list, kwargs: dict, spos, skeys) -> tuple:
    """The scattered inputs of one slice (numpy rows) copied to ``device``."""
    if spos:
        args = list(args)
        for i in spos:
            args[i] = device.to_device(args[i])
    if skeys:
        kwargs = dict(kwargs)
        for key in skeys:
            kwargs[key] = device.to_device(kwargs[key])
    return args, kwargs


def to_host(device, value):
    """``value`` with device arrays copied back to numpy (also inside tuples, lists and
    dicts); other values unchanged."""
    if device.is_device_array(value):
        host = device.to_host(value)
        return host[()] if host.ndim == 0 else host  # a scalar, as numpy's reductions give
    if isinstance(value, tuple):
        return tuple(to_host(device, v) for v in value)
    if isinstance(value, list):
        return [to_host(device, v) for v in value]
    if isinstance(value, dict):
        return {k: to_host(device, v) for k, v in value.items()}
    return value
