"""``broadcast`` and ``allgather`` where only some ranks know what moves: the broadcast of
an array or structure from a root whose peers pass None, and the fused allgather of a
structure.

::

    the root's x --over the host--> host arrays in one message; for device arrays, a header
      --the device communicator, for device arrays--> the array, or the structure's buffer
"""
from __future__ import annotations

import pickle

import numpy as np

from ... import _tree
from ..._wire.arrays import dtype_token, dumps
from ...errors import add_note
from .. import context as _context, route as _route
from ..handle import Handle, then
from . import structures as _structures

_HEADER = "synk_device_header"  # field name of a broadcast's header
_REFUSED = "synk_refused"  # field name of a root's refusal of its own value (its error)


def _done(value, wait: bool):
    return value if wait else Handle.done(value)


def _received(got, root: int):
    """What a host broadcast brought: a structure's message unpacked, else the array (the
    root's refusal raised)."""
    if got.dtype.names == (_REFUSED,):
        _raise_refused(got, root)
    if got.dtype.names == (_structures.MARK,):
        description, buffer = _structures.read_message(got)
        return _structures.unpack(buffer, description)
    return got


def broadcast(x, root: int, wait: bool = True, out=None):
    """Rank ``root``'s ``x`` (an array, or a structure of them) on every rank (the others
    may pass None), in one collective on the communicator of the root's arrays (received
    into ``out`` where a communicator can)."""
    c = _context.collective("broadcast")
    comm = _route.host("broadcast")
    # (what the others pass is not used: only the root's is checked)
    x, packed = _root_value(x, comm, root) if c.rank == root else (None, None)
    on_gpu = c.device is not None and not c.device.is_host
    if not on_gpu or c.size == 1 and packed is None:
        if c.size == 1 and on_gpu:  # (x stays where it is: on the device or the host)
            comm.broadcast(None if c.device.is_device_array(x) else x, root)  # (checks root)
            return _done(x, wait)
        return then((comm.broadcast if wait else comm.ibroadcast)(x, root, out=out),
                    lambda got: _received(got, root), wait)
    if c.rank == root:
        return _sent_from_root(c, comm, x, packed, root, wait)
    got = comm.broadcast(None, root)
    if got.dtype.names != (_HEADER,):
        return _done(_received(got, root), wait)
    meta = pickle.loads(got.view(np.uint8).tobytes())
    on_device = _route.device("broadcast")
    if meta[0] == "structure":
        _, description, size = meta
        return _unpacked(on_device.ibroadcast(None, root, shape=(size,), dtype=np.uint8),
                         description, wait)
    _, shape, dtype = meta
    call = on_device.broadcast if wait else on_device.ibroadcast
    return call(None, root, shape=shape, dtype=np.dtype(dtype), out=out)


def _root_value(x, comm, root: int) -> tuple:
    """The root's ``x`` as it goes out (a host structure: one message), and for a
    structure ``(on, description, buffer)``, else None."""
    try:
        if not isinstance(x, _structures.STRUCTURES):  # (not a structure of arrays)
            if x is not None:
                _route.check_carried(x, "broadcast")
            return x, None
        leaves = _tree.flatten(x)[0]
        for leaf in leaves:
            _route.check_carried(leaf, "broadcast")
        on = _route.for_arrays(leaves, "broadcast")
        description, arrays = _structures.describe(x, on)
        buffer = _structures.pack(on.xp, arrays, description[1])
        if on is comm:
            x = _structures.host_message(description, buffer)
        return x, (on, description, buffer)
    except (TypeError, ValueError) as exc:
        # The root refuses its value: its refusal goes in the value's place, so that every
        # rank raises it, none waits for the value nor takes a later broadcast's for it.
        comm.broadcast(np.frombuffer(pickle.dumps((type(exc).__name__, str(exc))),
                                     [(_REFUSED, "u1")]), root)
        add_note(exc, "synk: every other rank of synk.comm.broadcast raises it too")
        raise


