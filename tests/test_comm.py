"""synk.comm inside functions: every collective and op against numpy, point-to-point
messages, non-blocking forms, and failures that must not hang."""
import time

import numpy as np
import pytest
from conftest import on_every_rank

import synk
from synk import comm

# docs/api/comm.md, "Transport (CPU)": from 128 KiB up (on 2 ranks; 64 KiB in larger groups), an
# array travels through shared memory
SHM_FROM = 128 * 1024

N = 3


def data_of(rank, shape=(4, 3)):
    return np.random.default_rng(rank).random(shape) + 0.5


NUMPY = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min, "mean": np.mean}
LARGE = (SHM_FROM // 8 * N + 3000,)  # float64 chunks past SHM_FROM: through shared memory


@pytest.mark.parametrize("shape", [(4, 3), LARGE], ids=["small", "large"])
@pytest.mark.parametrize("op", list(NUMPY))
def test_allreduce_every_op(ranks3, op, shape):
    got = on_every_rank(lambda arg: comm.allreduce(data_of(comm.rank(), arg[1]), arg[0]),
                        op, shape)
    want = NUMPY[op](np.stack([data_of(r, shape) for r in range(N)]), axis=0)
    for r in range(N):
        np.testing.assert_allclose(got[r], want, rtol=1e-12)
        assert np.array_equal(got[r], got[0]), "every rank must get the same bits"


def test_allreduce_shapes_and_dtypes(ranks3):
    def fn(arg):
        r = comm.rank()
        return (comm.allreduce(np.float32(r)), comm.allreduce(np.arange(7) * r, "max"),
                comm.allreduce(np.array([r % 2 == 0, True]), "sum"),
                comm.allreduce(np.arange(5, dtype=np.int64), "mean"))

    for zero_d, ints, bools, mean in on_every_rank(fn):
        assert zero_d.shape == () and zero_d == 3 and zero_d.dtype == np.float32
        assert np.array_equal(ints, np.arange(7) * 2) and ints.dtype == np.arange(7).dtype
        assert bools.tolist() == [2, 3]  # counts, as numpy's sum of booleans
        assert np.allclose(mean, np.arange(5))


def test_allgather_uneven_and_0d(ranks3):
    def fn(arg):
        r = comm.rank()
        return comm.allgather(np.full((r + 1, 2), r)), comm.allgather(np.float64(r))

    for rows, scalars in on_every_rank(fn):
        assert np.array_equal(rows, np.concatenate([np.full((r + 1, 2), r) for r in range(N)]))
        assert scalars.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("root", [0, 1, 2])
def test_broadcast(ranks3, root):
    got = on_every_rank(lambda arg: comm.broadcast(
        data_of(comm.rank()) if comm.rank() == arg[0] else None, root=arg[0]), root)
    for r in range(N):
        assert np.array_equal(got[r], data_of(root))


@pytest.mark.parametrize("op", list(NUMPY))
def test_reduce_scatter(ranks3, op):
    got = on_every_rank(lambda arg: comm.reduce_scatter(data_of(comm.rank(), (7, 2)), arg[0]),
                        op)
    full = NUMPY[op](np.stack([data_of(r, (7, 2)) for r in range(N)]), axis=0)
    assert np.allclose(np.concatenate(got), full)
    assert [len(g) for g in got] == [3, 2, 2]  # split as synk splits rows


def test_point_to_point_between_ranks_1_and_2_while_0_waits(ranks3):
    def fn(arg):
        r = comm.rank()
        got = None
        if r == 1:
            comm.send(np.arange(10.0), dest=2)
            got = comm.recv(source=2, tag=7)
        if r == 2:
            got = comm.recv(source=1)
            comm.send(got * 2, dest=1, tag=7)
        comm.barrier()  # rank 0 only waits for the other two
        return got

    got = on_every_rank(fn)
    assert got[0] is None
    assert np.array_equal(got[1], np.arange(10.0) * 2)
    assert np.array_equal(got[2], np.arange(10.0))


def test_simultaneous_large_exchange_does_not_deadlock(ranks3):
    def fn(arg):
        r = comm.rank()
        big = np.full(4 << 20, float(r))  # 32 MiB each way, far beyond socket buffers
        peer = {0: 1, 1: 0, 2: 2}[r]
        if peer == r:
            return 0.0
        comm.send(big, dest=peer)  # both send first, then receive
        return float(comm.recv(source=peer)[-1])

    assert on_every_rank(fn, timeout=60) == [1.0, 0.0, 0.0]


def test_non_blocking_forms(ranks3):
    def fn(arg):
        r = comm.rank()
        right, left = (r + 1) % N, (r - 1) % N
        out = comm.isend(np.array([r]), dest=right)
        inc = comm.irecv(source=left)
        total = comm.iallreduce(np.ones(4) * r)
        gathered = comm.iallgather(np.array([r]))
        bcast = comm.ibroadcast(np.array([9]) if r == 0 else None)
        part = comm.ireduce_scatter(np.ones((3, 2)), "sum")
        busy = sum(range(10000))  # computing while the messages move
        out.wait()
        return (int(inc.wait()[0]), total.wait().tolist(), gathered.wait().tolist(),
                bcast.wait().tolist(), part.wait().tolist(), busy)

    for r, (left, total, gathered, bcast, part, _) in enumerate(on_every_rank(fn)):
        assert left == (r - 1) % N
        assert total == [3.0] * 4 and gathered == [0, 1, 2] and bcast == [9]
        assert part == [[3.0, 3.0]]


def test_messages_stay_within_their_call(ranks3):
    def fn(arg):
        r = comm.rank()
        if r == 1:
            comm.send(np.array([arg[0]]), dest=2)
        if r == 2 and arg[0] == 2:
            return int(comm.recv(source=1)[0])
        return None

    on_every_rank(fn, 1)  # rank 2 never takes this one
    assert on_every_rank(fn, 2)[2] == 2


def test_comm_outside_a_function_says_what_to_do():
    for call in (comm.rank, comm.size, comm.barrier, lambda: comm.allreduce(np.ones(2)),
                 lambda: comm.send(np.ones(2), 1), lambda: comm.recv(0)):
        with pytest.raises(synk.SynkError, match=r"only be called inside a synk function"):
            call()


def test_bad_arguments(ranks3):
    def fn(arg):
        kind = arg[0]
        if kind == "op":
            comm.allreduce(np.ones(2), "median")
        if kind == "peer":
            comm.send(np.ones(2), dest=5)
        if kind == "self":
            comm.recv(source=comm.rank())
        if kind == "root":
            comm.broadcast(np.ones(2), root=7)

    for kind, message in [("op", "unknown op 'median'"), ("peer", "rank 5 is not a rank"),
                          ("self", "message from itself"), ("root", "root must be a rank")]:
        with pytest.raises(ValueError, match=message):
            on_every_rank(fn, kind)
    assert on_every_rank(lambda arg: comm.size()) == [3, 3, 3]


def test_shapes_that_differ_raise_instead_of_hanging(ranks3):
    def fn(arg):
        return comm.allreduce(np.ones(2 + comm.rank()))

    with pytest.raises(ValueError, match="different shapes"):
        on_every_rank(fn, timeout=30)
    assert on_every_rank(lambda arg: comm.allreduce(np.ones(2)).tolist()) == [[3.0, 3.0]] * 3


class Custom(Exception):
    pass


@pytest.mark.parametrize("bad", [0, 2])
def test_a_failing_rank_does_not_leave_the_others_waiting(ranks3, bad):
    def fn(arg):
        if comm.rank() == arg[0]:
            raise Custom("no gradient for you")
        return comm.allreduce(np.ones(3))

    start = time.monotonic()
    with pytest.raises(Custom, match="no gradient") as info:
        on_every_rank(fn, bad)
    assert time.monotonic() - start < 10
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "CommAborted" in notes
    assert on_every_rank(lambda arg: comm.allreduce(np.ones(1)).tolist()) == [[3.0]] * 3


def test_a_skipped_collective_raises_without_a_timeout(ranks3):
    """(tests/test_a_rank_that_skips_a_collective.py has every collective and size.)"""
    def fn(arg):
        if comm.rank() != 1:
            comm.allreduce(np.ones(3))

    start = time.monotonic()
    with pytest.raises(ValueError, match="from rank 1, whose function returned"):
        on_every_rank(fn)
    assert time.monotonic() - start < 10
    assert on_every_rank(lambda arg: comm.allreduce(1)) == [3] * 3


def test_one_rank_group():
    synk.fork(1)
    try:
        got = on_every_rank(lambda arg: (comm.rank(), comm.size(), comm.allreduce(np.ones(2)),
                                         comm.allgather(np.ones(2)), comm.broadcast(np.ones(1))))
        r, n, total, gathered, bcast = got[0]
        assert (r, n) == (0, 1) and total.tolist() == [1.0, 1.0] and len(gathered) == 2
    finally:
        synk.close()


def test_blocking_and_non_blocking_forms_of_a_collective_match(ranks3):
    def fn(arg):
        if comm.rank() == 0:
            return comm.iallreduce(np.ones(2)).wait().tolist()
        return comm.allreduce(np.ones(2)).tolist()

    assert on_every_rank(fn, timeout=30) == [[3.0, 3.0]] * 3
