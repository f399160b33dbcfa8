"""Patterns that users of MPI, NCCL and torch.distributed bring to ``synk.comm``, ported from
those libraries' own test suites, on CPU ranks (3 and 4) and simulated GPUs (2 ranks on 2
devices, 4 ranks on 2), checked against numpy."""
import numpy as np
import pytest
from conftest import PEER_LAYOUTS, layout_group, leaves as tree_leaves

import synk

LAYOUTS = PEER_LAYOUTS


@pytest.fixture(params=list(LAYOUTS))
def group(request, monkeypatch):
    with layout_group(monkeypatch, *LAYOUTS[request.param]) as n:
        yield n


def _many_in_flight(marker, count, listed):
    """torch's ``allreduce_stress``: ``count`` non-blocking allreduces started before any is
    waited, then waited in order."""
    xp = synk.xp(marker)
    r = synk.comm.rank()
    if listed:  # the coalesced form: a list of arrays in each
        handles = [synk.comm.iallreduce([xp.full(3, float(r + i)), xp.arange(2) + i], "sum")
                   for i in range(count)]
        return [float(h.wait()[0][0]) + float(h.wait()[1][1]) for h in handles]
    handles = [synk.comm.iallreduce(xp.full(3, float(r + i)), "sum") for i in range(count)]
    return [float(h.wait()[0]) for h in handles]


@pytest.mark.parametrize("listed", [False, True], ids=["arrays", "lists"])
def test_a_thousand_non_blocking_allreduces_in_flight(group, listed):
    n, count = group, 1000
    f = synk.function(_many_in_flight, bcast_inputs=["marker", "count", "listed"],
                      reduce=None, timeout=120)
    want = [sum(r + i for r in range(n)) + (n * (1 + i) if listed else 0)
            for i in range(count)]
    for got in f(np.zeros(1), count, listed):
        assert got == want


def _rooted(marker):
    """Rooted collectives inside a function, blocking and not, with uneven lengths."""
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    root = n - 1
    x = xp.arange(6.0).reshape(3, 2) * (r + 1)
    rows = xp.arange(2 * r, dtype=xp.int32).reshape(r, 2)  # r rows: rank 0 has none
    chunks = [xp.full((p + 1, 2), float(p)) for p in range(n)] if r == root else None
    out = {
        "reduce": synk.comm.reduce(x, "sum", root=root),
        "ireduce max": synk.comm.ireduce(x, "max", root=0).wait(),
        "reduce mean weighted": synk.comm.reduce(x, "mean", root=root, weight=r + 1),
        "reduce number": synk.comm.reduce(r + 1, "prod", root=root),
        "gather": synk.comm.gather(rows, root=root),
        "igather": synk.comm.igather(x[:1] + r, root=0).wait(),
        "scatter": synk.comm.scatter(chunks, root=root),
        "iscatter": synk.comm.iscatter(chunks, root=root).wait(),
    }
    kinds = {k: type(v).__name__ if v is None or isinstance(v, int) else
             "where x is" if synk.xp(v) is xp else "moved" for k, v in out.items()}
    host = {k: (None if v is None else v if isinstance(v, int) else
                np.asarray(v.get() if hasattr(v, "get") else v)) for k, v in out.items()}
    return host, kinds


def test_rooted_collectives_inside_functions(group):
    n = group
    f = synk.function(_rooted, bcast_inputs=["marker"], reduce=None)
    hosts, kinds_of = f(np.zeros(1))  # (two outputs, each a list of every rank's)
    x = [np.arange(6.0).reshape(3, 2) * (r + 1) for r in range(n)]
    w = np.arange(1, n + 1, dtype=np.float64)
    on_root = {
        "reduce": (n - 1, sum(x)),
        "ireduce max": (0, np.max(x, axis=0)),
        "reduce mean weighted": (n - 1, np.average(np.array(x), axis=0, weights=w)),
        "reduce number": (n - 1, int(np.prod(np.arange(1, n + 1)))),
        "gather": (n - 1, np.concatenate([np.arange(2 * r, dtype=np.int32).reshape(r, 2)
                                          for r in range(n)])),
        "igather": (0, np.concatenate([x[r][:1] + r for r in range(n)])),
    }
    for r, (got, kinds) in enumerate(zip(hosts, kinds_of)):
        for name, (root, want) in on_root.items():
            if r != root:
                assert got[name] is None, (name, r)
                continue
            if name == "reduce mean weighted":  # a mean in float64: a few ulps off numpy's
                np.testing.assert_allclose(got[name], want, rtol=(n + 2) * 2.0**-52,
                                           err_msg=name)
            else:
                np.testing.assert_array_equal(got[name], want, err_msg=name)
            assert np.asarray(got[name]).dtype == np.asarray(want).dtype, name
        assert kinds["reduce number"] == ("int" if r == n - 1 else "NoneType")
        for name in ("scatter", "iscatter"):
            np.testing.assert_array_equal(got[name], np.full((r + 1, 2), float(r)))
        # device arrays stay device arrays on GPU ranks, numpy ones numpy arrays
        assert set(kinds.values()) <= {"where x is", "NoneType", "int"}, kinds


