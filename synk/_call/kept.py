"""What the ranks keep between calls: this process's replicas of the shared variables
(``PROCESS.replicas``), with the master's new values installed on a worker (``apply``) and
the collectives every rank runs on them (``on_rank``), and each GPU rank's copy of a
``Data`` resident on the devices (``PROCESS.resident``, ``resolve``).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import comm
from .._devices.discovery import array_module
from .._process import PROCESS
from .._wire import protocol as P
from .._wire.arrays import _attach
from ..comm import route as _route
from ..errors import SynkError
from . import rank_copies
from .port import Port
from .rows import Rows, split_bounds, take_rows

# -- the shared variables' replicas ----------------------------------------------------------------

class Replicated:
    """A variable every rank holds a replica of (``synk.Shared``): passed as an argument,
    each rank's function gets its own replica (never split), sent as a ``ReplicaRef``."""

    id: int
    name: str
    _installed: int  # the generation of the group it was last installed on (-1: none)
    frame = None  # made from a torch tensor or a JAX array: its frame (``synk._arrays``)


def replica(sid: int, name: str = "") -> np.ndarray:
    """What a ``ReplicaRef`` becomes on a rank: that rank's replica."""
    PROCESS.touched.add(sid)
    try:
        return PROCESS.replicas[sid]
    except KeyError:
        raise SynkError(
            f"shared variable {name or sid!r} is not installed on this rank: pass shared "
            "variables to synk functions directly as arguments (not inside a list, a dict or "
            "another object), so that every rank gets its own replica"
        ) from None


class ReplicaRef:
    """How a shared variable passed as an argument travels: each rank rebuilds it as its
    own replica."""

    __slots__ = ("id", "name")

    def __init__(self, variable: Replicated) -> None:
        self.id, self.name = variable.id, variable.name

    def __reduce__(self):
        return replica, (self.id, self.name)


def install(port: Port, variables) -> None:
    """Send the variables not yet on the workers of the group behind ``port`` (and the ids
    to drop)."""
    todo = [v for v in variables if v._installed != port.generation]
    if not todo and not PROCESS.dropped:
        return
    if port.size > 1:
        drop = tuple(PROCESS.dropped)
        items = [(v.id, host_copy(PROCESS.replicas[v.id], port.device, copy=False))
                 for v in todo]
        send_values(port, port.workers, items, drop)
        del PROCESS.dropped[:len(drop)]
    for v in todo:
        PROCESS.replicas[v.id] = on_device(port.device, PROCESS.replicas[v.id])
        v._installed = port.generation


def reinstall(port: Port, generation: int, before: int | None) -> None:
    """After group ``generation`` was replaced by the one behind ``port``: every worker
    given back its own replicas as they were before request ``before`` of the old group
    (None: after its last), from the copies its ranks kept (``rank_copies``); a variable
    a rank kept no copy of gets rank 0's value there."""
    values = rank_copies.restored(generation, port.size, before)
    items: dict[int, list] = {rank: [] for rank in port.workers}
    restored = [v for sid in sorted({sid for sid, _ in values})
                if (v := PROCESS.variables.get(sid)) is not None and sid in PROCESS.replicas]
    for variable in restored:
        mine = host_copy(PROCESS.replicas[variable.id], port.device, copy=False)
        for rank in port.workers:
            items[rank].append((variable.id, values.get((variable.id, rank), mine)))
    for rank, given in items.items():
        if given:
            send_values(port, [rank], given, ())
    for variable in restored:
        PROCESS.replicas[variable.id] = on_device(port.device, PROCESS.replicas[variable.id])
        variable._installed = port.generation


def send_values(port: Port, ranks, items, drop) -> None:
    """Set the replicas ``items`` (``[(id, value)]``) on the workers ``ranks``, and have
    them forget the ids ``drop``."""
    ask(port, ranks, P.request(P.SHARED, items, drop, rank_copies.keep_for(port)),
        "while installing shared variables")


def ask(port: Port, ranks, payload: bytes, during: str) -> None:
    """Send ``payload`` to the workers ``ranks`` in a round of its own, and read their
    replies: the first failure among them (in rank order) raised."""
    port.send(ranks, payload, during, port.clock.next_round())
    for rank, reply in sorted(port.recv(ranks, during).items()):
        failed = P.failure(reply, rank)
        if failed is not None:
            raise failed


