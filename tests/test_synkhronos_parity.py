"""What Synkhronos users relied on, in synk: per-rank values and shapes of shared
variables, Data capacity and casting, and running a function in the master alone
(``f.local``), each checked against plain numpy on 2 and 3 ranks."""
import math

import numpy as np
import pytest

import synk


@pytest.fixture(params=["ranks2", "ranks3"])
def ranks(request):
    """A running group of 2, then of 3 ranks."""
    return request.getfixturevalue(request.param)


def seen_by_ranks(var):
    """Each rank's replica as its functions see it."""
    return synk.function(lambda v: v.copy(), bcast_inputs=["v"], reduce=None)(var)


# -- Shared.set_value(value, rank=) and Shared.shapes() -------------------------------------
def test_set_value_on_one_rank_changes_only_that_replica(ranks):
    w = synk.shared(np.zeros((2, 3)), name="w")
    want = [np.zeros((2, 3)) for _ in range(ranks)]
    for r in reversed(range(ranks)):
        value = np.random.default_rng(r).random((2, 3))
        w.set_value(value, rank=r)
        want[r] = value
        got = seen_by_ranks(w)
        for g, expected in zip(got, want):
            np.testing.assert_array_equal(g, expected)
        np.testing.assert_array_equal(w.get_value(r), value)
    np.testing.assert_array_equal(w.value, want[0])  # rank 0 is the master's replica
    synk.shared_all_reduce(w, "sum")  # the collectives combine the per-rank values
    for g in seen_by_ranks(w):
        np.testing.assert_allclose(g, np.sum(want, axis=0))


def test_set_value_on_one_rank_before_first_use_installs_the_rest_first(ranks):
    w = synk.shared(np.arange(4.0))  # never used in this group yet
    w.set_value(np.full(4, -1.0), rank=ranks - 1)
    got = seen_by_ranks(w)
    for r in range(ranks - 1):
        np.testing.assert_array_equal(got[r], np.arange(4.0))
    np.testing.assert_array_equal(got[-1], np.full(4, -1.0))


def test_a_rank_value_keeps_the_dtype_and_may_have_its_own_shape(ranks):
    w = synk.shared(np.zeros(3, dtype=np.float32))
    w.set_value([1, 2, 3, 4, 5], rank=1)  # ints cast to float32; a longer replica
    got = w.get_value(1)
    assert got.dtype == np.float32 and got.tolist() == [1, 2, 3, 4, 5]
    assert w.shapes() == [(3,), (5,)] + [(3,)] * (ranks - 2)
    with pytest.raises(TypeError, match="must keep its dtype float32"):
        w.set_value(np.array([1 + 2j]), rank=1)
    k = synk.shared(np.zeros(2, dtype=np.int64))
    with pytest.raises(TypeError, match="int64"):
        k.set_value([0.5, 1.5], rank=0)  # no silent truncation
    assert w.get_value(1).tolist() == [1, 2, 3, 4, 5] and k.value.tolist() == [0, 0]
    w.set_value(np.ones(2, dtype=np.int8))  # without rank: dtype and shape change everywhere
    assert [v.dtype for v in seen_by_ranks(w)] == [np.int8] * ranks


def test_shapes_match_numpys_split_after_scatter(ranks):
    w = synk.shared(np.zeros((1, 4)))
    assert w.shapes() == [(1, 4)] * ranks
    values = np.arange(4 * 11.0).reshape(11, 4)
    synk.shared_scatter(w, values)
    want = [part.shape for part in np.array_split(values, ranks)]
    assert w.shapes() == want
    assert [s[0] for s in w.shapes()] == [len(p) for p in np.array_split(values, ranks)]
    synk.shared_all_gather(w)
    assert w.shapes() == [values.shape] * ranks
    s = synk.shared(np.float64(3.0))  # 0-d
    assert s.shapes() == [()] * ranks


def test_per_rank_values_without_a_group():
    w = synk.shared(np.zeros(2))
    assert w.shapes() == [(2,)]
    w.set_value(np.ones(2), rank=0)  # rank 0 is the only rank there is
    with pytest.raises(synk.NotForkedError):
        w.set_value(np.ones(2), rank=1)
    synk.fork(2)
    try:
        assert [v.tolist() for v in seen_by_ranks(w)] == [[1.0, 1.0]] * 2
        with pytest.raises(ValueError, match=r"rank must be 0..1, got 2"):
            w.set_value(np.ones(2), rank=2)
        with pytest.raises(ValueError, match=r"rank must be 0..1, got True"):
            w.set_value(np.ones(2), rank=True)
        w.set_value(np.full(2, 5.0), rank=1)  # still usable
        assert w.get_value(1).tolist() == [5.0, 5.0]
    finally:
        synk.close()


