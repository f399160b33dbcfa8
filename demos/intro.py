"""The Synkhronos introduction, written for synk.

The mean of ``x @ y`` with ``x`` scattered over the ranks and ``y`` broadcast to all of
them, beside plain numpy's answer in one process; then a heavier function of the same form,
the mean of ``tanh(x @ w)`` over 100,000 rows, timed against numpy in one process given
as many BLAS threads as the ranks have together. Runs on the CPU cores when there is no
GPU.
"""
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

import synk

n = synk.fork()  # one rank per CPU core (the master is rank 0 and works too)
print(f"synk: {n} ranks")


def loss(x, y):
    xp = synk.xp(x)  # numpy here; cupy on GPU ranks
    return xp.mean(x @ y, axis=0)


def activation(x, w):
    xp = synk.xp(x)
    return xp.mean(xp.tanh(x @ w))


f = synk.function(loss, bcast_inputs=["y"], reduce="mean")
g = synk.function(activation, bcast_inputs=["w"], reduce="mean")
synk.distribute()

x_dat = np.random.randn(100, 10).astype("float32")
y_dat = np.random.randn(10).astype("float32")
x_synk = synk.data(x_dat)  # shared memory: every rank maps it, no copies
y_synk = synk.data(y_dat)

# float32 sums of terms near 1 round at about 1e-7, so a mean near zero needs an
# absolute tolerance as well as a relative one.
TOL = dict(rtol=1e-5, atol=1e-5)
print(f"{'':<44} {f'synk, {n} ranks':>15} {'numpy, 1 process':>17} {'difference':>11}")


def show(what, got, want):
    """synk's answer beside numpy's, and the check that they agree."""
    print(f"{what:<44} {float(got):>15.8f} {float(want):>17.8f} {abs(got - want):>11.1e}")
    assert np.allclose(got, want, **TOL), (what, got, want)


r_np = loss(x_dat, y_dat)
r = f(x_synk, y_synk)
show("mean(x @ y), 100 rows in a synk.Data", r, r_np)
show("mean(x @ y), plain numpy arrays", f(x_dat, y_dat), r_np)  # plain numpy arrays work too
# fn in the master alone, over all the rows (Synkhronos compared with a Theano function).
show("mean(x @ y), f.local: the master alone", f.local(x_synk, y_synk), r_np)

# Uneven splits still give the single-process answer: 101 rows over n ranks.
x_odd = np.random.randn(101, 10).astype("float32")
show("mean(x @ y), 101 rows (an uneven split)", f(x_odd, y_dat), loss(x_odd, y_dat))

# A heavier function, timed warm (best of 5) on both sides. The one process may use as many
# BLAS threads as the ranks have together (synk gives each rank its share of the cores).
x_big = np.random.default_rng(0).standard_normal((100_000, 64), dtype=np.float32)
w = np.random.default_rng(1).standard_normal((64, 256), dtype=np.float32) / 8
x_big_synk = synk.data(x_big)
threads = n * max((pool["num_threads"] for pool in threadpool_info()), default=1)


def best_time(run):
    run()  # warm
    times = []
    for _ in range(5):
        start = time.perf_counter()
        value = run()
        times.append(time.perf_counter() - start)
    return value, min(times)


with threadpool_limits(limits=threads):
    a_np, t_np = best_time(lambda: activation(x_big, w))
a, t = best_time(lambda: g(x_big_synk, w))
show("mean(tanh(x @ w)), 100,000 rows", a, a_np)
where = " (on the CUDA simulator: numpy's times, not a GPU's)" if synk.simulator.enabled() else ""
print(f"time of mean(tanh(x @ w)), 100,000 rows: {t_np * 1e3:.1f} ms in one process "
      f"({threads} BLAS threads), {t * 1e3:.1f} ms on {n} ranks, {t_np / t:.2f} times as fast"
      f"{where}")

synk.close()
print("All assertions passed.")
