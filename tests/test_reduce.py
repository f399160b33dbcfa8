"""Every reduce op on uneven splits, against single-process numpy on the same data."""
import numpy as np
import pytest
from conftest import check_every

import synk

ROWS = 101  # 34 + 34 + 33 rows on 3 ranks


@pytest.fixture(params=["inline", "shared-memory", "parallel"])
def group(request, monkeypatch):
    """3 ranks; outputs come back inside replies, or (limit 1 byte) through shared memory and
    combined by the master, or by every rank in parallel (a reduce-scatter)."""
    if request.param != "inline":
        monkeypatch.setenv("SYNK_INLINE_OUTPUT_BYTES", "1")
    if request.param == "parallel":
        monkeypatch.setenv("SYNK_PARALLEL_REDUCE_RANKS", "2")
    synk.fork(3)
    yield request.param
    synk.close()


@pytest.fixture
def x():
    rng = np.random.default_rng(0)
    return (1 + 0.01 * rng.standard_normal((ROWS, 5))).astype("float32")


def per_row_mean(x):
    return x.mean(axis=0)


def col_sum(x):
    return x.sum(axis=0)


def col_prod(x):
    return x.prod(axis=0)


def col_max(x):
    return x.max(axis=0)


def col_min(x):
    return x.min(axis=0)


def double(x):
    return 2 * x


CASES = [
    ("mean", per_row_mean, lambda x: x.mean(axis=0)),
    ("avg", per_row_mean, lambda x: x.mean(axis=0)),
    ("sum", col_sum, lambda x: x.sum(axis=0)),
    ("prod", col_prod, lambda x: x.prod(axis=0)),
    ("max", col_max, lambda x: x.max(axis=0)),
    ("min", col_min, lambda x: x.min(axis=0)),
    ("gather", double, lambda x: 2 * x),
]


def test_op_uneven_split_matches_numpy(group, x):
    check_every([(x, *case) for case in CASES], _uneven_split)


def _uneven_split(x, op, fn, expect):
    f = synk.function(fn, reduce=op)
    for arg in (x, synk.data(x)):
        got = f(arg)
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, expect(x), rtol=1e-5)


def test_none_gives_each_ranks_result(group, x):
    f = synk.function(col_sum, reduce=None)
    got = f(x)
    want = [part.sum(axis=0) for part in np.array_split(x, 3)]
    assert isinstance(got, list) and len(got) == 3
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def rank_ids(x):
    return np.full(len(x), synk.rank())


def test_gather_is_in_rank_order(group, x):
    got = synk.function(rank_ids, reduce="gather")(x)
    np.testing.assert_array_equal(got, [0] * 34 + [1] * 34 + [2] * 33)
    np.testing.assert_array_equal(synk.function(double, reduce="gather")(x), 2 * x)


def test_gather_of_uneven_per_rank_lengths(group):
    def keep_even(v):
        return v[v % 2 == 0]

    v = np.arange(50)
    np.testing.assert_array_equal(synk.function(keep_even, reduce="gather")(v), v[v % 2 == 0])


def test_integer_dtypes_preserved(group):
    v = np.arange(1000, dtype=np.int32).reshape(100, 10)
    got = synk.function(col_sum, reduce="sum")(v)
    assert got.dtype == v.sum(axis=0).dtype
    np.testing.assert_array_equal(got, v.sum(axis=0))
    got = synk.function(col_max, reduce="max")(v)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, v.max(axis=0))
    # the mean of integers is a float, as in numpy
    np.testing.assert_allclose(synk.function(per_row_mean)(v), v.mean(axis=0))


def test_scalar_outputs_keep_their_type(group, x):
    def py_total(x):
        return float(x.sum())

    def np_mean(x):
        return np.mean(x)

    got = synk.function(py_total, reduce="sum")(x)
    assert type(got) is float and got == pytest.approx(float(x.sum()), rel=1e-5)
    got = synk.function(np_mean)(x)
    assert isinstance(got, np.float32) and got == pytest.approx(np.mean(x), rel=1e-5)
    got = synk.function(np_mean, reduce="gather")(x)
    assert got.shape == (3,)


@pytest.mark.parametrize("op", ["sum", "prod", "mean", "exact_mean"])
def test_number_outputs_combine_to_the_bits_of_float64_arrays(group, op):
    """An output that is a number is combined as one, an array of it as an array: both
    must give numpy's float64 answer, bit for bit (signed zeros, infinities and NaN
    included), weighted by the uneven rows."""
    rough = np.random.default_rng(5).standard_normal(20) * 10.0 ** np.arange(-10, 10)
    values = np.concatenate([[0.1, -0.0, 1e308, 3.5, -7.25, 1e-300, np.inf, 2.0, 0.3, -0.0,
                              5.0], rough])
    for lo in range(0, len(values) - 3):
        x = values[lo:lo + 4] if op != "prod" else values[lo:lo + 4][np.isfinite(
            values[lo:lo + 4])]
        rows = np.arange(10).reshape(-1, 1)  # 4, 3 and 3: they only weigh the ranks
        as_number = synk.function(lambda r, x: float(x[synk.comm.rank() % len(x)]),
                                  inputs=["r"], reduce=op)(rows, x)
        as_array = synk.function(lambda r, x: x[synk.comm.rank() % len(x):][:1],
                                 inputs=["r"], reduce=op)(rows, x)
        assert type(as_number) is float and as_array.shape == (1,)
        assert np.asarray(as_number).tobytes() == as_array.tobytes(), (x, op)


