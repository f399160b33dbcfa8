"""Bad input gets a specific exception with a message that says what to do, and the group
stays usable; awkward but valid input simply works (checked against numpy)."""
import os

import numpy as np
import pytest

import synk


def total(x, y):
    return (x * y).sum()


def assert_usable():
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(9)) == 9


# -- wrong arguments -------------------------------------------------------------------------
def test_wrong_number_or_names_of_arguments(ranks2):
    f = synk.function(total, bcast_inputs=["y"], reduce="sum")
    with pytest.raises(TypeError, match=r"total\(x, y\): missing a required argument: 'y'"):
        f(np.ones(4))
    with pytest.raises(TypeError, match="too many positional arguments"):
        f(np.ones(4), 1.0, 2.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'z'"):
        f(np.ones(4), 1.0, z=1.0)
    assert f(np.ones(4), y=2.0) == 8
    assert_usable()


def test_scattered_inputs_of_different_lengths(ranks2):
    f = synk.function(total, reduce="sum")
    with pytest.raises(ValueError, match=r"same length along axis 0, got x: 4, y: 5.*bcast_inputs"):
        f(np.ones(4), np.ones(5))
    assert_usable()


def test_scalar_scattered_input(ranks2):
    with pytest.raises(ValueError,
                       match="'y' is scattered along axis 0 but is a scalar.*bcast_inputs"):
        synk.function(total, reduce="sum")(np.ones(4), 3.0)


# -- batch and num_slices --------------------------------------------------------------------
@pytest.mark.parametrize(
    "batch,exc,message",
    [
        (11, ValueError, r"batch=11 \(the inputs have 10 rows\): 11 rows are out of range; "
                         r"give 0 to 10"),
        (-1, ValueError, r"batch=-1 .*out of range"),
        ([0, 10], IndexError, r"batch=\[0, 10\] .*positions must lie in \[-10, 10\); got "
                              r"min 0, max 10"),
        ([-11], IndexError, r"must lie in \[-10, 10\)"),
        (np.array([0.0, 1.0]), TypeError, r"1-d integer index array or a boolean mask; got "
                                          r"1-d float64"),
        (2.5, TypeError, r"integer index array or a boolean mask; got 0-d float64"),
        (slice(None, None, -1), ValueError, r"negative step; use a positive step"),
        (np.ones(3, bool), ValueError, r"batch=.*: a boolean mask needs 10 entries, got 3"),
        (np.zeros((2, 2), int), TypeError, r"got 2-d int"),
    ],
)
def test_bad_batch(ranks2, batch, exc, message):
    f = synk.function(lambda x: x.sum(), reduce="sum")
    with pytest.raises(exc, match=message):
        f(np.arange(10.0), batch=batch)
    assert_usable()


def test_batch_without_scattered_inputs(ranks2):
    f = synk.function(lambda y: y * 2, bcast_inputs=["y"], reduce="max")
    with pytest.raises(ValueError, match="batch= was given but no input .* is scattered"):
        f(3.0, batch=2)


@pytest.mark.parametrize(
    "num_slices,exc,message",
    [(0, ValueError, "num_slices must be >= 1, got 0"), (-2, ValueError, ">= 1, got -2"),
     (1.5, TypeError, "num_slices must be an int >= 1, not 1.5")],
)
def test_bad_num_slices(ranks2, num_slices, exc, message):
    f = synk.function(lambda x: x.sum(), reduce="sum")
    with pytest.raises(exc, match=message):
        f(np.ones(4), num_slices=num_slices)
    assert_usable()


@pytest.mark.parametrize("timeout", [0, -1, "soon"])
def test_bad_timeout(ranks2, timeout):
    f = synk.function(lambda x: x.sum(), reduce="sum")
    with pytest.raises((ValueError, TypeError),
                       match="timeout must be a positive number of seconds"):
        f(np.ones(4), timeout=timeout)
    with pytest.raises((ValueError, TypeError), match="timeout must be a positive number"):
        synk.function(lambda x: x.sum(), timeout=timeout)
    assert_usable()


# -- reduce ops and outputs ------------------------------------------------------------------
def test_unknown_reduce_op():
    with pytest.raises(ValueError, match=r"unknown reduce op 'median'.*'mean'.*'gather'"):
        synk.function(total, reduce="median")
    with pytest.raises(ValueError, match="unknown reduce op 'bogus'"):
        synk.function(total, reduce=("sum", "bogus"))


def shape_by_rank(x):
    return np.ones(synk.rank() + 1)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("inline", [True, False])
def test_output_shapes_differ_across_ranks(monkeypatch, op, inline):
    if not inline:
        monkeypatch.setenv("SYNK_INLINE_OUTPUT_BYTES", "1")
    synk.fork(3)
    try:
        f = synk.function(shape_by_rank, reduce=op)
        with pytest.raises(
            ValueError,
            match=rf"output 0 of shape_by_rank has different shapes \(rank 0: \(1,\), "
                  rf"rank 1: \(2,\), rank 2: \(3,\)\); "
                  rf"reduce op '{op}' needs the same shape.*'gather'",
        ):
            f(np.ones(6))
        assert_usable()
        assert np.array_equal(synk.function(shape_by_rank, reduce="gather")(np.ones(6)), np.ones(6))
    finally:
        synk.close()


@pytest.mark.parametrize(
    "output,message",
    [
        ("np.array([object()])", "dtype object"),
        ("'text'", "str"),
        ("{'a': [object()]}", "object"),  # (a structure is reduced leaf by leaf)
        ("None", "NoneType"),
    ],
)
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_outputs_that_cannot_be_reduced_as_arrays(ranks2, output, message, op):
    f = synk.function(eval(f"lambda x: {output}"), reduce=op)
    with pytest.raises(TypeError, match=rf"output 0 of .*{message}; "
                                        rf"reduce op '{op}' needs numbers.*reduce=None"):
        f(np.ones(4))
    assert_usable()
    result = synk.function(eval(f"lambda x: {output}"), reduce=None)(np.ones(4))
    assert result is not None or output == "None"


# -- the group and Data ----------------------------------------------------------------------
def test_calling_before_fork_and_after_close():
    f = synk.function(lambda x: x.sum(), reduce="sum")
    with pytest.raises(synk.NotForkedError,
                       match=r"no synk group is running: call synk.fork\(\) before"):
        f(np.ones(4))
    synk.fork(2)
    assert f(np.ones(4)) == 4
    synk.close()
    with pytest.raises(synk.NotForkedError, match=r"synk.fork\(\)"):
        f(np.ones(4))
    with pytest.raises(synk.NotForkedError):
        synk.distribute()


def test_data_after_free(ranks2):
    d = synk.data(np.arange(4.0))
    d.free()
    f = synk.function(lambda x: x.sum(), reduce="sum")
    for use in (lambda: f(d), lambda: d.array, lambda: d[0], lambda: d.set_value(np.ones(4))):
        with pytest.raises(synk.SynkError, match=r"was freed.*make a new one"):
            use()
    d.free()  # freeing twice is fine
    assert_usable()


def test_fork_twice_and_bad_n():
    synk.fork(2)
    try:
        with pytest.raises(synk.SynkError, match=r"already called; call synk.close\(\) first"):
            synk.fork(2)
    finally:
        synk.close()
    for n in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="n must be a positive int"):
            synk.fork(n)


