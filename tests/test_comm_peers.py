"""Patterns that users of MPI, NCCL and torch.distributed bring to ``synk.comm``, ported from
those libraries' own test suites, on CPU ranks (3 and 4) and simulated GPUs (2 ranks on 2
devices, 4 ranks on 2), checked against numpy."""
import numpy as np
import pytest
from conftest import fresh_nccl_process, use_devices

import synk

LAYOUTS = {"3 cpu": (3, None), "4 cpu": (4, None),
           "2 gpus": (2, 2), "4 ranks on 2 gpus": (4, 2)}


@pytest.fixture(params=list(LAYOUTS))
def group(request, monkeypatch):
    n, devices = LAYOUTS[request.param]
    if devices is None:
        synk.fork(n)
    else:
        use_devices(monkeypatch, devices)
        synk.fork(n, backend="gpu")
    yield n
    synk.close()
    if devices is not None:
        fresh_nccl_process()


def _many_in_flight(marker, count, listed):
    """torch's ``allreduce_stress``: ``count`` non-blocking allreduces started before any is
    waited, then waited in order."""
    xp = synk.xp(marker)
    r = synk.comm.rank()
    if listed:  # the coalesced form: a list of arrays in each
        handles = [synk.comm.iallreduce([xp.full(3, float(r + i)), xp.arange(2) + i], "sum")
                   for i in range(count)]
        return [float(h.wait()[0][0]) + float(h.wait()[1][1]) for h in handles]
    handles = [synk.comm.iallreduce(xp.full(3, float(r + i)), "sum") for i in range(count)]
    return [float(h.wait()[0]) for h in handles]


@pytest.mark.parametrize("listed", [False, True], ids=["arrays", "lists"])
def test_a_thousand_non_blocking_allreduces_in_flight(group, listed):
    n, count = group, 1000
    f = synk.function(_many_in_flight, bcast_inputs=["marker", "count", "listed"],
                      reduce=None, timeout=120)
    want = [sum(r + i for r in range(n)) + (n * (1 + i) if listed else 0)
            for i in range(count)]
    for got in f(np.zeros(1), count, listed):
        assert got == want
