"""The GPU path against what CuPy 14.2 and NCCL 2.28-2.30.7 do, as their sources read: NaN
under NCCL's max/min, the caller's current stream, ranks whose arrays differ, dtypes CuPy
refuses, the failure path, communicators renewed only when one was aborted, page-locking,
writes into a Data, and what a call costs on the device.
Under the simulator here; for real with CUDA."""

import numpy as np
import pytest
from conftest import REAL, layout_group

import synk

pytestmark = pytest.mark.gpu

RNG = np.random.default_rng(36)
X = RNG.standard_normal((13, 4))


# -- NaN under max and min ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("op", ["max", "min"])
def test_nan_wins_max_and_min_on_the_devices_as_in_numpy(gpus, op, dtype):
    """NCCL's max/min of floats drop NaN (IEEE maxNum); numpy's keep it. A NaN in one rank's
    rows reaches the result, through a function's output (large: combined on NCCL) and
    through synk.comm.allreduce, next to infinities and signed zeros."""
    x = RNG.standard_normal((6 * gpus, 3000)).astype(dtype)
    x[0, 7] = np.nan  # rank 0's rows
    x[-1, 100] = np.nan  # the last rank's
    x[1, 8], x[-2, 9], x[0, 10], x[-1, 10] = np.inf, -np.inf, -0.0, 0.0

    def fn(x):
        xp = synk.xp(x)
        part = getattr(xp, op)(x, axis=0)
        return part, synk.comm.allreduce(part, op)

    got, every = synk.function(fn, reduce=(op, None))(x)
    want = getattr(np, op)(x, axis=0)
    assert got.dtype == dtype and np.isnan(got[7]) and np.isnan(got[100])
    np.testing.assert_array_equal(got, want)
    for mine in every:
        np.testing.assert_array_equal(mine, want)


# -- ranks whose arrays differ --------------------------------------------------------------------
_SHAPES = {"same count": [(2, 6), (6, 2), (4, 3)], "other counts": [(5,), (4,), (4,)]}


@pytest.mark.parametrize("form", ["allreduce", "iallreduce", "reduce_scatter"])
@pytest.mark.parametrize("shapes", list(_SHAPES))
def test_arrays_of_different_shapes_raise_valueerror_on_every_rank(gpus, form, shapes):
    """NCCL checks nothing of the sort: counts that differ hang or overrun, equal counts
    combine unrelated elements. synk.comm raises the documented ValueError on every rank
    before any NCCL operation, and the group stays usable."""
    layout = _SHAPES[shapes]

    def fn(x):
        xp = synk.xp(x)
        y = xp.ones(layout[synk.comm.rank()])
        try:
            if form == "iallreduce":
                synk.comm.iallreduce(y).wait()
            else:
                getattr(synk.comm, form)(y)
        except ValueError as err:
            return str(err)
        return "no error"

    got = synk.function(fn, reduce=None)(X)
    assert all("different shapes" in g and "rank 1: " in g for g in got), got
    total = synk.function(lambda x: synk.comm.allreduce(synk.xp(x).ones(3)), reduce=None)(X)
    assert all(np.array_equal(t, [gpus] * 3) for t in total)


def test_arrays_of_different_dtypes_raise_valueerror_on_every_rank(gpus):
    """Rank 0 passes float32, the others int16: NCCL would sum their bytes as one datatype;
    synk raises on every rank, naming each rank's dtype, as on the host (cast first)."""

    def fn(x):
        xp = synk.xp(x)
        r = synk.comm.rank()
        y = xp.full(5, r + 0.5, xp.float32) if r == 0 else xp.full(5, r, xp.int16)
        try:
            synk.comm.allreduce(y)
        except ValueError as err:
            return str(err)
        return "no error"

    for said in synk.function(fn, reduce=None)(X):
        assert "different shapes" in said and "float32" in said and "int16" in said
    total = synk.function(lambda x: synk.comm.allreduce(synk.xp(x).ones(3)), reduce=None)(X)
    assert all(np.array_equal(t, [gpus] * 3) for t in total)