def test_more_ranks_than_cores_is_allowed_with_a_warning():
    n = len(os.sched_getaffinity(0)) + 1  # the cores fork() counts (its docstring)
    with pytest.warns(RuntimeWarning, match="more ranks than the .* CPU cores"):
        synk.fork(n)
    try:
        assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(10)) == 10
    finally:
        synk.close()


# -- awkward input that must simply work -----------------------------------------------------
def row_sums(x):
    return x.sum(axis=1)


def layouts():
    base = np.arange(60.0).reshape(10, 6)
    return {
        "non-contiguous columns": base[:, ::2],
        "fortran order": np.asfortranarray(base),
        "row view": base[2:9],
        "strided rows": base[::3],
        "transposed": np.arange(60.0).reshape(6, 10).T,
        "reversed rows": base[::-1],
    }


@pytest.mark.parametrize("name", list(layouts()))
def test_awkward_layouts_work(ranks3, name):
    x = layouts()[name]
    f = synk.function(row_sums, reduce="gather")
    assert np.array_equal(f(x), x.sum(axis=1))
    d = synk.data(x)
    assert np.array_equal(f(d), x.sum(axis=1))
    assert np.array_equal(f(x, batch=[3, 0, 1]), x[[3, 0, 1]].sum(axis=1))


