"""allreduce and barrier between ranks on one host meet on the board (docs/api/comm.md,
"Transport (CPU)"): the same answers as numpy, blocking and non-blocking forms mixed, and
every disagreement or failure an error on every rank, never a hang."""
import os
import time

import numpy as np
import pytest

import synk
from synk import comm


def _mixed(seed):
    """Blocking and non-blocking allreduces and barriers interleaved, of sizes that fit a
    slot and that do not, each rank's data its own."""
    rng = np.random.default_rng(seed + comm.rank())
    sizes = [1, 7, 1000, 20_000, 300_000]  # float64: the last is past every slot
    arrays = [rng.standard_normal(n) for n in sizes * 3]
    got, handles = [], []
    for i, x in enumerate(arrays):
        if i % 3 == 0:
            handles.append((i, comm.iallreduce(x, "sum")))
        elif i % 3 == 1:
            got.append((i, comm.allreduce(x, "max")))
            comm.barrier()
        else:
            handles.append((i, comm.iallreduce([x, x[:3]], "mean", weight=comm.rank() + 1)))
            comm.ibarrier().wait()
    got += [(i, h.wait()) for i, h in handles]
    return dict(got), arrays


def test_mixed_blocking_and_non_blocking_collectives_agree_with_numpy(ranks3):
    gots, every = synk.function(_mixed, bcast_inputs=["seed"], reduce=None, timeout=120)(4)
    results = list(zip(gots, every))  # (each output is a list of the ranks')
    weights = np.array([1.0, 2.0, 3.0])
    for got, _ in results:
        for i, value in got.items():
            stack = np.stack([arrays[i] for arrays in every])
            if i % 3 == 0:
                np.testing.assert_allclose(value, stack.sum(0), rtol=1e-12, atol=1e-12)
            elif i % 3 == 1:
                np.testing.assert_array_equal(value, stack.max(0))
            else:
                want = (stack * weights[:, None]).sum(0) / weights.sum()
                np.testing.assert_allclose(value[0], want, rtol=1e-12, atol=1e-12)
                np.testing.assert_allclose(value[1], want[:3], rtol=1e-12, atol=1e-12)
    first = results[0][0]
    for got, _ in results[1:]:  # the same bits on every rank
        for i, value in got.items():
            pairs = zip(first[i], value) if i % 3 == 2 else [(first[i], value)]
            for a, b in pairs:
                np.testing.assert_array_equal(a, b)


def _skewed(n):
    """Rank 0 runs ahead through many non-blocking allreduces before it waits; the others
    wait on each as they go, after a pause (the slots are reused many times over)."""
    if comm.rank() == 0:
        handles = [comm.iallreduce(np.full(4, float(i))) for i in range(n)]
        return [float(h.wait()[0]) for h in handles]
    time.sleep(0.2)
    return [float(comm.allreduce(np.full(4, float(i)))[0]) for i in range(n)]


def test_ranks_far_apart_in_their_collectives_still_match(ranks3):
    got = synk.function(_skewed, bcast_inputs=["n"], reduce=None, timeout=60)(200)
    assert got == [[3.0 * i for i in range(200)]] * 3


def _large_and_skewed(n):
    """As ``_skewed``, with arrays as large as a slot takes: each slot is written again as
    soon as every rank has read it, while the others are still read."""
    rows = 15_000  # float64: 120 KB, a slot's on 3 ranks
    if comm.rank() == 0:
        handles = [comm.iallreduce(np.full(rows, float(i))) for i in range(n)]
        got = [h.wait() for h in handles]
    else:
        time.sleep(0.2)
        got = [comm.allreduce(np.full(rows, float(i) * (1 + i % 3))) for i in range(n)]
    return [float(g[0]) for g in got if g.min() == g.max()]


def test_ranks_far_apart_in_their_largest_collectives_still_match(ranks3):
    got = synk.function(_large_and_skewed, bcast_inputs=["n"], reduce=None, timeout=60)(120)
    assert got == [[i * (1 + 2 * (1 + i % 3)) for i in range(120)]] * 3


def _queued_behind_a_wait(n):
    """A non-blocking reduce_scatter queued on a rank's lane behind an allreduce that waits
    for a late rank, then more non-blocking collectives than the board has slots: each is
    posted where it is called, in order, so none takes the reduce_scatter's slot first."""
    if comm.rank() == 0:
        time.sleep(0.3)
    first = comm.iallreduce(np.ones(2))
    scattered = comm.ireduce_scatter(np.arange(4.0) * (comm.rank() + 1))
    rest = [comm.iallreduce(np.full(2, float(i))) for i in range(n)]
    return ([float(first.wait()[0])], scattered.wait().tolist(),
            [float(h.wait()[0]) for h in rest])


def test_non_blocking_collectives_are_posted_in_the_order_they_are_called(ranks2):
    got = synk.function(_queued_behind_a_wait, bcast_inputs=["n"], reduce=None,
                        timeout=60)(6)
    firsts, scattered, rest = got  # (each output, over the ranks)
    assert firsts == [[2.0], [2.0]]
    assert scattered == [[0.0, 3.0], [6.0, 9.0]]
    assert rest == [[2.0 * i for i in range(6)]] * 2


@pytest.mark.parametrize("case", ["other collective", "other shapes", "one rank past a slot"])
def test_disagreements_raise_on_every_rank_and_the_group_stays_usable(ranks2, case):
    def disagree(which):
        r = comm.rank()
        if which == "other collective":
            return comm.allreduce(np.ones(3)) if r == 0 else comm.barrier()
        if which == "other shapes":
            return comm.allreduce(np.ones(3 + r))
        return comm.allreduce(np.ones(10 if r == 0 else 2_000_000))  # (16 MB: messages)

    start = time.monotonic()
    with pytest.raises(ValueError, match="different collectives|different shapes|another "
                                         "size"):
        synk.function(disagree, bcast_inputs=["which"], timeout=30)(case)
    assert time.monotonic() - start < 20  # (an error on every rank, not the timeout)
    assert synk.function(lambda: comm.allreduce(np.ones(2)).tolist(), reduce=None)() == [
        [2.0, 2.0]] * 2


def test_a_rank_that_fails_ends_the_others_waits_on_the_board(ranks3):
    def fail():
        if comm.rank() == 2:
            time.sleep(0.3)
            raise RuntimeError("rank 2 gives up")
        return comm.allreduce(np.ones(3))

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 2 gives up"):
        synk.function(fail, timeout=30)()
    assert time.monotonic() - start < 10
    assert synk.function(lambda: comm.allreduce(np.ones(2)).tolist(), reduce=None)() == [
        [3.0, 3.0]] * 3


def test_a_rank_that_dies_ends_the_others_waits_on_the_board():
    synk.fork(2)
    try:
        def die():
            if comm.rank() == 1:
                time.sleep(0.3)
                os._exit(3)
            comm.barrier()

        start = time.monotonic()
        with pytest.raises(synk.SynkError):
            synk.function(die, timeout=30)()
        assert time.monotonic() - start < 10
    finally:
        synk.close()
