"""Property test: any row count, batch and num_slices give numpy's answer for every op."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import synk

OPS = {
    "sum": (lambda x: x.sum(axis=0), lambda x: x.sum(axis=0)),
    "mean": (lambda x: x.mean(axis=0), lambda x: x.mean(axis=0)),
    "max": (lambda x: x.max(axis=0, initial=-np.inf), lambda x: x.max(axis=0, initial=-np.inf)),
    "min": (lambda x: x.min(axis=0, initial=np.inf), lambda x: x.min(axis=0, initial=np.inf)),
    "gather": (lambda x: x * 2, lambda x: x * 2),
}


@st.composite
def calls(draw):
    n_rows = draw(st.integers(0, 40))
    cols = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    kind = draw(st.sampled_from(["none", "int", "slice", "index"]))
    if kind == "none":
        batch = None
    elif kind == "int":
        batch = draw(st.integers(0, n_rows))
    elif kind == "slice":
        start = draw(st.none() | st.integers(-n_rows - 2, n_rows + 2))
        stop = draw(st.none() | st.integers(-n_rows - 2, n_rows + 2))
        batch = slice(start, stop, draw(st.integers(1, 4)))
    else:
        batch = draw(st.lists(st.integers(0, max(n_rows - 1, 0)), max_size=30)) if n_rows else []
        batch = np.array(batch, dtype=np.int64)
    return n_rows, cols, seed, batch, draw(st.sampled_from(sorted(OPS))), draw(st.integers(1, 4))


@pytest.fixture(scope="module")
def functions():
    return {op: synk.function(fn, reduce=op) for op, (fn, _) in OPS.items()}


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls())
def test_matches_numpy(ranks3, functions, case):
    n_rows, cols, seed, batch, op, num_slices = case
    x = np.random.default_rng(seed).standard_normal((n_rows, cols))
    rows = x if batch is None else (x[:batch] if isinstance(batch, int) else x[batch])
    if op == "mean" and len(rows) == 0:
        return  # numpy's mean of nothing is nan with a warning; not a useful comparison
    got = functions[op](x, batch=batch, num_slices=num_slices)
    np.testing.assert_allclose(got, OPS[op][1](rows), rtol=1e-12, atol=1e-12)