@pytest.mark.parametrize("rows", [0, 1, 2])
def test_fewer_rows_than_ranks(ranks3, rows):
    x = np.arange(rows * 3.0).reshape(rows, 3)
    assert np.array_equal(synk.function(row_sums, reduce="gather")(x), x.sum(axis=1))
    assert synk.function(lambda x: x.sum(), reduce="sum")(x) == x.sum()
    if rows:
        assert np.isclose(synk.function(lambda x: x.mean(), reduce="mean")(x), x.mean())
        assert synk.function(lambda x: x.max(), reduce="max")(x) == x.max()


def test_zero_row_batch(ranks3):
    f = synk.function(lambda x: x.sum(), reduce="sum")
    assert f(np.ones(5), batch=[]) == 0
    assert f(np.ones(5), batch=0) == 0


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod", "gather"])
def test_zero_d_and_empty_outputs(ranks3, op):
    x = np.arange(9.0)
    zero_d = synk.function(lambda x: np.float32(x.size), reduce=op)(x)
    assert np.ndim(zero_d) == (1 if op == "gather" else 0)
    empty = synk.function(lambda x: np.zeros((0, 4)), reduce=op)(x)
    assert empty.shape == (0, 4)


# -- inputs written in place ---------------------------------------------------------------
def _notes(exc) -> str:
    return " ".join(getattr(exc, "__notes__", []))


@pytest.mark.parametrize("rows", [10, 20_000])  # travels in the message / staged in shared memory
@pytest.mark.parametrize("kind", ["bcast", "scattered"])
def test_plain_numpy_inputs_are_read_only_on_every_rank(ranks3, rows, kind):
    y = np.arange(rows, dtype=float)
    original = y.copy()

    def writes(x, y):
        if synk.rank() == 1:
            y += 1  # rank 1 only: the others must still see the master's value
        return x.sum()

    f = synk.function(writes, bcast_inputs=["y"] if kind == "bcast" else (), reduce="sum")
    with pytest.raises(ValueError, match="read-only") as info:
        f(np.ones(rows), y)
    assert "synk.Data" in _notes(info.value) and "x.copy()" in _notes(info.value)

    def writes_everywhere(x, y):
        y[...] = -1
        return x.sum()

    f = synk.function(writes_everywhere, bcast_inputs=["y"] if kind == "bcast" else (),
                      reduce="sum")
    with pytest.raises(ValueError, match="read-only"):
        f(np.ones(rows), y)
    assert (y == original).all()  # the master's own share did not write the caller's array

    def sees(x, y):  # every rank sees the master's value, whatever the call before did
        return float(y.sum())

    g = synk.function(sees, bcast_inputs=["y"], reduce=None)
    assert g(np.ones(6), y) == [original.sum()] * 3
    assert_usable()


def test_a_data_input_stays_writable_shared_memory(ranks3):
    d = synk.data(np.zeros(6))

    def writes(x, d):
        d[synk.rank()] = synk.rank() + 1  # a Data is shared on purpose
        return x.sum()

    synk.function(writes, bcast_inputs=["d"], reduce="sum")(np.ones(6), d)
    assert d.array.tolist() == [1, 2, 3, 0, 0, 0]


# -- records (structured dtypes) keep their fields ------------------------------------------
RECORD = np.dtype([("a", "f8"), ("b", "i4", (2,))])
NESTED = np.dtype([("p", RECORD), ("c", "U3"), ("d", "f4")])


