"""A tour of synk.Data: shared-memory arrays that every rank maps without copying."""
import pickle

import numpy as np

import synk

n = synk.fork()  # one rank per CPU core

# Making Data: from a value, or zeros of a shape and dtype.
d = synk.data(np.arange(12, dtype=np.float32).reshape(6, 2))
z = synk.data(shape=(4, 3), dtype="int64")
print("d:", d)
print("shape", d.shape, "dtype", d.dtype, "len", len(d))

# numpy-like: indexing, assignment, the numpy view, np.asarray.
d[0] = [100, 200]
print("d[0] =", d[0], " d[:, 1] =", d[:, 1])
print("np.asarray(d).sum() =", np.asarray(d).sum(), " d.array is a view:", d.array.base is not None)

# Passed to a synk function, Data is scattered along axis 0: each rank maps the block and
# takes its rows; nothing is copied. Here each rank reports which rows it saw (with
# reduce=None, each output comes back as a list with one entry per rank).
rows_seen = synk.function(lambda x: (synk.rank(), len(x), x[:, 0].tolist()), reduce=None)
for rank, count, first_col in zip(*rows_seen(d)):
    print(f"  rank {rank}: {count} rows, first column {first_col}")

# Ranks can write into Data too: a broadcast Data is the same block everywhere.
def mark(i, out):
    out[i] = synk.rank()


out = synk.data(np.full(6, -1))
synk.function(mark, inputs=["i"], reduce=None)(np.arange(6), out)
print("written by ranks:", out.array)
assert list(out.array) == [r for r, part in enumerate(np.array_split(range(6), n)) for _ in part]

# set_value replaces the contents; growing moves Data to a new, larger block, and every
# rank sees the new block on its next call.
total = synk.function(lambda x: x.sum(axis=0), reduce="sum")
name = d.name
d.set_value(np.ones((1000, 2), dtype=np.float32))
print("after growing: new block?", d.name != name, " sum per column:", total(d))
assert np.array_equal(total(d), [1000, 1000])
d.resize((10, 2))  # shrinking keeps the block; contents kept in flat order
assert np.array_equal(total(d), [10, 10])

# Room to grow (Synkhronos's demos/demo_2.py): oversize leaves headroom in the block, so
# that later, larger values move nothing; capacity is the block's size in bytes
# (Synkhronos's alloc_size counted items: capacity // itemsize).
rng = np.random.default_rng(0)
x_dat_2 = rng.standard_normal((2000, 10)).astype(np.float32)
x_dat_3 = rng.standard_normal((2100, 10)).astype(np.float32)
x = synk.data(np.zeros((5, 4), dtype=np.float32))
x.set_value(x_dat_2, oversize=1.1)
print("\nsize", x.size, "capacity", x.capacity, "bytes for", x.nbytes)
name = x.name
x.set_value(x_dat_3)  # fits in the headroom: same block, and every rank sees the new value
assert x.name == name and np.allclose(total(x), x_dat_3.sum(axis=0), rtol=1e-4, atol=1e-3)
x.resize((2000, 10))  # Synkhronos's set_length(2000): the contents stay, in flat order
x[:] = x_dat_2
assert x.name == name and np.allclose(total(x), x_dat_2.sum(axis=0), rtol=1e-4, atol=1e-3)
x.set_value(rng.standard_normal((100, 8)).astype(np.float32))  # smaller: the block stays
assert x.capacity == 88000
x.shrink()  # Synkhronos's free_memory(): a block of exactly nbytes; contents kept
print("after shrink(): capacity", x.capacity, "bytes for", x.nbytes)
assert x.capacity == x.nbytes == 100 * 8 * 4 and x.name != name
x_dat_5 = rng.standard_normal((100, 8))  # float64
x.set_value(x_dat_5, force_cast=True)  # keeps float32, casting the value (numpy's rules)
assert x.dtype == np.float32 and np.allclose(total(x), x_dat_5.sum(axis=0), rtol=1e-4, atol=1e-3)
print("force_cast kept the dtype:", x.dtype)
x.set_value(x_dat_5)  # without force_cast the Data takes the value's dtype
assert x.dtype == np.float64 and np.allclose(total(x), x_dat_5.sum(axis=0))

# batch= picks rows out of the whole data set held once in shared memory.
idx = np.random.default_rng(0).permutation(10)[:4]
print("sum of a shuffled minibatch of 4 rows:", total(d, batch=idx))

# Data pickles by name: a few dozen bytes, whatever its size.
print("pickled size:", len(pickle.dumps(d)), "bytes")

# free() releases the block now; later use raises a clear error.
z.free()
try:
    z.array
except synk.SynkError as err:
    print("after free():", err)

synk.close()  # frees every remaining Data too
print("All assertions passed.")
