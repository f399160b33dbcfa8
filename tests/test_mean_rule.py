"""``mean`` has one rule on every back end (docs/api/calls.md, "How mean is computed"):
``sum_r (w_r / W) * x_r``, each part pre-scaled and summed in the data's own dtype, within
the documented bound of float64 numpy's answer: ``(n + 2) * eps * sum_r |w_r / W * x_r|``.
``exact_mean`` (and ``mean`` under ``SYNK_MEAN=exact``) is synk 0.1's float64 rule:
``sum(w_r * x_r) / sum(w_r)`` with each term in float64, so large values that cancel give
numpy's float64 answer cast to the result dtype, bit for bit. Both are checked through every
path that averages: synk.comm's allreduce (plain, fused, non-blocking, weighted or not) and
reduce_scatter, functions' outputs (small and large, one slice or several per rank) and the
shared variables' collectives, on CPU ranks and simulated GPUs here and under MPI, so the
back ends agree with each other."""
import os

import mpirun
import numpy as np
import pytest
from conftest import check_every

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


def _comm_means(marker, dtype, even, weighted, k, op):
    xp = synk.xp(marker)
    r = synk.comm.rank()
    x = xp.full(k, even[r], dtype)
    y = xp.full(k, weighted[r], dtype)
    w = ROWS[r]
    got = {
        "allreduce": synk.comm.allreduce(x, op),
        "allreduce weighted": synk.comm.allreduce(y, op, weight=w),
        "fused": synk.comm.allreduce([x, x[:2]], op)[1],
        "fused weighted": synk.comm.allreduce({"a": y, "b": y[:2]}, op, weight=w)["b"],
        "iallreduce": synk.comm.iallreduce(x, op).wait(),
        "iallreduce weighted": synk.comm.iallreduce(y, op, weight=w).wait(),
        "reduce_scatter": synk.comm.reduce_scatter(xp.full((3, k), even[r], dtype), op),
    }
    return {key: _on_host(v) for key, v in got.items()}


def _first_row(x):
    return x[0, :4], x[0]  # a small output (on the host for GPU ranks) and a large one


def bound(dtype: str, vals, weights=None) -> float:
    """The documented bound of a mean's error against float64 numpy (synk._reduction)."""
    w = np.ones(len(vals)) if weights is None else np.asarray(weights, np.float64)
    terms = np.abs(np.array(vals, np.float64) * w / w.sum()).sum()
    out = np.dtype(dtype) if np.dtype(dtype).kind in "fc" else np.dtype(np.float64)
    return (len(vals) + 2) * float(np.finfo(out).eps) * terms


class Want:
    """What one rule must give: ``exact_mean`` numpy's float64 answer in the dtype, bit for
    bit; ``mean`` that answer within the documented bound, in the dtype."""

    def __init__(self, op: str, dtype: str, vals, weights=None) -> None:
        self.op, self.value = op, expected(dtype, vals, weights)
        self.exact = np.average(np.array(vals, np.float64), weights=weights)
        self.bound = bound(dtype, vals, weights)

    def check(self, got, what: str) -> None:
        got = np.asarray(got)
        assert got.dtype == self.value.dtype, (what, got.dtype, self.value.dtype)
        if self.op == "exact_mean":
            assert np.array_equal(got, np.full(got.shape, self.value)), (
                what, got.reshape(-1)[:3], self.value)
        else:
            error = np.abs(got.astype(np.float64) - self.exact).max()
            assert error <= self.bound, (what, got.reshape(-1)[:3], self.exact, error,
                                         self.bound)


def check_every_path(dtype: str, op: str = "exact_mean") -> None:
    """The averaging paths of a running group of 3 ranks, against numpy."""
    even, weighted = values(dtype)
    want_even, want_weighted = Want(op, dtype, even), Want(op, dtype, weighted, ROWS)
    k = 4096  # large enough that a GPU group combines on the devices

    f = synk.function(_comm_means, bcast_inputs=["marker", "dtype", "even", "weighted", "k",
                                                 "op"], reduce=None)
    for rank, got in enumerate(f(np.zeros(1), dtype, even, weighted, 8, op)):
        for key, value in got.items():
            (want_weighted if "weighted" in key else want_even).check(value, f"{key} r{rank}")

    g = synk.function(_first_row, reduce=op)
    rows_even = np.repeat(np.array(even, dtype)[:, None], k, axis=1)
    rows_weighted = np.repeat(np.array(weighted, dtype).repeat(ROWS)[:, None], k, axis=1)
    for num_slices in (1, 2):
        for rows, want in ((rows_even, want_even), (rows_weighted, want_weighted)):
            small, large = g(rows, num_slices=num_slices)
            want.check(small, f"small output, {num_slices} slice(s)")
            want.check(large, f"large output, {num_slices} slice(s)")


def check_shared(dtype: str, op: str = "exact_mean") -> None:
    """all_reduce and reduce of shared variables (a running group of 3 ranks)."""
    even, _ = values(dtype)
    want = Want(op, dtype, even)
    a = synk.shared(np.zeros(4096, dtype), name="a")
    b = synk.shared(np.zeros(3, dtype), name="b")
    for name, collective in (("all_reduce", synk.shared_all_reduce),
                             ("reduce", lambda v, op: synk.shared_reduce(v, op, root=0))):
        for rank in range(3):
            a.set_value(np.full(4096, even[rank], dtype), rank=rank)
            b.set_value(np.full(3, even[rank], dtype), rank=rank)
        collective([a, b], op)
        for var in (a, b):
            want.check(var.get_value(0), f"{name} of {var!r}")


def test_mean_follows_one_rule_everywhere(three):
    check_every([(dtype, op) for op in ("mean", "exact_mean") for dtype in DTYPES],
                check_every_path)


def test_shared_variables_average_by_the_same_rule(three):
    check_every([(dtype, op) for op in ("mean", "exact_mean")
                 for dtype in ("float16", "float32", "float64")], check_shared)


MPI_JOB = """
import test_mean_rule as rule

assert n == 3, n
print("BACKEND", synk.backend(), flush=True)
for op in ("mean", "exact_mean"):
    for dtype in rule.DTYPES:
        rule.check_every_path(dtype, op)
    for dtype in ("float16", "float32", "float64"):
        rule.check_shared(dtype, op)
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


def _the_row(x):
    return x[0]


def test_a_function_follows_the_mean_rule_of_the_group_it_runs_in(monkeypatch):
    """SYNK_MEAN is read once, where the group starts: a Function made in a group under
    one rule follows the next group's, as synk.comm and new Functions there do."""
    x = np.array([[3e7], [1.0], [-3e7]], np.float32)  # (float32 loses the 1 unless exact)
    exact, in_dtype = np.float32(1 / 3), np.float32(0.0)
    monkeypatch.setenv("SYNK_MEAN", "exact")
    synk.fork(3)
    f = synk.function(_the_row, reduce="mean")
    try:
        assert f(x)[0] == exact
    finally:
        synk.close()
    monkeypatch.setenv("SYNK_MEAN", "dtype")
    synk.fork(3)
    try:
        assert f(x)[0] == in_dtype
        assert synk.function(_the_row, reduce="mean")(x)[0] == in_dtype
    finally:
        synk.close()
