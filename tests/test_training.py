"""Training equivalence: N-rank data-parallel SGD ends with the same parameters as
single-process SGD on the same minibatches (uneven splits included)."""
import numpy as np
import pytest

import synk


def grad_sums(w, x, y):
    """Least squares: sum over rows of the loss and of its gradient."""
    err = x @ w - y
    return float((err ** 2).sum()), 2 * x.T @ err


def sgd_single(x, y, w, batches, lr):
    w = w.copy()
    for idx in batches:
        _, g = grad_sums(w, x[idx], y[idx])
        w -= lr * g / len(idx)
    return w


def step(x, y, w, n_total, lr):
    loss, g = grad_sums(w, x, y)
    g = synk.comm.allreduce(g, "sum")
    w -= lr * g / n_total
    return loss / n_total


@pytest.mark.parametrize("ranks", [2, 3])
def test_data_parallel_sgd_equals_single_process(ranks):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((1001, 8)), rng.standard_normal(1001)
    w0 = rng.standard_normal(8) * 0.1
    batches = [rng.choice(1001, size=rng.integers(50, 130), replace=False) for _ in range(40)]
    want = sgd_single(x, y, w0, batches, lr=0.05)
    synk.fork(ranks)
    try:
        w = synk.shared(w0)
        f = synk.function(step, inputs=["x", "y"], bcast_inputs=["n_total", "lr"], reduce="sum")
        xd, yd = synk.data(x), synk.data(y)
        for idx in batches:
            f(xd, yd, w, len(idx), 0.05, batch=idx)
        for r in range(ranks):
            assert np.allclose(w.get_value(r), want, rtol=1e-12, atol=1e-12), r
    finally:
        synk.close()


@pytest.mark.parametrize("ranks", [2, 3])
def test_many_steps_in_one_call_equal_a_call_per_step_bit_for_bit(ranks):
    """docs/training.md's loop on the ranks (``step.steps(batches)``, the bench's route B
    step, its mean also a persistent allreduce) ends with the very weights and losses of
    route B (a call per step), on every rank; 20 rows a step split unevenly over 3 ranks
    too."""
    from synk.bench import mlp
    from synk.bench.training import persistent_step, train_step

    x, y = mlp.data()
    batches = mlp.batches(12)
    synk.fork(ranks)
    try:
        xd, yd = synk.data(x), synk.data(y)
        per_step = [synk.shared(p) for p in mlp.params()]
        step = synk.function(train_step, inputs=["x", "y"], reduce="mean")
        losses_b = [step(*per_step, xd, yd, batch=idx) for idx in batches]
        in_one = [synk.shared(p) for p in mlp.params()]
        losses_c = step.bind(*in_one, xd, yd).steps(batches)
        persisted = [synk.shared(p) for p in mlp.params()]
        persistent = synk.function(persistent_step, inputs=["x", "y"], bcast_inputs=["state"],
                                   reduce="mean").bind(*persisted, xd, yd)
        losses_p = persistent.steps(batches[:5], state={}) + persistent.steps(
            batches[5:], state={})
        for b, c, p in zip(per_step, in_one, persisted):
            for r in range(ranks):
                assert np.array_equal(b.get_value(r), c.get_value(r)), r
                assert np.array_equal(b.get_value(r), p.get_value(r)), r
        assert not np.array_equal(per_step[0].get_value(), mlp.params()[0])  # (it learned)
        assert losses_c == losses_b == losses_p
    finally:
        synk.close()
