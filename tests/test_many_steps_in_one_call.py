"""Many steps in one call (``f.steps(batches, ...)``, ``step.steps(batches)``): every rank
runs the function once per batch, on the rows ``batch=`` gives it, and the call returns
each step's result with the bits of a loop of calls, every rank's replicas too; a failure in
a step names it, the steps before it took effect and the later ones did not run; a rank's
death makes the call run again from its start. On 2 CPU ranks and 2 simulated GPUs
(``two``), 3 CPU ranks, and under MPI across pretend hosts; checked against a loop of calls
and numpy."""
import os
import signal
import warnings

import numpy as np
import pytest

import synk

pytestmark = pytest.mark.timeout(180)


def _step(x, w, scale):
    """A step of route B's shape: the rows' mean, averaged over the ranks (weighted by
    rows), applied to the replica; its outputs in every reduce op's form."""
    g = synk.comm.allreduce(x.mean(axis=0) * scale - 0.1 * w, "mean", weight=len(x))
    w -= 0.5 * g
    return (x * scale).sum(axis=0), (x ** 2).mean(), x[:, :1] * scale, w.copy()


_REDUCE = ("sum", "mean", "gather", None)


def _batches(n: int) -> list:
    rng = np.random.default_rng(1)
    return [rng.permutation(n)[:20], slice(3, 40, 3), 7, rng.permutation(n)[:5],
            np.arange(n) % 4 == 1, rng.integers(0, n, 30)]


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return np.array_equal(np.asarray(a), np.asarray(b)) and np.asarray(a).dtype == \
        np.asarray(b).dtype


def test_the_steps_give_the_bits_of_a_loop_of_calls(two):
    x = np.random.default_rng(0).standard_normal((64, 3)).astype(np.float32)
    d = synk.data(x)
    f = synk.function(_step, inputs=["x"], bcast_inputs=["scale"], reduce=_REDUCE)
    looped, stepped = synk.shared(np.ones(3, np.float32)), synk.shared(np.ones(3, np.float32))
    want = [f(d, looped, 2.0, batch=b) for b in _batches(64)]
    got = f.steps(_batches(64), d, stepped, 2.0)
    assert len(got) == len(want) and all(map(_same, got, want))
    bound = f.bind(d, stepped, scale=2.0)
    want += [f(d, looped, 2.0, batch=b) for b in _batches(64)]
    assert all(map(_same, bound.steps(_batches(64)), want[6:]))
    for r in range(2):
        assert np.array_equal(looped.get_value(r), stepped.get_value(r))


def test_three_ranks_and_steps_of_fewer_rows_than_ranks(ranks3):
    """A step with 1 or 2 rows leaves ranks without rows: they run the step on none and
    take part in its collectives, as in a call."""
    x = np.arange(30.0).reshape(10, 3)
    f = synk.function(_step, inputs=["x"], bcast_inputs=["scale"], reduce=_REDUCE)
    looped, stepped = synk.shared(np.ones(3)), synk.shared(np.ones(3))
    batches = [np.array([4]), slice(0, 2), np.arange(10), [9, 0, 5, 5]]
    want = [f(x, looped, 0.5, batch=b) for b in batches]
    assert all(map(_same, f.steps(batches, x, stepped, 0.5), want))
    assert all(np.array_equal(looped.get_value(r), stepped.get_value(r)) for r in range(3))


