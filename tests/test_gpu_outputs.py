"""Outputs combined on GPU groups: large ones on the devices with NCCL, small ones (a loss,
a few metrics) on rank 0's host from the values the ranks send with their descriptions.
Every reduce op over every dtype, both ways, against numpy and against the CPU backend's
own combining; only the combined result of a large output crosses to the host, once, on
rank 0, and of a small one each rank's own value (asserted from the transfer counters);
ranks without rows, uneven gathers, mixed outputs, errors, and a rank killed during the
NCCL reduction."""
import collections
import threading
import time

import numpy as np
import pytest
from conftest import REAL, first_op, on_every_rank, use_devices

import synk
from synk import simulator as sim

pytestmark = pytest.mark.gpu
PROMPT = 15
SMALL_OUTPUT_BYTES = 4096  # docs/gpu.md: "small outputs" are up to 4 KiB on every rank

DTYPES = ["float64", "float32", "float16", "int64", "int32", "int16", "uint8", "bool",
          "complex128"]
FNS = {"sum": lambda x: x.sum(axis=0), "prod": lambda x: x.prod(axis=0),
       "max": lambda x: x.max(axis=0), "min": lambda x: x.min(axis=0),
       "mean": lambda x: x.mean(axis=0), "gather": lambda x: x * 2}
WIDE = SMALL_OUTPUT_BYTES + 4  # columns: every output is then combined on the devices
WIDTHS = pytest.mark.parametrize("width", [4, WIDE], ids=["small", "large"])


def _data(dtype: str, n: int = 13, width: int = 4) -> np.ndarray:
    rng = np.random.default_rng(7)
    shape = (n, width)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith("complex"):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype.startswith(("int", "uint")):
        return rng.integers(1, 3, shape).astype(dtype)  # small: products stay in range
    return (rng.random(shape) + 0.5).astype(dtype)


def _fn_for(op, dtype):
    if dtype == "bool" and op in ("prod", "mean"):
        return (lambda x: x.sum(axis=0)) if op == "prod" else FNS[op]
    return FNS[op]


def mixed(x):
    return (((x - 1) ** 2).mean(), x.sum(axis=0), x[:, :2], x * 2, x.max(axis=0)[:3],
            float(len(x)))


MIXED_OPS = ("mean", "sum", "gather", "gather", "max", "sum")


def _mixed_input():
    return _data("float64", n=29, width=WIDE)


@pytest.fixture(scope="module")
def cpu_answers():
    """What the CPU backend gives for every case below, on 2 and on 3 CPU ranks: {(case,
    ranks): result}. Computed first, in CPU groups, since a process runs one group at a time."""
    cases = {(op, dtype, width): (_fn_for(op, dtype), op, _data(dtype, width=width))
             for op in FNS for dtype in DTYPES for width in (4, WIDE)}
    cases["mixed"] = (mixed, MIXED_OPS, _mixed_input())
    answers = {}
    for n in (2, 3):
        synk.fork(n, backend="cpu")
        try:
            for case, (fn, op, x) in cases.items():
                answers[case, n] = synk.function(fn, reduce=op)(x)
        finally:
            synk.close()
    return answers



@WIDTHS
def test_every_op_and_dtype_matches_the_cpu_backend_and_numpy(cpu_answers, gpus, width):
    """Every reduce op over every dtype, in one group (a group per case made this file most
    of the suite's time); every case is checked, and the failures are listed together."""
    failed = []
    for op in FNS:
        for dtype in DTYPES:
            try:
                _check_op_and_dtype(cpu_answers, gpus, op, dtype, width)
            except AssertionError as err:
                failed.append(f"{op} {dtype}: {err}")
    assert not failed, "\n".join(failed)


def _check_op_and_dtype(cpu_answers, gpus, op, dtype, width):
    x = _data(dtype, width=width)
    fn = _fn_for(op, dtype)
    got = synk.function(fn, reduce=op)(x)
    want = cpu_answers[(op, dtype, width), gpus]
    assert type(got) is type(want) and np.asarray(got).dtype == np.asarray(want).dtype
    # (a real GPU's per-rank sums and products round in CuPy's kernels' order, not
    # numpy's: a float32 result may differ in its last bit)
    tol = 1e-2 if dtype == "float16" else 1e-6 if REAL and dtype == "float32" else 1e-7
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
    if op in ("sum", "max", "min", "mean", "gather") and dtype != "float16":
        single = fn(x) if op == "gather" else {"sum": np.sum, "max": np.max, "min": np.min,
                                               "mean": np.mean}[op](x, axis=0)
        np.testing.assert_allclose(np.asarray(got), single, rtol=1e-6)


def _counters():
    return sim.transfer_counts()


def test_large_results_cross_to_the_host_once_on_rank_0_small_ones_from_each_rank(gpus):
    if REAL:
        pytest.skip("reads the simulator's counters")
    x = synk.data(np.random.default_rng(1).standard_normal((1001, 1024)))

    def outputs(x):
        xp = synk.xp(x)
        return x.sum(axis=0), xp.mean(x), x[:, :3], x[:, 0].max()

    f = synk.function(outputs, reduce=("sum", "mean", "gather", "max"))
    f(x)  # warm: ships the function, maps and page-locks the block
    before = on_every_rank(lambda arg: _counters())
    total, mean, gathered, top = f(x)
    after = on_every_rank(lambda arg: _counters())
    assert np.allclose(total, x.array.sum(axis=0)) and np.isclose(mean, x.array.mean())
    assert np.allclose(gathered, x.array[:, :3]) and isinstance(mean, np.floating)
    assert top == x.array[:, 0].max() and isinstance(top, np.floating)
    d2h = [after[r]["d2h"] - before[r]["d2h"] for r in range(gpus)]
    # the large results, once; its smalls; 1 byte: whether fn wrote into x's rows (written
    # back into the Data, as a CPU rank's writes land there)
    assert d2h[0] == 1024 * 8 + 1001 * 3 * 8 + 8 + 8 + 1
    assert d2h[1:] == [8 + 8 + 1] * (gpus - 1)  # only each rank's own small outputs, and that


