"""A rank whose function returns without taking part in a collective (or sending what a
peer receives) leaves no one waiting: the ranks that wait for it raise a ``ValueError``
naming it, the call raises, and the group goes on; what a rank sent before its function
returned is still received, however late its peer reads it."""
import time

import mpirun
import numpy as np
import pytest
from conftest import on_every_rank

import synk

pytestmark = pytest.mark.timeout(120)

SIZES = {"tiny": 3, "ring": 1000, "shared memory": 40_000, "two rounds": 600_000}


def _skipped(arg):
    kind, n = arg
    r = synk.comm.rank()
    if r == 1:
        return "returned"
    x = np.ones(n)
    try:
        if kind == "allreduce":
            synk.comm.allreduce(x)
        elif kind == "reduce":
            synk.comm.reduce(x, root=0)
        elif kind == "broadcast":
            synk.comm.broadcast(x, root=1)
        elif kind == "allgather":
            synk.comm.allgather(x)
        elif kind == "barrier":
            synk.comm.barrier()
        elif kind == "recv":
            synk.comm.recv(source=1, tag=7)
        elif kind == "recv from any rank":
            synk.comm.recv(synk.comm.ANY_SOURCE if r == 0 else 1, synk.comm.ANY_TAG)
        elif kind == "probe":
            synk.comm.probe(1)
        elif kind == "scan":
            synk.comm.scan(x)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


CASES = [pytest.param(kind, n, id=f"{kind}, {size}") for kind in
         ("allreduce", "reduce", "broadcast", "allgather", "scan")
         for size, n in SIZES.items()] + [(kind, 0) for kind in (
             "barrier", "recv", "recv from any rank", "probe")]


@pytest.mark.parametrize("kind, n", CASES)
def test_a_collective_a_rank_skipped_raises_on_the_ranks_that_wait(ranks3, kind, n):
    got = on_every_rank(_skipped, kind, n, timeout=60)
    assert got[1] == "returned"
    for said in (got[0], got[2]):
        assert said.startswith("ValueError: rank ") and "returned without sending it" in said, got
    assert on_every_rank(lambda arg: synk.comm.allreduce(1), timeout=30) == [3, 3, 3]


def _skipped_on_the_device(arg):
    marker, kind = arg
    xp = synk.xp(marker)
    if synk.comm.rank() == 1:
        return "returned"
    x = xp.ones(5)
    try:
        if kind == "allreduce":
            synk.comm.allreduce(x)
        elif kind == "reduce":
            synk.comm.reduce(x, root=0)
        elif kind == "recv":
            synk.comm.recv(1)
        else:
            synk.comm.recv(synk.comm.ANY_SOURCE if synk.comm.rank() == 0 else 1)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


@pytest.mark.parametrize("kind", ["allreduce", "reduce", "recv", "recv from any rank"])
def test_a_collective_a_rank_skipped_raises_on_every_backend(three, kind):
    """On GPU ranks, device arrays (NCCL's check of what the ranks pass, over the host,
    before it launches); the rank that returned waits to combine the outputs meanwhile, in
    exchanges of its own, so its share has not ended: a receive from it ends on those.
    (An allgather of device arrays exchanges its sizes on NCCL: it waits for the call's
    timeout.)"""
    got = on_every_rank(_skipped_on_the_device, np.zeros(1), kind, timeout=60)
    assert got[1] == "returned"
    for said in (got[0], got[2]):
        assert said.startswith("ValueError: rank ") and "returned without sending it" in said, \
            got
    assert on_every_rank(lambda arg: synk.comm.allreduce(1), timeout=30) == [3, 3, 3]


def _skipping_fn(x):
    if synk.comm.rank() == 0:
        synk.comm.allreduce(x)
    return x


def test_the_call_raises_the_waiting_ranks_error(ranks2):
    f = synk.function(_skipping_fn, bcast_inputs=["x"])
    with pytest.raises(ValueError, match="rank 0 waited for its part of allreduce"):
        f(np.ones(3), timeout=60)
    assert synk.function(lambda x: x * 2, bcast_inputs=["x"], reduce="sum")(1.0) == 4.0


def _sent_then_returned(arg):
    count, n = arg
    r = synk.comm.rank()
    if r == 1:
        for i in range(count):
            synk.comm.send(np.full(n, i, np.float64), 0, tag=i)
        return "sent"
    time.sleep(0.5)  # (rank 1's share has ended by now)
    got = [synk.comm.recv(source=1, tag=i) for i in range(count)]
    return [int(g[0]) for g in got] == list(range(count)) and all(len(g) == n for g in got)


@pytest.mark.parametrize("count, n", [(200, 10), (40, 40_000), (3, 2_000_000)])
def test_what_a_rank_sent_before_its_share_ended_is_received(ranks2, count, n):
    """More than its ring holds (the rest queued on its socket), large arrays in shared
    memory: all there when its peer reads them after it returned."""
    assert on_every_rank(_sent_then_returned, count, n, timeout=60) == [True, "sent"]



