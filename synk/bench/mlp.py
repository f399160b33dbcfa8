"""The training step the ``training`` benchmark times, in every form: an MLP of MNIST's sizes
(784 -> 32 -> 10, tanh, softmax cross-entropy), float32, 20 rows a step. Its gradients are
written out by hand (numpy), so that synk, mpi4py and one process run the same arithmetic."""
from __future__ import annotations

import numpy as np

FEATURES, HIDDEN, CLASSES, ROWS, BATCH = 784, 32, 10, 4000, 20
DTYPE = np.float32
LR = 0.1


def data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """ROWS rows of inputs and their one-hot labels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS, FEATURES)).astype(DTYPE)
    y = np.eye(CLASSES, dtype=DTYPE)[rng.integers(0, CLASSES, ROWS)]
    return x, y


def params(seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The weights (W1, b1, W2, b2), updated in place by ``update``."""
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((FEATURES, HIDDEN)) / 28).astype(DTYPE),
            np.zeros(HIDDEN, DTYPE),
            (rng.standard_normal((HIDDEN, CLASSES)) / 6).astype(DTYPE),
            np.zeros(CLASSES, DTYPE))


def batches(steps: int, seed: int = 2) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.permutation(ROWS)[:BATCH] for _ in range(steps)]


def loss_and_grads(W1, b1, W2, b2, x, y):
    """The mean loss over the rows of ``x`` and its gradients (mean over the rows)."""
    n = max(len(x), 1)
    h = np.tanh(x @ W1 + b1)
    z = h @ W2 + b2
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    p = e / e.sum(axis=1, keepdims=True)
    loss = -(y * np.log(p + 1e-12)).sum() / n
    d = (p - y) / n
    dh = (d @ W2.T) * (1 - h * h)
    return loss, [x.T @ dh, dh.sum(axis=0), h.T @ d, d.sum(axis=0)]


def update(params, grads) -> None:
    """Plain SGD, in place."""
    for p, g in zip(params, grads):
        p -= LR * g
