"""The GPU path against what CuPy 14.2 and NCCL 2.28-2.30.7 do where the simulator used to be
kinder than the real libraries (issue 36): NaN under NCCL's max/min, the caller's current
stream, ranks whose arrays differ, dtypes CuPy refuses, the failure path, communicators
renewed only when one was aborted, page-locking, writes into a Data, and what a call costs
on the device. Under the simulator here; for real with CUDA."""
import numpy as np
import pytest
from conftest import REAL

import synk

pytestmark = pytest.mark.gpu

RNG = np.random.default_rng(36)
X = RNG.standard_normal((13, 4))


# -- NaN under max and min ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("op", ["max", "min"])
def test_nan_wins_max_and_min_on_the_devices_as_in_numpy(gpus, op, dtype):
    """NCCL's max/min of floats drop NaN (IEEE maxNum); numpy's keep it. A NaN in one rank's
    rows reaches the result, through a function's output (large: combined on NCCL) and
    through synk.comm.allreduce, next to infinities and signed zeros."""
    x = RNG.standard_normal((6 * gpus, 3000)).astype(dtype)
    x[0, 7] = np.nan  # rank 0's rows
    x[-1, 100] = np.nan  # the last rank's
    x[1, 8], x[-2, 9], x[0, 10], x[-1, 10] = np.inf, -np.inf, -0.0, 0.0

    def fn(x):
        xp = synk.xp(x)
        part = getattr(xp, op)(x, axis=0)
        return part, synk.comm.allreduce(part, op)

    got, every = synk.function(fn, reduce=(op, None))(x)
    want = getattr(np, op)(x, axis=0)
    assert got.dtype == dtype and np.isnan(got[7]) and np.isnan(got[100])
    np.testing.assert_array_equal(got, want)
    for mine in every:
        np.testing.assert_array_equal(mine, want)


# -- ranks whose arrays differ --------------------------------------------------------------------
_SHAPES = {"same count": [(2, 6), (6, 2), (4, 3)], "other counts": [(5,), (4,), (4,)]}


@pytest.mark.parametrize("form", ["allreduce", "iallreduce", "reduce_scatter"])
@pytest.mark.parametrize("shapes", list(_SHAPES))
def test_arrays_of_different_shapes_raise_valueerror_on_every_rank(gpus, form, shapes):
    """NCCL checks nothing of the sort: counts that differ hang or overrun, equal counts
    combine unrelated elements. synk.comm raises the documented ValueError on every rank
    before any NCCL operation, and the group stays usable."""
    layout = _SHAPES[shapes]

    def fn(x):
        xp = synk.xp(x)
        y = xp.ones(layout[synk.comm.rank()])
        try:
            if form == "iallreduce":
                synk.comm.iallreduce(y).wait()
            else:
                getattr(synk.comm, form)(y)
        except ValueError as err:
            return str(err)
        return "no error"

    got = synk.function(fn, reduce=None)(X)
    assert all("different shapes" in g and "rank 1: " in g for g in got), got
    total = synk.function(lambda x: synk.comm.allreduce(synk.xp(x).ones(3)), reduce=None)(X)
    assert all(np.array_equal(t, [gpus] * 3) for t in total)


def test_arrays_of_different_dtypes_are_promoted_as_on_the_host(gpus):
    """Rank 0 passes float32, the others int16: NCCL would sum their bytes as one datatype;
    synk promotes every rank's array as numpy (and the host communicator) does."""

    def fn(x):
        xp = synk.xp(x)
        r = synk.comm.rank()
        y = xp.full(5, r + 0.5, xp.float32) if r == 0 else xp.full(5, r, xp.int16)
        return synk.comm.allreduce(y), synk.comm.reduce_scatter(xp.tile(y, gpus), "max")

    for total, part in zip(*synk.function(fn, reduce=None)(X)):
        assert total.dtype == np.float32 and np.allclose(total, 0.5 + sum(range(1, gpus)))
        assert part.dtype == np.float32 and np.allclose(part, max(0.5, gpus - 1))