def _objects(arg):
    r, n = synk.comm.rank(), synk.comm.size()
    mine = {"rank": r, "shape": (r, 2), "name": "r" * r}
    return (synk.comm.broadcast_object(mine if r == 1 else None, root=1),
            synk.comm.allgather_object(mine),
            synk.comm.gather_object(mine, root=0),
            synk.comm.scatter_object([{"to": p} for p in range(n)] if r == 0 else None,
                                     root=0))


def test_python_objects(group):
    n = group
    everyone = [{"rank": r, "shape": (r, 2), "name": "r" * r} for r in range(n)]
    outputs = synk.function(_objects, reduce=None)(np.zeros(n))  # (each a list per rank)
    for r, (bcast, allgathered, gathered, scattered) in enumerate(zip(*outputs)):
        assert bcast == everyone[1]
        assert allgathered == everyone
        assert gathered == (everyone if r == 0 else None)
        assert scattered == {"to": r}


def _mismatch(marker, what):
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    try:
        if what == "reduce":
            synk.comm.reduce(xp.ones(3 + (r == 1)), "sum", root=0)
        elif what == "gather":
            synk.comm.gather(xp.ones((2, 2 + (r == 1))), root=0)
        elif what == "root":
            synk.comm.reduce(xp.ones(3), "sum", root=7)
        elif what == "weight":
            synk.comm.reduce(xp.ones(3), "mean", weight=1 if r else None)
        elif what == "counts differ":
            counts = [2] + [1] * (n - 1) if r else [1] * (n - 1) + [2]  # each n + 1
            synk.comm.reduce_scatter(xp.ones((n + 1, 2)), counts=counts)
        elif what == "forms differ":
            synk.comm.alltoall(xp.ones(n) if r else [xp.ones(1)] * n)
        elif what == "tails differ":
            synk.comm.alltoall(xp.ones((n, 1 + (r == 1))))
        elif what == "scan shapes":
            synk.comm.scan(xp.ones(2 + (r == 1)))
    except ValueError as err:
        said = str(err)
    else:
        said = "no error"
    synk.comm.barrier()  # (the ranks are still in step)
    return said


@pytest.mark.parametrize("what,words", [
    ("reduce", "different shapes"), ("gather", "other dimensions must agree"),
    ("root", "root must be a rank"), ("weight", "gave no weight")])
def test_rooted_mismatches_raise_on_every_rank(group, what, words):
    """On every rank, not the root alone (NCCL would hang on sizes that differ)."""
    f = synk.function(_mismatch, bcast_inputs=["marker", "what"], reduce=None)
    said = f(np.zeros(1), what)
    assert all(words in s for s in said), said


def test_a_short_list_to_scatter_fails_the_call(ranks3):
    """The root alone knows: it raises, and the others' wait for it ends (CommAborted)."""
    def short(x):
        synk.comm.scatter([np.ones(1)] if synk.comm.rank() == 0 else None, root=0)

    with pytest.raises(ValueError, match="a list of one array per rank"):
        synk.function(short, reduce=None, timeout=30)(np.zeros(3))


