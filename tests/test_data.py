"""synk.Data: numpy-like surface, resize, free, pickling by name."""
import pickle

import numpy as np
import pytest
from conftest import synk_segments

import synk


def data_blocks() -> set:
    """This process's synk blocks, without the lock files of their owners."""
    return {name for name in synk_segments() if not name.endswith("-lock")}


def test_numpy_like_surface():
    v = np.arange(24, dtype=np.float32).reshape(6, 4)
    d = synk.data(v)
    assert d.shape == (6, 4) and d.dtype == np.float32 and len(d) == 6
    assert d.ndim == 2 and d.size == 24 and d.nbytes == v.nbytes
    np.testing.assert_array_equal(d[2], v[2])
    np.testing.assert_array_equal(d[1:3, ::2], v[1:3, ::2])
    np.testing.assert_array_equal(np.asarray(d), v)
    d[0] = -1
    d[:, 3] = 7
    v[0] = -1
    v[:, 3] = 7
    np.testing.assert_array_equal(d.array, v)
    assert np.sum(d) == v.sum()
    assert "shape=(6, 4)" in repr(d)
    d.free()


def test_zeros_from_shape_and_dtype():
    d = synk.data(shape=(3, 2), dtype="int16")
    assert d.dtype == np.int16
    np.testing.assert_array_equal(d.array, np.zeros((3, 2), np.int16))
    e = synk.data()
    assert e.shape == (0,) and len(e) == 0
    with pytest.raises(TypeError, match="dtype object"):
        synk.data([object()])
    d.free()
    e.free()


def test_set_value_and_resize_grow_and_shrink():
    d = synk.data(np.arange(4.0))
    name = d.name
    d.set_value(np.ones((2, 2)))  # same bytes: same block
    assert d.name == name and d.shape == (2, 2)
    d.set_value(np.arange(100, dtype=np.int64))  # larger: a new block
    assert d.name != name and d.dtype == np.int64
    np.testing.assert_array_equal(d.array, np.arange(100))
    d.resize(10)  # smaller: same block, contents kept in flat order
    np.testing.assert_array_equal(d.array, np.arange(10))
    d.resize((5, 4))
    np.testing.assert_array_equal(d.array.ravel(), np.r_[np.arange(10), np.zeros(10)])
    d.free()


def test_free_releases_the_block_and_later_use_raises():
    before = data_blocks()
    d = synk.data(np.ones(10))
    assert len(data_blocks()) == len(before) + 1
    d.free()
    d.free()  # idempotent
    assert data_blocks() == before
    with pytest.raises(synk.SynkError, match="freed"):
        d.array
    with pytest.raises(synk.SynkError, match="freed"):
        d[0] = 1


def test_collected_data_releases_its_block():
    before = data_blocks()
    d = synk.data(np.ones(10))
    del d
    import gc

    gc.collect()
    assert data_blocks() == before


def test_collected_data_is_let_go_by_every_rank(ranks3):
    """A Data the script drops (garbage-collected, not freed) is unmapped by the workers at
    the next call, as a freed one is: its memory goes back to the system then."""
    import gc

    f = synk.function(lambda x: x.sum(), reduce="sum")
    mapped = synk.function(lambda name: open("/proc/self/maps").read().count(name),
                           bcast_inputs=["name"], reduce=None)
    d = synk.data(np.ones((1000, 100)))
    name = d.name
    assert f(d) == 100000
    assert all(mapped(name)[1:])  # the workers have it mapped
    del d
    gc.collect()
    assert f(np.ones(3)) == 3
    assert mapped(name) == [0, 0, 0]


def test_view_outlives_free():
    d = synk.data(np.arange(5.0))
    view = d.array
    d.free()
    np.testing.assert_array_equal(view, np.arange(5.0))  # the mapping stays until views go


def test_pickles_by_name():
    d = synk.data(np.arange(6.0))
    payload = pickle.dumps(d)
    assert len(payload) < 200  # the name, not the bytes
    other = pickle.loads(payload)
    other[0] = 42  # same block
    assert d[0] == 42
    d.free()


def test_resize_is_seen_by_every_rank(ranks3):
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    d = synk.data(np.ones((10, 3)))
    np.testing.assert_array_equal(f(d), [10, 10, 10])
    d.set_value(np.full((1000, 3), 2.0))  # grows: new block
    np.testing.assert_array_equal(f(d), [2000, 2000, 2000])
    d.resize((7, 3))
    np.testing.assert_array_equal(f(d), [14, 14, 14])
    d[:] = 5
    np.testing.assert_array_equal(f(d), [35, 35, 35])


def test_ranks_write_into_data(ranks3):
    d = synk.data(np.zeros(9))
    out = synk.data(np.zeros(9))

    def fill(i, out):
        out[i.astype(int)] = synk.rank() + 1

    synk.function(fill, inputs=["i"], reduce=None)(np.arange(9.0), out)
    np.testing.assert_array_equal(out.array, [1, 1, 1, 2, 2, 2, 3, 3, 3])
    d.free()


def test_close_frees_every_data():
    synk.fork(2)
    d = synk.data(np.ones(3))
    synk.close()
    with pytest.raises(synk.SynkError, match="freed"):
        d.array


def test_data_captured_in_a_closure_follows_resizes(ranks3):
    d = synk.data(np.ones(4))

    def total(k):
        return d.array.sum() * k

    f = synk.function(total, bcast_inputs=["k"], reduce=None)
    assert f(1) == [4, 4, 4]
    d.set_value(np.full(100_000, 2.0))  # grows: a new block
    assert f(1) == [200_000] * 3
    d.resize(3)  # shrinks in place
    assert f(1) == [6, 6, 6]
    d.free()
    with pytest.raises(synk.SynkError, match="freed"):
        f(1)
