"""Under MPI: what each host other than the master's reads of a call's shared-memory inputs.

A call's large inputs reach the workers as ``SharedArray`` names of the master's blocks (a
``Data``, a staging block, a large ``batch`` index). Before the call goes out, the master
sends each other host's leader the rows of every scattered one that the host's ranks will
read, and every broadcast one whole (``protocol.FILL``); the leader writes them into the
host's copies (``_engine.hosts``). The rows are cut out here with the call's plan, exactly
as the ranks will take them.
"""
from __future__ import annotations

import functools
import os
import pickle

import numpy as np

from .._engine import protocol as P
from .._engine.shm import SHM_DIR
from .._engine.wire import SharedArray
from .runner import take_rows


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
        payload = pickle.dumps((P.FILL, tuple(drop), items), protocol=pickle.HIGHEST_PROTOCOL)
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
            pieces.append((_rows(plan.selection, a, b), take_rows(local, plan.selection, a, b)))
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
