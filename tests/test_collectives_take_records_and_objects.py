"""The collectives probed the way careless users probe them: records through every
data-moving collective, Python objects of the user's script through the object collectives
and fused structures, ``scan`` with ``maxloc``, broadcast arrays nested in lists and dicts
read-only as top-level ones, and the objects a GPU rank refuses; each against numpy, on
CPU ranks and simulated GPUs."""
import re
import textwrap

import numpy as np
import pytest
from conftest import PEER_LAYOUTS, layout_group, run_script

import synk

RECORD = np.dtype([("id", "<i4"), ("score", "<f8"), ("tag", "S3")])


@pytest.fixture(params=list(PEER_LAYOUTS))
def group(request, monkeypatch):
    with layout_group(monkeypatch, *PEER_LAYOUTS[request.param]) as n:
        yield n


def _records(r: int, rows: int) -> np.ndarray:
    out = np.zeros(rows, RECORD)
    out["id"] = np.arange(rows) + 100 * r
    out["score"] = np.arange(rows) / (r + 1)
    out["tag"] = f"r{r}".encode()
    return out


# -- item 6: records in gather/igather and alltoall/ialltoall --------------------------------
def _move_records(marker):
    r, n = synk.comm.rank(), synk.comm.size()
    mine = _records(r, r + 1)  # lengths differ between ranks
    return {
        "gather": synk.comm.gather(mine, root=n - 1),
        "igather": synk.comm.igather(mine, root=0).wait(),
        "alltoall list": synk.comm.alltoall([_records(r, p + 1) for p in range(n)]),
        "ialltoall list": synk.comm.ialltoall([_records(r, p) for p in range(n)]).wait(),
        "alltoall": synk.comm.alltoall(_records(r, 2 * n), counts=[2] * n),
        "ialltoall": synk.comm.ialltoall(_records(r, n)).wait(),
        "scatter": synk.comm.scatter([_records(r, p + 1) for p in range(n)] if r == 1
                                     else None, root=1),
    }


def test_records_travel_through_gather_and_alltoall(group):
    n = group
    got = synk.function(_move_records, bcast_inputs=["marker"], reduce=None,
                        timeout=60)(np.zeros(1))
    joined = np.concatenate([_records(q, q + 1) for q in range(n)])
    for r, out in enumerate(got):
        for name in ("gather", "igather"):
            root = n - 1 if name == "gather" else 0
            if r == root:
                assert out[name].dtype == RECORD, name
                np.testing.assert_array_equal(out[name], joined)
            else:
                assert out[name] is None
        for name, want in [
                ("alltoall list", [_records(q, r + 1) for q in range(n)]),
                ("ialltoall list", [_records(q, r) for q in range(n)])]:
            assert [p.dtype for p in out[name]] == [RECORD] * n
            for part, expected in zip(out[name], want):
                np.testing.assert_array_equal(part, expected)
        rows = np.concatenate([_records(q, 2 * n)[2 * r:2 * r + 2] for q in range(n)])
        np.testing.assert_array_equal(out["alltoall"], rows)
        assert out["alltoall"].dtype == RECORD
        rows = np.concatenate([_records(q, n)[r:r + 1] for q in range(n)])
        np.testing.assert_array_equal(out["ialltoall"], rows)
        assert out["scatter"].dtype == RECORD
        np.testing.assert_array_equal(out["scatter"], _records(1, r + 1))


