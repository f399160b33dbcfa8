"""synk's many-host code from the inside: how fork() tells an MPI launch (the launcher's
variables read as a table; fork() under a real launcher is test_mpi.py's) and the pure parts
of the many-host code (hosts, the rows a host reads, the names of mirrored blocks), checked
here on their own without mpiexec; and MPI jobs with pretend hosts (see mpirun.py) that read
where MPI put the ranks, which way large outputs were combined (MPI's Reduce where its op
gives numpy's answer, else gathered and combined by numpy: every reduce op and dtype family
against numpy's fold in rank order, bit for bit), the plans sent for them, and what went over
the control channel rather than MPI.

It reaches synk's internals (``synk._testing``) because none of these has a public handle:
the hosts synk found, its plans and the ways it combined outputs are its own records; the
results of the same calls are checked through the public API in test_mpi.py."""
import subprocess
import sys

import mpirun
import numpy as np
import pytest

import synk
from synk._testing import (
    Hosts,
    mirror_name,
    rows_of_runs as _rows,
    runs_of_ranks as _runs,
    settings as _settings,
)

# ================================================ the pure parts
_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
                "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "PMIX_RANK", "PMI_RANK", "SYNK_MPI")


@pytest.fixture
def clean_env(monkeypatch):
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, ("OMPI_COMM_WORLD_SIZE", 4)),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"PMI_SIZE": "3"}, ("PMI_SIZE", 3)),
    ({"SLURM_STEP_NUM_TASKS": "8"}, None),  # a batch script's environment, not a step's task
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "2"}, ("SLURM_STEP_NUM_TASKS", 8)),
    ({"PMIX_RANK": "0"}, ("PMIX_RANK", None)),  # PMIx (srun --mpi=pmix): ask MPI the size
])
def test_the_launcher_is_told_by_its_environment(clean_env, env, expected):
    for var, value in env.items():
        clean_env.setenv(var, value)
    assert _settings.mpi_launcher() == expected


