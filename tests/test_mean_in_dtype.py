"""``mean`` in the data's own dtype (docs/api/calls.md, "How mean is computed"): pre-scaled on
each rank, summed in the parts' dtype by one collective of the data's own bytes, within the
documented bound of float64 numpy on random data, with no overflow where the mean has none;
a fused structure's layout kept between calls; on NCCL, the data's own bytes and one call
per dtype; ``SYNK_MEAN=exact`` for the float64 rule."""
import subprocess
import sys

import numpy as np
import pytest
from conftest import REAL, on_every_rank

import synk

DTYPES = ["float16", "float32", "float64"]


def _bound(parts: list, weights: list, dtype) -> np.ndarray:
    w = np.asarray(weights, np.float64) / np.sum(weights)
    terms = sum(np.abs(p.astype(np.float64)) * f for p, f in zip(parts, w))
    return (len(parts) + 2) * float(np.finfo(dtype).eps) * terms


def _host(x):
    return np.asarray(x.get() if hasattr(x, "get") else x)


def _means(arg):
    """This rank's random leaves, and synk.comm's means of them (plain, weighted, fused),
    on the rank's device (GPU ranks) or the host."""
    marker, dtype, seed = arg
    xp = synk.xp(marker)
    r = synk.comm.rank()
    rng = np.random.default_rng(seed + r)
    a = rng.standard_normal((37, 5)).astype(dtype) * 10
    b = rng.standard_normal(11).astype(dtype)
    weight = float(r + 1)
    da, db = xp.asarray(a), xp.asarray(b)
    got = {
        "plain": synk.comm.allreduce(da, "mean"),
        "weighted": synk.comm.allreduce(da, "mean", weight=weight),
        "fused": synk.comm.allreduce([da, db], "mean", weight=weight),
    }
    return a, b, {k: ([_host(v) for v in got[k]] if isinstance(got[k], list)
                      else _host(got[k])) for k in got}


@pytest.mark.parametrize("dtype", DTYPES)
def test_means_are_within_the_bound_of_float64_numpy(three, dtype):
    results = on_every_rank(_means, np.zeros(1), dtype, 5)
    a_parts = [r[0] for r in results]
    b_parts = [r[1] for r in results]
    weights = [1.0, 2.0, 3.0]
    for rank, (_, _, got) in enumerate(results):
        exact = np.mean(np.array(a_parts, np.float64), axis=0)
        assert got["plain"].dtype == np.dtype(dtype)
        assert np.all(np.abs(got["plain"] - exact) <= _bound(a_parts, [1, 1, 1], dtype))
        exact = np.average(np.array(a_parts, np.float64), axis=0, weights=weights)
        assert np.all(np.abs(got["weighted"] - exact) <= _bound(a_parts, weights, dtype))
        fa, fb = got["fused"]
        assert fa.dtype == fb.dtype == np.dtype(dtype)
        assert np.all(np.abs(fa - exact) <= _bound(a_parts, weights, dtype))
        exact_b = np.average(np.array(b_parts, np.float64), axis=0, weights=weights)
        assert np.all(np.abs(fb - exact_b) <= _bound(b_parts, weights, dtype))
        if rank:  # every rank the same bits
            assert all(np.array_equal(x, y) for x, y in zip(
                [got["plain"], got["weighted"], fa, fb],
                [results[0][2]["plain"], results[0][2]["weighted"], *results[0][2]["fused"]]))


def _near_the_top(arg):
    xp = synk.xp(arg[0])
    x = xp.full(8, 60000.0, np.float16)  # float16's largest is 65504: a sum of two overflows
    return _host(synk.comm.allreduce(x, "mean")), _host(synk.comm.allreduce(
        [x, x[:2]], "mean", weight=1000.0 * (synk.comm.rank() + 1))[1])