def _records(dtype, rows):
    x = np.zeros(rows, dtype)
    raw = x.view(np.uint8).reshape(rows, -1)
    raw[...] = np.random.default_rng(rows).integers(0, 255, raw.shape, dtype=np.uint8)
    if "c" in dtype.names:
        x["c"] = np.array([str(i % 1000) for i in range(rows)])
    return x


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("rows", [7, 20_000])
@pytest.mark.parametrize("dtype", [RECORD, NESTED], ids=["record", "nested"])
def test_records_keep_their_fields_through_inputs_outputs_and_data(ranks3, dtype, rows):
    x = _records(dtype, rows)
    echo = synk.function(lambda x: x, reduce="gather")
    assert _same(echo(x), x)  # staged input, gathered output (inline and shared memory)
    assert _same(echo(synk.data(x)), x)  # Data
    assert _same(echo(x, batch=np.arange(rows)[::-2]), x[::-2])

    expected = x.copy()

    def fields(x, y):  # a broadcast record array, inline or staged
        return y.dtype.names, _same(y, expected)

    names, same = synk.function(fields, bcast_inputs=["y"], reduce=None)(x, x)
    assert names == [dtype.names] * 3 and same == [True] * 3

    d = synk.data(x)
    d.set_value(x[::-1].copy())
    assert _same(echo(d), x[::-1])


@pytest.mark.parametrize("rows", [7, 20_000])  # socket and shared-memory messages
def test_records_keep_their_fields_through_synk_comm(ranks3, rows):
    x = _records(NESTED, rows)

    def exchange(x, whole):
        got = synk.comm.allgather(x)
        root = synk.comm.broadcast(whole if synk.comm.rank() == 0 else None)
        peer = (synk.comm.rank() + 1) % synk.comm.size()
        synk.comm.send(x, peer)
        came = synk.comm.recv((synk.comm.rank() - 1) % synk.comm.size())
        return _same(got, whole), _same(root, whole), came.dtype == whole.dtype

    assert synk.function(exchange, bcast_inputs=["whole"], reduce=None)(x, x) == (
        [True] * 3, [True] * 3, [True] * 3)


# -- error messages that name the right cause ---------------------------------------------
def test_a_shared_variable_captured_in_a_closure_is_refused_clearly(ranks2):
    v = synk.shared(np.ones(3))
    f = synk.function(lambda x: x.sum() + v.sum(), reduce="sum")
    with pytest.raises(TypeError,
                       match="shared variable 'shared.*directly as an argument.*closure"):
        f(np.ones(4))
    nested = synk.function(lambda x, vs: x.sum() + vs[0].sum(), bcast_inputs=["vs"], reduce="sum")
    with pytest.raises(TypeError, match="directly as an argument.*inside a list"):
        nested(np.ones(4), [v])
    assert_usable()


@pytest.mark.parametrize("collective", ["broadcast", "scatter"])
def test_one_variable_with_a_one_element_list_means_that_value(ranks3, collective):
    value = np.arange(6.0)
    v, w = synk.shared(np.zeros(6)), synk.shared(np.zeros(6))
    getattr(synk, collective)(v, [value])
    getattr(synk, collective)([w], [value])
    assert synk.shared_gather(v).tolist() == synk.shared_gather(w).tolist()
    with pytest.raises(ValueError, match="2 variables but 1 values"):
        getattr(synk, collective)([v, w], [value])


@pytest.mark.parametrize("name, value", [
    ("SYNK_SPIN_US", "inf"), ("SYNK_SPIN_US", "-1"), ("SYNK_SPIN_US", "fast"),
    ("SYNK_INLINE_OUTPUT_BYTES", "-5"), ("SYNK_INLINE_OUTPUT_BYTES", "1.5"),
    ("SYNK_PARALLEL_REDUCE_RANKS", "1"), ("SYNK_PARALLEL_REDUCE_RANKS", "nan"),
])
def test_bad_tuning_variables_are_refused_at_fork_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}={value!r} is not valid: it must be .* from"):
        synk.fork(2)
    monkeypatch.delenv(name)
    synk.fork(2)
    assert_usable()
    synk.close()


def test_num_slices_far_above_the_rows_costs_nothing(ranks2):
    x = np.arange(10.0)
    f = synk.function(lambda x: x.sum(), reduce="sum")
    assert f(x, num_slices=10**12) == x.sum()
    g = synk.function(lambda x: x, reduce="gather")
    assert g(x, num_slices=10**12).tolist() == x.tolist()
