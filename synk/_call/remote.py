"""Under MPI: what each host other than the master's reads of a call's shared-memory
inputs, and how those hosts' large outputs come back.

A call's large inputs reach the workers as ``SharedArray`` names of the master's blocks (a
``Data``, a staging block, a large ``batch`` index). Before the call goes out, the master
sends each other host's leader the rows of every scattered one that the host's ranks will
read, and every broadcast one whole (``protocol.FILL``); the leader writes them into the
host's copies (``_engine.hosts``). The rows are cut out here with the call's plan, exactly
as the ranks will take them.

A rank on another host cannot leave a large output in shared memory for the master to read:
it posts it to rank 0 over MPI instead, names it in its reply (``MpiOut``), and the master
receives it into its own array before combining the outputs as usual.
"""
from __future__ import annotations

import functools
import os
import select
import time
from typing import NamedTuple

import numpy as np

from .._wire import protocol as P
from .._wire.arrays import SharedArray, dtype_token, wrap_output
from .._wire.shm import SHM_DIR
from ..comm.mpi import Backoff
from .ops import DONE


def send_inputs(group, prep, drop, during: str, rid: int) -> None:
    """Send every other host's leader its host's rows of ``prep``'s shared inputs (and the
    master blocks it may forget, ``drop``), as request ``rid``, before the call itself."""
    arrays = list(_shared_inputs(prep))
    if not arrays and not drop:
        return
    hosts = group.hosts
    for host in group.remote_hosts:
        ranks = hosts.ranks(host)
        items = [_item(ref, local, scattered, prep.plan, ranks)
                 for ref, local, scattered in arrays]
        payload = P.request(P.FILL, tuple(drop), items)
        group.send([hosts.leader(host)], payload, during, rid)


def _shared_inputs(prep):
    """(name for the workers, the master's array, whether scattered) of each shared input."""
    for i, ref in enumerate(prep.wargs):
        if isinstance(ref, SharedArray):
            yield ref, prep.args[i], i in prep.spos
    for key, ref in prep.wkwargs.items():
        if isinstance(ref, SharedArray):
            yield ref, prep.kwargs[key], key in prep.skeys
    if isinstance(prep.wplan.selection, SharedArray):
        yield prep.wplan.selection, prep.plan.selection, False


def _item(ref: SharedArray, local, scattered: bool, plan, ranks) -> tuple:
    pieces = []
    if scattered and plan.bounds is not None:
        for a, b in _runs(plan.bounds, ranks):
            rows = _rows(plan.selection, a, b)
            pieces.append((rows, np.asarray(local)[rows]))
    else:
        pieces.append((None, np.asarray(local)))
    return (ref.name, _block_size(ref.name), ref.shape, ref.dtype, ref.offset, pieces)


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


# -- outputs of ranks on other hosts: over MPI, straight into the master's arrays ----------
OUT_TAG = 3  # on synk's communicator (synk.comm's messages use 1 and 2)


class MpiOut(NamedTuple):
    """An output sent to the master over MPI after the reply that names it."""

    shape: tuple
    dtype: object  # a dtype token (wire.dtype_token)


class OutputSends:
    """A rank on another host: its large outputs, sent to rank 0 over MPI. They are posted
    with the share and finished once the reply is out (the master receives them only then,
    knowing their shapes)."""

    def __init__(self, comm, limit: int) -> None:
        self.comm, self.limit = comm, limit
        self._pending: list = []  # (request, the array it reads)

    def export(self, share, ops) -> tuple:
        """``share`` as a plain tuple: outputs of at least ``limit`` bytes (array ops and
        gather) posted to rank 0 and sent as ``MpiOut``, smaller ones inline."""
        from mpi4py import MPI

        outputs = []
        for (kind, value), op in zip(share.outputs, ops):
            if op is None or kind == DONE:  # (DONE: combined on the devices already)
                outputs.append((kind, value))
            elif value.nbytes >= self.limit:
                value = np.ascontiguousarray(value)
                request = self.comm.Isend([_bytes(value), MPI.BYTE], 0, OUT_TAG)
                self._pending.append((request, value))
                outputs.append((kind, MpiOut(value.shape, dtype_token(value.dtype))))
            else:
                outputs.append((kind, wrap_output(value)))
        return (share.weight, share.multi, tuple(outputs))

    def finish(self) -> None:
        """After the reply: wait until the master has every posted output."""
        if not self._pending:
            return
        from mpi4py import MPI

        requests = [r for r, _ in self._pending]
        backoff = Backoff()
        while not MPI.Request.Testall(requests):
            backoff.wait()
        self._pending.clear()


def fetch_outputs(group, shares: dict, during: str) -> None:
    """Master: receive the ``MpiOut`` outputs of ``shares`` (ranks on other hosts) in place,
    every one of them even when the call failed (their ranks wait until they are taken),
    within the call's deadline, watching the ranks' control channels for a death."""
    wanted = [(rank, i, out) for rank, share in sorted(shares.items()) if share is not None
              for i, (_, out) in enumerate(share.outputs) if isinstance(out, MpiOut)]
    if not wanted:
        return
    from mpi4py import MPI

    comm = group.mesh.comm
    arrays, requests = {}, []
    for rank, i, out in wanted:
        array = np.empty(out.shape, np.dtype(out.dtype))
        requests.append(comm.Irecv([_bytes(array), MPI.BYTE], rank, OUT_TAG))
        arrays[(rank, i)] = array
    ranks = sorted({rank for rank, _, _ in wanted})
    backoff = Backoff()
    while not MPI.Request.Testall(requests):
        if group.deadline is not None and time.monotonic() > group.deadline:
            raise group.timed_out(ranks, during)
        gone = _hung_up(group, ranks)
        if gone is not None:
            group.died(gone, during)
        backoff.wait()
    for rank in ranks:
        share = shares[rank]
        outputs = tuple((kind, arrays.get((rank, i), value))
                        for i, (kind, value) in enumerate(share.outputs))
        shares[rank] = share._replace(outputs=outputs)


def _hung_up(group, ranks) -> int | None:
    """A rank among ``ranks`` whose control channel the peer closed, if any."""
    poller = select.poll()
    fds = {group.channels[r].fileno(): r for r in ranks}
    for fd in fds:
        poller.register(fd, select.POLLRDHUP)
    for fd, _ in poller.poll(0):
        return fds[fd]
    return None


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)
