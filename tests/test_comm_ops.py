"""The reduce ops MPI and torch.distributed have besides sum/prod/max/min: bitwise and
logical and/or/xor and maxloc/minloc, in ``synk.comm`` (blocking and not, allreduce, reduce,
reduce_scatter, fused lists) and as a function's ``reduce=``, on CPU ranks and simulated
GPUs (NCCL, which lacks them and gathers; the host-staged transport), against numpy."""
import numpy as np
import pytest
from conftest import PEER_LAYOUTS, check_every, layout_group, on_every_rank

import synk

LAYOUTS = {**PEER_LAYOUTS,
           "3 ranks on 2 gpus, staged": (3, 2, {"SYNK_SIM_NCCL_VERSION": "22803"})}

OPS = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
       "land": np.logical_and, "lor": np.logical_or, "lxor": np.logical_xor}
DTYPES = ("int32", "uint8", "int64", "bool")


@pytest.fixture(params=list(LAYOUTS))
def group(request, monkeypatch):
    with layout_group(monkeypatch, *LAYOUTS[request.param]) as n:
        yield n


def _host(v):
    """``v`` (a device or numpy array, a number, None, a pair of them) on the host, and
    whether it stayed where ``xp``'s arrays are."""
    if isinstance(v, tuple):
        return tuple(_host(p) for p in v)
    return v.get() if hasattr(v, "get") and not isinstance(v, dict) else v


def _part(r: int, dtype: str, shape=(5, 3)) -> np.ndarray:
    """Rank ``r``'s numbers, with many bits and zeros in common between ranks."""
    values = np.random.default_rng(r).integers(0, 256, shape)
    values[0] = 255  # (every rank: all bits of a uint8 set, true everywhere)
    values[1] = np.arange(shape[1]) * (r % 2)  # (zeros on some ranks only)
    return values.astype(dtype)


def _everything(marker):
    """Every new op on every dtype, in every form."""
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    out, where = {}, {}
    for dtype in DTYPES:
        x = xp.asarray(_part(r, dtype))
        for op in OPS:
            key = f"{op} {dtype}"
            got = {"allreduce": synk.comm.allreduce(x, op),
                   "iallreduce": synk.comm.iallreduce(x, op.upper()).wait(),
                   "reduce": synk.comm.reduce(x, op, root=n - 1),
                   "ireduce": synk.comm.ireduce(x, op, root=1).wait(),
                   "reduce_scatter": synk.comm.reduce_scatter(x, op),
                   "ireduce_scatter": synk.comm.ireduce_scatter(x, op).wait()}
            for form, v in got.items():
                out[f"{key} {form}"] = _host(v)
                where[f"{key} {form}"] = None if v is None else synk.xp(v) is xp
    return out, where


def test_bitwise_and_logical_ops_match_numpy(group):
    n = group
    f = synk.function(_everything, bcast_inputs=["marker"], reduce=None, timeout=120)
    outs, wheres = f(np.zeros(1))
    bounds = np.array_split(np.arange(5), n)
    for r, (got, where) in enumerate(zip(outs, wheres)):
        for dtype in DTYPES:
            stack = np.stack([_part(q, dtype) for q in range(n)])
            for op, ufunc in OPS.items():
                want = ufunc.reduce(stack, axis=0)
                assert want.dtype == (bool if op[0] == "l" else np.dtype(dtype))
                mine = want[bounds[r][0]:bounds[r][-1] + 1] if len(bounds[r]) else want[:0]
                expected = {"allreduce": want, "iallreduce": want,
                            "reduce": want if r == n - 1 else None,
                            "ireduce": want if r == 1 else None,
                            "reduce_scatter": mine, "ireduce_scatter": mine}
                for form, w in expected.items():
                    key = f"{op} {dtype} {form}"
                    if w is None:
                        assert got[key] is None, (key, r)
                        continue
                    np.testing.assert_array_equal(got[key], w, err_msg=f"{key} rank {r}")
                    assert got[key].dtype == w.dtype, (key, got[key].dtype)
                    assert where[key], f"{key}: a device array came back on the host"