def _sent_from_root(c, comm, x, packed: tuple | None, root: int, wait: bool):
    """The root's side of a broadcast among GPU ranks: over the host, a header (a device
    array's shape and dtype, for NCCL's receive buffer, or a structure's description), a
    host array itself, or a structure of host arrays as one message; then the device array
    or buffer."""
    if packed is not None and packed[0] is comm or (
            packed is None and not c.device.is_device_array(x)):
        message = comm.broadcast(x, root)  # (one host message)
        return _done(_received(message, root), wait)
    meta = (("structure", packed[1], packed[2].size) if packed is not None else
            ("array", tuple(x.shape), dtype_token(x.dtype)))
    head = dumps(meta, "a structure's description")  # (a script's named tuple too)
    comm.broadcast(np.frombuffer(head, [(_HEADER, "u1")]), root)
    on_device = _route.device("broadcast")
    if packed is not None:
        return _unpacked(on_device.ibroadcast(packed[2], root), packed[1], wait)
    return on_device.broadcast(x, root) if wait else on_device.ibroadcast(x, root)


def _unpacked(handle: Handle, description, wait: bool):
    """The structure that ``handle``'s buffer holds (a Handle of it, unless ``wait``)."""
    return then(handle.wait() if wait else handle,
                lambda buffer: _structures.unpack(buffer, description), wait)


def _raise_refused(got, root: int):
    """Raise the root's refusal of its value (``got``: its error's type and text)."""
    kind, text = pickle.loads(got.view(np.uint8).tobytes())
    exc = (TypeError if kind == "TypeError" else ValueError)(text)
    add_note(exc, f"synk: rank {root}, the root, refused its value; every rank of "
                  "synk.comm.broadcast raises it")
    raise exc


def allgather_structure(tree, wait: bool = True):
    """Every rank's structure (the same on every rank; lengths along axis 0 may differ),
    each leaf joined along axis 0 in rank order: every rank's leaves in one message (host)
    or one NCCL allgather of their buffers."""
    what = "allgather" if wait else "iallgather"
    leaves = _tree.flatten(tree)[0]
    for leaf in leaves:
        _route.check_carried(leaf, what)
    comm = _route.for_arrays(leaves, what)
    host = _route.host(what)
    description, arrays = _structures.describe(tree, comm)
    buffer = _structures.pack(comm.xp, arrays, description[1])
    if comm is host:  # every rank's description and leaves in one message
        said = [_structures.read_message(m) for m in host.allgather_heads(
            _structures.host_message(description, buffer))]
        return _done(_joined(comm.xp, said, what), wait)
    said = host.allgather_objects((description, buffer.nbytes), what)
    sizes = [size for _, size in said]

    def finish(joined):
        starts = np.cumsum([0, *sizes])
        return _joined(comm.xp, [(d, joined[starts[r]:starts[r + 1]])
                                 for r, (d, _) in enumerate(said)], what)

    return then((comm.allgather if wait else comm.iallgather)(buffer, sizes), finish, wait)


def _joined(xp, said: list, what: str):
    """Every rank's structure (``said[r]``: rank r's description and buffer), leaf by leaf
    joined along axis 0."""
    template, specs, _ = said[0][0]
    if any(d[0] != template or len(d[1]) != len(specs) for d, _ in said):
        raise ValueError(f"synk.comm.{what}: the ranks passed different structures (their "
                         "keys or lengths differ); every rank passes the same structure")
    parts = [_tree.flatten(_structures.unpack(buffer, d, restore=False))[0]
             for d, buffer in said]
    joined = []
    for i in range(len(specs)):
        leaf = [xp.atleast_1d(p[i]) for p in parts]
        tails = {r: (tuple(a.shape[1:]), str(a.dtype)) for r, a in enumerate(leaf)}
        if len(set(tails.values())) > 1:
            listing = ", ".join(f"rank {r}: {t}" for r, t in tails.items())
            raise ValueError(f"synk.comm.{what} joins each leaf along axis 0, so its other "
                             f"dimensions and dtype must agree; leaf {i}: {listing}")
        joined.append(xp.concatenate(leaf, axis=0))
    return _tree.rebuild(template, iter(joined))