# -- the caller's current stream ------------------------------------------------------------------
_STREAM_LAYOUTS = {"nccl": (2, 2, {}), "staged": (3, 2, {"SYNK_SIM_NCCL_VERSION": "22809"}),
                   "one rank": (1, 1, {})}


@pytest.mark.parametrize("layout", list(_STREAM_LAYOUTS))
def test_synk_comm_orders_its_work_after_and_before_the_callers_current_stream(
        monkeypatch, layout):
    """A function that computes on a stream of its own (ordered after the rank's stream, as
    CuPy requires) and calls synk.comm inside ``with s:``: every collective reads what s
    computed and s reads what it produced (on a GPU, NCCL ordered after the rank's stream
    alone reads garbage; the simulator reports the race)."""
    n, devices, env = _STREAM_LAYOUTS[layout]
    with layout_group(monkeypatch, n, devices, env):
        def fn(x):
            xp = synk.xp(x)
            main = xp.cuda.get_current_stream()
            s = xp.cuda.Stream(non_blocking=True)
            s.wait_event(main.record())
            with s:
                y = x * 2  # written on s
                total = synk.comm.allreduce(y.sum(axis=0)) + 1  # read on s after NCCL
                fused = synk.comm.allreduce({"a": y[:1], "b": y.sum()}, "max")
                handle = synk.comm.iallreduce(y.sum(axis=0), "min")
                gathered = synk.comm.allgather(y[:1])
                first = synk.comm.broadcast(y[:1] if synk.comm.rank() == 0 else None)
                scattered = synk.comm.reduce_scatter(xp.tile(y.sum(axis=0), synk.comm.size()))
                low = handle.wait() * 1
                if synk.comm.size() > 1:
                    synk.comm.send(y[:1], (synk.comm.rank() + 1) % synk.comm.size())
                    got = synk.comm.recv((synk.comm.rank() - 1) % synk.comm.size()) * 1
                else:
                    got = y[:1] * 1
                outs = (total, fused["a"] * 1, fused["b"] * 1, low, gathered * 1, first * 1,
                        scattered * 1, got)
            main.wait_event(s.record())  # the rank's stream after s, as CuPy requires
            return outs

        parts = np.array_split(X, n)
        sums = [2 * p.sum(axis=0) for p in parts]
        got = synk.function(fn, reduce=None)(X)
        for r in range(n):
            total, a, b, low, gathered, first, scattered, received = (o[r] for o in got)
            np.testing.assert_allclose(total, sum(sums) + 1)
            np.testing.assert_allclose(a, np.max([2 * p[:1] for p in parts], axis=0))
            np.testing.assert_allclose(b, max(s.sum() for s in sums))
            np.testing.assert_allclose(low, np.min(sums, axis=0))
            np.testing.assert_allclose(gathered, np.concatenate([2 * p[:1] for p in parts]))
            np.testing.assert_allclose(first, 2 * parts[0][:1])
            np.testing.assert_allclose(scattered, sum(sums))
            np.testing.assert_allclose(received, 2 * parts[(r - 1) % n][:1])


