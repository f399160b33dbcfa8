"""Which communicator carries an operation of the running call: the rank's device one for
device arrays (NCCL, or the host-staged one), the host one for everything else.

This is the one place that tells host arrays from device arrays; what runs above it
(``synk.comm``, the fused allreduce, synk's own exchanges) is written once.
"""
from __future__ import annotations

import pickle

import numpy as np

from .. import _tree
from .._wire.arrays import dtype_token
from . import _collectives as _c, _context
from ._communicator import Communicator
from ._handle import Handle
from ._mailbox import OBJECTS_REFUSED
from .transports import communicator_class

_HEADER = "synk_device_header"  # field name of a broadcast's header


def host(what: str) -> Communicator:
    """The running call's host communicator."""
    return _host_of(_context.require(what))


def _host_of(c) -> Communicator:
    comm = c.host
    if comm is None:
        comm = c.host = communicator_class("host")(c.mesh, c.rank, c.size, c.device)
    return comm


def for_barrier() -> Communicator:
    return _host_of(_context.collective("barrier"))


def _on_gpu(c) -> bool:
    return c.device is not None and not c.device.is_host


def device(what: str) -> Communicator:
    """The running call's device communicator (GPU ranks)."""
    c = _context.require(what)
    comm = c.device_comm
    if comm is None:
        comm = c.transport
        if comm is None and c.size == 1:  # a group of one computes on its device
            comm = communicator_class("staged")(c.device, 1, 0)
        if comm is None:
            raise RuntimeError(f"synk.comm.{what}: this GPU rank has no device communicator "
                               "(NCCL); it is made by synk.fork()")
        comm.host = host(what)
        c.device_comm = comm
    return comm


def for_arrays(leaves: list, what: str) -> Communicator:
    """The communicator of a collective of ``leaves`` (all on this rank's device, or none
    of them)."""
    c = _context.collective(what)
    if not _on_gpu(c):
        return _host_of(c)
    on_device = [c.device.is_device_array(x) for x in leaves]
    if not any(on_device):
        return _host_of(c)
    if not all(on_device):
        raise TypeError(f"synk.comm.{what} got a mix of device and host arrays; pass all of "
                        "them on the device (or all as numpy arrays)")
    return device(what)


def check_carried(x, what: str) -> None:
    """The one rule of what synk.comm carries, the same for every operation, back end and
    group size: no Python objects (dtype object). (Reductions need numbers: ``numbers``.)"""
    dtype = getattr(x, "dtype", None)
    if dtype is None and not isinstance(x, (int, float, complex, bool, str, bytes)):
        dtype = np.asarray(x).dtype  # (a list, or an object: its array's)
    if dtype is not None and np.dtype(dtype).hasobject:
        raise TypeError(f"synk.comm.{what}: {OBJECTS_REFUSED}")


def for_array(x, what: str) -> Communicator:
    """The communicator of ``x``, which may hold anything synk.comm carries."""
    check_carried(x, what)
    return for_arrays([x], what)


def numbers(x, what: str) -> Communicator:
    """The communicator of ``x`` (an array or a structure of them), each leaf checked to
    hold numbers."""
    if type(x) is np.ndarray:  # (the usual case, in short)
        if x.dtype.kind not in _c.NUMBERS:
            _c.check_numbers(x, what)  # (raises)
        return for_arrays([x], what)
    leaves = _tree.flatten(x)[0]
    for leaf in leaves:
        _c.check_numbers(leaf, what)
    return for_arrays(leaves, what)


def broadcast(x, root: int, wait: bool = True):
    """Rank ``root``'s ``x`` on every rank, on the communicator of the root's array: the
    other ranks may pass None, so on GPU ranks the root first says over the host whether it
    is a device array, and its shape and dtype (NCCL needs the receiving buffer's size)."""
    c = _context.collective("broadcast")
    if x is not None:  # (the root's, and what the others pass: the same rule on each)
        check_carried(x, "broadcast")
    comm = host("broadcast")
    if not _on_gpu(c):
        return comm.broadcast(x, root) if wait else comm.ibroadcast(x, root)
    if c.size == 1:  # (x stays where it is: on the device or the host)
        comm.broadcast(None if c.device.is_device_array(x) else x, root)  # (checks root)
        return x if wait else Handle.done(x)
    if c.rank == root:
        if not c.device.is_device_array(x):  # the root's host array is the header itself
            value = comm.broadcast(x, root)
            return value if wait else Handle.done(value)
        meta = pickle.dumps((tuple(x.shape), dtype_token(x.dtype)))
        comm.broadcast(np.frombuffer(meta, [(_HEADER, "u1")]), root)
        on_device = device("broadcast")
        return on_device.broadcast(x, root) if wait else on_device.ibroadcast(x, root)
    got = comm.broadcast(None, root)
    if got.dtype.names != (_HEADER,):
        return got if wait else Handle.done(got)
    shape, dtype = pickle.loads(got.view(np.uint8).tobytes())
    on_device = device("broadcast")
    if wait:
        return on_device.broadcast(None, root, shape=shape, dtype=np.dtype(dtype))
    return on_device.ibroadcast(None, root, shape=shape, dtype=np.dtype(dtype))
