"""Ranks that return outputs of different dtypes: one rule on every path and back end —
numpy's promotion over all the ranks' outputs (booleans summed and multiplied as counts),
whichever rank returned which dtype and whatever the output's size (inline, shared memory,
combined in parallel), on CPU ranks and on (simulated) GPU ranks."""
import functools

import numpy as np
import pytest
from conftest import check_every

import synk


def _outputs(n_cols, bool_rank):
    """Each rank's output: ``bool_rank``'s a bool array, the others' int8 (values near the
    top of int8, so that the dtype decides the value)."""
    outs = []
    for r in range(3):
        if r == bool_rank:
            outs.append(np.ones(n_cols, bool))
        else:
            outs.append(np.full(n_cols, 100, np.int8))
    return outs


def _want(op, outs):
    dtype = np.result_type(*[o.dtype for o in outs])
    dtype = np.dtype(np.int_) if dtype.kind == "b" and op in ("sum", "prod") else dtype
    ufunc = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}[op]
    with np.errstate(all="ignore"):
        return functools.reduce(ufunc, [o.astype(dtype) for o in outs])


@pytest.mark.parametrize("n_cols", [4, 200_000])  # inline, and through shared memory
def test_mixed_output_dtypes_follow_one_rule(three, n_cols):
    check_every([(op, bool_rank, n_cols) for op in ["sum", "prod", "max", "min"]
                 for bool_rank in [0, 1, None]], _mixed_outputs)


def _mixed_outputs(op, bool_rank, n_cols):
    outs = _outputs(n_cols, bool_rank)
    if bool_rank is None:  # every rank a bool: counts
        outs = [np.ones(n_cols, bool)] * 3

    def fn(x, outs):
        xp = synk.xp(x)
        return xp.asarray(outs[synk.comm.rank()])

    got = synk.function(fn, bcast_inputs=["outs"], reduce=op)(np.ones(3), outs)
    want = _want(op, outs)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    np.testing.assert_array_equal(got, want)


def test_mixed_slice_dtypes_follow_the_same_rule(three):
    """The pieces of ``num_slices`` combine by the same rule on a rank, then the ranks."""
    def fn(x):
        total = x.sum(axis=0)
        return total > 0 if float(x[0, 0]) == 0 else (total * 50).astype("int8")

    x = np.ones((12, 2))
    x[::4] = 0  # each rank's first piece starts with a 0 row: bool; its second int8
    got = synk.function(fn, reduce="sum")(x, num_slices=2)
    assert got.dtype == np.dtype(np.int8)
    with np.errstate(all="ignore"):
        want = np.int8(3) * np.int8(1) + np.int8(3) * np.int8(100)
    np.testing.assert_array_equal(got, [want, want])
