"""``mean`` has one accumulation rule on every back end (docs/api.md, "How mean is computed"):
``sum(w_r * x_r) / sum(w_r)`` with each term in float64. Large values that cancel, in every
dtype, give numpy's float64 answer cast to the result dtype, bit for bit, through every path
that averages: synk.comm's allreduce (plain, fused, non-blocking, weighted or not) and
reduce_scatter, functions' outputs (small and large, one slice or several per rank) and the
shared variables' collectives. The same expected values are checked on CPU ranks here, on
simulated GPUs here and under MPI in test_mpi, so the back ends agree with each other."""
import os

import mpirun
import numpy as np
import pytest

import synk

DTYPES = ["float16", "float32", "float64", "int32", "int64"]
# Large enough that a float16/float32 accumulator loses the small value; every float64
# term and partial sum is exact, so the expected value does not depend on the order.
BIG = {"float16": 3e4, "float32": 3e7, "float64": 3e15, "int32": 2**30, "int64": 2**50}
ROWS = (2, 1, 1)  # the rows of each of 3 ranks when 4 rows are split


def values(dtype: str) -> tuple:
    """(each rank's value for an equal-weight mean, for a mean weighted by ROWS)."""
    big = BIG[dtype]
    if np.dtype(dtype).kind in "iu":
        big = int(big)
    return (big, 1, -big), (big, 1, -2 * big)


def expected(dtype: str, vals, weights=None):
    """What one process's numpy gives: the float64 average, in the mean's dtype."""
    kind = np.dtype(dtype).kind
    out = np.dtype(dtype) if kind in "fc" else np.dtype(np.float64)
    return np.average(np.array(vals, np.float64), weights=weights).astype(out)


def _on_host(value):
    return np.asarray(value.get() if hasattr(value, "get") else value)


def _comm_means(marker, dtype, even, weighted, k):
    xp = synk.xp(marker)
    r = synk.comm.rank()
    x = xp.full(k, even[r], dtype)
    y = xp.full(k, weighted[r], dtype)
    w = ROWS[r]
    got = {
        "allreduce": synk.comm.allreduce(x, "mean"),
        "allreduce weighted": synk.comm.allreduce(y, "mean", weight=w),
        "fused": synk.comm.allreduce([x, x[:2]], "mean")[1],
        "fused weighted": synk.comm.allreduce({"a": y, "b": y[:2]}, "mean", weight=w)["b"],
        "iallreduce": synk.comm.iallreduce(x, "mean").wait(),
        "iallreduce weighted": synk.comm.iallreduce(y, "mean", weight=w).wait(),
        "reduce_scatter": synk.comm.reduce_scatter(xp.full((3, k), even[r], dtype), "mean"),
    }
    return {key: _on_host(v) for key, v in got.items()}


def _first_row(x):
    return x[0, :4], x[0]  # a small output (on the host for GPU ranks) and a large one


def check(got, want, what: str) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert np.array_equal(got, np.full(got.shape, want)), (what, got.reshape(-1)[:3], want)


def check_every_path(dtype: str) -> None:
    """The averaging paths of a running group of 3 ranks, against numpy."""
    even, weighted = values(dtype)
    want_even, want_weighted = expected(dtype, even), expected(dtype, weighted, ROWS)
    k = 4096  # large enough that a GPU group combines on the devices

    f = synk.function(_comm_means, bcast_inputs=["marker", "dtype", "even", "weighted", "k"],
                      reduce=None)
    for rank, got in enumerate(f(np.zeros(1), dtype, even, weighted, 8)):
        for key, value in got.items():
            check(value, want_weighted if "weighted" in key else want_even, f"{key} r{rank}")

    g = synk.function(_first_row, reduce="mean")
    rows_even = np.repeat(np.array(even, dtype)[:, None], k, axis=1)
    rows_weighted = np.repeat(np.array(weighted, dtype).repeat(ROWS)[:, None], k, axis=1)
    for num_slices in (1, 2):
        for rows, want in ((rows_even, want_even), (rows_weighted, want_weighted)):
            small, large = g(rows, num_slices=num_slices)
            check(small, want, f"small output, {num_slices} slice(s)")
            check(large, want, f"large output, {num_slices} slice(s)")


def check_shared(dtype: str) -> None:
    """all_reduce and reduce of shared variables (a running group of 3 ranks)."""
    even, _ = values(dtype)
    want = expected(dtype, even)
    a = synk.shared(np.zeros(4096, dtype), name="a")
    b = synk.shared(np.zeros(3, dtype), name="b")
    for name, collective in (("all_reduce", synk.shared_all_reduce),
                             ("reduce", lambda v, op: synk.shared_reduce(v, op, root=0))):
        for rank in range(3):
            a.set_value(np.full(4096, even[rank], dtype), rank=rank)
            b.set_value(np.full(3, even[rank], dtype), rank=rank)
        collective([a, b], "mean")
        for var in (a, b):
            check(var.get_value(0), want, f"{name} of {var!r}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_follows_one_rule_everywhere(three, dtype):
    check_every_path(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_shared_variables_average_by_the_same_rule(three, dtype):
    check_shared(dtype)


MPI_JOB = """
import test_mean_rule as rule

assert n == 3, n
print("BACKEND", synk.backend(), flush=True)
for dtype in rule.DTYPES:
    rule.check_every_path(dtype)
for dtype in ("float16", "float32", "float64"):
    rule.check_shared(dtype)
print("MEAN RULE OK", flush=True)
"""


@pytest.mark.parametrize("gpus", [None, pytest.param("2", marks=pytest.mark.gpu)],
                         ids=["cpu", "gpu"])
def test_mean_follows_the_same_rule_under_mpi(tmp_path, gpus):
    """3 ranks over 2 pretend hosts, on the CPU and on simulated GPUs (2 per host)."""
    here = os.path.dirname(os.path.abspath(__file__))
    preamble = f"import sys\nsys.path.insert(0, {here!r})\n" + mpirun.PREAMBLE
    run = mpirun.run(tmp_path, MPI_JOB, hosts=("a", "a", "b"), preamble=preamble, timeout=120,
                     env={"SYNK_SIMULATE_GPUS": gpus} if gpus else None)
    assert run.rc == 0 and "MEAN RULE OK" in run.out, run
    assert f"BACKEND backend '{'gpu' if gpus else 'cpu'}'" in run.out, run