# -- item 7: one pickler for everything synk moves -------------------------------------------
def test_objects_of_the_script_travel_through_the_object_collectives(tmp_path):
    """A dataclass, a named tuple and an enum defined in the user's script, and a lambda,
    sent from a worker and from rank 0, by every object collective and a fused structure."""
    out = run_script(tmp_path / "objects.py", textwrap.dedent("""
        import collections, dataclasses, enum
        import numpy as np
        import synk
        from synk import comm

        @dataclasses.dataclass
        class Meta:
            rank: int
            name: str

        Pair = collections.namedtuple("Pair", "w b")

        class Kind(enum.Enum):
            A = 1

        def step(marker):
            r = comm.rank()
            return {
                "bcast from 1": comm.broadcast_object(Meta(r, "m") if r == 1 else None, 1),
                "bcast from 0": comm.broadcast_object(Meta(r, "m") if r == 0 else None, 0),
                "lambdas": [f(r) for f in comm.allgather_object(lambda q, r=r: q * 10 + r)],
                "gather": comm.gather_object(Meta(r, "g"), root=0),
                "scatter": comm.scatter_object(
                    [Meta(q, "s") for q in range(comm.size())] if r == 1 else None, 1),
                "pair": comm.broadcast(Pair(np.full(2, r), np.ones(1)) if r == 1 else None,
                                       root=1),
                "keys": comm.broadcast({Kind.A: np.arange(3)} if r == 1 else None, root=1),
            }

        synk.fork(3, backend="cpu")
        outs = synk.function(step, bcast_inputs=["marker"], reduce=None)(0)
        for r, got in enumerate(outs):
            assert (got["bcast from 1"].rank, got["bcast from 0"].rank) == (1, 0), got
            assert type(got["bcast from 1"]).__name__ == "Meta"
            assert got["lambdas"] == [r * 10 + q for q in range(3)], got["lambdas"]
            if r == 0:
                assert [m.rank for m in got["gather"]] == [0, 1, 2], got["gather"]
            else:
                assert got["gather"] is None
            assert got["scatter"] == Meta(r, "s") or got["scatter"].rank == r
            assert type(got["pair"]).__name__ == "Pair", got["pair"]
            assert got["pair"].w.tolist() == [1, 1]
            (key, value), = got["keys"].items()
            assert key.name == "A" and value.tolist() == [0, 1, 2]
        synk.close()
        print("ok")
    """))
    assert out.strip() == "ok"


def test_an_object_no_pickler_takes_raises_a_clear_error(ranks2):
    import threading

    def send_lock(marker):
        return synk.comm.broadcast_object(threading.Lock() if synk.comm.rank() == 1 else 0, 1)

    f = synk.function(send_lock, bcast_inputs=["marker"], reduce=None, timeout=60)
    with pytest.raises(TypeError, match=r"synk.comm.broadcast_object's object cannot be "
                                        r"pickled .*_thread.lock"):
        f(0)
    assert f.__class__ is synk.Function
    assert synk.function(lambda m: synk.comm.rank(), bcast_inputs=["m"],
                         reduce=None)(0) == [0, 1]


# -- item 8: scan and exscan take maxloc and minloc ------------------------------------------
def _prefix_located(marker):
    xp = synk.xp(marker)
    r = synk.comm.rank()
    x = xp.asarray(_ties(r))
    return {
        "scan maxloc": synk.comm.scan(x, "maxloc"),
        "iscan minloc": synk.comm.iscan(x, "MINLOC").wait(),
        "exscan maxloc": synk.comm.exscan(x, "maxloc"),
        "iexscan minloc": synk.comm.iexscan(x, "minloc").wait(),
        "number": synk.comm.scan(float(r % 2), "maxloc"),
    }


def _ties(r: int) -> np.ndarray:
    return np.array([[3.0, r, -r, 1.5], [r % 2, 7.0, (r * 5) % 3, 1e9 if r == 2 else 0.0]])


def _on_host(v):
    if isinstance(v, tuple):
        return tuple(_on_host(p) for p in v)
    return v.get() if hasattr(v, "get") and not isinstance(v, dict) else v


def _prefix_located_on_host(marker):
    return {k: _on_host(v) for k, v in _prefix_located(marker).items()}


def test_scan_and_exscan_take_maxloc_and_minloc(group):
    f = synk.function(_prefix_located_on_host, bcast_inputs=["marker"], reduce=None,
                      timeout=60)
    outs = f(np.zeros(1))
    for r, got in enumerate(outs):
        upto = np.stack([_ties(q) for q in range(r + 1)])
        for name, pick in [("scan maxloc", "max"), ("iscan minloc", "min")]:
            np.testing.assert_array_equal(got[name][0], getattr(upto, pick)(axis=0))
            np.testing.assert_array_equal(got[name][1], getattr(upto, "arg" + pick)(axis=0))
            assert got[name][1].dtype == np.int64
        for name, pick in [("exscan maxloc", "max"), ("iexscan minloc", "min")]:
            if r == 0:
                assert got[name] is None
                continue
            before = upto[:r]
            np.testing.assert_array_equal(got[name][0], getattr(before, pick)(axis=0))
            np.testing.assert_array_equal(got[name][1], getattr(before, "arg" + pick)(axis=0))
        assert got["number"] == (float(r >= 1), 1 if r >= 1 else 0)


