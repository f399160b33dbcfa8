"""A mean of subnormal numbers (below the dtype's least normal number) is numpy's answer.

Each rank's part of a mean is scaled by ``w_r / W`` in the data's dtype, and a scaled
subnormal loses its low bits (``1.4e-45 / 3`` is 0 in float32) where numpy, which sums
and then divides, keeps them. Where a term underflows, the mean is taken as
``exact_mean`` takes it (float64 terms, summed, divided by ``W``, rounded once), which is
numpy's answer for such numbers: ``np.mean`` of the ranks' values with equal weights,
``np.average`` in float64, cast to the dtype, with weights. Checked on CPU ranks through
``synk.comm`` (plain, weighted, fused, non-blocking, in two rounds, reduce,
reduce_scatter) and a function's outputs (small, large, numbers), on GPU ranks that share
a device (staged through the host) and under MPI across pretend hosts. NCCL sums the parts
each rank scaled on its device: a mean there is within the documented bound of ``n`` of
the dtype's smallest subnormals."""
import os

import mpirun
import numpy as np
import pytest
from conftest import REAL, check_every, use_devices

import synk

pytestmark = pytest.mark.timeout(180)

DTYPES = ["float32", "float64", "complex64"]
WEIGHTS = (1.0, 2.0, 3.0)  # synk.comm's weight= of ranks 0, 1, 2
ROWS = (2, 1, 1)  # the rows of each of 3 ranks when 4 rows are split


def table(dtype: str) -> np.ndarray:
    """Three ranks' values: subnormals (in units of the smallest), and normal numbers whose
    thirds are subnormal."""
    info = np.finfo(dtype)
    units = np.array([[1, 3, -2, 5, 1, 0, 7, 2],
                      [1, 3, 1, -7, 1, 0, 0, 2],
                      [1, 4, 2, 1, 0, 1, 0, 3]], np.float64)
    values = units * float(info.smallest_subnormal)
    least = float(info.tiny)
    values = np.concatenate([values, [[1.5 * least], [1.5 * least], [1.25 * least]]], axis=1)
    if np.dtype(dtype).kind == "c":
        return (values + 1j * values[::-1]).astype(dtype)
    return values.astype(dtype)


def numpys_mean(values: np.ndarray, weights=None) -> np.ndarray:
    """numpy's answer: its mean (summed in the dtype, divided once), or its float64 average
    in the dtype."""
    if weights is None:
        return np.mean(values, axis=0)
    wide = np.complex128 if values.dtype.kind == "c" else np.float64
    return np.average(values.astype(wide), axis=0, weights=weights).astype(values.dtype)


def bits(x) -> list:
    x = np.asarray(x)
    return x.reshape(-1).view({4: np.uint32, 8: np.uint64}[x.dtype.itemsize // (
        2 if x.dtype.kind == "c" else 1)]).tolist()


def same(got, want: np.ndarray, what: str) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{what}: {got.dtype}, not {want.dtype}"
    assert bits(got) == bits(want), f"{what}: {got.tolist()} != numpy's {want.tolist()}"


def within_units(got, want: np.ndarray, n: int, what: str) -> None:
    """NCCL's precision: within ``n`` of the dtype's smallest subnormals of numpy's."""
    unit = float(np.finfo(want.dtype).smallest_subnormal)
    error = np.abs(np.asarray(got).astype(np.complex128) - want.astype(np.complex128)).max()
    assert error <= n * unit, f"{what}: {np.asarray(got).tolist()} != {want.tolist()}"


def _on_host(value):
    return None if value is None else np.asarray(value.get() if hasattr(value, "get") else value)