def test_small_and_large_outputs_of_one_call_match_the_cpu_backend(cpu_answers, gpus):
    x = _mixed_input()
    got = synk.function(mixed, reduce=MIXED_OPS)(x)
    wants = cpu_answers["mixed", gpus]
    for i, want in enumerate(wants):
        assert type(got[i]) is type(want), (i, type(got[i]), type(want))
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), rtol=1e-12)
    if not REAL:  # the small mean: the same bits (a real GPU's own sum of a rank's rows
        assert got[0] == wants[0]  # may round otherwise than numpy's: CuPy's kernel order)


@pytest.mark.parametrize("width", [3, WIDE], ids=["small", "large"])
def test_ranks_without_rows_contribute_nothing(gpus, width):
    x = np.resize(np.array([[3.0, -1.0, 2.0]]), (1, width))  # one row: the others have none
    for op, fn in FNS.items():
        got = synk.function(fn, reduce=op)(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(fn(x)))
    none = synk.function(lambda x: x.sum(), reduce="sum")(x, batch=[])  # no rows at all
    assert none == 0.0
    ints = synk.function(lambda x: x.max(axis=0), reduce="max")(np.array([[-5, -7]]))
    assert ints.tolist() == [-5, -7]  # not the identity the other ranks sent


def test_tuples_with_every_kind_of_output_and_reduce_none(gpus):
    x = np.arange(20.0).reshape(10, 2)

    def many(x):
        xp = synk.xp(x)
        return x.sum(), float(len(x)), x.max(axis=0), xp.asarray(len(x)), x[:1]

    total, rows, big, count, firsts = synk.function(
        many, reduce=("sum", "sum", "max", "mean", None))(x)
    assert total == x.sum() and isinstance(total, np.floating)
    assert rows == 10.0 and type(rows) is float
    assert big.tolist() == [18.0, 19.0]
    parts = np.array_split(x, gpus)
    assert count == sum(len(p) ** 2 for p in parts) / 10  # row-weighted mean of the counts
    assert [f.tolist() for f in firsts] == [p[:1].tolist() for p in parts]
    assert all(type(f) is np.ndarray for f in firsts)


Pair = collections.namedtuple("Pair", "first last")


def test_an_output_kept_as_it_is_keeps_its_named_tuples_and_containers(gpus2):
    """reduce=None gives each rank's value as the function returned it, device arrays
    copied to the host: a named tuple stays one (it came back a plain tuple), and a value
    holding no device array comes back as itself."""
    def kept(x):
        xp = synk.xp(x)
        return Pair(xp.asarray(x[:1]), [x[-1:], 2]), {"plain": Pair(1, "a")}

    pairs, plains = synk.function(kept, reduce=None)(np.arange(6.0))
    for pair, part in zip(pairs, np.array_split(np.arange(6.0), 2)):
        assert type(pair) is Pair and type(pair.first) is np.ndarray
        assert pair.first.tolist() == part[:1].tolist() and pair.last[0].tolist() == [part[-1]]
    assert all(type(p["plain"]) is Pair and p["plain"] == (1, "a") for p in plains)


def test_outputs_of_different_dtypes_on_different_ranks(gpus):
    def typed(x):
        xp = synk.xp(x)
        return x.sum(axis=0).astype(xp.float32 if synk.comm.rank() == 0 else xp.float64)

    x = np.ones((9, 2))
    got = synk.function(typed, reduce="sum")(x)
    assert got.dtype == np.float64 and got.tolist() == [9.0, 9.0]
    gathered = synk.function(typed, reduce="gather")(x)
    assert gathered.dtype == np.float64 and gathered.shape == (2 * gpus,)


@WIDTHS
def test_complex_products_and_maxima_are_combined_on_rank_0(cpu_answers, gpus, width):
    x = _data("complex128", width=width)
    for op in ("prod", "max", "min"):
        got = synk.function(FNS[op], reduce=op)(x)
        np.testing.assert_allclose(got, cpu_answers[(op, "complex128", width), gpus])


def test_different_shapes_raise_as_on_the_cpu_and_the_group_stays_usable(gpus):
    def ragged(x):
        return x.sum(axis=0)[: 1 + synk.comm.rank()]

    with pytest.raises(ValueError, match="different shapes"):
        synk.function(ragged, reduce="sum")(np.ones((6, 3)))
    with pytest.raises(TypeError, match="needs numbers"):
        synk.function(lambda x: "text", reduce="sum")(np.ones((6, 3)))
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones((6, 3))) == 18.0


def test_a_rank_killed_during_the_nccl_reduction_raises_in_seconds(monkeypatch):
    if REAL:
        pytest.skip("fault injection is the simulator's")
    use_devices(monkeypatch, 3)
    monkeypatch.setenv("SYNK_SIM_FAULTS", f"kill:rank=1:collective={first_op(3)}")  # the reduce
    synk.fork(3, backend="gpu")
    start = time.monotonic()
    with pytest.raises(synk.WorkerDiedError, match="rank 1 was killed by SIGKILL"):
        synk.function(lambda x: x.sum(axis=0), reduce="sum", timeout=60)(np.ones((9, WIDE)))
    assert time.monotonic() - start < PROMPT
    synk.close()
    # at once: the NCCL watcher (which holds the group, and so the call's staged input) is
    # joined by close(), not left to end on its own
    assert not [t.name for t in threading.enumerate() if t.name.startswith("synk")]