def _counts(x, w, bad, marker):
    """Adds the rows' count to each replica; rank 1 raises at its step ``bad`` (the
    number of its replica's calls so far), or dies there once (``marker``)."""
    step = int(w[1])
    if synk.rank() == 1 and step == bad:
        if marker is None:
            raise KeyError(f"step {step}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    rows = synk.comm.allreduce(float(len(x)))
    w += synk.xp(w).asarray([rows, 1.0])
    return w.copy()


def test_a_failure_in_a_step_names_it_and_the_steps_after_it_do_not_run(two):
    f = synk.function(_counts, inputs=["x"], bcast_inputs=["bad", "marker"], reduce=None)
    w = synk.shared(np.zeros(2))
    with pytest.raises(KeyError) as err:
        f.steps([slice(0, 4), slice(0, 6), slice(0, 8), slice(0, 2)], np.ones((8, 1)), w, 2,
                None)
    assert "in step 2 of the 4 of the call (batches[2])" in "".join(err.value.__notes__)
    assert [w.get_value(r).tolist() for r in range(2)] == [[10.0, 2.0]] * 2  # (steps 0, 1)
    assert f.steps([slice(0, 4)], np.ones((8, 1)), w, -1, None)[0][1].tolist() == [14, 3]


def _wide_sums(x, w, bad):
    """Adds the rows' sum over the ranks to the replica, through an allreduce of wide items
    (large messages, in more than one round), and counts the step; rank 0 raises after its
    step ``bad``'s update, while the other ranks may still be reading that allreduce."""
    xp = synk.xp(w)
    wide = xp.zeros(50_000)
    wide[0] = x.sum()
    w[0] += synk.comm.allreduce(wide)[0]
    w[1] += 1
    if synk.rank() == 0 and int(w[1]) == bad + 1:
        raise KeyError(f"after step {bad}")
    return w.copy()


def _fail_after_steps(n: int) -> None:
    """Ten calls of three steps whose second fails on rank 0 after its update: every one
    of the ``n`` replicas holds the first two steps' updates after each."""
    x = np.arange(12.0).reshape(12, 1)
    f = synk.function(_wide_sums, inputs=["x"], bcast_inputs=["bad"], reduce=None)
    w = synk.shared(np.zeros(2))
    want = np.zeros(2)
    for _ in range(10):
        with pytest.raises(KeyError):
            f.steps([slice(0, 5), slice(2, 12), slice(0, 3)], x, w, int(want[1]) + 1)
        want += [x[0:5].sum() + x[2:12].sum(), 2]
        assert [w.get_value(r).tolist() for r in range(n)] == [want.tolist()] * n


def test_a_failure_after_a_steps_collective_leaves_every_replica_with_that_step(three):
    """Rank 0 finished the step's allreduce before it failed: the other ranks finish it
    too, whatever they hear of the failure meanwhile, and every replica makes the update."""
    _fail_after_steps(3)


def test_a_rank_that_dies_in_a_step_makes_the_call_run_again_from_its_start(tmp_path):
    marker = str(tmp_path / "died")
    batches = [slice(0, 4), slice(0, 6), slice(0, 8), slice(0, 2)]
    synk.fork(2, restarts=1)
    try:
        f = synk.function(_counts, inputs=["x"], bcast_inputs=["bad", "marker"], reduce=None)
        w = synk.shared(np.zeros(2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = f.steps(batches, np.ones((8, 1)), w, 2, marker)
        assert any(c.category is synk.RankReplacedWarning for c in caught)
        assert os.path.exists(marker) and synk.restarts_left() == 0
        assert [g[1].tolist() for g in got] == [[4, 1], [10, 2], [18, 3], [20, 4]]
        assert [w.get_value(r).tolist() for r in range(2)] == [[20.0, 4.0]] * 2
    finally:
        synk.close()


def test_steps_refuse_what_they_cannot_run(ranks2):
    f = synk.function(_step, inputs=["x"], bcast_inputs=["scale"], reduce=_REDUCE)
    w = synk.shared(np.ones(3))
    with pytest.raises(ValueError, match="at least one batch"):
        f.steps([], np.ones((4, 3)), w, 1.0)
    with pytest.raises(IndexError, match="step 1's batch"):
        f.steps([slice(0, 2), np.array([0, 9])], np.ones((4, 3)), w, 1.0)
    g = synk.function(lambda w: w.sum(), reduce="sum")
    with pytest.raises(ValueError, match="no input of .* is scattered"):
        g.steps([slice(0, 2)], w)
    assert f.steps([2], np.ones((4, 3)), w, 1.0)[0][0].tolist() == [2.0] * 3  # (usable)


def test_steps_across_pretend_hosts_under_mpi(tmp_path):
    """Three ranks on two pretend hosts: the steps' results and replicas are a loop's."""
    import mpirun

    body = """
from test_many_steps_in_one_call import _REDUCE, _batches, _same, _step
x = np.random.default_rng(0).standard_normal((64, 3))
d = synk.data(x)
f = synk.function(_step, inputs=["x"], bcast_inputs=["scale"], reduce=_REDUCE)
looped, stepped = synk.shared(np.ones(3)), synk.shared(np.ones(3))
want = [f(d, looped, 2.0, batch=b) for b in _batches(64)]
assert all(map(_same, f.steps(_batches(64), d, stepped, 2.0), want))
assert all(np.array_equal(looped.get_value(r), stepped.get_value(r)) for r in range(n))
print("STEPS OK", flush=True)
synk.close()
"""
    tests = os.path.dirname(os.path.abspath(__file__))
    run = mpirun.run(tmp_path, body, hosts=("a", "b", "b"), env={"PYTHONPATH": tests})
    assert run.rc == 0 and "STEPS OK" in run.out, run


def test_a_failure_after_a_steps_collective_across_pretend_hosts_under_mpi(tmp_path):
    """As on one host: the ranks that finish the step's allreduce after rank 0 failed make
    its update too, over MPI between the hosts."""
    import mpirun

    body = """
from test_many_steps_in_one_call import _fail_after_steps
_fail_after_steps(n)
print("REPLICAS OK", flush=True)
synk.close()
"""
    tests = os.path.dirname(os.path.abspath(__file__))
    run = mpirun.run(tmp_path, body, hosts=("a", "b", "c"), env={"PYTHONPATH": tests})
    assert run.rc == 0 and "REPLICAS OK" in run.out, run