def _empties(marker):
    """Count-0 operations: NCCL accepts them, and so does every communicator here."""
    xp = synk.xp(marker)
    r = synk.comm.rank()
    got = {
        "broadcast": synk.comm.broadcast(xp.zeros((0, 3)) if r == 0 else None, root=0),
        "ibroadcast": synk.comm.ibroadcast(xp.zeros((0, 3)) if r == 0 else None).wait(),
        "allgather, some empty": synk.comm.allgather(xp.ones((r % 2, 2))),
        "iallgather, all empty": synk.comm.iallgather(xp.ones((0, 2))).wait(),
        "reduce_scatter, 0-row shares": synk.comm.reduce_scatter(xp.ones((1, 2)) * (r + 1)),
        "ireduce_scatter, empty": synk.comm.ireduce_scatter(xp.ones((0, 2))).wait(),
        "allreduce, empty": synk.comm.allreduce(xp.ones(0)),
        "gather, empty": synk.comm.gather(xp.ones((0, 2)), root=0),
    }
    return {k: None if v is None else (tuple(v.shape), float(v.sum()), synk.xp(v) is xp)
            for k, v in got.items()}


def test_count_0_and_empty_arrays(group):
    n = group
    for r, got in enumerate(synk.function(_empties, bcast_inputs=["marker"],
                                          reduce=None)(np.zeros(1))):
        ones = sum(k % 2 for k in range(n))
        assert got == {
            "broadcast": ((0, 3), 0.0, True), "ibroadcast": ((0, 3), 0.0, True),
            "allgather, some empty": ((ones, 2), 2.0 * ones, True),
            "iallgather, all empty": ((0, 2), 0.0, True),
            "reduce_scatter, 0-row shares": (((1, 2), 2.0 * n * (n + 1) / 2, True) if r == 0
                                             else ((0, 2), 0.0, True)),
            "ireduce_scatter, empty": ((0, 2), 0.0, True),
            "allreduce, empty": ((0,), 0.0, True),
            "gather, empty": ((0, 2), 0.0, True) if r == 0 else None,
        }, r


def _empty_and_full_dtypes(marker):
    xp = synk.xp(marker)
    got = {}
    for blocking in (True, False):
        for op in ("sum", "prod", "max", "mean", "band", "land"):
            for dtype in ("bool", "int32", "float32"):
                if op == "band" and dtype == "float32":
                    continue
                for n in (0, 2):
                    x = xp.ones(n, dtype)
                    y = (synk.comm.allreduce(x, op) if blocking
                         else synk.comm.iallreduce(x, op).wait())
                    got[blocking, op, dtype, n] = str(y.dtype)
    return got


def test_an_empty_arrays_reduction_has_the_dtype_of_a_full_ones(group):
    """Booleans sum to counts and means are of floats whether or not there are elements
    (NCCL is given nothing to do for an empty array)."""
    for got in synk.function(_empty_and_full_dtypes, bcast_inputs=["marker"],
                             reduce=None)(np.zeros(1)):
        for (blocking, op, dtype, n), empty in got.items():
            if n == 0:
                assert empty == got[blocking, op, dtype, 2], (blocking, op, dtype, empty)


def _objects_refused(x):
    said = []
    for name, op in [("allgather", lambda v: synk.comm.allgather(v)),
                     ("broadcast", lambda v: synk.comm.broadcast(v, root=0)),
                     ("gather", lambda v: synk.comm.gather(v, root=0)),
                     ("iallgather", lambda v: synk.comm.iallgather(v))]:
        for value in (np.array({"a": 1}, dtype=object), np.array([1, "a"], dtype=object)):
            try:
                op(value)
            except TypeError as err:
                said.append(f"{name}: {err}")
            else:
                said.append(f"{name}: carried it")
    return said


@pytest.mark.parametrize("n", [1, 3])
def test_one_rule_for_what_synk_comm_carries(n):
    """Python objects (dtype object) are refused by every operation alike, also in a group
    of one (where nothing travels); the *_object forms carry them."""
    synk.fork(n)
    try:
        for said in synk.function(_objects_refused, reduce=None)(np.zeros(n)):
            assert len(said) == 8 and all("moves arrays of fixed-size dtypes" in s
                                          and "allgather_object" in s for s in said), said
    finally:
        synk.close()


def _to_host(v):
    return v if v is None or isinstance(v, int) else np.asarray(v.get() if hasattr(v, "get")
                                                                else v)


