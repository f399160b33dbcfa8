"""CuPy's Gaussian mixture example (github.com/cupy/cupy, examples/gmm/gmm.py), data-parallel.

    python demos/gmm.py [RANKS] [SAMPLES]
    SYNK_SIMULATE_GPUS=2 python demos/gmm.py         # on (simulated) GPUs

EM over the training rows, scattered across the ranks: each iteration is one synk function
in which a rank runs CuPy's ``e_step`` on its rows, unchanged, and the sums of CuPy's
``m_step`` (``nk``, ``resp.T @ X``, ``resp.T @ X**2``); the sums are reduced with "sum" and
the mean log-likelihood with "mean" (weighted by rows, so it is the mean over all rows), and
the master finishes ``m_step``'s divisions. Predictions are CuPy's ``predict``, unchanged,
gathered from the ranks. The port's changes: the array module comes from ``synk.xp(X)``
(``cupy.get_array_module`` there), ``m_step`` is split into the sums on the ranks and the
divisions on the master, the random data are seeded, and nothing is drawn. The result is
checked against CuPy's ``train_gmm`` and ``predict``, unchanged, run by numpy in one
process.
"""
import sys

import numpy as np

import synk

# ---------------------------------------------------------------- CuPy's code (xp: synk.xp)

def estimate_log_prob(X, inv_cov, means):
    xp = synk.xp(X)
    n_features = X.shape[1]
    log_det = xp.sum(xp.log(inv_cov), axis=1)
    precisions = inv_cov ** 2
    log_prob = xp.sum((means ** 2 * precisions), 1) - \
        2 * xp.dot(X, (means * precisions).T) + xp.dot(X ** 2, precisions.T)
    return -0.5 * (n_features * xp.log(2 * np.pi) + log_prob) + log_det


def m_step(X, resp):
    xp = synk.xp(X)
    nk = xp.sum(resp, axis=0)
    means = xp.dot(resp.T, X) / nk[:, None]
    X2 = xp.dot(resp.T, X * X) / nk[:, None]
    covariances = X2 - means ** 2
    return nk / len(X), means, covariances


def e_step(X, inv_cov, means, weights):
    xp = synk.xp(X)
    weighted_log_prob = estimate_log_prob(X, inv_cov, means) + \
        xp.log(weights)
    log_prob_norm = xp.log(xp.sum(xp.exp(weighted_log_prob), axis=1))
    log_resp = weighted_log_prob - log_prob_norm[:, None]
    return xp.mean(log_prob_norm), log_resp


def train_gmm(X, max_iter, tol, means, covariances):
    xp = synk.xp(X)
    lower_bound = -np.inf
    converged = False
    weights = xp.array([0.5, 0.5], dtype=np.float32)
    inv_cov = 1 / xp.sqrt(covariances)

    for n_iter in range(max_iter):  # noqa: B007 (CuPy's code, unchanged)
        prev_lower_bound = lower_bound
        log_prob_norm, log_resp = e_step(X, inv_cov, means, weights)
        weights, means, covariances = m_step(X, xp.exp(log_resp))
        inv_cov = 1 / xp.sqrt(covariances)
        lower_bound = log_prob_norm
        change = lower_bound - prev_lower_bound
        if abs(change) < tol:
            converged = True
            break

    if not converged:
        print('Failed to converge. Increase max-iter or tol.')

    return inv_cov, means, weights, covariances


def predict(X, inv_cov, means, weights):
    xp = synk.xp(X)
    log_prob = estimate_log_prob(X, inv_cov, means)
    return (log_prob + xp.log(weights)).argmax(axis=1)


# ---------------------------------------------------------------- over the ranks

def em_sums(X, inv_cov, means, weights):
    """One EM iteration on this rank's rows: CuPy's e_step, and m_step's sums."""
    xp = synk.xp(X)
    log_prob_norm, log_resp = e_step(X, inv_cov, means, weights)
    resp = xp.exp(log_resp)
    return log_prob_norm, xp.sum(resp, axis=0), xp.dot(resp.T, X), xp.dot(resp.T, X * X)


def train_gmm_on_ranks(X, max_iter, tol, means, covariances):
    """CuPy's train_gmm, each iteration's e_step and sums on the ranks."""
    step = synk.function(em_sums, bcast_inputs=["inv_cov", "means", "weights"],
                         reduce=("mean", "sum", "sum", "sum"))
    lower_bound = -np.inf
    weights = np.array([0.5, 0.5], dtype=np.float32)
    inv_cov = 1 / np.sqrt(covariances)
    for n_iter in range(max_iter):
        prev_lower_bound = lower_bound
        log_prob_norm, nk, sum_x, sum_x2 = step(X, inv_cov, means, weights)
        means = sum_x / nk[:, None]  # m_step's divisions
        covariances = sum_x2 / nk[:, None] - means ** 2
        weights = nk / len(X)
        inv_cov = 1 / np.sqrt(covariances)
        lower_bound = log_prob_norm
        if abs(lower_bound - prev_lower_bound) < tol:
            return inv_cov, means, weights, covariances, n_iter
    return inv_cov, means, weights, covariances, max_iter


def main(ranks=None, num=20000, dim=2, max_iter=30, tol=1e-3):
    rng = np.random.default_rng(0)
    scale = np.ones(dim)
    train1 = rng.normal(1, scale, size=(num, dim)).astype(np.float32)
    train2 = rng.normal(-1, scale, size=(num, dim)).astype(np.float32)
    X_train = np.r_[train1, train2]
    test1 = rng.normal(1, scale, size=(100, dim)).astype(np.float32)
    test2 = rng.normal(-1, scale, size=(100, dim)).astype(np.float32)
    X_test = np.r_[test1, test2]
    y_train = np.r_[np.zeros(num), np.ones(num)].astype(np.int32)
    y_test = np.r_[np.zeros(100), np.ones(100)].astype(np.int32)
    means = np.stack([rng.normal(1, scale, size=dim), rng.normal(-1, scale, size=dim)])
    covariances = rng.random((2, dim))

    want = train_gmm(X_train, max_iter, tol, means, covariances)  # numpy, one process
    want_train = predict(X_train, *want[:2], want[2])
    want_test = predict(X_test, *want[:2], want[2])

    n = synk.fork(ranks)
    try:
        X = synk.data(X_train)
        inv_cov, got_means, weights, cov, iterations = train_gmm_on_ranks(
            X, max_iter, tol, means, covariances)
        guess = synk.function(predict, bcast_inputs=["inv_cov", "means", "weights"],
                              reduce="gather")
        train_pred = guess(X, inv_cov, got_means, weights)
        test_pred = guess(X_test, inv_cov, got_means, weights)
        gpu = synk.devices()[0] is not None
    finally:
        synk.close()
    for got, expected in zip((inv_cov, got_means, weights, cov), want):
        assert np.allclose(got, expected, rtol=1e-5, atol=1e-8), (got, expected)
    assert np.array_equal(train_pred, want_train) and np.array_equal(test_pred, want_test)
    print(f"GMM on {n} {'GPU' if gpu else 'CPU'} ranks: {iterations + 1} EM iterations, "
          f"means {np.round(got_means, 3).tolist()}, train accuracy "
          f"{np.mean(train_pred == y_train) * 100:.1f}%, test accuracy "
          f"{np.mean(test_pred == y_test) * 100:.1f}%, equal to numpy's")
    print("All assertions passed.")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:]))
