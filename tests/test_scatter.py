"""Scatter along axis 0: batch selection, num_slices, staging of plain arrays."""

import numpy as np
import pytest
from conftest import synk_segments

import synk


def col_sum(x):
    return x.sum(axis=0)


def mean_xy(x, y):
    return np.mean(x @ y, axis=0)


def identity(x):
    return x


@pytest.fixture
def xy():
    rng = np.random.default_rng(2)
    return rng.standard_normal((101, 10)), rng.standard_normal(10)


def test_shares_differ_by_at_most_one_row(ranks3):
    got = synk.function(len, reduce=None)(np.zeros((101, 2)))
    assert got == [34, 34, 33]
    assert synk.function(len, reduce=None)(np.zeros((7, 1))) == [3, 2, 2]


@pytest.mark.parametrize("batch", [0, 1, 17, 101])
def test_batch_int_takes_first_rows(ranks3, xy, batch):
    x, y = xy
    f = synk.function(col_sum, reduce="sum")
    for arg in (x, synk.data(x)):
        np.testing.assert_allclose(f(arg, batch=batch), x[:batch].sum(axis=0), atol=1e-12)


@pytest.mark.parametrize(
    "batch",
    [slice(10, 60), slice(None, None, 3), slice(5, None, 7), slice(-20, None), slice(50, 10)],
)
def test_batch_slice(ranks3, xy, batch):
    x, _ = xy
    f = synk.function(identity, reduce="gather")
    np.testing.assert_array_equal(f(synk.data(x), batch=batch), x[batch])


def test_batch_shuffled_index_arrays(ranks3, xy):
    x, y = xy
    d = synk.data(x)
    f = synk.function(mean_xy, bcast_inputs=["y"])
    g = synk.function(identity, reduce="gather")
    rng = np.random.default_rng(3)
    for size in (1, 2, 3, 32, 101):
        idx = rng.permutation(101)[:size]
        np.testing.assert_allclose(f(d, y, batch=idx), np.mean(x[idx] @ y), rtol=1e-10)
        np.testing.assert_array_equal(g(d, batch=idx), x[idx])
    repeated = rng.integers(-101, 101, size=500)  # with repeats and negative indices
    np.testing.assert_array_equal(g(d, batch=repeated), x[repeated])
    mask = rng.random(101) < 0.5
    np.testing.assert_array_equal(g(d, batch=mask), x[mask])


def test_batch_applies_to_every_scattered_input(ranks3, xy):
    x, _ = xy
    labels = np.arange(101)

    def pair(x, labels):
        return x[:, 0] * labels

    idx = np.random.default_rng(4).permutation(101)[:40]
    got = synk.function(pair, reduce="gather")(x, labels, batch=idx)
    np.testing.assert_allclose(got, x[idx, 0] * labels[idx])


@pytest.mark.parametrize("num_slices", [1, 2, 5, 50])
def test_num_slices(ranks3, xy, num_slices):
    x, y = xy
    kw = {"num_slices": num_slices}
    np.testing.assert_allclose(
        synk.function(mean_xy, bcast_inputs=["y"])(x, y, **kw), np.mean(x @ y), rtol=1e-10
    )
    np.testing.assert_allclose(synk.function(col_sum, reduce="sum")(x, **kw), x.sum(axis=0))
    np.testing.assert_array_equal(synk.function(identity, reduce="gather")(x, **kw), x)
    np.testing.assert_array_equal(
        synk.function(lambda x: x.max(axis=0), reduce="max")(x, **kw), x.max(axis=0)
    )
    idx = np.arange(100, 0, -3)
    np.testing.assert_array_equal(
        synk.function(identity, reduce="gather")(x, batch=idx, **kw), x[idx]
    )


def test_num_slices_with_none_lists_slices(ranks2):
    got = synk.function(len, reduce=None)(np.zeros(10), num_slices=2)
    assert got == [[3, 2], [3, 2]]


def test_scattered_lengths_must_match(ranks3):
    f = synk.function(lambda a, b: a.sum() + b.sum(), reduce="sum")
    with pytest.raises(ValueError, match="same length along axis 0.*a: 10, b: 9"):
        f(np.zeros(10), np.zeros(9))
    assert f(np.ones(10), np.ones(10)) == 20  # still usable


def test_plain_arrays_are_staged_once_and_reused(ranks3, xy):
    x, y = xy
    f = synk.function(mean_xy, bcast_inputs=["y"])
    big_y = np.ones(10)
    f(x, big_y)
    before = synk_segments()
    for _ in range(5):
        np.testing.assert_allclose(f(x + 1, y), np.mean((x + 1) @ y))
    assert synk_segments() == before
    f(np.vstack([x, x]), y)  # a larger array regrows the staging block
    assert len(synk_segments()) == len(before)


def test_inputs_and_bcast_by_keyword(ranks3, xy):
    x, y = xy

    def affine(x, w, *, b=0.0):
        return (x @ w + b).sum()

    f = synk.function(affine, inputs=["x"], reduce="sum")  # w, b broadcast
    want = (x @ y + 2).sum()
    assert f(x, y, b=2.0) == pytest.approx(want)
    assert f(w=y, x=x, b=2.0) == pytest.approx(want)
    assert f(synk.data(x), synk.data(y), b=2.0) == pytest.approx(want)
    big = np.ones((1000, 20))  # > 64 KiB broadcast goes through shared memory
    g = synk.function(lambda x, big: (x[:, :1] * big.sum()).sum(), bcast_inputs="big", reduce="sum")
    assert g(x, big) == pytest.approx(x[:, 0].sum() * 20000)
