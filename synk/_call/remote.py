"""Under MPI, the ranks' side of a call across hosts: a host's leader receives the rows of
the call's inputs its host reads (``receive_rows``). The master's side is ``across_hosts``;
outputs come back by MPI's collectives (``mpi_collect``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._wire.arrays import DtypeToken
from ..comm.host.mpi_mesh import Backoff, mpi_errors

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
