"""The Synkhronos introduction, written for synk.

The mean of ``x @ y`` with ``x`` scattered over the ranks and ``y`` broadcast to all of
them, checked against plain numpy. Runs on the CPU cores when there is no GPU.
"""
import numpy as np

import synk

n = synk.fork()  # one rank per CPU core (the master is rank 0 and works too)
print(f"synk: {n} ranks")


def loss(x, y):
    xp = synk.xp(x)  # numpy here; cupy on GPU ranks
    return xp.mean(x @ y, axis=0)


f = synk.function(loss, bcast_inputs=["y"], reduce="mean")
synk.distribute()

x_dat = np.random.randn(100, 10).astype("float32")
y_dat = np.random.randn(10).astype("float32")
x_synk = synk.data(x_dat)  # shared memory: every rank maps it, no copies
y_synk = synk.data(y_dat)

# float32 sums of terms near 1 round at about 1e-7, so a mean near zero needs an
# absolute tolerance as well as a relative one.
TOL = dict(rtol=1e-5, atol=1e-5)
r_np = loss(x_dat, y_dat)
r = f(x_synk, y_synk)
assert np.allclose(r, r_np, **TOL), (r, r_np)
assert np.allclose(f(x_dat, y_dat), r_np, **TOL)  # plain numpy arrays work too
# fn in the master alone, over all the rows (Synkhronos compared with a Theano function).
assert np.allclose(f.local(x_synk, y_synk), r, **TOL)

# Uneven splits still give the single-process answer: 101 rows over n ranks.
x_odd = np.random.randn(101, 10).astype("float32")
assert np.allclose(f(x_odd, y_dat), loss(x_odd, y_dat), **TOL)

synk.close()
print("All assertions passed.")
