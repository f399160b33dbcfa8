"""synk.comm and the calls over the shared-memory rings between ranks: messages that take the
ring, overflow to the socket when it is full, or go by reference through shared memory all
arrive once, whole and in order; groups without rings (no room in /dev/shm, or a pair of
ranks that has none, as ranks on other hosts will) work the same."""
import numpy as np
import pytest
from conftest import on_every_rank

import synk
from synk import comm

# No public handle: the control rings (faked full or missing, to take the socket path) and
# the sizes at which a message or an allreduce changes its way.
from synk._testing import SHM_FROM, ring as _ring
from synk.errors import ShmSpaceError

SIZES = [0, 1, 7, 100, 3000, 20000, SHM_FROM // 8 + 5]  # float64 counts: ring, ring, ..., shm


def message(i: int, seed: int) -> np.ndarray:
    n = SIZES[(i * 7 + seed) % len(SIZES)]
    return np.arange(n, dtype=np.float64) + i * 1000.0 + seed


def _flood(arg):
    """Every rank sends ``count`` messages to every other rank with one tag before reading
    any (the rings fill and the rest overflow to the sockets), then reads them all."""
    count = arg[0]
    me, n = comm.rank(), comm.size()
    handles = [comm.isend(message(i, me), peer, tag=5)
               for i in range(count) for peer in range(n) if peer != me]
    bad = []
    for peer in range(n):
        if peer == me:
            continue
        for i in range(count):
            got = comm.recv(peer, tag=5)
            if not np.array_equal(got, message(i, peer)):
                bad.append((peer, i, got.shape))
            got[...] = -1  # what arrives is the receiver's own, writable array
    for h in handles:
        h.wait()
    return bad


def test_many_messages_with_one_tag_arrive_in_order_whole_and_once(ranks3):
    for bad in on_every_rank(_flood, 300, timeout=60):
        assert bad == []


def test_small_collectives_many_times_against_numpy(ranks3):
    def fn(arg):
        r, out = comm.rank(), []
        rng = np.random.default_rng(r)
        for i in range(300):
            x = rng.random(i % 40 + 1)
            comm.barrier()
            out.append((comm.allreduce(x, "sum"), comm.allreduce(x, "max"),
                        comm.allgather(x[:1]), comm.broadcast(x if r == i % 3 else None,
                                                              root=i % 3)))
        return out

    results = on_every_rank(fn, timeout=60)
    rngs = [np.random.default_rng(r) for r in range(3)]
    for i in range(300):
        xs = [g.random(i % 40 + 1) for g in rngs]
        for r in range(3):
            total, top, firsts, root = results[r][i]
            np.testing.assert_allclose(total, xs[0] + xs[1] + xs[2], rtol=1e-12)
            assert np.array_equal(top, np.maximum(np.maximum(xs[0], xs[1]), xs[2]))
            assert np.array_equal(firsts, [x[0] for x in xs])
            assert np.array_equal(root, xs[i % 3])


def _calls_and_comm_work():
    def fn(x, y):
        return comm.allreduce(x.sum() * y, "sum") + np.zeros(2)

    f = synk.function(fn, bcast_inputs=["y"], reduce="gather")
    x = np.arange(12.0)
    for _ in range(20):
        out = f(x, 2.0)
        assert np.array_equal(out, np.full(2 * synk.size(), x.sum() * 2))
    assert on_every_rank(lambda arg: comm.rank()) == list(range(synk.size()))


def test_a_group_without_room_for_rings_uses_the_sockets(monkeypatch):
    def full(prefix, tag, capacity):
        raise ShmSpaceError("a synk message ring", capacity, 0)

    monkeypatch.setattr(_ring, "create", full)
    synk.fork(3)
    try:
        from synk import _testing

        assert _testing.control_rings() == {}
        _calls_and_comm_work()
        assert on_every_rank(_flood, 50, timeout=60) == [[], [], []]
    finally:
        synk.close()


def test_pairs_without_a_ring_mix_with_pairs_that_have_one(monkeypatch):
    """As ranks on another host will: rank 2 has rings with nobody (sockets only)."""
    from synk._testing import LocalLaunch

    made = LocalLaunch._make_rings

    def some(self, group):
        control, mesh, board = made(self, group)  # (no rank has the board: not all on rings)
        control.pop(2, None)
        return control, {k: v for k, v in mesh.items() if 2 not in k}, board

    monkeypatch.setattr(LocalLaunch, "_make_rings", some)
    synk.fork(3)
    try:
        from synk import _testing

        assert sorted(_testing.control_rings()) == [1]
        _calls_and_comm_work()
        assert on_every_rank(_flood, 50, timeout=60) == [[], [], []]
    finally:
        synk.close()


@pytest.mark.parametrize("spin_us", ["0", "50"])
def test_calls_and_messages_with_polling_off_or_short(monkeypatch, spin_us):
    """Readers that sleep at once must be woken by every message (a lost wake-up would
    show as a hang, cut by the timeout)."""
    monkeypatch.setenv("SYNK_SPIN_US", spin_us)
    synk.fork(3)
    try:
        _calls_and_comm_work()
        assert on_every_rank(_flood, 50, timeout=60) == [[], [], []]
    finally:
        synk.close()


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_both_allreduce_algorithms_agree_with_numpy_at_every_size(ranks3, op):
    """One round (whole arrays) and two rounds (reduce-scatter, allgather), forced by the
    size limit, at sizes that take the ring, the socket and shared memory."""
    from synk._testing import comm_collectives as _collectives

    def fn(arg):
        out = []
        for limit in (0, 1 << 62):
            _collectives.ONE_SHOT_BYTES = limit
            for n in (1, 5, 1000, SHM_FROM // 8 * 3 + 7):
                x = np.random.default_rng(comm.rank() * 7 + n).random(n)
                out.append(comm.allreduce(x, arg[0]))
        _collectives.ONE_SHOT_BYTES = 4 << 20
        return out

    results = on_every_rank(fn, op)
    numpy_op = {"sum": np.sum, "mean": np.mean, "max": np.max}[op]
    i = 0
    for _limit in (0, 1):
        for n in (1, 5, 1000, SHM_FROM // 8 * 3 + 7):
            want = numpy_op([np.random.default_rng(r * 7 + n).random(n) for r in range(3)], axis=0)
            for r in range(3):
                np.testing.assert_allclose(results[r][i], want, rtol=1e-12)
                assert np.array_equal(results[r][i], results[0][i])
            i += 1