def test_scan_maxloc_refuses_what_allreduce_refuses(ranks2):
    def refused(marker, what):
        x = np.arange(3.0)
        try:
            if what == "complex":
                synk.comm.scan(x * 1j, "maxloc")
            else:
                synk.comm.exscan([x, x], "minloc")
        except TypeError as err:
            return str(err)
        return None

    f = synk.function(refused, bcast_inputs=["marker", "what"], reduce=None)
    assert all("compares real numbers" in said for said in f(0, "complex"))
    assert all("once per array" in said for said in f(0, "list"))


# -- item 9: arrays nested in broadcast lists and dicts are read-only, as top-level ones ------
def _write_nested(x, params, who):
    if who is None or synk.rank() == who:
        params["layers"][1]["w"] += 1
    return x.sum()


@pytest.mark.parametrize("who", [None, 0, 1], ids=["every rank", "rank 0", "rank 1"])
@pytest.mark.parametrize("size", [3, 100_000], ids=["small", "large"])
def test_arrays_nested_in_broadcast_inputs_are_read_only_on_every_rank(ranks2, who, size):
    w = np.zeros(size)
    params = {"layers": [np.ones(2), {"w": w}], "scale": 2.0}
    f = synk.function(_write_nested, bcast_inputs=["params", "who"], reduce="sum")
    with pytest.raises(ValueError, match="read-only") as err:
        f(np.ones((4, 2)), params, who)
    assert any("x = x.copy()" in note for note in err.value.__notes__)
    assert not w.any(), "rank 0 changed the caller's own array"
    assert params["layers"][1]["w"] is w  # the caller's containers are untouched


def test_nested_broadcast_arrays_keep_their_containers_and_values(ranks2):
    from collections import namedtuple

    Layer = namedtuple("Layer", "w b")
    params = {"layers": [Layer(np.arange(3.0), (np.ones(2),))], "n": 3}

    def look(x, params):
        layer = params["layers"][0]
        return [type(layer).__name__, type(layer.b).__name__, layer.w.flags.writeable,
                float(layer.w.sum() + layer.b[0].sum()), params["n"]]

    got = synk.function(look, bcast_inputs=["params"], reduce=None)(np.ones((4, 1)), params)
    assert got == [["Layer", "tuple", False, 5.0, 3]] * 2
    assert params["layers"][0].w.flags.writeable  # the caller's array itself stays writable


# -- item 10: GPU ranks refuse every object that holds host arrays ----------------------------
class _Slots:
    __slots__ = ("w", "name")

    def __init__(self):
        self.w, self.name = np.ones(3), "s"


class _DictAttribute:
    def __init__(self):
        self.params = {"w": np.ones(3)}


class _ListAttribute:
    def __init__(self):
        self.layers = [1.0, np.ones(3)]


class _Deep:
    def __init__(self):
        self.inner = _DictAttribute()


class _NoArrays:
    def __init__(self):
        self.name, self.sizes, self.act = "net", [3, 4], np.tanh


@pytest.mark.parametrize("obj, where", [
    (_Slots(), "w"), (_DictAttribute(), "params['w']"), (_ListAttribute(), "layers[1]"),
    (_Deep(), "inner.params['w']")], ids=["slots", "dict attribute", "list attribute", "deep"])
def test_gpu_ranks_refuse_any_object_holding_host_arrays(two, obj, where):
    x = np.ones((4, 3))
    f = synk.function(lambda x, model: x.sum(), bcast_inputs=["model"], reduce="sum")
    if two == "cpu":  # host arrays are what CPU ranks compute on
        assert f(x, obj) == 12.0
        return
    said = f"holds numpy arrays in a {type(obj).__name__} object (attribute {where!r})"
    with pytest.raises(TypeError, match=re.escape(f"broadcast input 'model' {said}")):
        f(x, obj)
    assert f(x, _NoArrays()) == 12.0  # an object without arrays passes; the group goes on


# -- item 12: a function that uses synk.comm cannot be run in slices --------------------------
def _total_rows(x):
    return synk.comm.allreduce(x.sum(0))  # the whole call's column sums, on every rank


def _sliced_peers(x):
    if synk.comm.rank() == 0:
        synk.comm.send(x[:1], 1)
    return x.sum()


