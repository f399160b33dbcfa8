"""A rank with no rows still takes part in the call's collectives: fewer rows than ranks, a
1-row minibatch, a ``local_batch`` of 0 for one rank, ``num_slices`` past a rank's rows. It
runs ``fn`` on its empty share (every rank runs as many pieces), and what that gives counts
for nothing. On CPU ranks and on (simulated) GPU ranks."""
import numpy as np
import pytest
from conftest import REAL

import synk

X = np.random.default_rng(0).standard_normal((12, 3))
Y = np.random.default_rng(1).standard_normal(12)


def step(x, y, w):
    """docs/training.md's loop: a gradient on this rank's rows, averaged by rows."""
    xp = synk.xp(x)
    g = x.T @ (x @ w - y) / max(len(x), 1)
    g = synk.comm.allreduce(g, "mean", weight=len(x))
    return g if xp is np else g.get()


def _grad(rows):
    x, y, w = X[rows], Y[rows], np.ones(3)
    return x.T @ (x @ w - y) / len(x)


@pytest.mark.parametrize("batch", [1, 2, slice(5, 6), np.array([7])])
def test_a_minibatch_smaller_than_the_ranks_does_not_hang(three, batch):
    f = synk.function(step, bcast_inputs=["w"], reduce=None, timeout=20)
    got = f(synk.data(X), synk.data(Y), np.ones(3), batch=batch)
    rows = np.arange(12)[:batch] if isinstance(batch, int) else np.arange(12)[batch]
    want = _grad(rows)
    assert len(got) == len(rows)  # (reduce=None: the ranks that had rows)
    for g in got:
        np.testing.assert_allclose(g, want)


def test_a_local_batch_of_zero_for_one_rank_does_not_hang(three):
    f = synk.function(step, bcast_inputs=["w"], reduce="max", timeout=20)
    got = f(synk.data(X), synk.data(Y), np.ones(3), local_batch=[2, 0, 3])
    rows = np.r_[0:2, 8:11]
    np.testing.assert_allclose(got, _grad(rows))


def test_a_sliced_call_refuses_collectives_on_every_rank_alike(three):
    """2 rows on rank 2 and num_slices=3: every rank runs as many pieces as the others, and
    a collective inside a sliced call is refused on every rank at its first one (it would
    combine each piece alone: another answer than num_slices=1), so none waits in vain."""
    def piecewise(x):
        total = synk.comm.allreduce(x.sum(axis=0) if len(x) else 0 * x.sum(axis=0), "sum")
        return total if synk.xp(x) is np else total.get()

    f = synk.function(piecewise, reduce=None, timeout=20)
    with pytest.raises(synk.SynkError, match=r"allreduce\(\) was called inside a call with "
                                             r"num_slices=3") as err:
        f(X[:8], num_slices=3)  # rows per rank: 3, 3, 2
    assert "ranks [" in err.value.__notes__[0]  # (every rank raised it)
    got = f(X[:8])
    for per_rank in got:
        np.testing.assert_allclose(per_rank, X[:8].sum(axis=0))


def test_no_rows_contribute_nothing(three):
    """``x.mean()`` of no rows is NaN (with a warning, silenced): it reaches no result."""
    assert synk.function(lambda x: x.mean(), reduce="mean")(np.arange(2.0)) == 0.5
    assert synk.function(lambda x: x.sum(), reduce="prod")(np.arange(1.0, 3.0)) == 2.0
    got = synk.function(lambda x: x * 2, reduce="gather")(np.arange(2.0))
    np.testing.assert_array_equal(got, [0.0, 2.0])
    got = synk.function(lambda x: x.sum(), reduce=None)(np.arange(2.0))
    assert got == [0.0, 1.0]  # the ranks that had rows


def test_a_function_that_fails_on_no_rows_costs_nothing(three):
    """``x.max()`` fails on no rows: with no collective before it, that rank simply
    contributes nothing (as when it did not run ``fn``)."""
    assert synk.function(lambda x: x.max(), reduce="max", timeout=20)(np.arange(2.0)) == 1.0
    assert synk.function(lambda x: x.max(), reduce="max")(np.arange(2.0), num_slices=3) == 1.0


def test_an_error_on_no_rows_after_a_collective_is_the_calls(three):
    def fn(x):
        s = synk.comm.allreduce(x.sum(), "sum")
        if len(x) == 0:
            raise ZeroDivisionError("no rows here")
        return s

    with pytest.raises(ZeroDivisionError, match="no rows here") as info:
        synk.function(fn, reduce="sum", timeout=20)(np.arange(2.0))
    assert "no rows" in " ".join(getattr(info.value, "__notes__", []))
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.arange(6.0)) == 15.0


def test_an_error_on_no_rows_before_a_collective_stops_the_others(three):
    """The rank that failed on its empty share cannot join the collective: the others stop
    waiting at once (naming why), rather than hanging."""
    def fn(x):
        if len(x) == 0:
            raise ZeroDivisionError("no rows here")
        return synk.comm.allreduce(x.sum(), "sum")

    with pytest.raises(synk.comm.CommAborted, match="no rows here"):
        synk.function(fn, reduce="sum", timeout=20)(np.arange(2.0))
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.arange(6.0)) == 15.0


def test_ranks_that_do_not_need_the_empty_one_are_not_stopped(three):
    """Ranks 0 and 1 exchange messages between themselves while rank 2, with no rows,
    failed quietly: their exchange goes on."""
    def fn(x):
        if len(x) == 0:
            raise ZeroDivisionError("no rows here")
        r = synk.comm.rank()
        peer = 1 - r
        if r == 0:
            synk.comm.send(x.sum(), peer)
            return synk.comm.recv(peer)
        got = synk.comm.recv(peer)
        synk.comm.send(x.sum(), peer)
        return got

    got = synk.function(fn, reduce=None, timeout=20)(np.arange(2.0))
    assert [np.asarray(g).item() for g in got] == [1.0, 0.0]


@pytest.mark.skipif(REAL, reason="counts the simulator's NCCL operations")
def test_training_loop_of_the_docs_on_a_small_last_batch(three):
    w = np.zeros(3)
    f = synk.function(step, bcast_inputs=["w"], reduce="mean", timeout=20)
    x, y = synk.data(X), synk.data(Y)
    for batch in (slice(0, 5), slice(5, 10), slice(10, 12), slice(11, 12)):
        w = w - 0.1 * f(x, y, w, batch=batch)
    assert np.all(np.isfinite(w))
