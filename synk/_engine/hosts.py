"""Hosts of an MPI job: which ranks share a machine, and copies (mirrors) of the master's
shared-memory blocks on the other hosts, which each host's first rank (its leader) fills
before each call that reads them::

    master                          leader of host h               other rank of host h
    FILL (h's rows) ------------->  write the mirrors; mark = rid
    (large rows, MPI) ----------->
    CALL ------------------------>  map the mirrors (mark >= rid)  wait for mark >= rid, map
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .._call.across_hosts import BulkRows, receive_rows
from .._wire import shm as _shm, sparse as _sparse
from .._wire.shm import ATTACHED
from ..errors import SynkError


@dataclass(frozen=True)
class Hosts:  # (not a NamedTuple: ``count`` would shadow tuple.count)
    """Which host each rank is on: ``of_rank[r]`` is an index into ``labels``; host 0 is
    the master's. Hosts are numbered in the order of their first rank."""

    of_rank: tuple
    labels: tuple

    @classmethod
    def from_keys(cls, keys) -> Hosts:
        """From each rank's (host key, label), in rank order."""
        index: dict = {}
        labels: list = []
        for key, label in keys:
            if key not in index:
                index[key] = len(labels)
                labels.append(label)
        return cls(tuple(index[key] for key, _ in keys), tuple(labels))

    @property
    def count(self) -> int:
        return len(self.labels)

    def ranks(self, host: int) -> list:
        return [r for r, h in enumerate(self.of_rank) if h == host]

    def leader(self, host: int) -> int:
        """The host's first rank, which fills its mirrors."""
        return self.of_rank.index(host)

    def label(self, rank: int) -> str:
        return self.labels[self.of_rank[rank]]

    def describe(self) -> str:
        """e.g. "host 'a': ranks [0, 1]; host 'b': ranks [2, 3]"."""
        return "; ".join(f"host {label!r}: ranks {self.ranks(h)}"
                         for h, label in enumerate(self.labels))


class Placement(NamedTuple):
    """What a rank learns of its host at start-up (sent in ``protocol.Init.mpi``)."""

    host: int
    label: str
    leader: int  # the host's first rank
    leader_prefix: str  # the leader's segment name prefix: its mirrors and mark live there

    @property
    def remote(self) -> bool:
        """On a host other than the master's: inputs come through the host's mirrors."""
        return self.host != 0


def mirror_name(leader_prefix: str, name: str) -> str:
    """The host's copy of the master's block ``name``: the same on every rank of the host."""
    return f"{leader_prefix}m{hashlib.sha1(name.encode()).hexdigest()[:24]}"


def _mark_name(leader_prefix: str) -> str:
    return f"{leader_prefix}mark"


class Mirrors:
    """A leader's mirrors (one block per master block it has rows of, under its own prefix and
    lock) and its host's mark. A FILL carries the rows the host lacks (``_call.across_hosts``);
    the mark then rises to the call's request id. So bytes cross the network once per host,
    and for a ``Data`` once per version."""

    def __init__(self, prefix: str, comm) -> None:
        self.prefix, self.comm = prefix, comm  # (comm: synk's MPI communicator)
        self._blocks: dict = {}  # master block name -> our copy
        self._mark = _shm._open(_mark_name(prefix), True, 64, "the host's input mark")
        self.error: BaseException | None = None  # why the last fill failed

    def fill(self, rid: int, drop, items) -> None:
        """Write one call's rows (never raises: a failure is raised by the call itself).
        Rows sent over MPI (``BulkRows``) are received whatever happens, in order, so that
        none is left for a later fill. An item whose ``clear`` is set first gives back the
        pages of the rows it held."""
        mark = np.ndarray(2, np.uint64, buffer=self._mark.buf)
        error = None
        try:
            for name in drop:
                self._drop(name)
        except Exception as exc:
            error = exc
        for name, size, shape, dtype, offset, clear, pieces in items:
            try:
                pieces = [(rows, receive_rows(self.comm, values)
                           if isinstance(values, BulkRows) else values)
                          for rows, values in pieces]
                if error is None:
                    self._write(name, size, shape, dtype, offset, clear, pieces)
            except Exception as exc:
                error = error or exc
        self.error = error
        mark[1] = rid if error is not None else 0
        mark[0] = rid  # last: the ranks read the rows once they see it (x86 keeps the order)

    def _write(self, name, size, shape, dtype, offset, clear, pieces) -> None:
        shm, new = self._block(name, size)
        view = _shm.ndarray(shm, shape, dtype, offset)
        if clear and not new:
            _sparse.clear(shm)
        starts, ends = _spans(view, offset, pieces)
        _sparse.reserve(shm, starts, ends, _MIRROR, fresh=clear or new)
        for rows, values in pieces:
            if rows is None:
                view[...] = values
            else:
                view[rows] = values

    def _block(self, name: str, size: int) -> tuple:
        """(our copy of the master's block ``name``, whether it was just made): sparse, as
        large as the master's, so that its rows sit where the ranks look for them and a
        later, larger value in the same block fits too; only the pages written take memory."""
        shm = self._blocks.get(name)
        if shm is not None:
            return shm, False
        shm = self._blocks[name] = _sparse.create(mirror_name(self.prefix, name), size, _MIRROR)
        return shm, True

    def _drop(self, name: str) -> None:
        shm = self._blocks.pop(name, None)
        if shm is not None:
            ATTACHED.release(name)
            _shm.destroy(shm)

    def close(self) -> None:
        for name in list(self._blocks):
            self._drop(name)
        _shm.destroy(self._mark)


