"""``synk.comm`` on device arrays (GPU ranks): collectives on the NCCL transport, the rest
staged through the host.

allreduce, allgather and reduce_scatter run on NCCL, on the rank's stream. broadcast sends a
small header (shape and dtype) over the host transport first, since the other ranks may pass
None and NCCL needs the size of the receiving buffer. Point-to-point messages of device
arrays are copied to the host and sent like host arrays, marked so that the receiver copies
them back to its device: unlike NCCL's sends, which wait for the matching receive, these
never deadlock two ranks that send to each other first (MPI's buffered semantics). A group
of one rank has no transport: the collectives are computed in place.
"""
from __future__ import annotations

import pickle

import numpy as np

from .._engine.wire import dtype_token
from . import _collectives as _c

_HEADER = "synk_device_header"  # field name of a broadcast's header
_WRAPPED = "synk_device_array"  # field name that marks a device array sent through the host


def is_device(context, x) -> bool:
    """True when ``x`` is an array on this rank's device (never on CPU ranks)."""
    device = context.device
    return device is not None and not device.is_host and device.is_device_array(x)


def _alone(context, x, op: str | None):
    """A collective of a one-rank group, on the device."""
    xp = context.device.xp
    result = xp.array(x, copy=True)
    if op == "mean" and result.dtype.kind not in "fc":
        result = result.astype(xp.float64)
    return result


class Done:
    """A finished operation, as a handle (a group of one rank computes in place)."""

    def __init__(self, value) -> None:
        self._value = value

    def wait(self):
        return self._value


def allreduce(context, x, op: str, wait: bool = True):
    """``x`` reduced over the ranks on the devices; ``wait=False``: a handle whose
    ``wait()`` gives it (launched on the transport's stream, waited for on an event)."""
    if context.size == 1:
        value = _alone(context, x, op)
        return value if wait else Done(value)
    transport = _transport(context, "allreduce")
    return transport.allreduce(x, op) if wait else transport.iallreduce(x, op)


def allgather(context, x, wait: bool = True):
    if context.size == 1:
        value = context.device.xp.atleast_1d(_alone(context, x, None))
        return value if wait else Done(value)
    transport = _transport(context, "allgather")
    return transport.allgather(x) if wait else transport.iallgather(x)


def reduce_scatter(context, x, op: str, wait: bool = True):
    if context.size == 1:
        value = _alone(context, x, op)
        return value if wait else Done(value)
    transport = _transport(context, "reduce_scatter")
    return transport.reduce_scatter(x, op) if wait else transport.ireduce_scatter(x, op)


def broadcast(context, tag, x, root: int, wait: bool = True):
    """Rank ``root``'s ``x`` on every rank: a device array if it was one at the root. The
    header (shape and dtype) goes over the host transport first, at once."""
    mesh, rank, size = context.mesh, context.rank, context.size
    if size == 1:
        return x if wait else Done(x)
    if rank == root:
        if not is_device(context, x):
            value = _c.broadcast(mesh, rank, size, tag, x, root)
            return value if wait else Done(value)
        meta = pickle.dumps((tuple(x.shape), dtype_token(x.dtype)))
        _c.broadcast(mesh, rank, size, tag, np.frombuffer(meta, [(_HEADER, "u1")]), root)
        transport = _transport(context, "broadcast")
        return transport.broadcast(x, root) if wait else transport.ibroadcast(x, root)
    got = _c.broadcast(mesh, rank, size, tag, None, root)
    if got.dtype.names != (_HEADER,):
        return got if wait else Done(got)
    shape, dtype = pickle.loads(got.view(np.uint8).tobytes())
    transport = _transport(context, "broadcast")
    if wait:
        return transport.broadcast(None, root, shape=shape, dtype=np.dtype(dtype))
    return transport.ibroadcast(None, root, shape=shape, dtype=np.dtype(dtype))


def wrap(context, x) -> np.ndarray:
    """A device array as a host array marked to go back to the device on arrival."""
    host = np.ascontiguousarray(context.device.to_host(x))
    return host.view(np.dtype([(_WRAPPED, host.dtype)]))


def unwrap(context, array):
    """What ``wrap`` made, back on this rank's device; anything else unchanged."""
    if array.dtype.names != (_WRAPPED,):
        return array
    host = array.view(array.dtype[_WRAPPED])
    device = context.device
    if device is None or device.is_host:
        return host  # a CPU rank of a mixed group keeps it on the host
    return device.to_device(host)


def _transport(context, what: str):
    transport = context.transport
    if transport is None:
        raise RuntimeError(f"synk.comm.{what}: this GPU rank has no device communicator "
                           "(NCCL); it is made by synk.fork()")
    return transport
