"""synk.comm.allreduce of structures (lists, tuples, dicts of arrays, nested), fused per
dtype, and the weighted mean, against numpy: on CPU ranks and on device arrays under the
CUDA simulator. (The cases that force the host's per-buffer way by lowering its size limit,
which has no public setting, are in test_wire_rings_and_segments.py.)"""
import collections

import numpy as np
import pytest
from conftest import on_every_rank, use_devices

import synk
from synk import comm

Grads = collections.namedtuple("Grads", "w b")


def tree_of(rank: int, n: int = 5):
    """A model's gradients, say: several dtypes, a nested dict, a named tuple, a 0-d array."""
    g = np.random.default_rng(rank)
    return {
        "layer1": Grads(g.random((n, 3)).astype(np.float32), g.random(3).astype(np.float32)),
        "layer2": [g.random((2, n)), np.float64(g.random())],
        "counts": np.arange(4) * (rank + 1),
        "mask": np.array([rank % 2 == 0, True]),
    }


def assert_same_structure(got, want):
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same_structure(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_structure(a, b)


def test_a_rank_with_weight_zero_contributes_nothing_and_plain_arrays_take_weights(ranks3):
    def fn(arg):
        r = comm.rank()
        x = np.full(3, np.nan) if r == 1 else np.full(3, float(r))  # rank 1: a mean of no rows
        return comm.allreduce(x, "mean", weight=0 if r == 1 else r + 1)

    for got in on_every_rank(fn):
        np.testing.assert_allclose(got, np.full(3, (0 * 1 + 2 * 3) / 4))


def test_integers_average_in_float64(ranks3):
    def fn(arg):
        return comm.allreduce({"n": np.array([comm.rank()])}, "mean", weight=comm.rank())

    for got in on_every_rank(fn):  # (within the mean's bound; exact_mean gives numpy's bits)
        assert got["n"].dtype == np.float64
        np.testing.assert_allclose(got["n"][0], (1 * 1 + 2 * 2) / 3, rtol=5 * 2.0 ** -52)


@pytest.mark.parametrize("case", ["split", "keys", "dtype"])
def test_different_structures_on_different_ranks_raise_on_every_rank(ranks3, case):
    """Same total size, so one fused buffer would combine without complaint: the digest of
    the structure catches it."""
    def fn(arg):
        r = comm.rank()
        if arg[0] == "split":
            tree = [np.ones(3), np.ones(2)] if r else [np.ones(2), np.ones(3)]
        elif arg[0] == "keys":
            tree = {"a" if r else "b": np.ones(2)}
        else:
            tree = [np.ones(2, np.float32 if r == 2 else np.float64)]
        try:
            comm.allreduce(tree, "sum")
        except ValueError as err:
            return str(err)
        return "no error"

    for message in on_every_rank(fn, case):
        assert "different structures" in message


# One rank's structure on each side of a limit of the fused allreduce's: a board slot, one
# round of messages, two rounds of one buffer (one dtype), or of a buffer per dtype.
STRUCTURES = {  # (each leaf's elements and dtype)
    "slot | one round": ([(100, np.float32)], [(100_000, np.float32)]),
    "slot | two rounds": ([(100, np.float32)], [(3 << 20, np.float32)]),
    "one round | two rounds": ([(100_000, np.float32)], [(3 << 20, np.float32)]),
    "one buffer | a buffer per dtype": ([(3 << 20, np.float32)],
                                        [(3 << 20, np.float32), (3, np.float64)]),
}


@pytest.mark.parametrize("sides", list(STRUCTURES))
def test_structures_on_either_side_of_a_limit_raise_on_every_rank(ranks3, sides):
    def fn(arg):
        leaves = STRUCTURES[arg[0]][1 if comm.rank() == 1 else 0]
        try:
            comm.allreduce([np.ones(n, dtype) for n, dtype in leaves], "mean")
        except ValueError as err:
            return str(err)
        return "no error"

    for message in on_every_rank(fn, sides, timeout=60):
        assert "different structures" in message or "another size" in message
    assert on_every_rank(lambda arg: comm.allreduce([np.ones(2)])[0].tolist()) == [[3.0] * 2] * 3


def test_weights_given_wrongly_raise_clearly(ranks2):
    def fn(arg):
        try:
            if arg[0] == "op":
                comm.allreduce(np.ones(2), "sum", weight=2)
            elif arg[0] == "negative":
                comm.allreduce(np.ones(2), "mean", weight=-1)
            elif arg[0] == "some":
                comm.allreduce(np.ones(2), "mean", weight=1 if comm.rank() else None)
            else:
                comm.allreduce(np.ones(2), "mean", weight=0)
        except (ValueError, TypeError) as err:
            return str(err)
        return "no error"

    assert "takes no weight" in on_every_rank(fn, "op")[0]
    assert ">= 0" in on_every_rank(fn, "negative")[0]
    assert all("gave weight= and others not" in m for m in on_every_rank(fn, "some"))
    assert all("sum to 0" in m for m in on_every_rank(fn, "zero"))


def test_a_repeated_mean_into_out_writes_every_call_in_place(ranks3):
    """A training step's ``allreduce(grads, "mean", weight=..., out=grads)``: from the second
    call the structure's layout is known, and the result still lands in ``out`` (the same
    arrays, in place), correct at every call; a wrong ``out=`` is still refused then."""
    def fn(arg):
        r = comm.rank()
        rows = r + 1
        kept = [np.zeros((3, 4), np.float32), np.zeros(2, np.float32)]
        results = []
        for step in range(4):
            grads = [np.full((3, 4), r + step, np.float32), np.full(2, r * step, np.float32)]
            if step % 2:  # in place, and into other arrays
                got = comm.allreduce(grads, "mean", weight=rows, out=grads)
                same = got is grads and all(a is b for a, b in zip(got, grads))
            else:
                got = comm.allreduce(grads, "mean", weight=rows, out=kept)
                same = all(a is b for a, b in zip(got, kept))
            results.append((same, [g.copy() for g in got]))
        try:
            comm.allreduce(grads, "mean", weight=rows, out=[np.zeros((3, 4)), kept[1]])
            refused = "no error"
        except ValueError as err:
            refused = str(err)
        return results, refused

    weights = np.array([1.0, 2.0, 3.0])
    for results, refused in on_every_rank(fn, timeout=60):
        assert "shape and dtype" in refused
        for step, (same, got) in enumerate(results):
            assert same
            want = [(weights * (np.arange(3) + step)).sum() / weights.sum(),
                    (weights * np.arange(3) * step).sum() / weights.sum()]
            for g, w in zip(got, want):
                assert g.dtype == np.float32
                np.testing.assert_allclose(g, w, rtol=1e-6)


def test_iallreduce_of_a_structure_and_one_rank_alone(ranks2):
    def fn(arg):
        h = comm.iallreduce((np.ones(2) * comm.rank(), np.ones(3)), "sum")
        return h.wait()

    for got in on_every_rank(fn):
        assert isinstance(got, tuple) and got[0].tolist() == [1, 1] and got[1].tolist() == [2] * 3

    def alone(x):
        return comm.allreduce({"x": x.sum(axis=0)}, "mean", weight=len(x))

    f = synk.function(alone, reduce=None)
    assert np.allclose(f.local(np.ones((4, 2)))["x"], [4, 4])


# -- device arrays (GPU ranks, under the CUDA simulator without CUDA) -----------------------
@pytest.mark.gpu
def test_fused_weighted_allreduce_of_device_arrays(monkeypatch):
    use_devices(monkeypatch, 2)
    synk.fork(2, backend="gpu")
    try:
        data = np.random.default_rng(1).random((9, 3))

        def step(x):
            xp = synk.xp(x)
            grads = {"w": x.mean(axis=0), "b": [(x ** 2).mean(axis=0).astype(xp.float32)]}
            out = comm.allreduce(grads, "mean", weight=len(x))
            same = type(out["w"]) is type(x) and type(out["b"][0]) is type(x)
            return out["w"].get(), out["b"][0].get(), same

        got = synk.function(step, reduce=None)(data)
        for w, b, same in zip(*got):
            assert same  # device arrays in, device arrays out
            np.testing.assert_allclose(w, data.mean(axis=0), rtol=1e-12)
            np.testing.assert_allclose(b, (data ** 2).mean(axis=0), rtol=1e-6)
            assert b.dtype == np.float32
    finally:
        synk.close()


def _stress(arg):
    r, n = comm.rank(), comm.size()
    handles = [comm.iallreduce(2 * [np.array([i + r])]) for i in range(arg[0])]
    got = [h.wait() for h in handles]
    want = [sum(i + k for k in range(n)) for i in range(arg[0])]
    return [i for i, (g, w) in enumerate(zip(got, want)) if g[0][0] != w or g[1][0] != w]


def test_fused_allreduces_in_flight_each_get_their_own_result(ranks3):
    """torch.distributed's test_allreduce_coalesced_stress: a thousand non-blocking fused
    allreduces, waited in order. A fused one is packed straight into the board's slot and
    read back from it by its own rank later, on the lane: the slot is not written again
    before that."""
    for wrong in on_every_rank(_stress, 1000):
        assert wrong == []


def _weighted(arg):
    marker, values, weights, fused, op = arg
    xp = synk.xp(marker)  # (device arrays on GPU ranks: NCCL's path)
    r = comm.rank()
    x = xp.asarray(values[r])
    got = comm.allreduce([x] if fused else x, op, weight=weights[r])
    got = got[0] if fused else got
    return np.asarray(got.get() if hasattr(got, "get") else got)


@pytest.mark.parametrize("fused", [False, True], ids=["array", "list"])
@pytest.mark.parametrize("case", ["float32 near its max", "float32 weights 1e30",
                                  "float64 weights 1e300", "weights past float64",
                                  "tiny equal weights", "tiny weight on an infinity"])
def test_weighted_means_of_any_weights_give_numpys_mean(three, case, fused):
    """The factors are w / W of the weights themselves, whatever their size: no part is
    scaled past its dtype's range, nor does a tiny weight's factor round to 0."""
    big = np.float32(1.7e38)
    values, weights = {
        "float32 near its max": ([np.full(4, big)] * 3, [1.0, 2.0, 1.0]),
        "float32 weights 1e30": ([np.arange(4, dtype=np.float32) + r for r in range(3)],
                                 [1e30, 2e30, 1e30]),
        "float64 weights 1e300": ([np.arange(4.0) + r for r in range(3)],
                                  [1e300, 2e300, 1e300]),
        "weights past float64": ([np.arange(4.0) + r for r in range(3)],
                                 [1e308, 1e308, 1e308]),
        "tiny equal weights": ([np.arange(4, dtype=np.float32) + r for r in range(3)],
                               [1e-50] * 3),
        "tiny weight on an infinity": ([np.array([1.0, np.inf], np.float32)] * 3,
                                       [1.0, 1.0, 1e-50]),
    }[case]
    wanted = np.stack([np.asarray(v, np.float64) for v in values])
    w = np.asarray(weights) / max(weights)
    with np.errstate(invalid="ignore"):
        want = (wanted * (w / w.sum())[:, None]).sum(axis=0).astype(values[0].dtype)
    ops = ["mean"] + (["exact_mean"] if case in ("weights past float64",
                                                  "tiny equal weights") else [])
    for op in ops:
        for got in on_every_rank(_weighted, np.zeros(1), values, weights, fused, op):
            assert got.dtype == values[0].dtype
            np.testing.assert_allclose(got, want, rtol=4e-7, err_msg=op)


def _aliased(arg):
    o = np.zeros(2)
    return comm.allreduce([np.ones(2), 2 * np.ones(2)], "sum", out=[o, o])


def test_out_naming_one_array_twice_is_refused(ranks2):
    with pytest.raises(ValueError, match="names the same memory twice"):
        on_every_rank(_aliased)


def _into_structures(arg):
    """Each op over ``tree_of``'s structure into an ``out=`` of its form: whether the call
    returned that very ``out``, and its values (blocking and not)."""
    value = tree_of(comm.rank())
    got = []
    for op, wait in (("max", True), ("sum", False), ("mean", True)):
        want = comm.allreduce(value, op)
        out = {k: v for k, v in _tree_zeros(want).items()}
        call = comm.allreduce(value, op, out=out) if wait else \
            comm.iallreduce(value, op, out=out).wait()
        got.append((call is out, out["layer1"].w is call["layer1"].w,
                    [np.array_equal(a, b) for a, b in zip(_leaves(out), _leaves(want))]))
    return got


def _tree_zeros(tree):
    if isinstance(tree, dict):
        return {k: _tree_zeros(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return type(tree)(*[_tree_zeros(v) for v in tree])
    if isinstance(tree, list):
        return [_tree_zeros(v) for v in tree]
    return np.zeros_like(np.asarray(tree))


def _leaves(tree):
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, (list, tuple)):
        return [x for v in tree for x in _leaves(v)]
    return [np.asarray(tree)]


def test_a_structure_reduced_into_out_returns_that_out_holding_the_result(ranks3):
    """``out=`` of the result's structure (a dict holding a named tuple, a list and a 0-d
    array) gets the result leaf by leaf and is what the call returns, the caller's own
    object, for a combine that writes in place and for one copied there (a mean's float
    scalar and bool counts), blocking and not."""
    for rank_got in on_every_rank(_into_structures, timeout=60):
        for returned_out, same_leaf, equal in rank_got:
            assert returned_out and same_leaf and all(equal)