def host_copy(value, device, copy: bool = True) -> np.ndarray:
    """A numpy copy of a replica on ``device`` (``copy=False``: the replica itself when on
    the host)."""
    if isinstance(value, np.ndarray):
        return value.copy() if copy else value
    if device is not None and not device.is_host:
        return device.to_host(value)  # on the rank's stream
    return value.get()  # a device replica (CuPy's API, also the simulator's)


def on_device(device, value):
    """``value`` on ``device`` (a GPU rank's), or as it is on the host."""
    if device is None or device.is_host or device.is_device_array(value):
        return value
    return device.to_device(value)


def apply(items, drop, device=None) -> None:
    """On a worker: take the master's new values (onto ``device`` on a GPU rank) and forget
    collected variables."""
    for sid in drop:
        PROCESS.replicas.pop(sid, None)
        PROCESS.replica_arrays.pop(sid, None)
    for sid, value in items:
        value = np.array(value, copy=True)  # aligned and owned (unpickled: neither)
        PROCESS.replicas[sid] = on_device(device, value)
        PROCESS.touched.add(sid)


def _fused(ids) -> list:
    """[(dtype, [ids])]: one flat buffer per dtype."""
    groups: dict = {}
    for sid in ids:
        groups.setdefault(PROCESS.replicas[sid].dtype, []).append(sid)
    return list(groups.items())


def _flatten(ids):
    xp = array_module(PROCESS.replicas[ids[0]])
    return xp.concatenate([PROCESS.replicas[s].reshape(-1) for s in ids])


def _unflatten(ids, flat) -> None:
    pos = 0
    for sid in ids:
        dest = PROCESS.replicas[sid]
        dest[...] = flat[pos:pos + dest.size].reshape(dest.shape)
        pos += dest.size


def _everyones_shapes(communicator, ids) -> list:
    """[rank][i]: the shape of every rank's replica of variable ``ids[i]``."""
    mine = [tuple(PROCESS.replicas[sid].shape) for sid in ids]
    return communicator.host.allgather_objects(mine, "shared shapes")


def _size(shape) -> int:
    return int(np.prod(shape, dtype=np.int64))


def on_rank(arg):
    """The body of every shared-variable collective, run as a synk function by ``synk.shared``'s
    collectives: one per dtype over the variables given, fused into one flat buffer
    (``_fused``), by the replicas' communicator."""
    kind, ids, extra = arg
    r, n = comm.rank(), comm.size()
    PROCESS.touched.update(ids)
    if kind == "get":
        return PROCESS.replicas[ids[0]].copy() if r == extra else None
    if kind == "shape":
        return list(PROCESS.replicas[ids[0]].shape)  # a tuple would count as several outputs
    communicator = _route.for_arrays([PROCESS.replicas[s] for s in ids], kind)
    return COLLECTIVES[kind](communicator, ids, extra, r, n)


def _broadcast(communicator, ids, extra, r, n):
    """Every replica set to the master's: one broadcast per dtype."""
    for _dtype, group in _fused(ids):
        flat = _flatten(group)
        _unflatten(group, communicator.broadcast(flat, 0, shape=flat.shape, dtype=flat.dtype))


def _all_reduce(communicator, ids, extra, r, n):
    """Every replica set to the combination: one allreduce per dtype."""
    op, _ = extra
    for _dtype, group in _fused(ids):
        _unflatten(group, communicator.allreduce(_flatten(group), op))


def _reduce(communicator, ids, extra, r, n):
    """Rank ``root``'s replicas set to the combination: one reduce per dtype."""
    op, root = extra
    for _dtype, group in _fused(ids):
        combined = communicator.reduce(_flatten(group), op, root)
        if r == root:
            _unflatten(group, combined)


