"""Shared variables: replicas that persist on every rank, and the master's collectives on
them, checked against numpy."""
import numpy as np
import pytest

import synk

N = 3


def set_per_rank(var, make):
    """Give each rank's replica its own value, make(rank), from inside a function."""
    def fn(x, v):
        v[...] = make(synk.rank())

    synk.function(fn, reduce=None)(np.ones(N), var)


def replicas(var):
    return [var.get_value(r) for r in range(N)]


def test_updates_persist_in_place_without_transfer(ranks3):
    w = synk.shared(np.zeros(4), name="w")
    ids = []

    def step(x, w):
        w += x.sum()  # each rank adds the sum of its own rows
        return id(w)

    f = synk.function(step, reduce=None)
    x = np.arange(6.0)  # rows 0-1, 2-3, 4-5
    for _ in range(3):
        ids.append(f(x, w))
    assert [r.tolist() for r in replicas(w)] == [[3.0] * 4, [15.0] * 4, [27.0] * 4]
    assert all(call == ids[0] for call in ids)  # the same replica object every call
    assert np.array_equal(w.value, [3.0] * 4) and w.get_value() is not w.value


def test_a_shared_argument_is_never_split(ranks3):
    w = synk.shared(np.arange(6.0))
    got = synk.function(lambda x, w: w.shape[0], reduce=None)(np.ones(9), w)
    assert got == [6, 6, 6]


def test_set_value_and_broadcast_reset_every_replica(ranks3):
    w = synk.shared(np.zeros(3))
    set_per_rank(w, lambda r: r)
    w.set_value(np.full(5, 7.0))  # a new shape too
    assert [r.tolist() for r in replicas(w)] == [[7.0] * 5] * 3
    set_per_rank(w, lambda r: r)
    synk.shared_broadcast(w)  # the master's value everywhere
    assert [r.tolist() for r in replicas(w)] == [[0.0] * 5] * 3
    synk.shared_broadcast([w], [np.arange(5.0)])
    assert all(np.array_equal(r, np.arange(5.0)) for r in replicas(w))


NUMPY = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min, "mean": np.mean}


def rank_value(r):
    return np.random.default_rng(r).random((2, 3)) + 0.5


@pytest.mark.parametrize("op", list(NUMPY))
def test_all_reduce_every_op(ranks3, op):
    w = synk.shared(np.zeros((2, 3)))
    set_per_rank(w, rank_value)
    synk.shared_all_reduce(w, op)
    want = NUMPY[op](np.stack([rank_value(r) for r in range(N)]), axis=0)
    for got in replicas(w):
        assert np.allclose(got, want)


@pytest.mark.parametrize("op", ["sum", "max", "mean"])
def test_reduce_to_a_root(ranks3, op):
    w = synk.shared(np.zeros((2, 3)))
    set_per_rank(w, rank_value)
    synk.shared_reduce(w, op, root=1)
    want = NUMPY[op](np.stack([rank_value(r) for r in range(N)]), axis=0)
    got = replicas(w)
    assert np.allclose(got[1], want)
    assert np.allclose(got[0], rank_value(0)) and np.allclose(got[2], rank_value(2))


def test_gather_uneven_shapes(ranks3):
    w = synk.shared(np.zeros(1))
    synk.shared_scatter(w, np.arange(7.0))  # rows 3, 2, 2
    assert np.array_equal(synk.shared_gather(w), np.arange(7.0))
    parts = synk.shared_gather(w, concat=False)
    assert [p.tolist() for p in parts] == [[0.0, 1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]


def test_all_gather_and_scatter(ranks3):
    w = synk.shared(np.zeros((1, 2)))
    set_per_rank(w, lambda r: np.full((1, 2), r))
    synk.shared_all_gather(w)
    for got in replicas(w):
        assert np.array_equal(got, [[0, 0], [1, 1], [2, 2]])
    values = np.arange(10.0).reshape(5, 2)
    synk.shared_scatter(w, values)
    assert [r.tolist() for r in replicas(w)] == [values[:2].tolist(), values[2:4].tolist(),
                                                  values[4:].tolist()]


def test_variables_live_across_groups():
    w = synk.shared(np.arange(3.0))
    synk.fork(2)
    try:
        synk.function(lambda x, w: w.__iadd__(1), reduce=None)(np.ones(2), w)
        assert w.get_value(1).tolist() == [1.0, 2.0, 3.0]
    finally:
        synk.close()
    synk.fork(3)  # a new group starts from the master's replica
    try:
        assert w.get_value(2).tolist() == [1.0, 2.0, 3.0]
    finally:
        synk.close()


def test_bad_use(ranks3):
    w = synk.shared(np.zeros(2))
    with pytest.raises(TypeError, match="takes shared variables"):
        synk.shared_all_reduce(np.zeros(2))
    with pytest.raises(ValueError, match="unknown op 'median'"):
        synk.shared_all_reduce(w, "median")
    with pytest.raises(ValueError, match="same shared variable twice"):
        synk.shared_all_reduce([w, w])
    with pytest.raises(ValueError, match="rank must be 0..2"):
        w.get_value(5)
    with pytest.raises(ValueError, match="root must be 0..2"):
        synk.shared_reduce(w, "sum", root=3)
    with pytest.raises(ValueError, match="2 variables but 1 values"):
        synk.shared_broadcast([w, synk.shared(np.ones(1))], [np.ones(2)])
    with pytest.raises(TypeError, match="must hold numbers"):
        synk.shared(np.array([object()]))
    synk.shared_all_reduce(w)  # still usable
