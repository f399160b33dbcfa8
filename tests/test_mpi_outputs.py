"""Large outputs combined by MPI's own collectives across pretend hosts (``_call.mpi_collect``):
every reduce op and dtype family against numpy's fold in rank order, bit for bit (a mean in
the data's dtype within its documented bound), with
uneven rows, ranks without rows, mixed dtypes, several ranks per host and one per host; and
which way each went (MPI's Reduce where its op gives numpy's answer, else gathered and
combined by numpy). Faults in the middle of them are in test_mpi_faults."""
import mpirun
import pytest

# Values that every order of adding or multiplying gives exactly (small integers, NaN and
# signed zeros where max/min must follow numpy), so that MPI's order of the terms cannot hide
# a wrong answer behind a tolerance.
# (no public handle: which way MPI combined a large output, and the plans sent for it)
OUTPUTS = """
from synk import _testing

K = 3000  # elements per output: past SYNK_INLINE_OUTPUT_BYTES (1024) for every dtype
DTYPES = ["bool", "int8", "uint16", "int32", "int64", "float16", "float32", "float64",
          "complex64", "complex128"]
ARRAY_OPS = ["sum", "prod", "max", "min", "mean", "exact_mean", "band", "bor", "bxor", "land",
             "lor", "lxor", "gather"]
UFUNC = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
         "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
         "land": np.logical_and, "lor": np.logical_or, "lxor": np.logical_xor}
CASES = [(d, op) for d in DTYPES for op in ARRAY_OPS
         if not (op in ("band", "bor", "bxor") and np.dtype(d).kind in "fc")]


def value(r, rows, dtype, op):
    # rank r's output of dtype for op (a gather's has rows + 1 rows)
    i = np.arange(K)
    if dtype == "bool":
        v = (i * (r + 2) + r) % 3 == 0
    elif op == "prod":
        v = ((i + r) % 3 - 1) * (1 + (i % 2))  # -2 .. 2: products stay exact
    else:
        v = (i * (r + 3) + r) % 11 - 5  # (unsigned: wraps, and sums wrap as numpy's)
    v = np.asarray(v).astype(dtype)
    if np.dtype(dtype).kind == "f" and op in ("max", "min"):
        v[r::7] = np.nan  # NaN, and zeros of both signs, where ranks meet
        v[3::5] = -0.0 if r % 2 else 0.0
    if np.dtype(dtype).kind == "c":
        v = v + 1j * ((i + r) % 3 - 1)
    if op == "gather":
        v = np.repeat(v[None, :1200], rows + 1, axis=0)  # rows differ by rank
    return v


def make(x):
    r = synk.rank()
    return tuple(value(r, len(x), d, op) for d, op in CASES)


def fold(op, parts):
    # numpy's answer: the parts in rank order, in numpy's promotion (as docs/api.md)
    if op == "gather":
        return np.concatenate(parts)
    if op in ("mean", "exact_mean"):  # (exact_mean's answer; mean's is within its bound)
        dtype = parts[0][1].dtype
        terms = np.array([p[1] for p in parts], np.complex128 if dtype.kind == "c" else float)
        return np.average(terms, axis=0, weights=[p[0] for p in parts]).astype(
            _mean_dtype(dtype))
    dtype = np.result_type(*parts)
    if op in ("sum", "prod") and dtype == bool:
        dtype = np.dtype(np.int_)
    if op in ("land", "lor", "lxor"):
        parts, dtype = [p != 0 for p in parts], np.dtype(bool)
    out = parts[0].astype(dtype)
    for p in parts[1:]:
        out = UFUNC[op](out, p.astype(dtype))
    if op in ("max", "min") and dtype.kind == "f":  # (IEEE's maximum/minimum: docs/index.md)
        signs = np.stack([np.signbit(p.astype(dtype)) for p in parts])
        negative = signs.all(axis=0) if op == "max" else signs.any(axis=0)
        out = np.where(out == 0, np.where(negative, dtype.type(-0.0), dtype.type(0.0)), out)
        out[np.isnan(out)] = np.nan  # (np.nan's bits, whichever NaN the ranks had)
    return out


def _mean_dtype(dtype):
    return dtype if dtype.kind in "fc" else np.dtype(np.float64)


def within_bound(got, parts):
    # a mean in the data's dtype: within (n + 2) eps of the dtype times the sum of the
    # scaled terms' magnitudes of float64 numpy's mean (docs/api.md, "How mean is computed")
    dtype = _mean_dtype(parts[0][1].dtype)
    total = sum(w for w, _ in parts)
    terms = np.array([w / total * np.asarray(v, np.complex128 if dtype.kind == "c" else float)
                      for w, v in parts])
    bound = (len(parts) + 2) * np.finfo(dtype).eps * np.abs(terms).sum(axis=0)
    got = np.asarray(got)
    return got.dtype == dtype and np.all(np.abs(got - terms.sum(axis=0)) <= bound)


def same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    return got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()


f = synk.function(make, reduce=tuple(op for _, op in CASES))
x = np.zeros((10 * n + 3, 1))
for batch, num_slices in ((None, 1), (n - 1, 1), (2 * n + 1, 2)):  # uneven; ranks without rows
    part = x if batch is None else x[:batch]
    rows = {r: len(p) for r, p in enumerate(np.array_split(part, n)) if len(p)}
    got = f(x, batch=batch, num_slices=num_slices)
    for (dtype, op), result in zip(CASES, got):
        if num_slices > 1 and op not in ("max", "min", "band", "bor", "land", "lor", "mean",
                                         "exact_mean"):
            continue  # (these give a rank's one value whatever its pieces)
        if op == "mean":
            parts = [(rows[r], value(r, rows[r], dtype, op)) for r in rows]
            assert within_bound(result, parts), (dtype, op, batch, result)
            continue
        if op == "exact_mean":
            want = fold(op, [(rows[r], value(r, rows[r], dtype, op)) for r in rows])
        else:
            want = fold(op, [value(r, rows[r], dtype, op) for r in rows])
        assert same(result, want), (dtype, op, batch, result, want)
    print("CHECKED", batch, num_slices, flush=True)

ways = _testing.output_ways()
for (dtype, op) in CASES:
    if op == "gather":
        continue
    one = value(0, 1, dtype, op)
    result = fold(op, [(1, one)] if "mean" in op else [one]).dtype
    kind = np.dtype(dtype).kind
    folded = (kind == "f" and dtype != "float16" and op in ("max", "min")) or (
        dtype == "float16" and op in ("sum", "prod", "max", "min")) or (  # (a float16
        # mean's terms travel as float32, which MPI sums)
        kind == "c" and op in ("prod", "max", "min"))
    assert ways[(op, result.str)] == ("fold" if folded else "reduce"), (dtype, op, ways)
assert ways[("gather", np.dtype("float64").str)] == "gather"

# mixed dtypes across ranks: numpy's promotion over every rank's (bool + int8 sum in int8,
# wrapping as numpy's int8 does)
def mixed(x):
    r = synk.rank()
    a = np.full(K, 100, np.int8) if r else np.ones(K, bool)
    b = np.full(K, 1.5, np.float32 if r % 2 else np.float64)
    c = np.full(K, r, np.int16 if r == 1 else np.uint8)
    return a, b, c

a, b, c = synk.function(mixed, reduce=("sum", "max", "bor"))(x)
want_a = np.ones(K, bool).astype(np.int8)
for r in range(1, n):
    want_a = want_a + np.full(K, 100, np.int8)
assert same(a, want_a), (a[:3], want_a[:3])
assert same(b, np.full(K, 1.5)), b.dtype
want_c = np.zeros(K, np.int16)
for r in range(n):
    want_c = want_c | np.full(K, r, np.int16 if r == 1 else np.uint8)
assert same(c, want_c), (c.dtype, want_c.dtype)

# structures: each leaf a large output, combined leaf by leaf
s = synk.function(lambda x: {"g": [np.full(K, synk.rank() + 1.0), np.ones(K, np.int32)]},
                  reduce="sum")(x)
assert same(s["g"][0], np.full(K, n * (n + 1) / 2)) and same(s["g"][1], np.full(K, n, np.int32))

# exact_mean's rule: float64 terms; large values that cancel, every dtype (docs/api.md);
# mean's: in the data's dtype, within its bound
for dtype, big in (("float16", 3e4), ("float32", 3e7), ("float64", 3e15), ("int64", 2**50)):
    vals = [big, 1, -big] + [0] * (n - 3)
    for op in ("exact_mean", "mean"):
        m = synk.function(lambda x, vals, dtype: np.full(K, vals[synk.rank()], dtype),
                          bcast_inputs=["vals", "dtype"], reduce=op)(x, vals, dtype, batch=n)
        if op == "mean":  # (one row each: weights 1)
            assert within_bound(m, [(1, np.full(K, v, dtype)) for v in vals]), (dtype, m[:2])
            continue
        want = np.full(K, np.mean(np.array(vals, np.float64))).astype(
            _mean_dtype(np.dtype(dtype)))
        assert same(m, want), (dtype, m[:2], want[:2])

# an exception on one rank, with large outputs: raised; the group stays usable
def fails(x):
    if synk.rank() == n - 1:
        raise KeyError("no such key")
    return np.ones(K)

try:
    synk.function(fails, reduce="sum")(x)
    raise AssertionError("no error")
except KeyError as err:
    print("RAISED", repr(err), flush=True)
assert same(synk.function(lambda x: np.ones(K), reduce="sum")(x), np.full(K, float(n)))
print("OUTPUTS OK", flush=True)
"""