def test_a_float16_mean_does_not_overflow_where_the_mean_does_not(two):
    for plain, weighted in on_every_rank(_near_the_top, np.zeros(1)):
        assert plain.dtype == np.float16 and np.all(plain == np.float16(60000))
        assert np.all(np.isfinite(weighted)) and np.allclose(weighted, 60000, rtol=2e-3)


def test_function_outputs_average_in_their_dtype_within_the_bound(three):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((301, 64)) * 100).astype(np.float32)
    f = synk.function(lambda x: x.mean(axis=0), reduce="mean")
    got = f(x)
    assert got.dtype == np.float32
    # each rank's output as it computed it (on a real GPU, CuPy sums in another order)
    means = [_host(m) for m in synk.function(lambda x: x.mean(axis=0), reduce=None)(x)]
    rows = [len(p) for p in np.array_split(x, 3)]
    exact = np.average(np.array(means, np.float64), axis=0, weights=rows)
    assert np.all(np.abs(got - exact) <= _bound(means, rows, np.float32))
    ints = synk.function(lambda x: (x[:, :3] > 0).sum(axis=0), reduce="mean")(x)
    assert ints.dtype == np.float64  # integers and bools average to float64, as numpy's


def _bytes_on_nccl(arg):
    marker, dtype, weighted = arg
    xp = synk.xp(marker)
    grads = [xp.ones((100, 10), dtype), xp.ones(24, dtype)]
    weight = 2.0 if weighted else None
    synk.comm.allreduce(grads, "mean", weight=weight)  # (the first: the ranks agree on it)
    before = synk.simulator.nccl_communicator()
    got = synk.comm.allreduce(grads, "mean", weight=weight)
    after = synk.simulator.nccl_communicator()
    given = {k: v - before.bytes_given.get(k, 0) for k, v in after.bytes_given.items()
             if v != before.bytes_given.get(k, 0)}
    return given, after.operations - before.operations, str(got[0].dtype), \
        float(_host(got[0]).sum())


