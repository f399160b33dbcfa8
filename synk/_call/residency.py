"""Data resident on the devices: each GPU rank's copy of a ``Data``, kept across calls.

``Data.to_device(mode)`` marks a ``Data``; a call on a GPU group then sends it as a
``ResidentRef`` (which Data, which version of its contents, which block), and each rank
keeps in ``PROCESS.resident`` its device copy: the whole array (``"replicate"``) or the rows the
rank would be given when the array is split (``"shard"``). A rank copies the array from
shared memory (page-locked) the first time, and again only when the master's ``Data``
changed since (its version or its block): never a stale value. The rows of a call are then
picked on the device, and given to the function as a copy of its own (as every input is),
so no input byte moves but the indices of an index ``batch=``.

On CPU ranks the shared memory is the device: nothing is kept, and the function gets its
rows of a resident ``Data`` (or the whole of a broadcast one) as a copy of its own, as GPU
ranks do. So on both back ends a write to them changes neither the ``Data`` nor any other
rank's rows: never a half-applied write.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .._process import PROCESS
from .._wire.arrays import _attach
from .rows import Rows, split_bounds


class Resident:
    """A resident ``Data`` as a call's argument on one rank: ``host`` is a read-only view of
    its block, to copy from when the rank's device copy is missing or stale."""

    __slots__ = ("key", "version", "mode", "name", "host")

    def __init__(self, key: int, version: int, mode: str, name: str, host: np.ndarray) -> None:
        self.key, self.version, self.mode, self.name, self.host = key, version, mode, name, host

    def __len__(self) -> int:
        return len(self.host)


class ResidentRef:
    """How a resident ``Data`` travels to the workers: by name, like a ``SharedArray``."""

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
    """This rank's device copy of ``resident``, made or refreshed if missing or stale."""
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
    """On CPU ranks (the shared memory is the device): ``picked`` rows of ``resident``, as
    a copy of their own, as GPU ranks get them."""
    if picked.index is not None:
        return np.take(resident.host, picked.index, axis=0)
    stop = picked.start + picked.count * picked.step
    return resident.host[picked.start:stop:picked.step].copy()


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