def _all_to_all(marker):
    """alltoall in both forms (mpi4py's Alltoallv, torch's all_to_all and
    all_to_all_single), blocking and not, even and uneven."""
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    listed = [xp.full((r + p, 2), 10.0 * r + p) for p in range(n)]  # rank 0 to 0: empty
    even = xp.arange(8.0 * n).reshape(4 * n, 2) + 100 * r
    counts = [p + 1 for p in range(n)]
    uneven = xp.arange(sum(counts), dtype=xp.int32) + 100 * r
    out = {"list": synk.comm.alltoall(listed),
           "ilist": synk.comm.ialltoall([xp.full(3, r * n + p) for p in range(n)]).wait(),
           "even": synk.comm.alltoall(even),
           "counts": synk.comm.ialltoall(uneven, counts=counts).wait()}
    kinds = {k: all(synk.xp(v) is xp for v in (w if isinstance(w, list) else [w]))
             for k, w in out.items()}
    return {k: [_to_host(p) for p in v] if isinstance(v, list) else _to_host(v)
            for k, v in out.items()}, kinds


def test_alltoall_even_and_uneven(group):
    n = group
    outs, kinds = synk.function(_all_to_all, bcast_inputs=["marker"], reduce=None)(
        np.zeros(1))
    counts = [p + 1 for p in range(n)]
    starts = np.cumsum([0, *counts])
    for r, got in enumerate(outs):
        for p in range(n):
            np.testing.assert_array_equal(got["list"][p], np.full((p + r, 2), 10.0 * p + r))
            np.testing.assert_array_equal(got["ilist"][p], np.full(3, p * n + r))
        np.testing.assert_array_equal(got["even"], np.concatenate(
            [(np.arange(8.0 * n).reshape(4 * n, 2) + 100 * p)[4 * r:4 * r + 4]
             for p in range(n)]))
        np.testing.assert_array_equal(got["counts"], np.concatenate(
            [(np.arange(sum(counts), dtype=np.int32) + 100 * p)[starts[r]:starts[r + 1]]
             for p in range(n)]))
        assert got["counts"].dtype == np.int32
        assert all(kinds[r].values()), kinds[r]


def _prefixes(marker):
    xp = synk.xp(marker)
    r = synk.comm.rank()
    x = xp.arange(6, dtype=xp.int64).reshape(2, 3) * (r + 1) - 4
    return {k: _to_host(v) for k, v in {
        "scan sum": synk.comm.scan(x, "sum"),
        "scan max": synk.comm.iscan(xp.asarray([r % 2, -r]), "max").wait(),
        "scan of numbers": synk.comm.scan(r + 1, "prod"),
        "exscan sum": synk.comm.exscan(x, "sum"),
        "iexscan min": synk.comm.iexscan(x, "min").wait(),
        "scan mean": synk.comm.scan(x.astype(xp.float32), "mean"),
    }.items()}


def test_scan_and_exscan_against_numpy(group):
    n = group
    xs = [np.arange(6, dtype=np.int64).reshape(2, 3) * (k + 1) - 4 for k in range(n)]
    for r, got in enumerate(synk.function(_prefixes, bcast_inputs=["marker"], reduce=None)(
            np.zeros(1))):
        np.testing.assert_array_equal(got["scan sum"], np.sum(xs[:r + 1], axis=0))
        assert got["scan sum"].dtype == np.int64
        np.testing.assert_array_equal(got["scan max"], np.max(
            [[k % 2, -k] for k in range(r + 1)], axis=0))
        assert got["scan of numbers"] == int(np.prod(np.arange(1, r + 2)))
        assert isinstance(got["scan of numbers"], int)
        np.testing.assert_allclose(got["scan mean"], np.mean(xs[:r + 1], axis=0), rtol=1e-6)
        assert got["scan mean"].dtype == np.float32
        if r == 0:
            assert got["exscan sum"] is None and got["iexscan min"] is None
        else:
            np.testing.assert_array_equal(got["exscan sum"], np.sum(xs[:r], axis=0))
            np.testing.assert_array_equal(got["iexscan min"], np.min(xs[:r], axis=0))


def _by_counts(marker):
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    counts = [0] + [2] * (n - 2) + [5]  # rank 0 gets no rows
    x = xp.arange(sum(counts) * 2.0).reshape(-1, 2) * (r + 1)
    return (_to_host(synk.comm.reduce_scatter(x, "sum", counts=counts)),
            _to_host(synk.comm.ireduce_scatter(x, "max", counts=counts).wait()))