def _comm_means(values, weights):
    comm = synk.comm
    xp = synk.xp(values)
    r = comm.rank()
    x, w = values[r], weights[r]
    n = x.shape[0]
    got = {
        "allreduce": comm.allreduce(x, "mean"),
        "weight 1": comm.allreduce(x, "mean", weight=1),
        "weighted": comm.allreduce(x, "mean", weight=w),
        "fused": comm.allreduce([x, x[::-1].copy()], "mean")[0],
        "fused weighted": comm.allreduce({"a": x[::-1].copy(), "b": x}, "mean", weight=w)["b"],
        "iallreduce": comm.iallreduce(x, "mean").wait(),
        "in two rounds": comm.allreduce(xp.tile(x, 200_000), "mean")[-n:],
        "reduce": comm.reduce(x, "mean", root=1),
        "reduce_scatter": comm.reduce_scatter(xp.stack([x] * comm.size()), "mean")[0],
    }
    return {key: _on_host(v) for key, v in got.items()}


def _outputs(rows, values, reps):
    x = values[int(rows[0, 0])]
    return x, synk.xp(values).tile(x, reps), x[0]


def check_comm(dtype: str, nccl: bool = False) -> None:
    """``synk.comm``'s means of a running group of 3 ranks, on every rank."""
    values = table(dtype)
    f = synk.function(_comm_means, bcast_inputs=["values", "weights"], reduce=None)
    for rank, got in enumerate(f(values, WEIGHTS)):
        for key, value in got.items():
            if key == "reduce" and rank != 1:
                assert value is None
                continue
            want = numpys_mean(values, WEIGHTS if "weighted" in key else None)
            what = f"{dtype} {key} on rank {rank}"
            if nccl:
                within_units(value, want, 3, what)
            else:
                same(value, want, what)


def check_outputs(dtype: str, nccl: bool = False) -> None:
    """A function's outputs reduced by ``mean`` (3 ranks): small ones (in the replies),
    large ones (in shared memory, or by MPI's collectives across hosts), numbers."""
    values = table(dtype)
    f = synk.function(_outputs, inputs=["rows"], bcast_inputs=["values", "reps"],
                      reduce="mean")
    for rows, weights in ((np.arange(3).reshape(3, 1), None),
                          (np.array([[0], [0], [1], [2]]), ROWS)):
        want = numpys_mean(values, weights)
        small, large, number = f(rows, values, 10_000)
        same(small, want, f"{dtype} small output, rows {rows.ravel().tolist()}")
        same(number, want[0], f"{dtype} number, rows {rows.ravel().tolist()}")
        what = f"{dtype} large output, rows {rows.ravel().tolist()}"
        if nccl:
            within_units(large[-want.size:], want, 3, what)
        else:
            same(large[-want.size:], want, what)


def _python_floats(rows, values):
    return float(values[int(rows[0, 0])][1]), float(values[int(rows[0, 0])][8])


def check_python_floats() -> None:
    """Python floats (float64, combined as numbers) average as numpy's float64."""
    values = table("float64")
    f = synk.function(_python_floats, inputs=["rows"], bcast_inputs=["values"], reduce="mean")
    got = f(np.arange(3).reshape(3, 1), values)
    for value, want in zip(got, numpys_mean(values)[[1, 8]]):
        assert type(value) is float and value == want, (got, numpys_mean(values)[[1, 8]])


# -- CPU ranks -----------------------------------------------------------------------------------
def test_the_mean_of_three_smallest_subnormals_is_numpys():
    """The smallest float32 subnormal on each of three ranks: its own mean, not 0."""
    tiny = np.float32(1.4e-45)
    synk.fork(3, backend="cpu")
    try:
        f = synk.function(lambda: (np.array([tiny]), tiny), reduce="mean")
        g = synk.function(lambda: (synk.comm.allreduce(np.array([tiny]), "mean"),
                                   synk.comm.allreduce(np.array([tiny]), "mean", weight=1)),
                          reduce=None)
        outputs, every_ranks = f(), g()
    finally:
        synk.close()
    assert np.mean(np.array([tiny] * 3)) == tiny
    got = [*outputs, *(v for output in every_ranks for v in output)]
    assert [float(np.asarray(v).reshape(-1)[0]) for v in got] == [float(tiny)] * 8, got


def test_synk_comm_means_of_subnormals_are_numpys(ranks3):
    check_every([(d,) for d in DTYPES], check_comm)


def test_function_outputs_average_subnormals_as_numpy(ranks3):
    check_every([(d,) for d in DTYPES], check_outputs)
    check_python_floats()