_MIRROR = "this host's copy of a block of the master's inputs"


def _spans(view: np.ndarray, offset: int, pieces) -> tuple:
    """(starts, ends): the bytes of the block that ``pieces`` write into ``view``."""
    starts: list = []  # (ints and arrays of them, concatenated at the end)
    ends: list = []
    for rows, _ in pieces:
        if rows is None or view.ndim == 0:
            starts.append(offset)
            ends.append(offset + view.nbytes)
            continue
        row = view.strides[0]
        if isinstance(rows, slice):
            a, b, step = rows.indices(len(view))
            if step == 1:
                starts.append(offset + a * row)
                ends.append(offset + max(b, a) * row)
                continue
            rows = np.arange(a, b, step)
        first = offset + np.asarray(rows, np.int64) % max(len(view), 1) * row
        starts.append(first)
        ends.append(first + row)
    return (np.concatenate([np.atleast_1d(s) for s in starts]) if starts else np.empty(0),
            np.concatenate([np.atleast_1d(e) for e in ends]) if ends else np.empty(0))


class Remote:
    """A rank on a host other than the master's: maps its host's copies of the inputs in
    place of the master's blocks (installed as ``wire.REMOTE``). Unpickling a call, it
    waits for the host's mark to reach the call's request id, then maps the mirrors by
    name, read-only (a write would not reach the master's block)."""

    def __init__(self, placement: Placement, rank: int, mirrors: Mirrors | None) -> None:
        self.placement, self.rank, self.mirrors = placement, rank, mirrors
        self._mark_shm = (mirrors._mark if mirrors is not None
                          else _shm.attach(_mark_name(placement.leader_prefix)))
        self._mark = np.ndarray(2, np.uint64, buffer=self._mark_shm.buf)
        self.rid = 0  # the request being handled

    def attach(self, name: str, shape, dtype, offset: int) -> np.ndarray:
        """The host's copy of the master's array ``name`` for the request being handled."""
        self._wait_filled(self.rid)
        shm = ATTACHED.adopt(name, mirror_name(self.placement.leader_prefix, name))
        view = _shm.ndarray(shm, shape, dtype, offset)
        view.flags.writeable = False  # a write would stay on this host
        return view

    def _wait_filled(self, rid: int) -> None:
        mark, pause = self._mark, 20e-6
        while int(mark[0]) < rid:
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        if int(mark[1]) == rid:
            why = (repr(self.mirrors.error) if self.mirrors is not None
                   else f"see the error of rank {self.placement.leader}")
            raise SynkError(f"the inputs of this call could not be copied to host "
                            f"{self.placement.label!r} ({why})")

    def close(self) -> None:
        self._mark = None
        if self.mirrors is not None:
            self.mirrors.close()
        else:
            _shm.release(self._mark_shm)