_ACROSS_HOSTS = """
def skips(kind):
    comm = synk.comm
    r = comm.rank()
    if kind == "refused":
        if r == 3:  # (it catches the refusal and goes on)
            try:
                comm.allreduce(object())
            except TypeError:
                pass
        return comm.allreduce(np.ones(2))
    if kind == "refused twice, then a receive":
        if r == 3:  # (it catches both refusals and waits for a message none sends)
            for _ in range(2):
                try:
                    comm.allreduce(object())
                except TypeError:
                    pass
            return comm.recv(0, tag=9)
        return comm.allreduce(np.ones(2))
    if kind == "refused in a sub-group":
        pair = comm.split(r % 2)  # (ranks 1 and 3: on hosts a and b)
        if r == 3:
            try:
                pair.allreduce(np.array([1, "a"], dtype=object))
            except TypeError:
                pass
        return pair.allreduce(np.ones(2))
    if kind == "a large send to a rank that returned":
        if r == 2:  # (16 MB: MPI sends it only once rank 0, on host a, takes it)
            comm.send(np.ones(2_000_000), 0)
        return None
    if r == 2:  # (on host b) it returns without taking part
        return None
    if kind == "allreduce":
        return comm.allreduce(np.ones(2))
    if kind == "recv" and r == 0:
        return comm.recv(source=2, tag=7)
    if kind == "recv from any rank" and r == 0:
        return comm.recv(comm.ANY_SOURCE, comm.ANY_TAG)
    return None


for kind in KINDS:
    began = time.monotonic()
    try:
        synk.function(skips, bcast_inputs=["kind"], reduce=None)(kind)
        print("OUTCOME", json.dumps([kind, 0.0, "no error"]), flush=True)
    except ValueError as err:
        print("OUTCOME", json.dumps([kind, time.monotonic() - began, str(err)]), flush=True)
assert synk.function(lambda: synk.comm.allreduce(1), reduce=None)() == [4] * 4
print("USABLE", flush=True)
"""

_ACROSS_HOSTS_ERRORS = {
    "allreduce": "from rank 2, whose function returned without sending it",
    "recv": "a message with tag 7 from rank 2, whose function returned without sending it",
    "recv from any rank": "from any rank, and every other rank's function returned without "
                          "sending it",
    "refused": "from rank 3, which refused its value of that collective",
    "refused twice, then a receive": "from rank 3, which refused its value of that collective",
    "refused in a sub-group": "a sub-group's collective from rank 3, which refused its value "
                              "of that collective",
    "a large send to a rank that returned": "no error"}  # (as on one host: it is taken)


def test_under_mpi_a_rank_on_another_host_that_skipped_or_refused_is_named(tmp_path):
    """Under mpiexec, where a rank on another host has no row here to read, the ranks that
    wait for it ask it where it is: a rank whose function returned without taking part, or
    which refused its value of the collective (the call's or a sub-group's) and went on,
    is named within seconds, not at the call's timeout (none here: never). A large message
    sent to a rank whose function returned without receiving it is taken there, as on one
    host, rather than its send waiting for ever."""
    body = f"KINDS = {list(_ACROSS_HOSTS_ERRORS)!r}\n" + _ACROSS_HOSTS
    run = mpirun.run(tmp_path, body, timeout=120)
    assert run.rc == 0 and "USABLE" in run.out, run
    outcomes = run.printed("OUTCOME")
    assert [kind for kind, _, _ in outcomes] == list(_ACROSS_HOSTS_ERRORS), run
    for kind, seconds, error in outcomes:
        assert _ACROSS_HOSTS_ERRORS[kind] in error, (kind, error)
        assert seconds < 20, (kind, seconds)


_SKIPS_INSIDE_NCCL = """
def f(x):
    if synk.comm.rank() == 0:  # (rank 1, on host b, returns without it)
        synk.comm.allgather(x[:2])
    return None


began = time.monotonic()
try:
    synk.function(f, reduce=None)(np.zeros(4), timeout=3)
except synk.CallTimeoutError as err:
    print("OUTCOME", json.dumps([time.monotonic() - began, str(err)]), flush=True)
"""


@pytest.mark.gpu
def test_under_mpi_a_gpu_rank_that_skipped_an_nccl_collective_ends_at_the_timeout(tmp_path):
    """GPU ranks on two pretend hosts (the CUDA simulator): rank 0 waits inside NCCL for an
    allgather that rank 1, on the other host, skipped. With no row of rank 1 to read, the
    wait lasts until the call's timeout, which then ends it: the master's operation in
    flight is aborted rather than waited for after the interrupt (for ever: rank 1 never
    launches it)."""
    run = mpirun.run(tmp_path, _SKIPS_INSIDE_NCCL, hosts=("a", "b"),
                     env={"SYNK_SIMULATE_GPUS": "1"}, timeout=60)
    outcomes = run.printed("OUTCOME")
    assert len(outcomes) == 1, run
    seconds, error = outcomes[0]
    assert seconds < 15 and "did not finish during a call of f within 3 s" in error, run