# -- dtypes CuPy refuses ------------------------------------------------------------------------
def test_inputs_of_dtypes_cupy_refuses_stay_numpy_on_gpu_ranks(two):
    """CuPy 14.2 makes no device array of objects, strings, bytes, datetimes, long doubles,
    nor of a big-endian type (cupy/_core/_dtype.pyx): such inputs reach the function as
    numpy on GPU ranks too (the same answers as CPU ranks), big-endian numbers as device
    arrays in the device's byte order; a resident Data of such a dtype is refused."""
    n = 12
    labels = np.array([f"row{i}" for i in range(n)])
    when = np.arange(n).astype("M8[D]")
    big = np.arange(n, dtype=">f8") / 4
    tags = np.array([b"x", b"yy"])
    names = np.array(["a", {"b": 1}], dtype=object)
    long = np.arange(3, dtype=np.longdouble)

    def fn(labels, when, big, tags, names, long):
        kinds = [type(v).__module__.split(".")[0] for v in (labels, when, tags, names, long)]
        return (kinds, [str(v) for v in labels], int((when - when[0]).astype(int).sum()),
                float(big.sum()), big.dtype.isnative, synk.xp(big) is np, tags[1], names[1],
                float(long.sum()))

    f = synk.function(fn, inputs=["labels", "when", "big"], reduce=None)
    got = f(labels, when, big, tags, names, long)
    parts = np.array_split(np.arange(n), 2)
    for r, (kinds, mine, days, total, native, on_host, tag, name, longs) in enumerate(
            zip(*got)):
        assert kinds == ["numpy"] * 5
        assert mine == [f"row{i}" for i in parts[r]]
        assert days == int(parts[r].sum() - len(parts[r]) * parts[r][0])
        assert total == big[parts[r]].sum() and (native or two == "cpu")
        assert on_host == (two == "cpu")
        assert (tag, name, longs) == (b"yy", {"b": 1}, 3.0)
    d = synk.data(long)
    with pytest.raises(TypeError, match="longdouble|float128"):
        d.to_device()
    d.free()


# -- the failure path ---------------------------------------------------------------------------
def test_a_failed_calls_work_on_the_functions_own_stream_ends_before_the_next_call(gpus):
    """The function reads its rows on a stream of its own, then raises before ordering that
    stream back: its work may still read the rows' memory, which CuPy's pool hands to the
    next call's copies at once. The failure path waits for every stream of the device, so
    the next call gets its rows untouched (the simulator reports the race otherwise)."""

    def fn(x, fail):
        xp = synk.xp(x)
        s = xp.cuda.Stream(non_blocking=True)
        s.wait_event(xp.cuda.get_current_stream().record())
        with s:
            y = x * 2  # reads x on s
        if fail:
            raise KeyError("gives up")
        xp.cuda.get_current_stream().wait_event(s.record())
        return y.sum(axis=0)

    f = synk.function(fn, bcast_inputs=["fail"], reduce="sum")
    with pytest.raises(KeyError, match="gives up"):
        f(X, True)
    for _ in range(2):
        np.testing.assert_allclose(f(X, False), 2 * X.sum(axis=0))


# -- communicators renewed only when one was aborted ---------------------------------------------
def _comm_ids():
    """Every rank's device communicator (the simulator's name of it: its unique id's)."""
    return synk.function(lambda x: synk.simulator.nccl_communicator().name, reduce=None)(X)


def test_communicators_are_renewed_only_after_a_rank_aborted_one(gpus):
    """A call that fails with no communicator aborted (a rank raises before any collective,
    or after the last one, or while the others check a shape new to them over the host)
    keeps every rank's NCCL communicator: renewing them costs a set-up on every rank. One
    aborted (a rank raises while the others wait inside NCCL) renews them all, and the next
    call works."""
    if REAL:
        pytest.skip("reads the communicators' identities")
    before = _comm_ids()

    def early(x):
        if synk.comm.rank() == 1:
            raise KeyError("before any collective")
        return synk.xp(x).ones(2)

    def late(x):
        total = synk.comm.allreduce(x.sum(axis=0))
        synk.comm.barrier()  # (so that no rank is still inside the NCCL one: under load,
        if synk.comm.rank() == gpus - 1:  # one was, now and then, and was rightly aborted)
            raise KeyError("after the last collective")
        return total

    def checking(x):  # (a shape not agreed before: its check runs before the launch)
        if synk.comm.rank() == 1:
            raise KeyError("while the others check shapes")
        return synk.comm.allreduce(x[:, :1].sum(axis=0))

    for fn in (early, late, checking, early):
        with pytest.raises(KeyError):
            synk.function(fn, reduce="sum")(X)
        assert _comm_ids() == before, fn.__name__

    def waits(x):
        if synk.comm.rank() == 1:
            raise KeyError("while the others wait")
        return synk.comm.allgather(x)  # (straight to NCCL: its sizes go by NCCL too)

    with pytest.raises(KeyError, match="while the others wait"):
        synk.function(waits, reduce=None, timeout=60)(X)
    after = _comm_ids()
    assert all(a != b for a, b in zip(after, before))
    got = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None)(X)
    assert all(np.allclose(g, X.sum(axis=0)) for g in got)


