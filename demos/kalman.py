"""The Kalman filter update of the theano-mpi-kalman seed, over two ranks with send/recv.

    python demos/kalman.py [N]

Rank 0 computes A = Sigma H^T and B = R + H Sigma H^T, posts non-blocking sends of them to
rank 1 *before* it computes the mean update, so the transfer overlaps that work. Rank 1
receives them and computes the covariance update, and sends it back. The result is checked
against the same update computed in one process. (It is not timed: at these sizes one
update takes milliseconds, and a fair timing against one process needs both sides warm and
the same thread budget; see demos/train_mlp.py and python -m synk.bench.)

    new_mu    = mu + A B^-1 (H mu - data)
    new_Sigma = Sigma - A B^-1 H Sigma
"""
import sys

import numpy as np

import synk


def inputs(n, seed=0):
    rng = np.random.default_rng(seed)
    m = rng.random((n, n))
    sigma = m @ m.T / n + np.eye(n)  # a covariance: symmetric positive definite
    return (rng.random((n, 1)), sigma, rng.random((n, n)), np.eye(n) * 2.0,
            rng.random((n, 1)))


def kalman_single(mu, Sigma, H, R, data):
    A = Sigma @ H.T
    B = R + H @ Sigma @ H.T
    new_mu = mu + A @ np.linalg.solve(B, H @ mu - data)
    new_Sigma = Sigma - A @ np.linalg.solve(B, H) @ Sigma
    return new_mu, new_Sigma


def kalman_two_ranks(mu, Sigma, H, R, data):
    """Run on both ranks; the inputs arrive whole on each (broadcast through shared memory)."""
    comm = synk.comm
    if comm.rank() == 0:
        A = Sigma @ H.T
        sent_a = comm.isend(A, dest=1, tag=1)  # posted before the work it overlaps
        B = R + H @ Sigma @ H.T
        sent_b = comm.isend(B, dest=1, tag=2)
        new_mu = mu + A @ np.linalg.solve(B, H @ mu - data)  # meanwhile, the mean update
        new_Sigma = comm.recv(source=1, tag=3)
        sent_a.wait()
        sent_b.wait()
        return new_mu, new_Sigma
    A = comm.recv(source=0, tag=1)
    B = comm.recv(source=0, tag=2)
    new_Sigma = Sigma - A @ np.linalg.solve(B, H) @ Sigma  # the covariance update
    comm.send(new_Sigma, dest=0, tag=3)
    return None, None


def main(n=300):
    args = inputs(n)
    want_mu, want_sigma = kalman_single(*args)
    synk.fork(2)
    try:
        update = synk.function(kalman_two_ranks,
                               bcast_inputs=["mu", "Sigma", "H", "R", "data"], reduce=None)
        mus, sigmas = update(*args)
    finally:
        synk.close()
    assert np.allclose(mus[0], want_mu) and np.allclose(sigmas[0], want_sigma)
    print(f"Kalman update, n={n}: the two-rank result matches the single-process one "
          f"(largest differences {np.abs(mus[0] - want_mu).max():.1e} in the mean, "
          f"{np.abs(sigmas[0] - want_sigma).max():.1e} in the covariance).")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