def _error_of(run) -> str:
    try:
        run()
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def _mixed(marker):
    """Fused lists and dicts, numbers, and the logical ops of floats and complex."""
    xp = synk.xp(marker)
    r = synk.comm.rank()
    a, b = xp.asarray(_part(r, "int32")), xp.asarray(_part(r, "bool", (2, 4)))
    out = {
        "list bxor": synk.comm.allreduce([a, b], "bxor"),
        "dict lor": synk.comm.iallreduce({"a": a, "b": [b]}, "lor").wait(),
        "number band": synk.comm.allreduce(6 + r, "band"),
        "numpy scalar bor": synk.comm.allreduce(np.int16(1 << r), "bor"),
        "logical of floats": synk.comm.allreduce(
            xp.asarray(np.array([0.0, 0.5, -1.0, np.nan]) * (r % 2)), "land"),
        "logical of complex": synk.comm.allreduce(
            xp.asarray(np.array([0j, 1j, 2.0]) * r), "lor"),
    }
    kinds = {k: type(v).__name__ for k, v in out.items()}
    return {k: _host(v) for k, v in out.items()}, kinds


def _mixed_dtypes(arg):
    marker, which = arg
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    if which == "reduce":  # (int8 on rank 0, uint8 elsewhere: numpy would promote to int16)
        return _error_of(lambda: synk.comm.reduce(
            xp.asarray(_part(r, "int8" if r == 0 else "uint8")), "bor", root=n - 1))
    return _error_of(lambda: synk.comm.allreduce(
        xp.asarray(_part(r, "float32" if r == 0 else "int64")), "lxor"))


def test_mixed_dtypes_raise_on_every_rank(group):
    """numpy would promote them; synk.comm asks every rank to pass one dtype (cast first),
    whatever the size and the transport (one call each: on NCCL a mismatch aborts the
    communicator for the rest of its call)."""
    for which in ("reduce", "allreduce"):
        for said in on_every_rank(_mixed_dtypes, np.zeros(1), which):
            assert said.startswith("ValueError") and "dtypes" in said, said


def test_fused_numbers_and_logical_ops(group):
    n = group
    f = synk.function(_mixed, bcast_inputs=["marker"], reduce=None, timeout=60)
    outs, kinds_of = f(np.zeros(1))
    ints = np.stack([_part(q, "int32") for q in range(n)])
    bools = np.stack([_part(q, "bool", (2, 4)) for q in range(n)])
    for got, kinds in zip(outs, kinds_of):
        a, b = got["list bxor"]
        np.testing.assert_array_equal(a, np.bitwise_xor.reduce(ints, axis=0))
        np.testing.assert_array_equal(b, np.bitwise_xor.reduce(bools, axis=0))
        assert b.dtype == bool
        d = got["dict lor"]
        np.testing.assert_array_equal(d["a"], np.logical_or.reduce(ints, axis=0))
        np.testing.assert_array_equal(d["b"][0], np.logical_or.reduce(bools, axis=0))
        assert d["a"].dtype == bool
        assert got["number band"] == int(np.bitwise_and.reduce(6 + np.arange(n)))
        assert got["numpy scalar bor"] == (1 << n) - 1
        assert np.asarray(got["numpy scalar bor"]).dtype == np.int16, kinds
        floats = np.stack([np.array([0.0, 0.5, -1.0, np.nan]) * (q % 2) for q in range(n)])
        np.testing.assert_array_equal(got["logical of floats"],
                                      np.logical_and.reduce(floats, axis=0))
        complexes = np.stack([np.array([0j, 1j, 2.0]) * q for q in range(n)])
        np.testing.assert_array_equal(got["logical of complex"],
                                      np.logical_or.reduce(complexes, axis=0))


