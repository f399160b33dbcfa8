"""What a GPU rank makes of its outputs: device arrays, their kinds, their copies back to
the host (``DeviceValues``, the device side of ``ops.combine_slices``, which combines a
rank's slices where they were computed).

The rules are ``synk._reduction``'s, the same as on the host, run with the device's array
module.
"""
from __future__ import annotations

import numpy as np

from .._reduction import ARR, NP, check_dtype
from . import ops as _ops


def kind_of(device, value) -> int:
    """Like ``ops.kind_of``; a 0-d device array comes back as a numpy scalar (as numpy's
    reductions give), a larger one as an array."""
    if device.is_device_array(value):
        return ARR if value.ndim else NP
    return _ops.kind_of(value)


#: Host outputs up to this size (a Python number, a numpy scalar, a small array) stay on the
#: host: they are combined there (``device_collect``: small on every rank), so a copy to
#: the device and back would cost two copies and a wait for nothing.
HOST_OUTPUT_BYTES = 4096


def as_device_array(device, value, op, index: int, fname: str):
    """``value`` as an array fit for ``op``: a device array, or a small host value kept on
    the host (``HOST_OUTPUT_BYTES``; larger ones are copied over), or the error
    ``ops.as_array`` gives."""
    if device.is_device_array(value):
        if value.dtype.kind in "biufc":
            check_dtype(op, value.dtype, f"output {index} of {fname}")
        if value.dtype.kind in "biufc" or (op == "gather" and not value.dtype.hasobject):
            return value
        raise TypeError(f"output {index} of {fname} is a device array of dtype {value.dtype}; "
                        f"reduce op {op!r} needs numbers or numeric arrays")
    host = np.asarray(_ops.as_array(value, op, index, fname))
    return host if host.nbytes <= HOST_OUTPUT_BYTES else device.to_device(host)


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
    on its device, combined there; outputs with op None copied back to the host."""

    def __init__(self, device) -> None:
        self.device, self.xp = device, device.xp

    def kind_of(self, value) -> int:
        return kind_of(self.device, value)

    def as_array(self, value, op, index: int, fname: str):
        return as_device_array(self.device, value, op, index, fname)

    def together(self, arrays: list) -> tuple:
        """(``arrays``, their array module): numpy when all are on the host, else all on the
        device."""
        if not any(self.device.is_device_array(a) for a in arrays):
            return arrays, np
        return [a if self.device.is_device_array(a) else self.device.to_device(a)
                for a in arrays], self.xp

    def kept(self, value):
        return to_host(self.device, value)