# -- Data: force_cast, oversize, capacity, shrink -------------------------------------------
def test_force_cast_keeps_the_dtype_as_numpy_unsafe_casting_does():
    d = synk.data(np.arange(4, dtype=np.int32))
    value = np.array([1.7, -2.5, 3.2, 1e3])
    d.set_value(value, force_cast=True)
    assert d.dtype == np.int32
    np.testing.assert_array_equal(d.array, value.astype(np.int32, casting="unsafe"))
    d.set_value([[True, False]], force_cast=True)  # the shape still follows the value
    assert d.shape == (1, 2) and d.dtype == np.int32 and d.array.tolist() == [[1, 0]]
    d.set_value(value)  # without force_cast the value's dtype wins, as before
    assert d.dtype == np.float64
    np.testing.assert_array_equal(d.array, value)
    with pytest.raises(ValueError):
        d.set_value(["not a number"], force_cast=True)
    assert d.shape == (4,) and d.dtype == np.float64  # a failed cast changes nothing
    np.testing.assert_array_equal(d.array, value)
    d.free()


def test_oversize_leaves_headroom_that_growth_uses_without_moving():
    d = synk.data(np.ones((10, 3)), oversize=2.5)
    assert d.capacity == math.ceil(2.5 * 240) and d.nbytes == 240
    name = d.name
    d.set_value(np.ones((25, 3)))  # 600 bytes: fits
    assert d.name == name and d.capacity == 600
    d.resize((20, 3))
    assert d.name == name
    d.set_value(np.ones((26, 3)))  # 624 > 600: moves, to exactly what it needs
    assert d.name != name and d.capacity == 624
    name = d.name
    d.set_value(np.ones(2), oversize=100)  # fits, but the asked headroom does not
    assert d.name != name and d.capacity == 1600
    name = d.name
    d.set_value(np.ones(50), oversize=2)  # 400 bytes with room for 800: already there
    assert d.name == name and d.capacity == 1600
    e = synk.data(shape=(4, 4), dtype=np.float32, oversize=3)
    assert e.capacity == 3 * e.nbytes and e.array.tolist() == [[0.0] * 4] * 4
    for bad in (0.5, math.nan, math.inf, "2", True, None):
        with pytest.raises(ValueError, match="oversize must be a finite number >= 1"):
            d.set_value(np.ones(2), oversize=bad)
    with pytest.raises(ValueError, match="oversize"):
        synk.data(np.ones(2), oversize=0)
    d.free()
    e.free()
    with pytest.raises(synk.SynkError, match="freed"):
        d.capacity


def test_shrink_releases_the_headroom_and_keeps_the_contents():
    d = synk.data(np.arange(6.0), oversize=4)
    name = d.name
    d.shrink()
    assert d.name != name and d.capacity == d.nbytes == 48
    np.testing.assert_array_equal(d.array, np.arange(6.0))
    name = d.name
    d.shrink()  # exact already: nothing moves
    assert d.name == name
    d.set_value(np.ones(1000))
    d.set_value(np.arange(3, dtype=np.int16))  # smaller: stays in the large block
    assert d.capacity == 8000
    d.shrink()
    assert d.capacity == 6 and d.array.tolist() == [0, 1, 2] and d.dtype == np.int16
    d.free()


def test_every_rank_sees_each_change_of_capacity(ranks):
    d = synk.data(np.arange(12.0).reshape(6, 2), oversize=4)
    names = []

    def rows(x):
        return x  # scattered: the ranks' rows, gathered back in order

    def whole(arg):
        return d.name, d.array.copy()  # the Data in the closure, on every rank

    gather = synk.function(rows, reduce="gather")
    every = synk.function(whole, bcast_inputs=["arg"], reduce=None)

    def check(want):
        np.testing.assert_array_equal(gather(d), want)
        names_seen, values = every(0)
        for v in values:
            np.testing.assert_array_equal(v, want)
        assert set(names_seen) == {d.name}  # every rank maps the master's block
        names.append(d.name)

    check(np.arange(12.0).reshape(6, 2))
    for value in (np.ones((20, 2)), np.full((24, 2), 3.0), np.arange(8.0).reshape(4, 2)):
        d.set_value(value)  # all within the headroom
        check(value)
    d.resize((5, 2))
    check(np.r_[np.arange(8.0), 0, 0].reshape(5, 2))
    assert len(set(names)) == 1  # none of these moved the block
    d.shrink()
    check(np.r_[np.arange(8.0), 0, 0].reshape(5, 2))
    value = np.random.default_rng(0).random((7, 2)).astype(np.float32)
    d.set_value(value.astype(np.float64) * 100, force_cast=False, oversize=2)
    check(value.astype(np.float64) * 100)
    d.set_value(value, force_cast=True)
    check(value.astype(np.float64))
    assert len(set(names)) == 3  # shrink and the oversize=2 growth moved it
    d.free()


# -- Function.local -----------------------------------------------------------------------
def _prod(x, y):
    return (1 + 0.01 * (x @ y)).prod(axis=0)


FNS = {  # an output for which combining the ranks' results gives fn over all rows
    "mean": lambda x, y: (x @ y).mean(axis=0),
    "avg": lambda x, y: (x @ y).mean(axis=0),
    "sum": lambda x, y: (x @ y).sum(axis=0),
    "prod": _prod,
    "max": lambda x, y: (x @ y).max(axis=0),
    "min": lambda x, y: (x @ y).min(axis=0),
    "gather": lambda x, y: x @ y,
}
ROWS = 101  # uneven on 2 and 3 ranks


