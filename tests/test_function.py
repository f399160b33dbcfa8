"""Building functions: name and op checks, calling conventions, distribute."""
import os

import numpy as np
import pytest

import synk


def loss(x, y):
    return np.mean(x @ y)


def test_names_checked_at_build():
    with pytest.raises(ValueError,
                       match=r"bcast_inputs names \['z'\].*parameters are \['x', 'y'\]"):
        synk.function(loss, bcast_inputs=["z"])
    with pytest.raises(ValueError, match=r"inputs names \['w'\]"):
        synk.function(loss, inputs=["w"])
    with pytest.raises(ValueError, match="both inputs and bcast_inputs"):
        synk.function(loss, inputs=["x"], bcast_inputs=["x"])
    with pytest.raises(ValueError, match="parameter named 'batch'"):
        synk.function(lambda x, batch: x)
    with pytest.raises(TypeError, match="callable"):
        synk.function(3)


def test_reduce_ops_checked_at_build():
    with pytest.raises(ValueError, match="unknown reduce op 'median'"):
        synk.function(loss, reduce="median")
    with pytest.raises(ValueError, match="unknown reduce op"):
        synk.function(loss, reduce=("sum", "bogus"))
    assert synk.function(loss, reduce="AVG").reduce == "mean"
    assert synk.function(loss, reduce=["sum", None]).reduce == ("sum", None)


def test_wrong_number_of_ops_for_outputs(ranks2):
    f = synk.function(lambda x: (x.sum(), x.max()), reduce=("sum", "max", "min"))
    with pytest.raises(ValueError, match="returned 2 output.*gives 3 ops"):
        f(np.ones(4))


def test_calling_before_fork_says_what_to_do():
    f = synk.function(loss, bcast_inputs=["y"])
    with pytest.raises(synk.NotForkedError, match=r"call synk.fork\(\)"):
        f(np.ones((4, 2)), np.ones(2))
    with pytest.raises(synk.NotForkedError):
        synk.distribute()


def test_bad_call_arguments(ranks2):
    f = synk.function(loss, bcast_inputs=["y"])
    with pytest.raises(TypeError, match="missing a required argument: 'y'"):
        f(np.ones((4, 2)))
    with pytest.raises(TypeError, match="unexpected keyword argument 'q'"):
        f(np.ones((4, 2)), np.ones(2), q=1)
    assert f(np.ones((4, 2)), np.ones(2)) == 2.0


def test_functions_built_after_distribute(ranks3):
    f = synk.function(loss, bcast_inputs=["y"])
    synk.distribute()
    x, y = np.random.default_rng(0).standard_normal((50, 4)), np.arange(4.0)
    assert np.isclose(f(x, y), loss(x, y))
    g = synk.function(lambda x: x.sum(), reduce="sum")
    h = synk.function(lambda x: x.max(), reduce="max")
    synk.distribute()  # ships g and h only
    assert g(x) == pytest.approx(x.sum())
    k = synk.function(lambda x: x.min(), reduce="min")  # never distributed: ships on call
    assert k(x) == x.min()
    assert h(x) == x.max()


SCALE = 3.0


def uses_global_and_closure():
    offset = 1.0

    def fn(x):
        return (x * SCALE + offset).sum()

    return fn


def test_closures_and_main_globals_ship(ranks2):
    f = synk.function(uses_global_and_closure(), reduce="sum")
    assert f(np.ones(10)) == 40.0


def test_var_positional_and_keyword(ranks2):
    def total(*xs, **scales):
        return sum(x.sum() for x in xs) * scales.get("k", 1)

    f = synk.function(total, bcast_inputs=["scales"], reduce="sum")
    assert f(np.ones(6), np.ones(6), k=2) == 24


def test_fork_counts_ranks_including_master():
    assert synk.fork(2) == 2
    assert synk.size() == 2 and synk.rank() == 0
    assert synk.function(lambda x: synk.rank(), reduce=None)(np.zeros(2)) == [0, 1]
    with pytest.raises(RuntimeError, match="already"):
        synk.fork(2)
    synk.close()


def cores():
    """The CPU cores this process may run on: fork()'s default n (its docstring)."""
    return len(os.sched_getaffinity(0))


def test_default_is_one_rank_per_core():
    n = cores()  # (before: the group then runs this process on rank 0's cores)
    assert synk.fork() == n
    synk.close()


def test_backend_names(monkeypatch):
    monkeypatch.delenv("SYNK_SIMULATE_GPUS", raising=False)
    if synk.backend().startswith("backend 'cpu'"):  # no CUDA here: a clear error, not a hang
        with pytest.raises(synk.GpuUnavailableError, match="the GPU backend is not available"):
            synk.fork(2, backend="gpu")
    with pytest.raises(ValueError, match="unknown backend"):
        synk.fork(2, backend="tpu")


def test_single_rank_group():
    synk.fork(1)
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(5)) == 5
    synk.close()


def test_xp_is_numpy_on_cpu():
    assert synk.xp(np.ones(2)) is np


def test_more_ranks_than_cores_warns():
    with pytest.warns(RuntimeWarning, match="more ranks than"):
        synk.fork(cores() + 1)
    assert synk.function(len, reduce="sum")(np.zeros(10)) == 10
    synk.close()