def test_synk_mpi_0_turns_detection_off(tmp_path):
    """Under a launcher's variables, SYNK_MPI=0 forks a group of this process's own, without
    mpi4py (which fork() would otherwise import, and raise: "one of 4 tasks")."""
    import mpirun

    out = _python("import sys, synk\n"
                  "synk.fork(2)\n"
                  "assert synk.function(lambda x: x.sum(), reduce='sum')([1.0, 2.0]) == 3\n"
                  "synk.close()\n"
                  "print('mpi4py' in sys.modules)\n",
                  {"OMPI_COMM_WORLD_SIZE": "4", "SYNK_MPI": "0", **mpirun.job_files(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_bad_synk_mpi_value_is_refused(clean_env):
    clean_env.setenv("SYNK_MPI", "yes")
    with pytest.raises(ValueError, match="SYNK_MPI='yes' is not valid"):
        synk.fork(2)
    assert synk.size() == 1  # no group started


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(full, **env))


def test_without_a_launcher_mpi4py_is_not_imported(tmp_path):
    out = _python("import sys, synk\n"
                  "synk.fork(2)\n"
                  "assert synk.function(lambda x: x.sum(), reduce='sum')([1.0, 2.0]) == 3\n"
                  "synk.close()\n"
                  "print('mpi4py' in sys.modules)\n", {})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_launcher_without_an_mpi_world_is_a_clear_error(tmp_path):
    """srun -n 8 without --mpi=pmix: every task is a world of one. (Open MPI started as a
    singleton leaves its sm_segment file behind even after MPI_Finalize: in tmp_path.)"""
    pytest.importorskip("mpi4py")
    import mpirun

    out = _python("import synk\n"
                  "try:\n"
                  "    synk.fork(2)\n"
                  "except synk.SynkError as err:\n"
                  "    print(err)\n", {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0",
                                       **mpirun.job_files(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "one of 4 tasks" in out.stdout and "srun --mpi=pmix" in out.stdout, out.stdout


def test_hosts_are_numbered_by_their_first_rank():
    hosts = Hosts.from_keys([(("id", "x"), "x"), (("id", "y"), "y"), (("id", "x"), "x"),
                             (("node", 3), "n3")])
    assert hosts.of_rank == (0, 1, 0, 2) and hosts.labels == ("x", "y", "n3")
    assert hosts.ranks(0) == [0, 2] and hosts.leader(1) == 1
    assert hosts.label(3) == "n3"
    assert hosts.describe() == "host 'x': ranks [0, 2]; host 'y': ranks [1]; host 'n3': ranks [3]"


def test_the_rows_a_host_reads():
    bounds = (0, 3, 6, 8, 10)  # 4 ranks
    assert _runs(bounds, [1, 2]) == [(3, 8)]  # adjacent ranks: one run
    assert _runs(bounds, [0, 2]) == [(0, 3), (6, 8)]
    assert _runs((0, 2, 2, 4), [1]) == []  # a rank with no rows
    x = np.arange(40).reshape(20, 2)
    for selection in (None, (2, 3), np.array([7, 1, 1, 19, 0, 4, 4, 5, 9, 2])):
        for a, b in ((0, 3), (3, 5), (5, 5)):
            rows = _rows(selection, a, b)
            if selection is None:
                want = x[a:b]
            elif isinstance(selection, tuple):
                want = x[selection[0] + a * selection[1]:selection[0] + b * selection[1]:
                         selection[1]]
            else:
                want = x[selection[a:b]]
            assert np.array_equal(x[rows], want)


def test_a_mirror_name_is_the_same_on_every_rank_and_under_the_leaders_prefix():
    a = mirror_name("synk-1-aaaa-", "synk-9-bbbb-d1-cccc")
    assert a == mirror_name("synk-1-aaaa-", "synk-9-bbbb-d1-cccc")
    assert a.startswith("synk-1-aaaa-m") and a != mirror_name("synk-1-aaaa-", "synk-9-x")


# ================================================ across pretend hosts (from test_mpi.py)
# (no public handle: where MPI put the ranks, and a request of synk's own sent to them)
# (no public handle: where MPI put the ranks, and a request of synk's own sent to them)
CALLS = """
from synk import _testing
print("HOSTS", _testing.group_hosts().describe(), flush=True)
assert _testing.group_hosts().count > 1, "expected ranks on another host"
rng = np.random.default_rng(0)
TOL = dict(rtol=1e-6, atol=1e-9)


def stats(x, y):
    z = x @ y
    return z.mean(axis=0), z.sum(axis=0), np.prod(np.tanh(z[:, :1]) + 1.5, axis=0), \\
        z.max(axis=0), z.min(axis=0), z, float(len(x))


def expected(x, y):
    z = x @ y
    return [z.mean(axis=0), z.sum(axis=0), np.prod(np.tanh(z[:, :1]) + 1.5, axis=0),
            z.max(axis=0), z.min(axis=0), z]


ops = ("mean", "sum", "prod", "max", "min", "gather", None)
f = synk.function(stats, bcast_inputs=["y"], reduce=ops)
x_np = rng.standard_normal((203, 7))
y_np = rng.standard_normal((7, 3))
x_data = synk.data(x_np)
big = rng.standard_normal((7, 40000))  # a broadcast input large enough to be staged
mask = rng.random(203) < 0.4
batches = [None, 50, 7, slice(3, 180, 4), slice(None), rng.permutation(203)[:77],
           np.array([5, 5, 200, -1, 0]), mask]
for x in (x_np, x_data):
    for batch in batches:
        for num_slices in (1, 3):
            sel = x_np if batch is None else (
                x_np[:batch] if isinstance(batch, int) else x_np[batch])
            got = f(x, y_np, batch=batch, num_slices=num_slices)
            if len(sel) == 0:
                continue
            for i, want in enumerate(expected(sel, y_np)):
                assert np.allclose(got[i], want, **TOL), (i, batch, num_slices, got[i], want)
            per_rank = got[6]
            assert len(per_rank) == n
            rows = [r for r in per_rank if r is not None]
            assert sum(sum(r) if isinstance(r, list) else r for r in rows) == len(sel)
# a large broadcast input (staged, copied whole to the other host) and large outputs
g = synk.function(lambda x, w: x @ w, bcast_inputs=["w"], reduce="gather")
assert np.allclose(g(x_data, big), x_np @ big)
s = synk.function(lambda x, w: (x @ w).sum(axis=0), bcast_inputs=["w"], reduce="sum")
assert np.allclose(s(x_np, big), (x_np @ big).sum(axis=0))
# the Data changes between calls: each call sees the new rows
x_data.set_value(x_np[::-1].copy())
assert np.allclose(g(x_data, big), x_np[::-1] @ big)
x_data.resize((300, 7))
assert np.allclose(g(x_data, big)[:203], x_np[::-1] @ big)
# a Data written in place by the master between calls: the other hosts' rows follow
x_data[:] = 1.0
assert np.allclose(g(x_data, big), np.ones((300, 7)) @ big)
try:  # a write the version would not count is refused: the other hosts keep copies
    x_data.array[:] = 2.0
    raise AssertionError("the master wrote a Data that other hosts keep copies of")
except ValueError as err:
    assert "read-only" in str(err)
x_data.touch()  # (nothing changed: touch() only makes the next call send the rows again)
assert np.allclose(g(x_data, big), np.ones((300, 7)) @ big)
print("CALLS OK", flush=True)
synk.close()
"""


@pytest.mark.parametrize("hosts", [("a", "a", "b", "b"), ("a", "b", "a", "c")],
                         ids=["2 hosts", "3 hosts, interleaved"])
def test_every_op_and_batch_form_across_hosts(tmp_path, hosts):
    run = mpirun.run(tmp_path, CALLS, hosts=hosts)
    assert run.rc == 0 and "CALLS OK" in run.out, run
    assert "'b': ranks" in run.out, run


BULK = """
import pickle
from synk import _testing
from synk._testing import protocol as P

group, fills = _testing.running_group(), []
send = group.send


def watching(ranks, payload, *args, **kwargs):  # the size of every FILL on the control channel
    message = pickle.loads(payload)
    if message[0] == P.FILL:
        fills.append(len(payload))
    return send(ranks, payload, *args, **kwargs)


group.send = watching
f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
x = np.random.default_rng(3).standard_normal((1 << 15, 64))  # 16 MiB: 8 MiB per host
assert np.allclose(f(x), x.sum(axis=0))
small = x[:200]  # 100 KiB, staged; each host's rows (48 KiB) go inside its FILL
assert np.allclose(f(small, batch=np.arange(190)), small[:190].sum(axis=0))
print("FILLS", fills, flush=True)
assert len(fills) == 2 and fills[0] < 4096 < fills[1] < 64 << 10, fills
print("BULK OK", flush=True)
"""


def test_large_rows_for_another_host_go_over_mpi_not_the_control_channel(tmp_path):
    """The FILL that tells a host's leader its rows carries 8 MiB of them by MPI, itself
    a few hundred bytes (it carried the 8 MiB itself before); small rows stay inside it."""
    run = mpirun.run(tmp_path, BULK)
    assert run.rc == 0 and "BULK OK" in run.out, run


def test_one_host_under_mpiexec(tmp_path):
    """Without SYNK_HOST_ID the ranks share this machine: one host, blocks mapped by name,
    the parallel output phase from 5 ranks on."""
    body = """
from synk import _testing
assert _testing.group_hosts().count == 1
x = synk.data(np.random.default_rng(2).standard_normal((1000, 300)))
s = synk.function(lambda x: x[:100] * 1.0, reduce="sum")  # 240 KB per rank: shared memory
want = sum(x.array[b:b + 100] for b in np.cumsum([0] + [len(p) for p in
           np.array_split(np.arange(1000), n)])[:-1])
assert np.allclose(s(x), want)
print("ONE HOST OK", flush=True)
"""
    run = mpirun.run(tmp_path, body, hosts=(None,) * 5)
    assert run.rc == 0 and "ONE HOST OK" in run.out, run


# ================================================ large outputs combined by MPI's collectives
# (every reduce op and dtype family against numpy's fold in rank
# order, bit for bit (a mean in the data's dtype within its documented bound), with uneven
# rows, ranks without rows, mixed dtypes, several ranks per host and one per host; and which
# way each went. Faults in the middle of them are in test_mpi_faults.)
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
    # numpy's answer: the parts in rank order, in numpy's promotion (as docs/api/calls.md)
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
    # scaled terms' magnitudes of float64 numpy's mean (docs/api/calls.md, "How mean is computed")
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

# exact_mean's rule: float64 terms; large values that cancel, every dtype (docs/api/calls.md);
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
