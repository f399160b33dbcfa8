"""Under MPI, a call across hosts: the rows of its shared-memory inputs that each other host
reads, sent by the master before the call and written into that host's copies by its
leader::

    master: AcrossHosts.send_inputs   the rows each host's ranks read, cut with the call's plan
        -- protocol.FILL, small rows inline -------------->  the host's leader (_engine.hosts)
        -- large rows over MPI (FILL_TAG), inputs_sent --->  receive_rows
"""
from __future__ import annotations

import functools
import hashlib
import os
import select
import time
from typing import NamedTuple

import numpy as np

from .._wire import protocol as P
from .._wire.arrays import DtypeToken, SharedArray, dtype_token
from .._wire.shm import SHM_DIR
from ..comm.host.mpi_mesh import Backoff, mpi_errors
from .kept import ResidentRef
from .port import Port
from .rows import split_bounds

# -- the ranks' side -------------------------------------------------------------------------------

FILL_TAG = 4  # on synk's communicator: rows of inputs for a host's copies (synk.comm's
# messages use 1 and 2)


class BulkRows(NamedTuple):
    """Rows of a FILL that follow over MPI (``FILL_TAG``, from rank 0), in their order."""

    shape: tuple
    dtype: DtypeToken


BULK_BYTES = 64 << 10  # rows of at least this many bytes go over MPI, not the control socket


def receive_rows(comm, bulk: BulkRows) -> np.ndarray:
    """A host's leader: the next rows the master posted to it over MPI, as ``bulk`` says."""
    from mpi4py import MPI

    array = np.empty(bulk.shape, np.dtype(bulk.dtype))
    with mpi_errors(MPI):
        request = comm.Irecv([_bytes(array), MPI.BYTE], 0, FILL_TAG)
        backoff = Backoff()
        while not request.Test():
            backoff.wait()
    return array


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


# -- the master's side -----------------------------------------------------------------------------

class AcrossHosts:
    """The master's steps of a call whose ranks span hosts (the ``port.HostSteps`` of the MPI
    launch): made by the MPI launch over ``hosts`` (an ``_engine.hosts.Hosts``), the job's
    communicator ``comm`` and the workers' control ``channels`` (whose hang-up is a rank's
    death). Large outputs are combined by MPI's collectives (``mpi_collect``). ``held``: ``(host,
    block name) -> (contents, rows)`` of each other host's copies; ``contents`` is a ``Data``'s
    ``(key, version, shape, dtype, offset)`` (None for a staging block). A copy that matches the
    call's is not sent again (a ``Data`` is read-only on every rank in such a job; the master's
    writes count its version); staging rows go every call."""

    spans = True

    def __init__(self, hosts, comm, channels: dict, device_is_host: bool) -> None:
        self.hosts, self.comm, self.channels = hosts, comm, channels
        self.remote_hosts = tuple(range(1, hosts.count))
        self.device_is_host = device_is_host
        self.held: dict = {}
        self.sending: list = []  # (MPI request, the rows it reads, leader) of this call

    def send_inputs(self, port: Port, prep, drop, during: str, rid: int,
                    whole: bool = False) -> dict:
        """Send each other host's leader its rows of ``prep``'s shared inputs that it lacks (and the
        blocks it may forget, ``drop``) as request ``rid``, before the call: rows of ``BULK_BYTES``
        or more over MPI (finished by ``inputs_sent``), smaller ones inline. Returns bytes sent by
        leader rank. A scattered input's rows are cut with the call's plan (every row if
        ``whole``: a call of many steps); a broadcast one goes whole; a resident ``Data`` as its
        replica or its ranks' shards."""
        inputs = list(_shared_inputs(port.size, prep, whole))
        if not inputs and not drop:
            return {}
        if drop and self.held:  # (the copies of the blocks dropped go)
            dropped = set(drop)
            self.held = {k: v for k, v in self.held.items() if k[1] not in dropped}
        may_clear = self.device_is_host  # (a GPU may have the pages page-locked: keep them)
        hosts, sent = self.hosts, {}
        for host in self.remote_hosts:
            ranks, leader = hosts.ranks(host), hosts.leader(host)
            items, nbytes = [], 0
            for ref, local, contents, runs in inputs:
                pieces, rows = _pieces(local, runs(ranks), prep.plan.selection)
                held = self.held.get((host, ref.name))
                if contents is not None and held == (contents, rows):
                    continue  # the host has these rows of this version already
                self.held[(host, ref.name)] = (contents, rows)
                clear = may_clear and held is not None and held[1] != rows
                nbytes += sum(values.nbytes for _, values in pieces)
                pieces = [(rows, self._post(leader, values)) for rows, values in pieces]
                items.append((ref.name, _block_size(ref.name), ref.shape, ref.dtype, ref.offset,
                              clear, pieces))
            # (sent even with nothing in it: the host's ranks wait for its mark)
            port.send([leader], P.request(P.FILL, tuple(drop), items), during, rid)
            sent[leader] = nbytes
        return sent

    def _post(self, leader: int, values: np.ndarray):
        """``values`` for a FILL: themselves when small, else a ``BulkRows`` after posting them
        to ``leader`` over MPI (``inputs_sent`` waits for the send)."""
        if values.nbytes < BULK_BYTES:
            return values
        from mpi4py import MPI

        values = np.ascontiguousarray(values)
        with mpi_errors(MPI):
            request = self.comm.Isend([_bytes(values), MPI.BYTE], leader, FILL_TAG)
        self.sending.append((request, values, leader))
        return BulkRows(values.shape, dtype_token(values.dtype))

    def inputs_sent(self, port: Port, during: str) -> None:
        """Master, once the call is out: wait until every host's leader has the rows posted to
        it over MPI (they read them while handling the FILL, before the call), within the
        call's deadline, watching the leaders' control channels for a death."""
        if not self.sending:
            return
        requests = [request for request, _, _ in self.sending]
        leaders = sorted({leader for _, _, leader in self.sending})
        self._wait_mpi(port, requests, leaders, during)
        self.sending.clear()

    def call_failed(self) -> None:
        """A call failed, maybe a host's copy half-written: send everything again next time."""
        self.held.clear()
        self.sending.clear()

    def _wait_mpi(self, port: Port, requests: list, ranks: list, during: str) -> None:
        """Master: wait for MPI ``requests`` with ``ranks``, within the call's deadline, raising
        the death of any of them (seen on its control channel)."""
        from mpi4py import MPI

        backoff = Backoff()
        with mpi_errors(MPI):
            while not MPI.Request.Testall(requests):
                if port.clock.deadline is not None and time.monotonic() > port.clock.deadline:
                    raise port.health.timed_out(ranks, during)
                gone = self._hung_up(ranks)
                if gone is not None:
                    port.health.died(gone, during)
                backoff.wait()

    def _hung_up(self, ranks) -> int | None:
        """A rank among ``ranks`` whose control channel the peer closed, if any."""
        poller = select.poll()
        fds = {self.channels[r].fileno(): r for r in ranks}
        for fd in fds:
            poller.register(fd, select.POLLRDHUP)
        for fd, _ in poller.poll(0):
            return fds[fd]
        return None