def test_reduce_scatter_with_counts_per_rank(group):
    n = group
    counts = [0] + [2] * (n - 2) + [5]
    starts = np.cumsum([0, *counts])
    x = np.arange(sum(counts) * 2.0).reshape(-1, 2)
    sums, maxes = synk.function(_by_counts, bcast_inputs=["marker"], reduce=None)(np.zeros(1))
    for r in range(n):
        rows = slice(starts[r], starts[r + 1])
        np.testing.assert_array_equal(sums[r], (x * n * (n + 1) / 2)[rows])
        np.testing.assert_array_equal(maxes[r], (x * n)[rows])


@pytest.mark.parametrize("what,words", [
    ("counts differ", "different counts"), ("forms differ", "the same form"),
    ("tails differ", "other dimensions must agree"), ("scan shapes", "different shapes")])
def test_alltoall_and_scan_mismatches_raise_on_every_rank(group, what, words):
    f = synk.function(_mismatch, bcast_inputs=["marker", "what"], reduce=None)
    said = f(np.zeros(1), what)
    assert all(words in s for s in said), said


@pytest.mark.parametrize("counts,words", [([1, 1], "each of the 3 ranks"),
                                          ([1, 1, 1], "add up to 3 rows, but x has 4")])
def test_counts_that_do_not_fit_raise(ranks3, counts, words):
    def split(x):
        synk.comm.alltoall(np.ones(4), counts=counts)

    with pytest.raises(ValueError, match=words):
        synk.function(split, reduce=None, timeout=30)(np.zeros(3))


def _structures(marker):
    """broadcast and allgather of lists and dicts of arrays, each in one fused collective
    (as allreduce of a list is)."""
    xp = synk.xp(marker)
    r = synk.comm.rank()
    params = {"w": xp.arange(6.0).reshape(2, 3), "b": [xp.ones(2, xp.int32), 7],
              "empty": xp.zeros((0, 4), xp.uint8)}
    mine = [xp.full((r + 1, 2), float(r)), {"count": xp.asarray(r), "flag": xp.asarray(r > 0)}]
    got = {"broadcast": synk.comm.broadcast(params if r == 1 else None, root=1),
           "ibroadcast": synk.comm.ibroadcast((xp.ones(3) * r, xp.arange(2)) if r == 0
                                              else None).wait(),
           "allgather": synk.comm.allgather(mine),
           "iallgather": synk.comm.iallgather([xp.full(2, r)]).wait()}
    arrays = [v for k in ("broadcast", "allgather") for v in tree_leaves(got[k])
              if hasattr(v, "shape")]
    return {k: _host_tree(v) for k, v in got.items()}, all(synk.xp(v) is xp for v in arrays)




def _host_tree(tree):
    if isinstance(tree, dict):
        return {k: _host_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_host_tree(v) for v in tree)
    return tree if isinstance(tree, int) else _to_host(tree)


def test_broadcast_and_allgather_of_structures_fused(group):
    n = group
    outs, on_device = synk.function(_structures, bcast_inputs=["marker"], reduce=None)(
        np.zeros(1))
    for r, got in enumerate(outs):
        b = got["broadcast"]
        assert set(b) == {"w", "b", "empty"} and isinstance(b["b"], list)
        np.testing.assert_array_equal(b["w"], np.arange(6.0).reshape(2, 3))
        np.testing.assert_array_equal(b["b"][0], np.ones(2, np.int32))
        assert b["b"][0].dtype == np.int32 and b["b"][1] == 7 and isinstance(b["b"][1], int)
        assert b["empty"].shape == (0, 4) and b["empty"].dtype == np.uint8
        assert isinstance(got["ibroadcast"], tuple)
        np.testing.assert_array_equal(got["ibroadcast"][0], np.zeros(3))
        np.testing.assert_array_equal(got["ibroadcast"][1], np.arange(2))
        rows, meta = got["allgather"]
        np.testing.assert_array_equal(rows, np.concatenate(
            [np.full((k + 1, 2), float(k)) for k in range(n)]))
        np.testing.assert_array_equal(meta["count"], np.arange(n))
        np.testing.assert_array_equal(meta["flag"], np.arange(n) > 0)
        assert meta["flag"].dtype == bool
        np.testing.assert_array_equal(got["iallgather"][0], np.repeat(np.arange(n), 2))
        assert on_device[r]


