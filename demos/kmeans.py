"""CuPy's k-means example (github.com/cupy/cupy, examples/kmeans/kmeans.py), data-parallel.

    python demos/kmeans.py [RANKS] [SAMPLES]
    SYNK_SIMULATE_GPUS=2 python demos/kmeans.py      # on (simulated) GPUs

Each iteration is one synk function over the samples, scattered across the ranks: a rank
labels its rows with the nearest center and sums them per cluster, the sums and counts are
reduced with "sum" and the labels gathered, and the master moves the centers. The rank's
code is CuPy's: ``fit_xp``'s loop body, and on GPU ranks also ``fit_custom``'s, with CuPy's
``var_kernel``, ``sum_kernel`` and ``count_kernel`` (an ElementwiseKernel and two
ReductionKernels) as CuPy wrote them. The port's only changes: the array module comes from
``synk.xp(X)`` (``cupy.get_array_module`` there), the initial centers are chosen once by the
master (CuPy's draws them with ``xp.random.choice``, so that every run here is checked
against the same numpy answer), and ``fit_custom`` passes the centers' columns in order
(CuPy's example passes column 1 as ``c0`` and column 0 as ``c1``, a slip that changes its
distances). The result is checked against CuPy's ``fit_xp`` run by numpy in one process.
"""
import sys

import numpy as np

import synk

# CuPy's kernels (examples/kmeans/kmeans.py), unchanged: built on GPU ranks by kernels()
VAR_KERNEL = ('T x0, T x1, T c0, T c1', 'T out',
              'out = (x0 - c0) * (x0 - c0) + (x1 - c1) * (x1 - c1)',
              'var_kernel')
SUM_KERNEL = ('T x, S mask', 'T out',
              'mask ? x : 0',
              'a + b', 'out = a', '0',
              'sum_kernel')
COUNT_KERNEL = ('T mask', 'float32 out',
                'mask ? 1.0 : 0.0',
                'a + b', 'out = a', '0.0',
                'count_kernel')


def kernels(cupy):
    """CuPy's three custom kernels (CuPy caches what it compiles for them by their code)."""
    return (cupy.ElementwiseKernel(*VAR_KERNEL), cupy.ReductionKernel(*SUM_KERNEL),
            cupy.ReductionKernel(*COUNT_KERNEL))


def fit_xp(X, n_clusters, max_iter, initial_indexes):
    """CuPy's fit_xp (the initial centers given), run by numpy in one process: the answer."""
    assert X.ndim == 2
    xp = np
    n_samples = len(X)
    pred = xp.zeros(n_samples)
    centers = X[initial_indexes]
    for _ in range(max_iter):
        distances = xp.linalg.norm(X[:, None, :] - centers[None, :, :], axis=2)
        new_pred = xp.argmin(distances, axis=1)
        if xp.all(new_pred == pred):
            break
        pred = new_pred
        i = xp.arange(n_clusters)
        mask = pred == i[:, None]
        sums = xp.where(mask[:, :, None], X, 0).sum(axis=1)
        counts = xp.count_nonzero(mask, axis=1).reshape((n_clusters, 1))
        centers = sums / counts
    return centers, pred


def step_xp(X, centers):
    """One iteration of fit_xp on this rank's rows: its labels, and its sums and counts per
    cluster (CuPy's lines)."""
    xp = synk.xp(X)
    n_clusters = len(centers)
    distances = xp.linalg.norm(X[:, None, :] - centers[None, :, :], axis=2)
    new_pred = xp.argmin(distances, axis=1)
    pred = new_pred
    i = xp.arange(n_clusters)
    mask = pred == i[:, None]
    sums = xp.where(mask[:, :, None], X, 0).sum(axis=1)
    counts = xp.count_nonzero(mask, axis=1).reshape((n_clusters, 1))
    return sums, counts, new_pred


def step_custom(X, centers):
    """One iteration of fit_custom on this rank's rows, with CuPy's kernels (GPU ranks)."""
    cupy = synk.xp(X)
    var_kernel, sum_kernel, count_kernel = kernels(cupy)
    n_clusters = len(centers)
    distances = var_kernel(X[:, None, 0], X[:, None, 1],
                           centers[None, :, 0], centers[None, :, 1])
    new_pred = cupy.argmin(distances, axis=1)
    pred = new_pred
    i = cupy.arange(n_clusters)
    mask = pred == i[:, None]
    sums = sum_kernel(X, mask[:, :, None], axis=1)
    counts = count_kernel(mask, axis=1).reshape((n_clusters, 1))
    return sums, counts, new_pred


def fit(X, n_clusters, max_iter, initial_indexes, step):
    """k-means over the ranks: the master's loop, each iteration one call of ``step``."""
    f = synk.function(step, bcast_inputs=["centers"], reduce=("sum", "sum", "gather"))
    pred = np.zeros(len(X))
    centers = X.array[initial_indexes]
    for _ in range(max_iter):
        sums, counts, new_pred = f(X, centers)
        if np.all(new_pred == pred):
            break
        pred = new_pred
        centers = sums / counts
    return centers, pred


def main(ranks=None, num=5000, n_clusters=2, max_iter=10):
    rng = np.random.default_rng(0)
    samples = rng.standard_normal((num, 2))
    X_train = np.r_[samples + 1, samples - 1]
    initial_indexes = rng.choice(len(X_train), n_clusters, replace=False)
    want_centers, want_pred = fit_xp(X_train, n_clusters, max_iter, initial_indexes)

    n = synk.fork(ranks)
    try:
        X = synk.data(X_train)
        gpu = synk.devices()[0] is not None
        steps = {"xp": step_xp, **({"custom kernels": step_custom} if gpu else {})}
        for label, step in steps.items():
            centers, pred = fit(X, n_clusters, max_iter, initial_indexes, step)
            assert np.array_equal(pred, want_pred), label
            assert np.allclose(centers, want_centers, rtol=1e-10, atol=1e-12), label
            print(f"k-means ({label}) on {n} {'GPU' if gpu else 'CPU'} ranks: centers "
                  f"{np.round(centers, 3).tolist()}, equal to numpy's")
    finally:
        synk.close()
    print("All assertions passed.")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