class OneHost:
    """The steps a call adds across hosts, on one host: none (see ``port.HostSteps``)."""

    spans = False

    def send_inputs(self, port: Port, prep, drop, during: str, rid: int,
                    whole: bool = False) -> dict:
        return {}

    def inputs_sent(self, port: Port, during: str) -> None:
        pass

    def call_failed(self) -> None:
        pass


ONE_HOST = OneHost()


def _shared_inputs(size: int, prep, whole: bool = False):
    """(reference for the workers, the master's array, its contents' version or None,
    ``runs(ranks)``: the positions ``[a, b)`` of the rows that ``ranks`` read, None for
    all) of each shared input (``whole``: all rows of every one)."""
    bounds = prep.plan.bounds
    scattered = (lambda ranks: _runs(bounds, ranks)) if bounds is not None and not whole \
        else _whole
    for i, ref in enumerate(prep.wargs):
        yield from _shared_input(size, prep, ref, prep.args[i],
                                 scattered if i in prep.spos else _whole)
    for key, ref in prep.wkwargs.items():
        yield from _shared_input(size, prep, ref, prep.kwargs[key],
                                 scattered if key in prep.skeys else _whole)
    if isinstance(prep.wplan.selection, SharedArray):
        yield prep.wplan.selection, prep.plan.selection, None, _whole


def _whole(ranks) -> None:
    return None


def _shared_input(size: int, prep, ref, local, runs):
    if isinstance(ref, SharedArray):
        kept = prep.kept.get(ref.name)
        contents = None if kept is None else (*kept, ref.shape, ref.dtype, ref.offset)
        yield ref, local, contents, runs
    elif isinstance(ref, ResidentRef):  # a whole replica, or each rank's shard
        array = SharedArray(ref.name, ref.shape, ref.dtype)
        contents = (ref.key, ref.version, ref.shape, ref.dtype, 0)
        if ref.mode == "shard":
            bounds = split_bounds(len(local.host), size)
            yield array, local.host, contents, lambda ranks: ("shard", _runs(bounds, ranks))
        else:
            yield array, local.host, contents, _whole


def _pieces(local, runs, selection) -> tuple:
    """(pieces to write: ``(rows, values)``, a key that says which rows they are)."""
    if runs is None:
        return [(None, np.asarray(local))], None
    if runs and runs[0] == "shard":  # positions are rows: no batch with a shard
        runs, selection = runs[1], None
    pieces, keys = [], []
    for a, b in runs:
        rows = _rows(selection, a, b)
        pieces.append((rows, np.asarray(local)[rows]))
        keys.append(rows if not isinstance(rows, np.ndarray) else
                    hashlib.sha1(np.ascontiguousarray(rows, np.intp).data).hexdigest())
    return pieces, tuple((k.start, k.stop, k.step) if isinstance(k, slice) else k
                         for k in keys)


def _runs(bounds, ranks) -> list:
    """The positions ``[a, b)`` in the selection that ``ranks`` take, adjacent ones joined."""
    runs: list = []
    for r in ranks:
        a, b = bounds[r], bounds[r + 1]
        if b <= a:
            continue
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    return runs


def _rows(selection, a: int, b: int):
    """Which rows of the block positions ``[a, b)`` of ``selection`` are (an index for
    ``view[rows] = values``)."""
    if selection is None:
        return slice(a, b)
    if isinstance(selection, tuple):
        start, step = selection
        return slice(start + a * step, start + b * step, step)
    return np.asarray(selection[a:b])


@functools.lru_cache(maxsize=4096)
def _block_size(name: str) -> int:
    """The size of the master's block ``name`` (names are never reused): the host's copy is
    as large, so that a later, larger value in the same block fits too."""
    return os.stat(f"{SHM_DIR}/{name}").st_size