def _different_structures(marker):
    xp = synk.xp(marker)
    r = synk.comm.rank()
    try:
        synk.comm.allgather({"a": xp.ones(2)} if r else {"b": xp.ones(2)})
    except ValueError as err:
        return str(err)
    return "no error"


def test_allgather_of_different_structures_raises_on_every_rank(group):
    said = synk.function(_different_structures, bcast_inputs=["marker"], reduce=None)(
        np.zeros(1))
    assert all("different structures" in s for s in said), said


def _into_buffers(marker):
    """``out=``: results written into the caller's arrays (the same objects come back)."""
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    x = xp.arange(6.0) * (r + 1)
    big = xp.ones(300000) * r  # (2.4 MB: the host's two-round allreduce)
    buffers = {"allreduce": xp.empty(6), "big": xp.empty(300000), "iallreduce": xp.empty(6),
               "in place": x.copy(), "mean": xp.empty(6), "broadcast": xp.empty((2, 3)),
               "ibroadcast": xp.empty(4, xp.int32), "allgather": xp.empty((n, 2)),
               "reduce_scatter": xp.empty(len(np.array_split(np.arange(7), n)[r])),
               "structure": [xp.empty(2), xp.empty(3)]}
    got = {"allreduce": synk.comm.allreduce(x, out=buffers["allreduce"]),
           "big": synk.comm.allreduce(big, out=buffers["big"]),
           "iallreduce": synk.comm.iallreduce(x, "max", out=buffers["iallreduce"]).wait(),
           "mean": synk.comm.allreduce(x, "mean", out=buffers["mean"])}
    got["in place"] = synk.comm.allreduce(buffers["in place"], out=buffers["in place"])
    got["broadcast"] = synk.comm.broadcast(xp.full((2, 3), 5.0) if r == 0 else None,
                                           out=buffers["broadcast"])
    got["ibroadcast"] = synk.comm.ibroadcast(xp.arange(4, dtype=xp.int32) if r == 1 else None,
                                             root=1, out=buffers["ibroadcast"]).wait()
    got["allgather"] = synk.comm.allgather(xp.full((1, 2), float(r)), out=buffers["allgather"])
    got["reduce_scatter"] = synk.comm.reduce_scatter(xp.arange(7.0), out=buffers["reduce_scatter"])
    got["structure"] = synk.comm.allreduce([xp.ones(2), xp.ones(3)], out=buffers["structure"])
    same = {k: got[k] is buffers[k] for k in got}
    same["structure"] = all(a is b for a, b in zip(got["structure"], buffers["structure"]))
    try:
        synk.comm.allreduce(x, out=xp.empty(5))
    except ValueError as err:
        wrong = str(err)
    return {k: _host_tree(v) for k, v in got.items()}, same, wrong


def test_results_into_given_buffers(group):
    n = group
    outs, same, wrong = synk.function(_into_buffers, bcast_inputs=["marker"], reduce=None)(
        np.zeros(1))
    w = sum(range(1, n + 1))
    for r, got in enumerate(outs):
        np.testing.assert_array_equal(got["allreduce"], np.arange(6.0) * w)
        np.testing.assert_array_equal(got["in place"], np.arange(6.0) * w)
        np.testing.assert_array_equal(got["big"], np.ones(300000) * sum(range(n)))
        np.testing.assert_array_equal(got["iallreduce"], np.arange(6.0) * n)
        np.testing.assert_allclose(got["mean"], np.arange(6.0) * w / n)
        np.testing.assert_array_equal(got["broadcast"], np.full((2, 3), 5.0))
        np.testing.assert_array_equal(got["ibroadcast"], np.arange(4))
        np.testing.assert_array_equal(got["allgather"], np.repeat(np.arange(n.__float__()), 2)
                                      .reshape(n, 2))
        np.testing.assert_array_equal(got["reduce_scatter"],
                                      np.array_split(np.arange(7.0) * n, n)[r])
        np.testing.assert_array_equal(got["structure"][1], np.full(3, float(n)))
        assert all(same[r].values()), same[r]
        assert "out= must have the result's shape and dtype" in wrong[r]
