"""Synkhronos's ``demos/demo_4.py`` (``batch=``) and ``demos/demo_5.py`` (``batch_s=``, as
``local_batch=`` on a ``Data`` resident on the devices in shard mode),
written for synk: choosing the rows a call computes on, before the split (``batch=``) and
within each rank's own rows, with ``num_slices``. Checked against plain numpy and against
the master alone (``f.local``).
"""
import sys

import numpy as np

import synk

# One rank per CPU core (one per GPU with the GPU backend), or as many as the first argument.
n = synk.fork(int(sys.argv[1]) if len(sys.argv) > 1 else None)
print(f"synk: {n} ranks")
rng = np.random.default_rng(0)
TOL = dict(rtol=1e-4, atol=1e-4)  # float32 sums

# -- demo_4: batch= selects rows of the whole data set, which are then split --------------


def sum_xw_y(x, w, y):
    return np.sum((x + w) @ y, axis=0)


f = synk.function(sum_xw_y, inputs=["x", "w"], bcast_inputs=["y"], reduce="sum")
synk.distribute()

x_dat = 0.01 * rng.standard_normal((1000, 10)).astype("float32")
w_dat = 0.01 * rng.standard_normal((1000, 10)).astype("float32")
y_dat = rng.standard_normal((10, 5)).astype("float32")
x_synk, w_synk = synk.data(x_dat), synk.data(w_dat)  # the data set, once in shared memory

# An int (the first rows), a slice, an index array (shuffled, with repeats); synk also
# takes slices with a step and boolean masks.
batches = [100, slice(100, 200), rng.integers(0, 1000, size=100), slice(3, 900, 7),
           rng.random(1000) < 0.1]
for batch in batches:
    rows = x_dat[:batch] if isinstance(batch, int) else x_dat[batch]
    w_rows = w_dat[:batch] if isinstance(batch, int) else w_dat[batch]
    r_np = sum_xw_y(rows, w_rows, y_dat)
    r = f(x_synk, w_synk, y_dat, batch=batch)
    assert np.allclose(r, r_np, **TOL)
    assert np.allclose(f.local(x_synk, w_synk, y_dat, batch=batch), r_np, **TOL)
    # Each rank can further compute its share in slices.
    assert np.allclose(f(x_synk, w_synk, y_dat, batch=batch, num_slices=4), r_np, **TOL)
print("Batch-selective input math tests passed.")
print("Batch-selective, sliced computation math tests passed.")

# Synkhronos's minibatch inputs (synk.data(w, minibatch=True)) lined up with the selected
# rows, not with the data set. synk splits every scattered input the same way, so select
# the data set's rows in the master and pass inputs of one length.
w_mb = 0.01 * rng.standard_normal((100, 10)).astype("float32")
idx = rng.integers(0, 1000, size=100)
r_mb = f(x_synk.array[idx], w_mb, y_dat)
assert np.allclose(r_mb, sum_xw_y(x_dat[idx], w_mb, y_dat), **TOL)
print("Minibatch input math test passed.")

# "mean" is weighted by the rows each rank had, so it stays exact where Synkhronos's
# equal-weight "avg" was not (here 101 rows, which no number of ranks > 1 splits evenly).
g = synk.function(lambda x, y: np.mean(x @ y, axis=0), bcast_inputs=["y"], reduce="mean")
assert np.allclose(g(x_synk, y_dat, batch=101, num_slices=3), np.mean(x_dat[:101] @ y_dat, 0),
                   **TOL)
print("Uneven batch mean test passed.")

# -- demo_5: batch_s selected rows within each rank's resident rows -----------------------
# Synkhronos scattered a data set into GPU shared variables (sliceable_shareds) and selected
# rows of each rank's part with batch_s=. In synk, a Data made resident on the devices in
# shard mode keeps each rank's rows there, and local_batch= picks rows within them: one
# slice or index array for every rank, or a list with one per rank. (On CPU ranks the shared
# memory is the device: the same calls work and nothing is copied.)
DAT = 200  # rows on each rank
x_dat = 0.01 * rng.standard_normal((DAT * n, 10)).astype("float32")
y_dat = rng.standard_normal((10, 5)).astype("float32")
x_res = synk.data(x_dat)
x_res.to_device("shard")  # rank r keeps rows r*DAT .. (r+1)*DAT - 1
h = synk.function(lambda x, y: np.sum(x @ y, axis=0), bcast_inputs=["y"], reduce="sum")

slice_1 = slice(100, 200)
list_2 = rng.integers(0, DAT, size=100)  # an index array: the same positions on every rank
slices_3 = [slice(i, 100 + i) for i in range(n)]  # a list: one entry per rank
lists_4 = [rng.integers(0, DAT, size=100 + i) for i in range(n)]  # lengths may differ
for batch_s in (slice_1, list_2, slices_3, lists_4):
    per_rank = batch_s if isinstance(batch_s, list) else [batch_s] * n
    x_sel = np.concatenate([x_dat[r * DAT:(r + 1) * DAT][s] for r, s in enumerate(per_rank)])
    r_np = np.sum(x_sel @ y_dat, axis=0)
    assert np.allclose(h(x_res, y_dat, local_batch=batch_s), r_np, **TOL)
    assert np.allclose(h(x_res, y_dat, local_batch=batch_s, num_slices=4), r_np, **TOL)
print("Batch-selection resident data math tests passed.")
print("Batch-selection, sliced computation, resident data math tests passed.")

synk.close()
print("All assertions passed.")
