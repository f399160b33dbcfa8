"""Synkhronos's ``demos/demo_1.py``, written for synk: outputs with their own reduce ops,
checking against the master alone (Synkhronos's ``as_theano`` is ``f.local``), and
``num_slices``. Checked against plain numpy.
"""
import sys

import numpy as np

import synk

# One rank per CPU core (one per GPU with the GPU backend), or as many as the first argument.
n = synk.fork(int(sys.argv[1]) if len(sys.argv) > 1 else None)
print(f"synk: {n} ranks")


# Data-parallel over the rows of x. Synkhronos built Theano graphs and named an op per
# output; synk wraps a plain function and gives one reduce op per returned value.
def stats(x, y):
    z = x @ y
    return z.mean(axis=0), z.sum(axis=0), z.max(axis=0)


# y is broadcast whole to every rank; x (every other parameter) is split along axis 0.
f = synk.function(stats, bcast_inputs=["y"], reduce=["mean", "sum", "max"])
synk.distribute()  # optional: functions are shipped on their first call anyway

rng = np.random.default_rng(0)
x_dat = 0.01 * rng.standard_normal((1000, 10)).astype("float32")
y_dat = rng.standard_normal((10, 5)).astype("float32")
TOL = dict(rtol=1e-4, atol=1e-5)  # float32 sums

# For comparison, run in the master alone, over all the rows (Synkhronos: f.as_theano).
r_avg, r_sum, r_max = f.local(x_dat, y_dat)
want = stats(x_dat, y_dat)  # and plain numpy
for got, expected in zip((r_avg, r_sum, r_max), want):
    assert np.allclose(got, expected, **TOL)

# Shared memory for the inputs (Synkhronos: f.build_inputs). Plain arrays work too; a
# synk.Data saves the copy into shared memory that a plain array costs on every call.
x_synk, y_synk = synk.data(x_dat), synk.data(y_dat)

# Computed on every rank, combined in the master.
r_avg_synk, r_sum_synk, r_max_synk = f(x_synk, y_synk)
assert np.allclose(r_avg, r_avg_synk, **TOL)
assert np.allclose(r_sum, r_sum_synk, **TOL)
assert np.allclose(r_max, r_max_synk, **TOL)
print("Basic math test passed.")

# Smaller memory use: each rank computes over 4 slices of its rows, then combines them.
r_avg_slc, r_sum_slc, r_max_slc = f(x_synk, y_synk, num_slices=4)
assert np.allclose(r_avg, r_avg_slc, **TOL)
assert np.allclose(r_sum, r_sum_slc, **TOL)
assert np.allclose(r_max, r_max_slc, **TOL)
print("Sliced math test passed.")

# Where synk differs: "mean" is weighted by the rows each rank had, so rows that do not
# split evenly (997 rows over the ranks, then 3 slices each) still give the one-process mean.
x_odd = x_dat[:997]
r_odd = f(x_odd, y_synk, num_slices=3)[0]
assert np.allclose(r_odd, stats(x_odd, y_dat)[0], **TOL)
assert np.allclose(r_odd, f.local(x_odd, y_dat)[0], **TOL)
print("Uneven split mean test passed.")

synk.close()
print("All assertions passed.")