@pytest.mark.gpu
@pytest.mark.skipif(REAL, reason="reads the simulated NCCL's records")
@pytest.mark.parametrize("weighted", [False, True], ids=["equal", "weighted"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_fused_mean_gives_nccl_the_datas_own_bytes_in_one_call(gpus2, dtype, weighted):
    """A mean of float32 gradients moves float32 over NCCL, the bytes of the data, in one
    NCCL allreduce; a mean of float16 ones moves float32 (summed in float32, as numpy's
    mean of float16, rounded to float16 once: ``_reduction.mean_work_dtype``). Weighted,
    the ranks' weights are exchanged over the host before it."""
    for given, calls, got_dtype, total in on_every_rank(_bytes_on_nccl, np.zeros(1), dtype,
                                                        weighted):
        assert given == {"allReduce": (1000 + 24) * 4}
        assert calls == 1 and got_dtype == dtype and total == 1000.0


def test_synk_mean_exact_makes_every_mean_the_float64_rule(tmp_path):
    script = tmp_path / "exact.py"
    script.write_text(
        "import numpy as np, synk\n"
        "synk.fork(3)\n"
        "vals = (3e7, 1.0, -3e7)\n"
        "f = synk.function(lambda x: x[0] * 1, reduce='mean')\n"
        "got = f(np.array(vals, np.float32)[:, None].repeat(4, 1))\n"
        "want = np.float32(np.mean(np.array(vals, np.float64)))\n"
        "assert got.dtype == np.float32 and np.all(got == want), (got, want)\n"
        "print('EXACT OK')\n"
        "synk.close()\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, env={**_env_with_this_synk(), "SYNK_MEAN": "exact"})
    assert run.returncode == 0 and "EXACT OK" in run.stdout, run.stdout + run.stderr
    bad = subprocess.run([sys.executable, "-c", "import synk; synk.fork(2)"],
                         capture_output=True, text=True, timeout=60,
                         env={**_env_with_this_synk(), "SYNK_MEAN": "float32"})
    assert bad.returncode != 0 and "SYNK_MEAN='float32'" in bad.stderr


def test_synk_mean_is_read_when_the_group_starts(monkeypatch):
    """A change of ``SYNK_MEAN`` in the master alone would make the ranks disagree: the
    group keeps the rule it started with, and the next ``fork()`` reads it again."""
    data = np.array((3e7, 1.0, -3e7), np.float32)[:, None].repeat(4, 1)
    exact = np.float32(np.mean(np.array((3e7, 1.0, -3e7), np.float64)))
    monkeypatch.delenv("SYNK_MEAN", raising=False)
    synk.fork(3)
    try:
        in_dtype = synk.function(lambda x: x[0] * 1, reduce="mean")(data)
        monkeypatch.setenv("SYNK_MEAN", "exact")
        assert np.array_equal(synk.function(lambda x: x[0] * 1, reduce="mean")(data),
                              in_dtype)
        synk.close()
        synk.fork(3)
        got = synk.function(lambda x: x[0] * 1, reduce="mean")(data)
        assert np.all(got == exact) and not np.all(in_dtype == exact), (got, in_dtype)
    finally:
        synk.close()
    monkeypatch.delenv("SYNK_MEAN")  # (closed: its next use reads it again)
    alone = synk.function(lambda x: x[0] * 1, reduce="mean").local(data, num_slices=3)
    assert np.array_equal(alone, in_dtype)


def _env_with_this_synk() -> dict:
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(synk.__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [here, os.environ.get("PYTHONPATH")])))


def test_exact_mean_is_an_op_of_its_own(ranks2):
    f = synk.function(lambda x: x.sum(axis=0), reduce="exact_mean")
    assert f.reduce == "exact_mean" and f(np.ones((4, 2), np.float32)).dtype == np.float32


def _float16_both_ways(arg):
    """A weighted mean of float16 data (summed in float32) as one large leaf, scaled leaf
    by leaf, and as many small leaves, copied then scaled in one pass."""
    rng = np.random.default_rng(11 + synk.comm.rank())
    x = (rng.standard_normal(40_000) * 3).astype(np.float16)
    weight = 3.0 + synk.comm.rank()
    large = synk.comm.allreduce([x], "mean", weight=weight)[0]
    small = synk.comm.allreduce(list(x.reshape(400, 100)), "mean", weight=weight)
    return large, np.concatenate(small)


def test_a_float16_mean_scales_the_same_way_whatever_the_leaves_sizes(ranks2):
    # (numpy 1.x would scale a float16 leaf by a float32 factor in float16, value-based
    # casting, unless told the dtype: the two ways of packing must not drift apart)
    for large, small in on_every_rank(_float16_both_ways):
        assert large.dtype == small.dtype == np.float16
        assert np.array_equal(large, small)


def _subnormal_means(arg):
    xp = synk.xp(arg[0])
    tiny = xp.full(4, 2.0 ** -24, xp.float16)  # float16's smallest subnormal
    got = synk.comm.allreduce(tiny, "mean"), synk.comm.allreduce([tiny], "mean", weight=1.0)
    return tuple(np.asarray(g.get() if hasattr(g, "get") else g) for g in (got[0], got[1][0]))


def test_a_float16_mean_is_summed_in_float32_as_numpys(three):
    """Three ranks of float16 2**-24: numpy's mean (summed in float32) is 2**-24; each
    part scaled by 1/3 in float16 would round to 0."""
    want = np.mean(np.full(3, 2.0 ** -24, np.float16))
    assert want == np.float16(2.0 ** -24)
    for plain, weighted in on_every_rank(_subnormal_means, np.zeros(1)):
        for got in (plain, weighted):
            assert got.dtype == np.float16
            np.testing.assert_array_equal(got, np.full(4, want, np.float16))
    f = synk.function(lambda x: x[0], reduce="mean")
    got = f(np.full((3, 4), 2.0 ** -24, np.float16))
    np.testing.assert_array_equal(np.asarray(got), np.full(4, want, np.float16))
