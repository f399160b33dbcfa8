"""Under MPI, the ranks' side of a call across hosts: a host's leader receives the rows of
the call's inputs its host reads (``receive_rows``), ranks alone on another host post their
large outputs to rank 0 over MPI (``OutputSends``), and a host's leader combines its ranks'
large outputs there (``run_host_tasks``). The master's side is ``across_hosts``.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._reduction import Kind, partial
from .._wire.arrays import DtypeToken, dtype_token, wrap_output
from .._wire.shm import ATTACHED
from ..comm.host.mpi_mesh import Backoff, mpi_errors
from .records import Share

FILL_TAG = 4  # on synk's communicator: rows of inputs for a host's copies (see OUT_TAG)


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


OUT_TAG = 3  # on synk's communicator (synk.comm's messages use 1 and 2)


class MpiOut(NamedTuple):
    """An output sent to the master over MPI after the reply that names it."""

    shape: tuple
    dtype: DtypeToken


class OutputSends:
    """A rank on another host: its large outputs, sent to rank 0 over MPI. They are posted
    with the share (or, by a host's first rank, with its host's combined outputs) and
    finished once the reply is out (the master receives them only then, knowing their
    shapes)."""

    def __init__(self, comm, limit: int) -> None:
        self.comm, self.limit = comm, limit
        self._pending: list = []  # (request, the array it reads)

    def export(self, share: Share, ops: tuple) -> Share:
        """``share`` ready for the reply: outputs of at least ``limit`` bytes (array ops and
        gather) posted to rank 0 and sent as ``MpiOut``, smaller ones inline."""
        outputs = []
        for (kind, value), op in zip(share.outputs, ops):
            if op is None or kind == Kind.DONE:  # (combined on the devices already)
                outputs.append((kind, value))
            elif value.nbytes >= self.limit:
                value = self.post(value)
                outputs.append((kind, MpiOut(value.shape, dtype_token(value.dtype))))
            else:
                outputs.append((kind, wrap_output(value)))
        return share.replace_outputs(outputs)

    def post(self, value: np.ndarray) -> np.ndarray:
        """Post ``value`` to rank 0 (``OUT_TAG``); ``finish`` waits for it."""
        from mpi4py import MPI

        value = np.ascontiguousarray(value)
        with mpi_errors(MPI):
            request = self.comm.Isend([_bytes(value), MPI.BYTE], 0, OUT_TAG)
        self._pending.append((request, value))
        return value

    def finish(self) -> None:
        """After the reply: wait until the master has every posted output."""
        if not self._pending:
            return
        from mpi4py import MPI

        requests = [r for r, _ in self._pending]
        backoff = Backoff()
        with mpi_errors(MPI):
            while not MPI.Request.Testall(requests):
                backoff.wait()
        self._pending.clear()


def _bytes(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def run_host_tasks(sends: OutputSends, tasks) -> None:
    """A host's first rank: its ranks' large outputs (in this host's shared memory),
    combined into one partial each (``_reduction.partial``) or as they are, posted to
    rank 0 over MPI in the order of ``tasks`` (``sends.finish`` waits for them once the
    reply is out)."""
    arrays = []
    for op, out, shape, sources in tasks:  # (all computed before any is posted: a failure
        views = [(w, ATTACHED.array(name, shape, dtype, offset))  # posts nothing)
                 for name, offset, dtype, w in sources]
        arrays.append(views[0][1] if op is None else partial(op, views, np.dtype(out)))
    for array in arrays:
        sends.post(array)
