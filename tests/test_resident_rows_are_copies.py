"""In-place writes to the rows of a resident Data (``to_device``): one behaviour on both
back ends, and never a half-applied write. Each rank's function gets its rows of a resident
Data (or the whole of a broadcast one) as a copy of its own: writing to it changes neither
the Data nor any other rank's rows, on CPU ranks as on (simulated) GPU ranks."""
import numpy as np
import pytest

import synk

X = np.arange(24.0).reshape(12, 2)


def _scribble(x):
    x[...] = -1  # in place, on this rank's rows
    return x.sum()


@pytest.mark.parametrize("mode", ["replicate", "shard"])
@pytest.mark.parametrize("batch", [None, "slice", "index", "local"])
def test_writes_to_resident_rows_change_nothing_anywhere(three, mode, batch):
    x = synk.data(X)
    x.to_device(mode)
    options = {}
    if batch == "slice" and mode == "replicate":
        options["batch"] = slice(2, 10)
    elif batch == "index" and mode == "replicate":
        options["batch"] = np.array([11, 0, 5, 6])
    elif batch == "local":
        options["local_batch"] = slice(0, 2)
    f = synk.function(_scribble, reduce="sum")
    for _ in range(2):  # the second call sees the Data as it was
        assert f(x, **options) < 0
        np.testing.assert_array_equal(x.array, X)
    got = synk.function(lambda x: x.sum(axis=0), reduce="sum")(x)
    np.testing.assert_array_equal(got, X.sum(axis=0))


def test_writes_to_a_resident_broadcast_input_change_nothing(three):
    w = synk.data(np.ones(3))
    w.to_device("replicate")

    def fn(x, w):
        w[...] = 7  # every rank scribbles on the whole broadcast input
        return float(w.sum())

    f = synk.function(fn, bcast_inputs=["w"], reduce=None)
    assert f(X, w) == [21.0, 21.0, 21.0]
    np.testing.assert_array_equal(w.array, np.ones(3))
    g = synk.function(lambda x, w: float(w.sum()), bcast_inputs=["w"], reduce=None)
    assert g(X, w) == [3.0, 3.0, 3.0]  # the ranks' resident copies are intact too


def test_a_data_that_is_not_resident_is_still_shared_memory_on_cpu_ranks():
    """(Unchanged: on CPU ranks a Data that is not resident is shared memory every rank
    may write.)"""
    synk.fork(3, backend="cpu")
    try:
        x = synk.data(np.zeros((6, 2)))
        synk.function(lambda x: x.__setitem__(Ellipsis, 1.0), reduce=None)(x)
        np.testing.assert_array_equal(x.array, np.ones((6, 2)))
    finally:
        synk.close()