# -- writes into a Data --------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["all rows", "batch slice", "num_slices", "batch index"])
def test_writes_into_a_data_land_in_it_on_both_back_ends(two, form):
    """A function writes into its rows of a scattered Data and into a Data broadcast whole
    (each rank its own elements): on CPU ranks the writes land in shared memory at once; on
    GPU ranks the device copies' changed elements are written back when the function
    returns, so the Data ends the same on both. Rows picked by an index are copies on both
    (nothing lands)."""
    n = 2
    d = synk.data(np.zeros((12, 3)))
    out = synk.data(np.zeros(12))
    ids = np.arange(12.0)

    def fn(x, i, out):
        xp = synk.xp(x)
        r = synk.comm.rank()
        x[:, 0] = r + 1  # the rank's rows
        x[1:, 1] += 5  # in place, all but its first row
        out[xp.asarray(i).astype(xp.int64)] = 10 * (r + 1)  # the rank's own elements
        return len(x)

    f = synk.function(fn, inputs=["x", "i"], bcast_inputs=["out"], reduce="sum")
    options = {"all rows": {}, "batch slice": {"batch": slice(2, 10)},
               "num_slices": {"num_slices": 2},
               "batch index": {"batch": np.array([9, 1, 4, 7, 2, 11])}}[form]
    f(d, ids, out, **options)
    picked = np.arange(12)[options.get("batch", slice(None))]
    want, want_out = np.zeros((12, 3)), np.zeros(12)
    for r, rows in enumerate(np.array_split(picked, n)):
        pieces = np.array_split(rows, 2) if form == "num_slices" else [rows]
        want_out[rows] = 10 * (r + 1)
        if form == "batch index":
            continue  # (copies: nothing lands in the Data)
        for p in pieces:
            want[p, 0] = r + 1
            want[p[1:], 1] += 5
    np.testing.assert_array_equal(d.array, want)
    np.testing.assert_array_equal(out.array, want_out)
    d.free()
    out.free()


# -- what a call costs on the device -------------------------------------------------------------
def test_python_number_outputs_cost_no_copy_on_gpu_ranks(gpus):
    """A function returning Python numbers (or numpy scalars): they are combined on the host
    (small on every rank), so a GPU rank copies nothing to its device and back for them,
    nor waits for such a copy; only its rows move (the device layer's counters, which the
    profile shows)."""
    def fn(x):
        return len(x), 2.5 * synk.comm.rank(), np.float32(1.5)

    f = synk.function(fn, reduce=("sum", "max", "mean"), profile=True)
    for num_slices in (1, 2):
        assert f(X, num_slices=num_slices) == (len(X), 2.5 * (gpus - 1), np.float32(1.5))
    rows = [len(p) * X.shape[1] * 8 for p in np.array_split(X, gpus)]
    for r in range(gpus):
        assert f.profile.transfers(r) == {"h2d": 2 * rows[r], "d2h": 0, "net": 0}


def test_a_large_result_lands_in_page_locked_memory(gpus):
    """Rank 0 copies a large combined result (here 2 MiB, gathered) into page-locked memory
    of its own (CuPy's pinned pool): a DMA at the bus's speed, where pageable memory makes
    the driver stage it. The array is the caller's, writable, and stays right."""
    if REAL:
        pytest.skip("reads the simulator's counters")
    from synk import simulator as sim

    x = RNG.standard_normal((4096, 64))  # 2 MiB
    f = synk.function(lambda x: x * 2, reduce="gather")
    f(x)  # (warm)
    before = sim.pinned_transfer_counts()["d2h"]
    got = f(x)
    assert sim.pinned_transfer_counts()["d2h"] - before >= x.nbytes
    np.testing.assert_array_equal(got, x * 2)
    got[0] = 7  # the caller's own
    again = f(x)
    np.testing.assert_array_equal(again, x * 2)
    assert got[0, 0] == 7