def _located(marker):
    """maxloc and minloc with ties (the lowest rank wins), every kind of value."""
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    x = xp.asarray(_ties(r))
    out = {
        "maxloc": synk.comm.allreduce(x, "maxloc"),
        "minloc": synk.comm.allreduce(x, "MINLOC"),
        "imaxloc": synk.comm.iallreduce(x.astype(xp.int32), "maxloc").wait(),
        "reduce minloc": synk.comm.reduce(x, "minloc", root=n - 1),
        "ireduce maxloc": synk.comm.ireduce(x > 1, "maxloc", root=1).wait(),
        "number": synk.comm.allreduce(float(r % 2), "maxloc"),
        "numpy scalar": synk.comm.allreduce(np.uint8(n - r), "minloc"),
    }
    kinds = {k: None if v is None else [_where(p, xp) for p in v] for k, v in out.items()}
    return {k: _host(v) for k, v in out.items()}, kinds


def _where(value, xp) -> str:
    if isinstance(value, (np.generic, int, float)):
        return type(value).__name__
    return "where x is" if synk.xp(value) is xp else "moved"


def _ties(r: int) -> np.ndarray:
    return np.array([[3.0, r, -r, 1.5], [r % 2, 7.0, (r * 5) % 3, 1e9 if r == 2 else 0.0]])


def test_maxloc_and_minloc(group):
    n = group
    f = synk.function(_located, bcast_inputs=["marker"], reduce=None, timeout=60)
    outs, kinds_of = f(np.zeros(1))
    stack = np.stack([_ties(q) for q in range(n)])
    wants = {"maxloc": (stack.max(axis=0), stack.argmax(axis=0)),
             "minloc": (stack.min(axis=0), stack.argmin(axis=0)),
             "imaxloc": (stack.astype(np.int32).max(axis=0),
                         stack.astype(np.int32).argmax(axis=0))}
    # the lowest rank wins a tie: every rank ties at [0, 0] and [0, 3], so rank 0 wins
    for name in wants:
        assert (wants[name][1][0, [0, 3]] == 0).all()
    for r, (got, kinds) in enumerate(zip(outs, kinds_of)):
        for name, (values, ranks) in wants.items():
            np.testing.assert_array_equal(got[name][0], values, err_msg=name)
            np.testing.assert_array_equal(got[name][1], ranks, err_msg=name)
            assert got[name][0].dtype == values.dtype and got[name][1].dtype == np.int64
            assert kinds[name] == ["where x is", "where x is"], (name, kinds)
        if r == n - 1:
            np.testing.assert_array_equal(got["reduce minloc"][0], stack.min(axis=0))
            np.testing.assert_array_equal(got["reduce minloc"][1], stack.argmin(axis=0))
        else:
            assert got["reduce minloc"] is None
        if r == 1:
            np.testing.assert_array_equal(got["ireduce maxloc"][0], (stack > 1).max(axis=0))
            np.testing.assert_array_equal(got["ireduce maxloc"][1], (stack > 1).argmax(axis=0))
        else:
            assert got["ireduce maxloc"] is None
        assert got["number"] == (1.0, 1) and kinds["number"] == ["float", "int"]
        assert got["numpy scalar"] == (1, n - 1)
        assert kinds["numpy scalar"] == ["uint8", "int64"], kinds


