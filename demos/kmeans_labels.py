"""State that stays on each rank between calls: k-means whose labels live on the ranks.

    python demos/kmeans_labels.py [RANKS] [POINTS]
    SYNK_SIMULATE_GPUS=2 python demos/kmeans_labels.py      # the GPU code path, simulated

Lloyd's k-means, data-parallel. Each call assigns every point to its nearest center and
returns, per cluster, the sum and the count of its points (reduce "sum": the new centers
follow), and how many points changed cluster. The labels (each point's cluster) are per-rank
state: each rank keeps those of its own points from one call to the next, and only the
master's final ``synk.gather`` brings them together. The recipe, on CPU and GPU ranks alike:

* the points are a ``synk.Data``, scattered, with no ``batch=``: rank r gets the same rows
  at every call;
* the labels are a ``synk.shared`` variable, split with ``synk.scatter(labels, initial)``,
  which splits as synk splits a call's rows: rank r's replica holds the labels of exactly
  the rows rank r is given;
* the function writes the replica in place (``labels[...] = new``): it stays on that rank
  (in host memory on CPU ranks, on its GPU on GPU ranks), and nothing moves between calls;
* the master reads every rank's part with ``synk.gather(labels)``, in rank order, which is
  row order.

Writing into a scattered ``synk.Data`` is not the way: a ``Data`` is the master's array, and
on GPU ranks each rank computes on a copy of its rows. The run is checked against the same
k-means in one process with numpy: the same labels, iterations and centers.
"""
import sys

import numpy as np

import synk

K, DIM = 5, 3


def make_points(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` points around ``K`` centers, and ``K`` of the points as the first centers."""
    rng = np.random.default_rng(seed)
    truth = rng.uniform(-10, 10, (K, DIM))
    points = truth[rng.integers(0, K, n)] + rng.standard_normal((n, DIM))
    return points, points[rng.choice(n, K, replace=False)].copy()


def assign(x, centers, labels):
    """Each of this rank's points to its nearest center, kept in ``labels`` (this rank's
    replica); per cluster the sum and the count of its points, and how many points moved."""
    xp = synk.xp(x)
    distances = ((x[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2)
    new = distances.argmin(axis=1)
    moved = (new != labels).sum()
    labels[...] = new  # this rank's state, for the next call
    members = (new[:, None] == xp.arange(len(centers))).astype(x.dtype)
    return members.T @ x, members.sum(axis=0), moved


def next_centers(sums, counts, centers) -> np.ndarray:
    """The mean of each cluster's points; a cluster without points keeps its center."""
    counts = np.asarray(counts)[:, None]
    return np.where(counts > 0, np.asarray(sums) / np.maximum(counts, 1), centers)


def kmeans_one_process(points, centers, most: int = 100):
    """The same k-means in one process: (labels, centers, iterations run)."""
    labels = np.full(len(points), -1)
    iterations, moved = 0, None
    while moved != 0 and iterations < most:
        sums, counts, moved = assign(points, centers, labels)
        centers = next_centers(sums, counts, centers)
        iterations += 1
    return labels, centers, iterations


def kmeans_synk(points, centers, most: int = 100):
    """k-means on the running group, the labels kept on the ranks: (labels, centers,
    iterations run)."""
    x = synk.data(points)
    labels = synk.shared(np.zeros(0, np.int64), name="labels")
    synk.scatter(labels, np.full(len(points), -1))  # rank r: the labels of rank r's rows
    step = synk.function(assign, bcast_inputs=["centers"], reduce="sum")
    iterations, moved = 0, None
    while moved != 0 and iterations < most:
        sums, counts, moved = step(x, centers, labels)
        centers = next_centers(sums, counts, centers)
        iterations += 1
    return synk.gather(labels), centers, iterations


def main(ranks: int | None = None, n: int = 3001) -> None:
    points, first = make_points(n)
    want_labels, want_centers, want_its = kmeans_one_process(points, first)
    ranks = synk.fork(ranks)
    print(synk.backend())
    try:
        labels, centers, its = kmeans_synk(points, first)
    finally:
        synk.close()
    print(f"k-means of {n} points into {K} clusters on {ranks} ranks: {its} iterations")
    assert its == want_its, (its, want_its)
    assert np.array_equal(labels, want_labels), "the labels differ from one process's"
    gap = float(np.abs(centers - want_centers).max())
    assert gap < 1e-9, f"the centers differ by {gap:.1e}"
    print(f"The labels kept on the ranks match the single-process k-means (centers within "
          f"{gap:.1e}). All assertions passed.")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else None,
         int(sys.argv[2]) if len(sys.argv) > 2 else 3001)
