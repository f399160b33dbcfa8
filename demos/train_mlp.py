"""Data-parallel training of a numpy MLP with synk.

    python demos/train_mlp.py [RANKS] [EPOCHS]

Part 1 is the training loop as you may already have it: a two-layer MLP classifier with
hand-written backprop and plain SGD, in one process. Part 2 is the same loop made
data-parallel, its steps run on the ranks:

1. the parameters become ``synk.shared`` variables (a replica on every rank);
2. the data becomes ``synk.data`` (shared memory, split by rows);
3. the gradient step is wrapped with ``synk.function``: each rank computes the gradient
   over its rows of the minibatch, ``synk.comm.allreduce(..., "mean", weight=len(x))``
   averages it across ranks (one fused buffer), and every rank applies the same SGD update
   to its own replica;
4. the step is bound to the data and the replicas, and each epoch is one call of many
   steps (``step.steps(minibatches)``): every rank runs the epoch's steps on its rows of
   each minibatch, as ``batch=idx`` would give them.

Both parts see the same minibatches, so they print the same losses and end with the same
parameters (up to float rounding). The two parts take turns, epoch by epoch, and are timed
warm with the same budget of BLAS threads: the one process may use as many as the ranks
have together, and runs with the count (up to that) that is fastest for it.
"""
import sys
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

import synk

N_SAMPLES, N_FEATURES, HIDDEN, N_CLASSES = 20_000, 64, 512, 4
BATCH, LR = 2000, 0.5


