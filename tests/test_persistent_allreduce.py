"""Persistent allreduces (``synk.comm.allreduce_init``): bound once, checked across the
ranks then, each use gives what ``synk.comm.allreduce`` gives of the arrays' contents now
(the same bits: weighted means included), blocking or started; a handle kept on a rank
serves later calls of its group; a freed one, or one of a group that ended, raises. On 3
CPU ranks and 2 simulated GPUs (``three``, ``two``)."""
import numpy as np
import pytest

import synk

pytestmark = pytest.mark.timeout(120)

_KEPT: dict = {}  # a rank's handles, kept across calls (a worker's state, and the master's)


def _uses(x, op, form):
    """The rank's value of each step's mean through a persistent allreduce and through
    ``allreduce``, three times with new contents, blocking and started; whether their bits
    agree."""
    xp = synk.xp(x)
    rank = synk.comm.rank()
    if form == "array":
        bound = xp.zeros_like(x[0])
    elif form == "list":
        bound = [xp.zeros_like(x[0]), xp.zeros((2, 3), x.dtype)]
    else:
        bound = {"b": xp.zeros(5, x.dtype), "a": xp.zeros_like(x[0])}
    real_op = "mean" if op == "weighted" else op
    p = synk.comm.allreduce_init(bound, real_op)
    same = []
    for k in range(3):
        values = bound if isinstance(bound, list) else (
            list(bound.values()) if isinstance(bound, dict) else [bound])
        for v in values:
            v[...] = x.sum() + xp.arange(v.size, dtype=v.dtype).reshape(v.shape) / 3 + \
                k * (rank + 1) / 7
        weight = len(x) if op == "weighted" else None
        want = synk.comm.allreduce(bound, real_op, weight=weight)
        got = p(weight=weight) if k % 2 == 0 else p.start(weight=weight).wait()
        leaves = zip(*(v if isinstance(v, list) else list(v.values()) if isinstance(v, dict)
                       else [v] for v in (got, want)))
        same.append(all(bool((a == b).all()) and a.dtype == b.dtype for a, b in leaves))
    p.free()
    return all(same)


@pytest.mark.parametrize("op", ["sum", "max", "mean", "weighted"])
@pytest.mark.parametrize("form", ["array", "list", "dict"])
def test_a_persistent_allreduce_gives_allreduces_bits(three, op, form):
    x = np.random.default_rng(3).standard_normal((30, 4)).astype(np.float32)
    f = synk.function(_uses, inputs=["x"], bcast_inputs=["op", "form"], reduce=None)
    assert f(x, op, form) == [True] * synk.size()


def _binds_its_own(x):
    xp = synk.xp(x)
    return synk.comm.allreduce_init(xp.zeros(3 + synk.comm.rank()), "sum")


def test_ranks_that_bind_different_arrays_raise_when_it_is_made(three):
    f = synk.function(_binds_its_own, reduce=None)
    with pytest.raises(ValueError, match=r"rank 0: \(3,\) float64, rank 1: \(4,\)"):
        f(np.ones((3, 2)))
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones((3, 2))) == 6.0


def _kept_across_calls(x, key):
    """A handle made at the first call and kept in the rank's own state after it."""
    if key not in _KEPT:
        buffer = synk.xp(x).zeros(2)
        _KEPT[key] = (buffer, synk.comm.allreduce_init(buffer, "sum"))
    buffer, p = _KEPT[key]
    buffer[...] = x.sum(axis=0)
    return p()


def test_a_handle_kept_on_the_rank_serves_later_calls_of_its_group(two, request):
    key = request.node.name
    f = synk.function(_kept_across_calls, inputs=["x"], bcast_inputs=["key"], reduce=None)
    x = np.arange(8.0).reshape(4, 2)
    for k in range(3):
        got = f(x + k, key)
        assert all(np.array_equal(np.asarray(g), (x + k).sum(axis=0)) for g in got)
    _KEPT.pop(key)  # (the master's: its group ends with the test)


def _freed(x):
    p = synk.comm.allreduce_init(synk.xp(x).zeros(2))
    p.free()
    p()


def test_a_freed_handle_and_one_of_an_ended_group_raise(ranks2):
    with pytest.raises(synk.SynkError, match="was freed"):
        synk.function(_freed, reduce=None)(np.ones((2, 2)))
    key = "ended"
    f = synk.function(_kept_across_calls, inputs=["x"], bcast_inputs=["key"], reduce=None)
    f(np.ones((2, 2)), key)
    synk.close()
    synk.fork(1)  # (rank 0 alone: its handle is of the group that ended)
    try:
        with pytest.raises(synk.SynkError, match="made in another group"):
            f(np.ones((2, 2)), key)
    finally:
        _KEPT.pop(key, None)
