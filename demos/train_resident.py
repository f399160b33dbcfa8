"""A training loop on data that stays on the devices, and the bytes each step moves.

    python demos/train_resident.py [RANKS] [STEPS]
    SYNK_SIMULATE_GPUS=2 python demos/train_resident.py     # the GPU code path, simulated

Logistic regression by minibatch SGD, data-parallel: the parameters are ``synk.shared``
variables (a replica on every rank), the data set is a ``synk.Data``, and each step passes
``batch=idx``. The loop runs twice on the same minibatches: first with the data in shared
memory only (every step copies its rows to the devices), then after
``x.to_device("replicate")`` (the data set is copied to every device once; a step moves only
its row indices). The profile's byte counters, per rank, show the difference. Both runs give
the losses of the same loop in one process with numpy. On CPU ranks nothing is copied at
all: the shared memory is the device.
"""
import sys

import numpy as np

import synk

N_SAMPLES, N_FEATURES, BATCH, LR = 20_000, 32, 1000, 0.5


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_SAMPLES, N_FEATURES))
    truth = rng.standard_normal(N_FEATURES)
    y = (x @ truth + 0.5 * rng.standard_normal(N_SAMPLES) > 0).astype(np.float64)
    return x, y


def loss_and_grad_sums(x, y, w, b):
    """Cross-entropy summed over the rows, and its gradient (also summed): numpy or cupy."""
    xp = synk.xp(x)
    p = 1 / (1 + xp.exp(-(x @ w + b)))
    loss = -(y * xp.log(p + 1e-12) + (1 - y) * xp.log(1 - p + 1e-12)).sum()
    g = p - y
    return loss, xp.concatenate([x.T @ g, g.sum(keepdims=True)])


def step(x, y, w, b, n_total, lr):
    """One rank's part of an SGD step: its rows' gradient, summed over the ranks, then the
    same update on every rank's replica."""
    loss, grads = loss_and_grad_sums(x, y, w, b)
    grads = synk.comm.allreduce(grads, "sum") / n_total
    w -= lr * grads[:-1]
    b -= lr * grads[-1:]
    return loss / n_total


def minibatches(steps):
    rng = np.random.default_rng(1)
    return [rng.permutation(N_SAMPLES)[:BATCH] for _ in range(steps)]


def single_process(x, y, batches):
    w, b, losses = np.zeros(N_FEATURES), np.zeros(1), []
    for idx in batches:
        loss, grads = loss_and_grad_sums(x[idx], y[idx], w, b)
        grads /= len(idx)
        w -= LR * grads[:-1]
        b -= LR * grads[-1:]
        losses.append(loss / len(idx))
    return losses


def train(f, x_data, y_data, batches, n):
    """The loop; its losses and, per step, the bytes each rank copied each way."""
    w, b = synk.shared(np.zeros(N_FEATURES), name="w"), synk.shared(np.zeros(1), name="b")
    losses, moved = [], []
    for idx in batches:
        before = [f.profile.transfers(r) for r in range(n)]
        losses.append(f(x_data, y_data, w, b, len(idx), LR, batch=idx))
        moved.append([{k: f.profile.transfers(r)[k] - before[r][k] for k in ("h2d", "d2h")}
                      for r in range(n)])
    return losses, moved


def show(title, moved):
    print(title)
    for s, per_rank in enumerate(moved[:3]):
        cells = ", ".join(f"rank {r}: {m['h2d']:>7} B to the device, {m['d2h']:>3} B back"
                          for r, m in enumerate(per_rank))
        print(f"  step {s}: {cells}")


def main(ranks=None, steps=6):
    x, y = make_data()
    batches = minibatches(steps)
    want = single_process(x, y, batches)
    n = synk.fork(ranks)
    gpu = synk.devices()[0] is not None
    print(synk.backend())
    try:
        x_data, y_data = synk.data(x), synk.data(y)
        f = synk.function(step, inputs=["x", "y"], bcast_inputs=["n_total", "lr"],
                          reduce="sum", profile=True)
        plain, plain_moved = train(f, x_data, y_data, batches, n)
        x_data.to_device("replicate")
        y_data.to_device("replicate")
        resident, resident_moved = train(f, x_data, y_data, batches, n)
    finally:
        synk.close()
    show("Data in shared memory: every step copies its rows to the devices", plain_moved)
    show("Data resident on the devices (after a first copy): only the indices move",
         resident_moved[1:])
    gap = max(abs(a - b) for a, b in zip(want, plain + resident))
    shown = ", ".join(f"{v:.4f}" for v in resident)
    print(f"losses: {shown}; largest difference from one numpy process {gap:.1e}")
    assert gap < 1e-9, "the data-parallel loop drifted from numpy"
    assert resident[-1] < resident[0], "the loss did not go down"
    for per_rank, idx in zip(resident_moved[1:], batches[1:]):
        rows = [len(part) for part in np.array_split(idx, n)]
        for r, m in enumerate(per_rank):  # the indices (8 bytes each), and each rank's loss
            assert m["h2d"] == (8 * rows[r] if gpu else 0), (r, m)
            assert m["d2h"] == (8 if gpu else 0), (r, m)
    print("All assertions passed.")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None,
         int(sys.argv[2]) if len(sys.argv) > 2 else 6)