def make_data(seed=0):
    """Gaussian blobs, lifted into N_FEATURES dimensions (no download needed)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, N_CLASSES, N_SAMPLES)
    centers = rng.normal(0, 2.0, (N_CLASSES, 2))
    flat = centers[y] + rng.normal(0, 1.0, (N_SAMPLES, 2))
    lift = rng.normal(0, 1.0, (2, N_FEATURES))
    x = np.tanh(flat @ lift) + 0.1 * rng.normal(0, 1.0, (N_SAMPLES, N_FEATURES))
    return x, y


def init_params(seed=1):
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 0.1, (N_FEATURES, HIDDEN)), np.zeros(HIDDEN),
            rng.normal(0, 0.1, (HIDDEN, N_CLASSES)), np.zeros(N_CLASSES)]


def loss_and_grad_sums(W1, b1, W2, b2, x, y):
    """Cross-entropy summed over the rows of x, and its gradients (also sums over rows)."""
    h = np.maximum(x @ W1 + b1, 0.0)
    logits = h @ W2 + b2
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    rows = np.arange(len(y))
    loss = -np.log(p[rows, y]).sum()
    d_logits = p
    d_logits[rows, y] -= 1.0
    gW2, gb2 = h.T @ d_logits, d_logits.sum(axis=0)
    d_h = (d_logits @ W2.T) * (h > 0)
    gW1, gb1 = x.T @ d_h, d_h.sum(axis=0)
    return loss, [gW1, gb1, gW2, gb2]


def minibatches(epoch):
    order = np.random.default_rng(100 + epoch).permutation(N_SAMPLES)
    return [order[i:i + BATCH] for i in range(0, N_SAMPLES, BATCH)]


# -- Part 1: the loop as you have it ---------------------------------------------------------
def train_single_epoch(params, x, y, epoch):
    """One epoch of plain SGD in one process; the mean minibatch loss."""
    batches = minibatches(epoch)
    total = 0.0
    for idx in batches:
        loss, grads = loss_and_grad_sums(*params, x[idx], y[idx])
        for p, g in zip(params, grads):
            p -= LR * g / len(idx)
        total += loss / len(idx)
    return total / len(batches)


# -- Part 2: the same loop, data-parallel -----------------------------------------------------
def train_step(x, y, W1, b1, W2, b2, lr):
    """One rank's part of an SGD step: its rows' mean gradient, averaged over every rank by
    one allreduce (weighted by rows: the minibatch's mean), then the same update applied to
    this rank's replica of each parameter."""
    params = (W1, b1, W2, b2)
    rows = max(len(x), 1)  # (a rank without rows weighs 0)
    loss, grads = loss_and_grad_sums(*params, x, y)
    grads = synk.comm.allreduce([g / rows for g in grads], "mean", weight=len(x))
    for p, g in zip(params, grads):
        p -= lr * g  # in place: the replica keeps it
    return loss / rows  # averaged over the ranks by rows: the minibatch's mean loss


def train_synk_epoch(step, epoch):
    """The same epoch, data-parallel, its steps run on the ranks in one call; the mean
    minibatch loss."""
    return float(np.mean(step.steps(minibatches(epoch))))


def blas_threads() -> int:
    """The BLAS/OpenMP threads this process may use now (synk caps each rank's)."""
    return max((pool["num_threads"] for pool in threadpool_info()), default=1)


def fastest_threads(budget, params, x, y, idx, repeats=5):
    """The BLAS thread count, up to ``budget``, at which one process computes a step the
    fastest here (more threads are not always faster, on small products or a busy machine)."""
    def step_time(threads):
        with threadpool_limits(limits=threads):
            loss_and_grad_sums(*params, x[idx], y[idx])  # warm this pool size up
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                loss_and_grad_sums(*params, x[idx], y[idx])
                times.append(time.perf_counter() - start)
        return np.median(times)

    counts = sorted({1, budget, *(2 ** k for k in range(budget.bit_length()) if 2 ** k < budget)})
    return min(counts, key=step_time)


def main(ranks=None, epochs=3):
    x, y = make_data()
    n = synk.fork(ranks)
    try:
        # The same thread budget on both sides: one process may use as many BLAS threads as
        # the n ranks have together, and gets the count that serves it best.
        budget = n * blas_threads()
        single_params = init_params()
        params = [synk.shared(p, name=name)
                  for p, name in zip(init_params(), ["W1", "b1", "W2", "b2"])]
        x_data, y_data = synk.data(x), synk.data(y)
        step_of = synk.function(train_step, inputs=["x", "y"], bcast_inputs=["lr"],
                                reduce="mean")
        step = step_of.bind(x_data, y_data, *params, LR)
        # Warm both sides up (thread pools; shipping the step, mapping the data) without
        # changing the parameters: lr=0 leaves them as they are.
        idx = minibatches(0)[0]
        threads = fastest_threads(budget, single_params, x, y, idx)
        step_of(x_data, y_data, *params, 0.0, batch=idx)
        single_losses, single_times, synk_losses, synk_times = [], [], [], []
        for epoch in range(epochs):  # the two sides take turns, so both see the same machine
            with threadpool_limits(limits=threads):
                start = time.perf_counter()
                single_losses.append(train_single_epoch(single_params, x, y, epoch))
                single_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            synk_losses.append(train_synk_epoch(step, epoch))
            synk_times.append(time.perf_counter() - start)
        for p in params:  # every rank applied the same updates: check that the replicas agree
            for r in range(1, synk.size()):
                assert np.allclose(p.get_value(r), p.get_value()), f"{p.name} differs on rank {r}"
        synk_params = [p.get_value() for p in params]
    finally:
        synk.close()
    print(f"{'epoch':>5} {'loss, 1 process':>16} {f'loss, {n} ranks':>16} "
          f"{'s/epoch, 1 process':>19} {f's/epoch, {n} ranks':>18}")
    for e in range(epochs):
        print(f"{e:>5} {single_losses[e]:>16.6f} {synk_losses[e]:>16.6f} "
              f"{single_times[e]:>19.3f} {synk_times[e]:>18.3f}")
    loss_gap = max(abs(a - b) for a, b in zip(single_losses, synk_losses))
    param_gap = max(np.abs(a - b).max() for a, b in zip(single_params, synk_params))
    print(f"largest loss difference {loss_gap:.2e}, largest parameter difference {param_gap:.2e}")
    assert loss_gap < 1e-9 and param_gap < 1e-9, "data-parallel training drifted from numpy"
    assert single_losses[-1] < single_losses[0], "the loss did not go down"
    print(f"The {n}-rank run matches single-process SGD. Mean time per epoch, both sides warm "
          f"and taking turns: {np.mean(single_times):.3f} s in one process with {threads} BLAS "
          f"thread(s) (its fastest count up to {budget}), {np.mean(synk_times):.3f} s on {n} "
          f"ranks with {budget // n} each.")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None,
         int(sys.argv[2]) if len(sys.argv) > 2 else 3)