def batches():
    rng = np.random.default_rng(7)
    mask = rng.random(ROWS) < 0.4
    return [None, 37, slice(5, 90, 3), rng.integers(-ROWS, ROWS, 50), mask]


@pytest.mark.parametrize("op", list(FNS))
def test_local_equals_the_distributed_call_and_numpy(ranks, op):
    fn = FNS[op]
    f = synk.function(fn, bcast_inputs=["y"], reduce=op)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((ROWS, 4)), rng.standard_normal((4, 3))
    xd = synk.data(x)
    for batch in batches():
        rows = x if batch is None else x[:batch] if isinstance(batch, int) else x[batch]
        want = fn(rows, y)
        for num_slices in (1, 3):
            local = f.local(xd, y, batch=batch, num_slices=num_slices)
            np.testing.assert_allclose(local, want, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(f(xd, y, batch=batch, num_slices=num_slices), local,
                                       rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(f.local(x, y=y, batch=batch, num_slices=num_slices),
                                       local, rtol=0, atol=0)  # numpy, keyword: the same
    xd.free()


def test_local_with_several_outputs_and_the_kinds_of_results(ranks):
    def stats(x, scale):
        return float(x.sum()) * scale, np.float32(x.max()), x[:, 0] * scale

    f = synk.function(stats, bcast_inputs=["scale"], reduce=["sum", "max", "gather"])
    x = np.arange(30.0).reshape(10, 3)
    local, dist = f.local(x, 2.0), f(x, 2.0)
    want = (870.0, np.float32(29.0), x[:, 0] * 2)
    for got in (local, dist):
        assert isinstance(got, tuple) and type(got[0]) is float and type(got[1]) is np.float32
        assert got[0] == want[0] and got[1] == want[1]
        np.testing.assert_array_equal(got[2], want[2])


def test_local_with_reduce_none_is_fns_value_not_a_list(ranks):
    f = synk.function(lambda x: x.sum(axis=0), reduce=None)
    x = np.arange(20.0).reshape(10, 2)
    np.testing.assert_array_equal(f.local(x), x.sum(axis=0))
    parts = f(x)  # the distributed call: one entry per rank
    assert isinstance(parts, list) and len(parts) == ranks
    np.testing.assert_array_equal(np.sum(parts, axis=0), f.local(x))
    pieces = f.local(x, num_slices=3)  # several pieces: their list, as on each rank
    assert [p.tolist() for p in pieces] == [x[a].sum(axis=0).tolist()
                                            for a in (slice(0, 4), slice(4, 7), slice(7, 10))]


def test_local_gives_shared_variables_the_masters_replica(ranks):
    w = synk.shared(np.ones(3))
    w.set_value(np.full(3, 10.0), rank=1)

    def step(x, w):
        w += x.sum()  # the replica is updated in place, as on the ranks
        return w.copy()

    f = synk.function(step, reduce=None)
    np.testing.assert_array_equal(f.local(np.ones(4), w), np.full(3, 5.0))
    np.testing.assert_array_equal(w.value, np.full(3, 5.0))
    np.testing.assert_array_equal(w.get_value(1), np.full(3, 10.0))  # workers untouched


def test_local_needs_no_group_and_synk_comm_sees_one_rank():
    def fn(x):
        total = synk.comm.allreduce(x.sum(axis=0), "sum")
        return total, synk.comm.size()

    f = synk.function(fn, reduce=["sum", None])
    x = np.arange(12.0).reshape(6, 2)
    d = synk.data(x)
    before = f.local(d)  # before fork(): a Data works too
    assert before[1] == 1
    np.testing.assert_array_equal(before[0], x.sum(axis=0))
    synk.fork(2)
    try:
        np.testing.assert_array_equal(f(d)[0], 2 * x.sum(axis=0))  # allreduce, then sum
        np.testing.assert_array_equal(f.local(d)[0], x.sum(axis=0))
    finally:
        synk.close()
    np.testing.assert_array_equal(f.local(x)[0], x.sum(axis=0))  # after close()


def test_local_refuses_what_a_call_refuses():
    f = synk.function(lambda x, y: x * y, bcast_inputs=["y"], reduce="gather")
    x = np.ones((5, 2))
    with pytest.raises(ValueError, match="out of range"):
        f.local(x, 1.0, batch=9)
    with pytest.raises(ValueError, match="num_slices must be >= 1"):
        f.local(x, 1.0, num_slices=0)
    with pytest.raises(TypeError, match="missing a required argument"):
        f.local(x)
    g = synk.function(lambda x, z: x + z, reduce="gather")
    with pytest.raises(ValueError, match="same length along axis 0"):
        g.local(x, np.ones((4, 2)))

    def boom(x):
        raise KeyError("from fn")

    with pytest.raises(KeyError, match="from fn"):
        synk.function(boom).local(x)