def test_num_slices_with_synk_comm_raises_instead_of_another_answer(two):
    x = np.arange(40.0).reshape(20, 2)
    f = synk.function(_total_rows, reduce="max", timeout=60)
    np.testing.assert_allclose(_on_host(f(x)), x.sum(0))
    for num_slices in (2, 5):
        with pytest.raises(synk.SynkError, match=rf"synk.comm.allreduce\(\) was called inside "
                                                 rf"a call with num_slices={num_slices}"):
            f(x, num_slices=num_slices)
    with pytest.raises(synk.SynkError, match=r"synk.comm.i?send\(\) was called inside a call "
                                             r"with num_slices=3"):
        synk.function(_sliced_peers, reduce="sum", timeout=60)(x, num_slices=3)
    # the group goes on; slicing a function without collectives works, rank() and size() too
    g = synk.function(lambda x: x.sum() * synk.comm.size() + 0 * synk.comm.rank(),
                      reduce="sum")
    assert float(g(x, num_slices=4)) == x.sum() * 2
    np.testing.assert_allclose(_on_host(f(x)), x.sum(0))


# -- item 14: clear errors for out= mistakes, mixed integer dtypes, a NaN color ---------------
def _out_mistakes(marker, what):
    xp = synk.xp(marker)
    x = xp.ones(4)
    wrong = [0.0] * 4 if what == "a list" else np.empty(4)  # (numpy: wrong for a device x)
    said = {}
    for name, call in [
            ("allreduce", lambda: synk.comm.allreduce(x, out=wrong)),
            ("iallreduce", lambda: synk.comm.iallreduce(x, out=wrong).wait()),
            ("broadcast", lambda: synk.comm.broadcast(x, out=wrong)),
            ("allgather", lambda: synk.comm.allgather(x, out=[0.0] * 8 if what == "a list"
                                                      else np.empty(8))),
            ("reduce_scatter", lambda: synk.comm.reduce_scatter(
                x, out=[0.0] * 2 if what == "a list" else np.empty(2)))]:
        try:
            call()
            said[name] = None
        except Exception as err:
            said[name] = f"{type(err).__name__}: {err}"
    return said


@pytest.mark.parametrize("what", ["a list", "a numpy array for a device result"])
def test_out_mistakes_raise_what_to_pass(two, what):
    if two == "cpu" and what != "a list":
        pytest.skip("a numpy out= is right for a host result")
    f = synk.function(_out_mistakes, bcast_inputs=["marker", "what"], reduce=None, timeout=60)
    side = "a numpy" if two == "cpu" else "a device"
    type_name = "list" if what == "a list" else "ndarray"
    for said in f(np.zeros(1), what):
        for name, got in said.items():
            assert got == (f"TypeError: synk.comm.{name}: out= must be {side} array, as the "
                           f"result is; got {type_name}"), (name, got)


def _bitwise_of_mixed_integers(marker):
    x = np.arange(3, dtype=np.uint64 if synk.comm.rank() else np.int64)
    try:
        synk.comm.allreduce(x, "band")
    except ValueError as err:
        return str(err)
    return None


def test_a_bitwise_op_over_int64_and_uint64_says_so(two):
    """synk.comm: the ranks must pass one dtype; a function's outputs of int64 and uint64
    (which numpy promotes to float64) cannot take a bitwise op."""
    f = synk.function(_bitwise_of_mixed_integers, bcast_inputs=["marker"], reduce=None,
                      timeout=60)
    for said in f(np.zeros(1)):
        assert "different shapes or dtypes" in said and "int64" in said and "uint64" in said, \
            said
    g = synk.function(lambda x: x.sum(axis=0).astype(np.uint64 if synk.rank() else np.int64),
                      reduce="bor")
    with pytest.raises(TypeError, match="dtypes int64, uint64, which numpy promotes"):
        g(np.ones((4, 2), np.int64))


def test_split_with_a_nan_color_raises_on_every_rank(ranks2):
    def split_nan(marker):
        try:
            synk.comm.split(float("nan") if synk.comm.rank() == 1 else 0)
        except ValueError as err:
            return str(err)
        return None

    f = synk.function(split_nan, bcast_inputs=["marker"], reduce=None, timeout=60)
    for said in f(0):
        assert said.startswith("synk.comm.split: a color is None or a value equal to itself")
        assert said.endswith("got rank 1: nan"), said