def _gather(communicator, ids, extra, r, n):
    """Every rank's replicas, on rank 0: one gather per dtype, one copy to the host per dtype.
    Returns {"fused": [variable][rank]} on rank 0 (a dict: one output, not a tuple of them)."""
    shapes = _everyones_shapes(communicator, ids)
    out: list = [[None] * n for _ in ids]
    for dtype, group in _fused(ids):
        index = [ids.index(sid) for sid in group]
        counts = [sum(_size(shapes[rank][i]) for i in index) for rank in range(n)]
        joined = communicator.gather(_flatten(group), counts, root=0, tail=(), dtype=dtype)
        if r:
            continue
        host, pos = communicator.to_host(joined), 0
        for rank in range(n):
            for i in index:
                size = _size(shapes[rank][i])
                out[i][rank] = host[pos:pos + size].reshape(shapes[rank][i])
                pos += size
    return {"fused": out} if r == 0 else None


def _all_gather(communicator, ids, extra, r, n):
    """Every replica set to all the ranks' replicas joined along axis 0: one allgather per
    dtype, split by the ranks' shapes (exchanged first, and checked)."""
    shapes = _everyones_shapes(communicator, ids)
    for i, sid in enumerate(ids):
        tails = {tuple(shapes[rank][i][1:]) for rank in range(n)}
        if len(tails) > 1:
            listing = ", ".join(f"rank {rank}: {shapes[rank][i]}" for rank in range(n))
            raise ValueError(f"synk.shared_all_gather joins along axis 0, so the other dimensions "
                             f"of shared variable {sid} must agree; got {listing}")
    xp = communicator.xp
    for _dtype, group in _fused(ids):
        index = [ids.index(sid) for sid in group]
        counts = [sum(_size(shapes[rank][i]) for i in index) for rank in range(n)]
        joined = communicator.allgather(_flatten(group), counts=counts)
        parts: dict = {sid: [] for sid in group}
        pos = 0
        for rank in range(n):
            for i, sid in zip(index, group):
                size = _size(shapes[rank][i])
                parts[sid].append(xp.atleast_1d(joined[pos:pos + size].reshape(shapes[rank][i])))
                pos += size
        for sid in group:
            PROCESS.replicas[sid] = xp.concatenate(parts[sid], axis=0)


def _scatter(communicator, ids, extra, r, n):
    """Rank r's replicas set to part r of the master's values (``extra``: their shapes and
    dtypes): the master sends each rank its parts, one message per rank and dtype."""
    layout = [(tuple(shape), np.dtype(dtype)) for shape, dtype in extra]
    by_dtype: dict = {}
    for i, (_, dtype) in enumerate(layout):
        by_dtype.setdefault(dtype, []).append(i)
    for dtype, index in by_dtype.items():
        bounds = {i: split_bounds(layout[i][0][0], n) for i in index}
        shapes = {rank: [(i, (bounds[i][rank + 1] - bounds[i][rank],) + layout[i][0][1:])
                         for i in index] for rank in range(n)}
        sizes = {rank: sum(_size(shape) for _, shape in shapes[rank]) for rank in range(n)}
        parts = None
        if r == 0:
            values = {i: np.ascontiguousarray(PROCESS.scattering[i], dtype=dtype) for i in index}
            parts = [np.concatenate([values[i][bounds[i][rank]:bounds[i][rank + 1]].reshape(-1)
                                     for i in index]) for rank in range(n)]
        mine = communicator.scatter(parts, 0, (sizes[r],), dtype)
        pos = 0
        for i, shape in shapes[r]:
            size = _size(shape)
            PROCESS.replicas[ids[i]] = mine[pos:pos + size].reshape(shape).copy()
            pos += size


COLLECTIVES = {"broadcast": _broadcast, "all_reduce": _all_reduce, "reduce": _reduce,
                "gather": _gather, "all_gather": _all_gather, "scatter": _scatter}


# -- Data resident on the devices ------------------------------------------------------------------

class Resident:
    """A resident ``Data`` as a call's argument on one rank: ``host`` is a read-only view of
    its block, to copy from when the rank's device copy is missing or stale."""

    __slots__ = ("key", "version", "mode", "name", "host")

    def __init__(self, key: int, version: int, mode: str, name: str, host: np.ndarray) -> None:
        self.key, self.version, self.mode, self.name, self.host = key, version, mode, name, host

    def __len__(self) -> int:
        return len(self.host)


