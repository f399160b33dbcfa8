"""A function may return a list, tuple or dict of arrays (nested) as one output, such as
(loss, [gradients]): each leaf is reduced with that output's op, and the structure comes
back. So an unchanged ``loss_and_grads`` wraps as it is."""
import collections

import numpy as np
import pytest

import synk


def loss_and_grads(w, b, x, y):
    """Mean squared error of a linear model over the rows given, and its mean gradients."""
    err = x @ w + b - y
    return float(np.mean(err ** 2)), [2 * x.T @ err / len(x), np.array(2 * err.mean())]


def data(n=23):
    g = np.random.default_rng(0)
    return g.random((n, 3)), g.random(n)


@pytest.mark.parametrize("big", [False, True], ids=["inline", "shared-memory"])
def test_an_unchanged_loss_and_grads_wraps_with_reduce_mean(ranks3, big, monkeypatch):
    if big:  # every output through the ranks' shared-memory blocks
        monkeypatch.setenv("SYNK_INLINE_OUTPUT_BYTES", "0")
        synk.close()
        synk.fork(3)
    x, y = data()
    w, b = np.full(3, 0.1), 0.5
    f = synk.function(loss_and_grads, bcast_inputs=["w", "b"], reduce="mean")
    for batch in (None, np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3]), slice(2, 20, 3)):
        rows = np.arange(len(x))[batch] if batch is not None else np.arange(len(x))
        loss, grads = f(w, b, x, y, batch=batch)
        want_loss, want_grads = loss_and_grads(w, b, x[rows], y[rows])
        assert isinstance(grads, list) and len(grads) == 2
        assert np.isclose(loss, want_loss) and isinstance(loss, float)
        np.testing.assert_allclose(grads[0], want_grads[0], rtol=1e-12)
        np.testing.assert_allclose(grads[1], want_grads[1], rtol=1e-12)
        local_loss, local_grads = f.local(w, b, x, y, batch=batch)
        assert np.isclose(local_loss, want_loss)
        np.testing.assert_allclose(local_grads[0], want_grads[0], rtol=1e-12)


def test_dicts_nested_structures_and_one_op_per_output(ranks2):
    def fn(x):
        return {"a": x.sum(axis=0), "b": (x.max(axis=0), [x.min()])}, [x[:, 0].sum()]

    x = np.arange(12.0).reshape(6, 2)
    out, total = synk.function(fn, reduce=("max", "sum"))(x)
    assert list(out) == ["a", "b"] and isinstance(out["b"], tuple)
    assert np.array_equal(out["a"], x[3:].sum(axis=0))  # max over the ranks of their sums
    assert np.array_equal(out["b"][0], x.max(axis=0)) and out["b"][1][0] == 6.0
    assert total == [x[:, 0].sum()]
    sliced, total = synk.function(fn, reduce="sum")(x, num_slices=2)  # slices combine too
    assert np.array_equal(sliced["a"], x.sum(axis=0)) and total == [x[:, 0].sum()]


Grads = collections.namedtuple("Grads", "w b")


@pytest.mark.parametrize("where", ["module", "local"])
def test_named_tuples_come_back_as_their_class(ranks2, where):
    """As synk.comm.allreduce gives them: one rule for structures everywhere. A class made
    inside a test travels by value and must come back as the caller's own class."""
    cls = Grads if where == "module" else collections.namedtuple("Local", "w b")

    def fn(x):
        return x.sum(), {"layer": cls(x.sum(axis=0), [x.max()])}

    x = np.arange(12.0).reshape(6, 2)
    f = synk.function(fn, reduce=("sum", "max"))
    for got in (f(x), f(x, num_slices=2), f.local(x)):
        total, grads = got
        assert type(grads["layer"]) is cls and isinstance(grads["layer"].b, list)
        assert total == x.sum() and grads["layer"].b == [x.max()]
    assert np.array_equal(f.local(x)[1]["layer"].w, x.sum(axis=0))
    assert np.array_equal(f(x)[1]["layer"].w, x[3:].sum(axis=0))  # max of the ranks' sums


def test_reduce_none_keeps_each_ranks_structure_and_gather_joins_leaves(ranks2):
    x = np.arange(8.0).reshape(4, 2)
    raw = synk.function(lambda x: [x.sum(), {"n": len(x)}], reduce=None)(x)
    assert raw == [[x[:2].sum(), {"n": 2}], [x[2:].sum(), {"n": 2}]]
    joined = synk.function(lambda x: {"rows": x * 2}, reduce="gather")(x)
    assert np.array_equal(joined["rows"], x * 2)


def test_structures_that_differ_between_ranks_raise(ranks2):
    def fn(x):
        return [x.sum()] * (2 if synk.comm.rank() else 1)

    with pytest.raises(ValueError, match="different structures"):
        synk.function(fn, reduce="sum")(np.ones((4, 1)))
