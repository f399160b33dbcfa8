"""Synkhronos's ``demos/demo_3.py``, written for synk: shared variables (an array replicated on
every rank, Theano shared variables in Synkhronos), inspecting and changing their per-rank
values, and the master's collectives on them. Checked against plain numpy.
"""
import sys

import numpy as np

import synk

# One rank per CPU core (one per GPU with the GPU backend), or as many as the first argument.
n = synk.fork(int(sys.argv[1]) if len(sys.argv) > 1 else None)
print(f"synk: {n} ranks")

dtype = np.float32
s_x = synk.shared(np.ones((100, 4), dtype=dtype), name="s_x")
s_y = synk.shared(np.zeros((4, 5), dtype=dtype), name="s_y")


# A function over shared variables only: it runs once on every rank over that rank's
# replicas, and "mean" averages the ranks' results with equal weights.
def mean_xy(s_x, s_y):
    return np.mean(s_x @ s_y, axis=0)


f = synk.function(mean_xy, reduce="mean")

# Every rank holds its own replica (Synkhronos: get_lengths / get_shapes).
print("\nLengths of s_x on each rank:", [shape[0] for shape in s_x.shapes()])
print("Shapes of s_x on each rank:", s_x.shapes())
assert s_x.shapes() == [(100, 4)] * n

rng = np.random.default_rng(0)
x_dat = rng.standard_normal((8 * n, 4)).astype(dtype)
y_dat = rng.standard_normal((4, 5)).astype(dtype)

# Change the replicas on every rank.
synk.shared_scatter(s_x, x_dat)  # rank r gets rows 8r..8r+7
synk.shared_broadcast(s_y, y_dat)  # every rank gets y_dat (without values: the master's replica)
print("\nData scattered to s_x and broadcast to s_y...")
print("Shapes of s_x on each rank:", s_x.shapes())
assert s_x.shapes() == [(8, 4)] * n
gathered_x = synk.shared_gather(s_x)  # joined along axis 0 (Synkhronos: nd_up=0)
assert np.allclose(x_dat, gathered_x)
print("Scatter-gather equivalency test passed.")
print("\nValue of s_x on rank 1:\n", s_x.get_value(1))
ys = synk.shared_gather(s_y, concat=False)  # one array per rank (np.stack: Synkhronos's nd_up=1)
for i in range(n):
    assert np.array_equal(ys[i], y_dat)

# numpy in one process for comparison.
r_np = np.mean(x_dat @ y_dat, axis=0)
r = f(s_x, s_y)
assert np.allclose(r, r_np, rtol=1e-5, atol=1e-6)
assert np.allclose(f.local(s_x, s_y), np.mean(x_dat[:8] @ y_dat, axis=0), rtol=1e-5, atol=1e-6)
print("\nShared variable math test passed.")


# Synkhronos sliced s_x itself (sliceable_shareds, num_slices=2). In synk, pass the rows to
# use as a scattered index array: its split hands every rank the indices 0..7 of its own
# replica, and num_slices cuts those in pieces.
def mean_xy_rows(rows, s_x, s_y):
    return np.mean(s_x[rows] @ s_y, axis=0)


g = synk.function(mean_xy_rows, inputs=["rows"], reduce="mean")
rows = np.tile(np.arange(8), n)
assert np.allclose(g(rows, s_x, s_y, num_slices=2), r_np, rtol=1e-5, atol=1e-6)
print("Shared variable sliced math test passed.")

# Average the replicas on every rank.
x_values = np.stack(synk.shared_gather(s_x, concat=False))  # (Synkhronos: gather(s_x, nd_up=1))
synk.shared_all_reduce(s_x, op="avg")  # "avg" is "mean": the plain average of the replicas
x_avg = x_values.mean(axis=0)
new_x_values = np.stack(synk.shared_gather(s_x, concat=False))
for i in range(n):
    assert np.allclose(x_avg, new_x_values[i])
print("\nValue on rank 1 after all_reduce:\n", s_x.get_value(1))
print("All_reduce avg test passed.")

# Reset one rank to its previous value (Synkhronos: set_value(rank=1, shared_vars=s_x, ...)).
s_x.set_value(x_values[1], rank=1)
print("\nReset the value on rank 1:\n", s_x.get_value(1))
assert np.array_equal(s_x.get_value(1), x_values[1])
assert np.allclose(s_x.get_value(0), x_avg)  # the other ranks keep theirs

# Every rank gets all the ranks' rows.
synk.shared_all_gather(s_x)
print("\nShapes of s_x after all_gather:", s_x.shapes())
assert s_x.shapes() == [(8 * n, 4)] * n
assert np.allclose(s_x.get_value(n - 1), np.concatenate([x_avg, x_values[1]] + [x_avg] * (n - 2)))

# Synkhronos could only run collectives on variables some function used; synk runs them
# on any shared variable.
s_unused = synk.shared(np.ones((5, 5), dtype=dtype))
synk.shared_all_reduce(s_unused, op="sum")
assert np.array_equal(s_unused.get_value(n - 1), np.full((5, 5), n, dtype=dtype))

synk.close()
print("All assertions passed.")
