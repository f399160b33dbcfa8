"""Reliability, round 4 (issue 38): nothing of a call or a group is left behind after a
failure, an interrupt of ``close()``, or a SIGTERM to a master that forked from a thread."""
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import synk_segments

import synk
from synk import comm


def _op_threads(marker=None) -> int:
    return sum(t.name == "synk-comm-op" for t in threading.enumerate())


def _count_everywhere() -> list:
    """The synk-comm-op threads on every rank (the master's counted in the master)."""
    workers = synk.function(_op_threads, bcast_inputs=["marker"], reduce=None)(0)
    return [_op_threads(), *workers[1:]]


# -- item 3: a failed call leaves no thread of its non-blocking collectives -------------------
def _many_in_flight_then_fail(marker, who):
    group = comm.split(0) if marker == "group" else None
    start = group.iallreduce if group is not None else comm.iallreduce
    handles = [start(np.ones(20_000), "max") for _ in range(25)]
    if comm.rank() == who:
        raise ValueError("boom")
    return sum(float(h.wait().sum()) for h in handles)


@pytest.mark.parametrize("who", [1, 0], ids=["a worker fails", "rank 0 fails"])
@pytest.mark.parametrize("where", ["call", "group"])
def test_a_failed_call_leaves_no_comm_op_threads(ranks3, who, where):
    f = synk.function(_many_in_flight_then_fail, bcast_inputs=["marker", "who"],
                      reduce=None, timeout=60)
    for _ in range(4):
        with pytest.raises(ValueError, match="boom"):
            f(where, who)
    assert _count_everywhere() == [0, 0, 0]
    ok = synk.function(lambda m: float(comm.allreduce(np.ones(3)).sum()), bcast_inputs=["m"],
                       reduce=None)
    assert ok(0) == [9.0] * 3  # the group goes on


def _started_not_waited(marker):
    handles = [comm.iallreduce(np.full(20_000, comm.rank() + 1.0)) for _ in range(10)]
    if comm.rank() == 0:
        return float(handles[-1].wait()[0])
    return None  # the other ranks never wait for theirs


def test_operations_not_waited_for_finish_with_the_call_and_leave_no_threads(ranks3):
    f = synk.function(_started_not_waited, bcast_inputs=["marker"], reduce=None, timeout=60)
    for _ in range(3):
        assert f(0) == [6.0, None, None]
    assert _count_everywhere() == [0, 0, 0]