def test_tuple_outputs_with_one_op_each(group, x):
    def stats(x):
        return x.sum(axis=0), x.max(), np.mean(x, axis=0), x * 3, len(x)

    f = synk.function(stats, reduce=("sum", "max", "mean", "gather", None))
    total, biggest, mean, tripled, counts = f(x)
    np.testing.assert_allclose(total, x.sum(axis=0), rtol=1e-5)
    assert biggest == x.max()
    np.testing.assert_allclose(mean, x.mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(tripled, 3 * x, rtol=1e-6)
    assert counts == [34, 34, 33]


def test_single_op_applies_to_every_output(group, x):
    f = synk.function(lambda x: (x.sum(axis=0), x.sum()), reduce="sum")
    a, b = f(x)
    np.testing.assert_allclose(a, x.sum(axis=0), rtol=1e-5)
    assert b == pytest.approx(x.sum(), rel=1e-5)


def test_rank_without_rows_contributes_nothing(group):
    v = np.array([[1.0, 2.0], [3.0, 4.0]])  # 2 rows on 3 ranks: rank 2 gets none
    np.testing.assert_allclose(synk.function(per_row_mean)(v), v.mean(axis=0))
    np.testing.assert_allclose(synk.function(col_min, reduce="min")(v), v.min(axis=0))
    np.testing.assert_allclose(synk.function(col_prod, reduce="prod")(v), v.prod(axis=0))
    assert len(synk.function(col_sum, reduce=None)(v)) == 2
    np.testing.assert_array_equal(synk.function(double, reduce="gather")(v), 2 * v)


def test_large_outputs(group):
    """Outputs past the inline limit go through shared memory in the default setting too."""
    rng = np.random.default_rng(1)
    v = rng.standard_normal((31, 300_000)).astype("float32")  # 1.2 MB per output row-sum
    for op, want in (("sum", v.sum(axis=0)), ("mean", v.mean(axis=0)), ("max", v.max(axis=0))):
        got = synk.function({"sum": col_sum, "mean": per_row_mean, "max": col_max}[op],
                            reduce=op)(v)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(synk.function(double, reduce="gather")(v), 2 * v)


def test_no_scattered_inputs_runs_once_per_rank(group):
    def one(k):
        return k

    assert synk.function(one, bcast_inputs=["k"], reduce="sum")(5) == 15
    assert synk.function(one, bcast_inputs=["k"], reduce="mean")(5) == 5
    assert synk.function(one, bcast_inputs="k", reduce=None)(5) == [5, 5, 5]


def test_bool_outputs_sum_like_numpy(group):
    v = np.arange(30) % 3 == 0
    got = synk.function(lambda v: v.copy(), reduce="gather")(v)
    np.testing.assert_array_equal(got, v)
    assert synk.function(lambda v: v.sum(), reduce="sum")(v) == v.sum()
    first = np.arange(30) % 10 == 0  # the first row of each rank's share is True
    got = synk.function(lambda v: v[:1], reduce="sum")(first)  # bools per rank: a count
    assert got.dtype.kind == "i" and got[0] == 3


def test_object_outputs_are_refused_for_array_ops(group):
    def objs(v):
        return np.array([object()] * len(v))

    with pytest.raises(TypeError, match="needs numbers or numeric arrays"):
        synk.function(objs, reduce="gather")(np.zeros(6))
    with pytest.raises(TypeError, match="reduce=None"):
        synk.function(lambda v: "text", reduce="sum")(np.zeros(6))
    assert synk.function(lambda v: len(v), reduce="sum")(np.zeros(6)) == 6  # still usable


class Point:
    def __init__(self, x):
        self.x = x


def test_none_returns_arbitrary_objects(group):
    got = synk.function(lambda v: Point(len(v)), reduce=None)(np.zeros(7))
    assert [type(p) for p in got] == [Point] * 3  # the master's own class, not a copy
    assert [p.x for p in got] == [3, 2, 2]


@pytest.mark.parametrize("op, each", [("sum", 2 ** 62), ("prod", 2 ** 40), ("sum", 2 ** 63)])
def test_python_ints_that_leave_int64_raise_rather_than_wrap(group, op, each):
    """Python's ints do not wrap; synk combines them as int64, so a sum or product past its
    range (or an int past it to begin with) raises OverflowError, never a wrapped number."""
    f = synk.function(lambda x: each, reduce=op)
    with pytest.raises(OverflowError, match="past the range of int64"):
        f(np.zeros((3, 1)))
    with pytest.raises(OverflowError, match="past the range of int64"):
        f(np.zeros((6, 1)), num_slices=2)
    small = synk.function(lambda x: 2 ** 20, reduce=op)(np.zeros((3, 1)))
    assert small == (3 * 2 ** 20 if op == "sum" else 2 ** 60) and type(small) is int


def test_python_ints_in_synk_comm_raise_rather_than_wrap(group):
    def fn(arg):
        out = {}
        for name, value, op in (("sum", 2 ** 62, "sum"), ("prod", 2 ** 40, "prod"),
                                ("beyond", 2 ** 64, "max"), ("fine", 2 ** 31, "sum")):
            try:
                out[name] = synk.comm.allreduce(value, op)
            except OverflowError as err:
                out[name] = f"OverflowError: {err}"
        return out

    for got in synk.function(fn, bcast_inputs=["arg"], reduce=None)(0):
        assert got["sum"].startswith("OverflowError") and "int64" in got["sum"]
        assert got["prod"].startswith("OverflowError")
        assert got["beyond"].startswith("OverflowError")
        assert got["fine"] == 3 * 2 ** 31 and type(got["fine"]) is int