def _refused(marker, what):
    """One refused use on every rank, then a collective that works."""
    xp = synk.xp(marker)
    r = synk.comm.rank()
    x = xp.arange(4.0) + r
    try:
        if what == "band of floats":
            synk.comm.allreduce(x, "band")
        elif what == "ireduce bor of floats":
            synk.comm.ireduce(x, "bor", root=1).wait()
        elif what == "reduce_scatter bxor of floats":
            synk.comm.reduce_scatter(x, "bxor")
        elif what == "list band with a float":
            synk.comm.allreduce([xp.arange(3), x], "band")
        elif what == "maxloc of complex":
            synk.comm.allreduce(x * 1j, "maxloc")
        elif what == "maxloc with weight":
            synk.comm.allreduce(x, "maxloc", weight=1)
        elif what == "maxloc of a list":
            synk.comm.allreduce([x, x], "maxloc")
        elif what == "reduce_scatter maxloc":
            synk.comm.reduce_scatter(x, "maxloc")
        said = None
    except (TypeError, ValueError) as err:
        said = f"{type(err).__name__}: {err}"
    after = synk.comm.allreduce(xp.arange(3) + r, "bxor")
    return said, _host(after)


REFUSED = {"band of floats": ("TypeError", "integer and bool"),
           "ireduce bor of floats": ("TypeError", "integer and bool"),
           "reduce_scatter bxor of floats": ("TypeError", "integer and bool"),
           "list band with a float": ("TypeError", "float64"),
           "maxloc of complex": ("TypeError", "real numbers"),
           "maxloc with weight": ("ValueError", "takes no weight"),
           "maxloc of a list": ("TypeError", "once per array"),
           "reduce_scatter maxloc": ("ValueError", "unknown op 'maxloc'")}


def test_refused_uses_raise_on_every_rank_and_the_group_goes_on(group):
    check_every([(group, what) for what in REFUSED], _refused_and_goes_on)


def _refused_and_goes_on(n, what):
    error, words = REFUSED[what]
    f = synk.function(_refused, bcast_inputs=["marker", "what"], reduce=None, timeout=60)
    saids, afters = f(np.zeros(1), what)
    for said in saids:
        assert said is not None and said.startswith(error) and words in said, said
    want = np.bitwise_xor.reduce(np.stack([np.arange(3) + q for q in range(n)]), axis=0)
    for after in afters:
        np.testing.assert_array_equal(after, want)


def _outputs(x, big):
    """Outputs of integer and bool dtypes, small and large (combined on the devices)."""
    return x.sum(axis=0), x.max(axis=0) > 150, x.max(axis=0) + big, x[0] % 3, \
        x.min(axis=0), (x.sum(axis=0) + big) % 7 > 2


def test_function_outputs_reduce_with_the_new_ops(group):
    n = group
    ops = ("band", "bor", "bxor", "land", "lor", "lxor")
    rows = np.random.default_rng(7).integers(0, 200, (11, 3000)).astype(np.int64)
    big = np.arange(3000, dtype=np.int64)  # (24 KB outputs: past the small-output path)
    f = synk.function(_outputs, bcast_inputs=["big"], reduce=ops, timeout=60)
    for num_slices in (1, 2):
        got = f(rows, big, num_slices=num_slices)
        parts = [_outputs(p, big) for p in np.array_split(rows, n)]
        if num_slices == 2:  # each rank's two slices, then the ranks: one fold
            parts = [_outputs(s, big) for p in np.array_split(rows, n)
                     for s in np.array_split(p, 2) if len(s)]
        for i, op in enumerate(ops):
            want = OPS[op].reduce(np.stack([p[i] for p in parts]), axis=0)
            np.testing.assert_array_equal(got[i], want, err_msg=f"{op} {num_slices}")
            assert got[i].dtype == want.dtype, (op, got[i].dtype)
    # fewer rows than ranks: the ranks without rows take no part
    small = rows[:2, :10]
    got = synk.function(lambda x: x[0], reduce="bxor")(small)
    np.testing.assert_array_equal(got, small[0] ^ small[1])
    with pytest.raises(TypeError, match="output 0 of .*integer and bool"):
        synk.function(lambda x: x.sum(axis=0) / 2, reduce="band")(rows)
    lengths = [len(p) for p in np.array_split(rows, n)]
    assert synk.function(lambda x: int(x.shape[0]), reduce="BOR")(rows) == \
        np.bitwise_or.reduce(lengths)
