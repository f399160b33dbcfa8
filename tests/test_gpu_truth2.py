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