def _mixed(values, weights):
    comm = synk.comm
    x = values[comm.rank()]
    return (comm.allreduce(x, "mean"), comm.allreduce(x, "mean", weight=weights[comm.rank()]),
            comm.allreduce(np.tile(x, 800_000), "mean")[-x.size:])


def test_ranks_whose_terms_underflow_beside_ranks_whose_terms_do_not(ranks3):
    """Rank 1's values scale to normal numbers, ranks 0 and 2's to subnormals: those send
    their parts as they are, rank 1 its scaled terms, in one round and in two."""
    unit, least = float(np.finfo(np.float32).smallest_subnormal), float(np.finfo(np.float32).tiny)
    values = np.array([[unit, 5 * unit, 3 * least], [3 * least, 6 * least, 3 * least],
                       [2 * unit, 0.0, 3 * least]], np.float32)
    f = synk.function(_mixed, bcast_inputs=["values", "weights"], reduce=None)
    for rank, (plain, weighted, large) in enumerate(zip(*f(values, WEIGHTS))):
        same(plain, numpys_mean(values), f"plain on rank {rank}")
        same(weighted, numpys_mean(values, WEIGHTS), f"weighted on rank {rank}")
        same(large, numpys_mean(values), f"in two rounds on rank {rank}")


def test_normal_means_keep_their_pre_scaled_bits(ranks3):
    """Values whose scaled terms stay normal are scaled and summed in their dtype as ever:
    the sum of the rounded terms, in rank order."""
    x = np.array([[1.0, 3e-38, 7.0], [2.0, 3e-38, 5.0], [4.0, 3e-38, 1.0]], np.float32)
    f = synk.function(lambda x: synk.comm.allreduce(x[synk.comm.rank()], "mean"),
                      bcast_inputs=["x"], reduce=None)
    third = np.float32(1.0 / 3)
    want = (x[0] * third + x[1] * third) + x[2] * third
    for got in f(x):
        same(got, want, "pre-scaled")


# -- GPU ranks -------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_ranks_sharing_a_device_average_subnormals_as_numpy(monkeypatch):
    """Ranks sharing one device stage their parts through the host, which averages them."""
    if REAL:
        monkeypatch.setenv("SYNK_TEST_SHARE_GPUS", "1")
    else:
        use_devices(monkeypatch, 1)
    synk.fork(3, backend="gpu")
    try:
        check_every([(d,) for d in DTYPES], check_comm)
        check_every([(d,) for d in DTYPES], check_outputs)
    finally:
        synk.close()


@pytest.mark.gpu
def test_gpu_ranks_on_nccl_average_subnormals_within_the_bound(monkeypatch):
    """NCCL sums the terms each rank scaled on its device: within ``n`` smallest
    subnormals of numpy's mean; small outputs are averaged on the host, as numpy's."""
    use_devices(monkeypatch, 3)
    synk.fork(3, backend="gpu")
    try:
        check_every([(d,) for d in DTYPES], lambda d: check_comm(d, nccl=True))
        check_every([(d,) for d in DTYPES], lambda d: check_outputs(d, nccl=True))
    finally:
        synk.close()


# -- MPI across pretend hosts ----------------------------------------------------------------------
MPI_JOB = """
import test_subnormal_means as means

assert n == 3, n
for dtype in means.DTYPES:
    means.check_comm(dtype)
    means.check_outputs(dtype)
means.check_python_floats()
print("SUBNORMAL MEANS OK", flush=True)
"""


def test_means_of_subnormals_across_hosts_are_numpys(tmp_path):
    """3 ranks over 2 pretend hosts: synk.comm over MPI's messages, and large outputs
    combined by MPI's collectives."""
    here = os.path.dirname(os.path.abspath(__file__))
    preamble = f"import sys\nsys.path.insert(0, {here!r})\n" + mpirun.PREAMBLE
    run = mpirun.run(tmp_path, MPI_JOB, hosts=("a", "a", "b"), preamble=preamble,
                     timeout=150)
    assert run.rc == 0 and "SUBNORMAL MEANS OK" in run.out, run
