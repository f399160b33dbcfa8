"""Which communicator carries an operation of the running call: the rank's device one for
device arrays (NCCL, or the host-staged one), the host one for everything else; the one place
that tells host arrays from device arrays, so that what runs above it is written once.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays, _tree
from .._reduction import ARITHMETIC, LOGICAL
from ..errors import SynkError
from . import context as _context
from .communicator import Communicator
from .communicators import communicator_class
from .host import host_collectives as _c
from .host.host_comm import HostCommunicator
from .host.mailbox import OBJECTS_REFUSED


def host(what: str) -> HostCommunicator:
    """The running call's host communicator."""
    if _arrays.jax_staging():
        _staged(what)
    return _host_of(_context.require(what))


def _staged(what: str):
    """synk.comm on values that ``jax.jit`` does not trace, while it traces: refused."""
    raise SynkError(
        f"synk.comm.{what} was called while jax.jit traces a function, on values it does not "
        "trace: it would run once, now, and not each time the compiled function runs (the "
        "other ranks would wait for it in vain). Call it outside jax.jit, or give it JAX "
        "arrays the function traces (for a message, synk.comm.sendrecv with an array of its "
        "shape; for broadcast and scatter, an array of the result's shape on every rank)")


def _host_of(c) -> HostCommunicator:
    comm = c.host
    if comm is None:
        comm = c.host = communicator_class("host")(c.mesh, c.rank, c.size, c.device)
    return comm


def for_barrier(what: str = "barrier") -> Communicator:
    if _arrays.jax_staging():
        _staged(what)
    c = _context.collective(what)
    comm = c.host
    return comm if comm is not None else _host_of(c)


def device(what: str) -> Communicator:
    """The running call's device communicator (GPU ranks)."""
    c = _context.require(what)
    comm = c.device_comm
    if not c.attached:
        if comm is None and c.size == 1:  # a group of one computes on its device
            comm = c.device_comm = communicator_class("staged")(c.device, 1, 0)
        if comm is None:
            raise RuntimeError(f"synk.comm.{what}: this GPU rank has no device communicator "
                               "(NCCL); it is made by synk.fork()")
        comm.host = host(what)
        c.attached = True
    return comm


_NUMBERS = (int, float, complex, np.generic)  # leaves that go where the arrays go


def on_host_ranks(what: str) -> bool:
    """Whether this rank's collectives go over the host (a CPU rank), where a framework's
    GPU value (a CUDA tensor; a JAX array on JAX's default device of a machine with a GPU)
    travels as a host copy."""
    device = _context.require(what).device
    return device is None or device.is_host


def for_arrays(leaves: list, what: str) -> Communicator:
    """The communicator of a collective of ``leaves`` (all on this rank's device, or none
    of them; numbers go with the others)."""
    if _arrays.jax_staging():
        _staged(what)
    c = _context.collective(what)
    if c.device is None or c.device.is_host:  # (a CPU rank, in short)
        comm = c.host
        return comm if comm is not None else _host_of(c)
    on_device = [c.device.is_device_array(x) for x in leaves]
    if not any(on_device):
        return _host_of(c)
    if not all(d or isinstance(x, _NUMBERS) for d, x in zip(on_device, leaves)):
        raise TypeError(f"synk.comm.{what} got a mix of device and host arrays; pass all of "
                        "them on the device (or all as numpy arrays)")
    return device(what)


def check_carried(x, what: str, name: str = "x") -> None:
    """The one rule of what synk.comm carries, the same for every operation, back end and
    group size: no Python objects (dtype object), nor ragged nested lists (``name``: the
    argument, for the error). (Reductions need numbers: ``numbers``.)"""
    dtype = getattr(x, "dtype", None)
    if dtype is None and not isinstance(x, (int, float, complex, bool, str, bytes)):
        dtype = _arrays.as_array(x, f"synk.comm.{what}: {name}",  # (a list, or an object:
                                 _arrays.RAGGED_IN_COMM).dtype  # its array's)
    if dtype is not None and np.dtype(dtype).hasobject:
        raise TypeError(f"synk.comm.{what}: {OBJECTS_REFUSED}")


def as_array(x, what: str, name: str = "x"):
    """``x`` as an array where it is a list or a tuple, which must not be ragged (the error
    says what to do); a dict refused (numpy makes no array of it, but an object that no
    rank can send); anything else as it is."""
    if isinstance(x, (list, tuple)):
        return _arrays.as_array(x, f"synk.comm.{what}: {name}", _arrays.RAGGED_IN_COMM)
    if isinstance(x, dict):
        raise TypeError(f"synk.comm.{what}: {name} is a dict, which is no array; pass an "
                        "array (a list or tuple of numbers is one). synk.comm.allreduce "
                        "takes a dict of arrays whole, and the *_object forms any object")
    return x


def for_array(x, what: str) -> Communicator:
    """The communicator of ``x``, which may hold anything synk.comm carries."""
    check_carried(x, what)
    return for_arrays([x], what)


def numbers(x, what: str, op: str | None = None) -> Communicator:
    """The communicator of ``x`` (an array or a structure of them), each leaf checked to
    hold numbers (that ``op`` takes: integers and bool for a bitwise op)."""
    return numbers_of([x] if type(x) is np.ndarray else _tree.flatten(x)[0], what, op)


def numbers_of(leaves: list, what: str, op: str | None = None) -> Communicator:
    """``numbers`` of a value taken apart already: its ``leaves``."""
    for leaf in leaves:
        if type(leaf) is np.ndarray and op in _ANY_NUMBER and leaf.dtype.kind in _c.NUMBERS:
            continue  # (numbers, which every such op takes)
        _c.check_numbers(leaf, what, op)
    return for_arrays(leaves, what)


_ANY_NUMBER = (None, *ARITHMETIC, *LOGICAL)  # ops that take every number