class ResidentRef:
    """How a resident ``Data`` (marked by ``Data.to_device(mode)``) travels to the workers
    of a GPU group: by name, like a ``SharedArray``, with which Data, which version of its
    contents and which block."""

    __slots__ = ("key", "version", "mode", "name", "shape", "dtype")

    def __init__(self, key, version, mode, name, shape, dtype) -> None:
        self.key, self.version, self.mode = key, version, mode
        self.name, self.shape, self.dtype = name, shape, dtype

    def __reduce__(self):
        return _resident, (self.key, self.version, self.mode, self.name, self.shape, self.dtype)


def _resident(key, version, mode, name, shape, dtype) -> Resident:
    return Resident(key, version, mode, name, _attach(name, shape, dtype, 0, False))


class _Copy(NamedTuple):
    version: int
    name: str
    shape: tuple
    mode: str
    size: int  # ranks the shard was cut for
    array: Any  # on the device
    offset: int  # first row of the Data it holds



def resolve(device, resident: Resident, rank: int, size: int) -> _Copy:
    """This rank's device copy of ``resident``, made or refreshed if missing or stale,
    kept in ``PROCESS.resident``: the whole array (``"replicate"``) or the rows the rank would
    be given when the array is split (``"shard"``), copied again whenever the master's
    ``Data`` changed (its version or its block): never a stale value."""
    size = size if resident.mode == "shard" else 0  # a replica is the same for any split
    copy = PROCESS.resident.get(resident.key)
    host = resident.host
    if copy is not None and (copy.version, copy.name, copy.shape, copy.mode, copy.size) == (
            resident.version, resident.name, host.shape, resident.mode, size):
        return copy
    PROCESS.resident.pop(resident.key, None)  # free the old copy first: it may be as large
    if resident.mode == "shard":
        bounds = split_bounds(len(host), size)
        offset = bounds[rank]
        array = device.to_device(host[offset:bounds[rank + 1]])
    else:
        offset, array = 0, device.to_device(host)
    copy = PROCESS.resident[resident.key] = _Copy(resident.version, resident.name, host.shape,
                                          resident.mode, size, array, offset)
    return copy


def whole(device, resident: Resident):
    """The whole array on the device (a broadcast input: replicate mode only), as a copy of
    its own: a write to it changes neither the resident copy nor the Data."""
    return resolve(device, resident, 0, 1).array.copy()


def host_rows(resident: Resident, picked: Rows):
    """On CPU ranks: ``picked`` rows of ``resident`` as a copy of their own, as GPU ranks get
    them, so that a write changes neither the ``Data`` nor another rank's rows."""
    rows = take_rows(resident.host, picked)
    return rows if picked.index is not None else rows.copy()


def host_whole(value):
    """On CPU ranks: a resident Data broadcast whole, as a copy of its own; anything else
    as it is."""
    return value.host.copy() if type(value) is Resident else value


def rows(device, resident: Resident, picked: Rows, rank: int, size: int, indices: dict):
    """``picked`` rows of ``resident``, picked on the device, as a copy of their own; only
    an index moves to the device, once per piece for all the inputs that share it
    (``indices``: row offset -> the index on the device)."""
    copy = resolve(device, resident, rank, size)
    array, offset = copy.array, copy.offset
    n = len(array)
    if picked.index is not None:
        index = indices.get(offset)
        if index is None:
            host = np.asarray(picked.index, np.intp) - offset
            if len(host) and (host.min() < 0 or host.max() >= n):
                raise IndexError(f"rows {host.min() + offset}..{host.max() + offset} are not all "
                                 f"in this rank's resident rows {offset}..{offset + n - 1}")
            index = indices[offset] = device.to_device(host)
        return array[index]
    start = picked.start - offset
    stop = start + picked.count * picked.step
    if picked.count and (start < 0 or start + (picked.count - 1) * picked.step >= n):
        raise IndexError(f"rows from {picked.start} are not all in this rank's resident rows "
                         f"{offset}..{offset + n - 1}")
    return array[start:stop:picked.step].copy()


def forget(keys=(), names=()) -> None:
    """Drop the device copies of the Data ``keys`` and of those in the blocks ``names``."""
    if not PROCESS.resident:
        return
    names = set(names)
    for key in list(PROCESS.resident):
        if key in keys or PROCESS.resident[key].name in names:
            del PROCESS.resident[key]