@pytest.mark.parametrize("hosts", [("a", "a", "b", "b"), ("a", "b", "c"),
                                   ("a", "b", "a", "b", "b")],
                         ids=["2 ranks per host", "1 rank per host", "interleaved, uneven"])
def test_large_outputs_by_mpi_collectives_against_numpy(tmp_path, hosts):
    run = mpirun.run(tmp_path, OUTPUTS, hosts=hosts, timeout=150,
                     env={"SYNK_INLINE_OUTPUT_BYTES": "1024"})
    assert run.rc == 0 and "OUTPUTS OK" in run.out, run.text[-6000:]
    assert "RAISED KeyError('no such key')" in run.out, run


PLANNED = """
import pickle
from synk._testing import protocol as P
from synk import _testing

group, combines = _testing.running_group(), []
send = group.send


def watching(ranks, payload, *args, **kwargs):  # every COMBINE round on the control channels
    if pickle.loads(payload)[0] == P.COMBINE:
        combines.append(len(ranks))
    return send(ranks, payload, *args, **kwargs)


group.send = watching
x = np.arange(float(4 * n)).reshape(4 * n, 1)


def outputs(x, k, fail):
    r = synk.rank()
    if r == fail:
        raise KeyError(f"rank {r} fails")
    return np.full(k, float(len(x) * (r + 1))), np.repeat(x, k // 8, axis=1)


f = synk.function(outputs, bcast_inputs=["k", "fail"], reduce=("sum", "gather"))


def check(k, batch=None, fail=-1):
    part = x if batch is None else x[:batch]
    rows = [len(p) for p in np.array_split(part, n)]
    got = f(x, k, fail, batch=batch)
    want = sum(rows[r] * (r + 1) for r in range(n) if rows[r])
    assert got[0].shape == (k,) and np.all(got[0] == want), (k, batch, got[0][:3], want)
    assert np.array_equal(got[1], np.repeat(part, k // 8, axis=1)), (k, batch)


check(4096)  # no plan yet: one round after the replies
assert combines == [n - 1], combines
for _ in range(3):
    check(4096)  # the same outputs: the plan came with the call
assert combines == [n - 1], combines
check(4096, batch=2 * n + 1)  # other rows: the plan no longer fits, a round again
check(4096, batch=2 * n + 1)
check(8192, batch=2 * n + 1)  # other shapes
check(4096, batch=n - 1)  # a rank without rows
check(4096, batch=n - 1)
check(64)  # small now: in the replies
assert combines == [n - 1] * 4, combines
check(4096)
try:  # a rank fails with the plan out: every rank still runs it, the group stays usable
    check(4096, fail=n - 1)
    raise AssertionError("no error")
except KeyError as err:
    print("RAISED", repr(err), flush=True)
check(4096)
check(4096)
assert combines == [n - 1] * 5, combines

# rank 0 receives a result into an array it handed out before only once nobody holds it
s = synk.function(lambda x: np.full(4096, float(synk.rank() + len(x))), reduce="sum")
address = lambda a: a.__array_interface__["data"][0]  # noqa: E731
kept = s(x)
before = kept.copy()
fresh = s(x[:n])
assert fresh is not kept and np.array_equal(kept, before), "a result held was overwritten"
again = address(fresh)
del fresh
reused = s(x[:n])
assert address(reused) == again, "a result let go was not received into again"
view = reused[:10]
del reused
other = s(x)
assert address(other) != again and np.array_equal(view, np.full(10, n * (n - 1) / 2 + n))
assert np.array_equal(kept, before) and np.array_equal(other, before)
print("PLANNED OK", flush=True)
"""


def test_a_call_like_the_last_runs_its_plan_at_once(tmp_path):
    """A call whose large outputs are as its function's last call's runs that call's plan
    of collectives right after the replies, with no round to agree on one; a call whose
    outputs differ (rows, shapes, a rank without rows, small ones), or in which a rank
    fails, still gives numpy's answer (or the error), and the group goes on."""
    run = mpirun.run(tmp_path, PLANNED, hosts=("a", "a", "b", "b"), timeout=90,
                     env={"SYNK_INLINE_OUTPUT_BYTES": "1024"})
    assert run.rc == 0 and "PLANNED OK" in run.out, run
    assert "RAISED KeyError('rank 3 fails')" in run.out, run
