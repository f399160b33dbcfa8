"""A call that passes what the function's last call passed gets, on every rank, exactly what
it is passed now, whatever changed in between (in place, another shape, a block freed, a
failed call, another group). Each test runs a function twice or more with the same objects,
changes something between the calls, and checks every rank's view against numpy (``two``:
on 2 CPU ranks and 2 simulated GPUs)."""
import math

import numpy as np
import pytest

import synk

pytestmark = pytest.mark.timeout(120)


def _sums(x, w):
    return float(np.sum(x)) + 10_000.0 * float(np.sum(w))


def test_the_same_data_and_shared_see_every_change(two):
    d = synk.data(np.arange(12.0).reshape(6, 2))
    w = synk.shared(np.ones(3))
    f = synk.function(_sums, bcast_inputs=["w"], reduce="sum")
    assert f(d, w) == 66.0 + 2 * 30_000.0
    d[...] = 1.0  # in place: the same block
    assert f(d, w) == 12.0 + 2 * 30_000.0
    w.set_value(np.full(3, 2.0))  # the same shape: every replica written
    assert f(d, w) == 12.0 + 2 * 60_000.0
    w.set_value(np.full(5, 1.0))  # another shape: new replicas
    assert f(d, w) == 12.0 + 2 * 50_000.0
    d.set_value(np.ones((40, 2)))  # a larger block: the Data moved
    assert f(d, w) == 80.0 + 2 * 50_000.0
    assert f(d, w, batch=[0, 1, 2]) == 6.0 + 2 * 50_000.0


def test_a_small_array_changed_in_place_reaches_every_rank_as_it_is_now(two):
    x = np.arange(8.0)
    f = synk.function(lambda x: x.copy(), reduce="gather")
    np.testing.assert_array_equal(f(x), x)
    x[6] = -1.0  # the same object, other bytes (in rank 1's rows)
    np.testing.assert_array_equal(f(x), x)
    y = x.astype(np.float32)  # the same values, another dtype
    out = f(y)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, y)
    z = x.reshape(2, 4)  # the same bytes, another shape
    np.testing.assert_array_equal(f(z), z)


def test_equal_numbers_are_reused_and_a_signed_zero_is_not_taken_for_another(two):
    f = synk.function(lambda x, s: np.full(len(x), math.copysign(1.0, s)),
                      bcast_inputs=["s"], reduce="gather")
    x = synk.data(np.zeros(4))
    assert list(f(x, 0.0)) == [1.0] * 4
    assert list(f(x, -0.0)) == [-1.0] * 4
    g = synk.function(lambda x, k: np.full(len(x), float(k) + 0.5 * (type(k) is bool)),
                      bcast_inputs=["k"], reduce="gather")
    assert list(g(x, 1)) == [1.0] * 4
    assert list(g(x, 1)) == [1.0] * 4
    assert list(g(x, True)) == [1.5] * 4  # True == 1, but not the same argument
    assert list(g(x, 4)) == [4.0] * 4


def test_keywords_and_a_freed_data_block(two):
    f = synk.function(lambda x, *, w: _sums(x, w), reduce="sum")
    d = synk.data(np.ones(4))
    w = synk.shared(np.zeros(2))
    assert f(d, w=w) == 4.0
    assert f(d, w=w) == 4.0
    other = synk.data(np.full(6, 2.0))
    assert f(other, w=w) == 12.0
    other.free()  # the workers unmap its block with the next call
    assert f(d, w=w) == 4.0
    assert f(d, w=w) == 4.0
    with pytest.raises(synk.SynkError):
        f(other, w=w)
    assert f(d, w=w) == 4.0


def test_after_a_failed_call_the_next_one_gets_its_arguments(two):
    def sometimes(x, fail):
        if fail and synk.comm.rank() == 1:
            raise ValueError("rank 1 fails")
        return float(np.sum(x))

    f = synk.function(sometimes, bcast_inputs=["fail"], reduce="sum")
    d = synk.data(np.arange(4.0))
    assert f(d, False) == 6.0
    with pytest.raises(ValueError, match="rank 1 fails"):
        f(d, True)
    assert f(d, False) == 6.0
    assert f(d, False) == 6.0


def _ranks_total(scale=1.0):
    """Every rank's number summed with synk.comm (which keeps a call's collectives apart
    from another's by the call's number), scaled."""
    if synk.comm.rank() == 1 and scale < 0:
        raise ValueError("rank 1 fails before the collective")
    return float(synk.comm.allreduce(np.array([synk.comm.rank() + 1.0]), "sum")[0]) * scale


def test_a_call_repeated_whole_gets_what_it_passes_and_its_own_collectives(ranks2):
    """Each call gets what it passes now and its own collectives (a call's number keeps
    them apart), around other arguments, a failed call, and blocks released in between."""
    f = synk.function(_ranks_total, bcast_inputs=["scale"], reduce="max")
    for _ in range(3):
        assert f() == 3.0
    assert f(2.0) == 6.0
    assert f() == 3.0
    with pytest.raises(ValueError, match="rank 1 fails"):
        f(-1.0)
    for _ in range(2):
        assert f() == 3.0
    g = synk.function(lambda x, w: float(np.sum(x)) * w[0], bcast_inputs=["w"], reduce="sum")
    d, w = synk.data(np.arange(6.0)), synk.shared(np.ones(1))
    for _ in range(3):
        assert g(d, w) == 15.0
    temporary = synk.data(np.ones(4))
    assert f(float(np.sum(temporary.array))) == 12.0
    del temporary  # (its block released: f's call tells the workers)
    assert f() == 3.0
    w.set_value(np.full(1, 2.0))
    for _ in range(2):
        assert g(d, w) == 30.0
        assert f() == 3.0


def test_a_new_group_prepares_the_arguments_again():
    x = np.arange(6.0)
    w = synk.shared(np.ones(2))
    f = synk.function(_sums, bcast_inputs=["w"], reduce="sum")
    for _ in range(2):
        synk.fork(2)
        try:
            assert f(x, w) == 15.0 + 2 * 20_000.0
            assert f(x, w) == 15.0 + 2 * 20_000.0
        finally:
            synk.close()


def test_varargs_and_varkwargs_reach_the_function_as_passed(two):
    def spread(x, *rest, **named):
        return float(np.sum(x)) + sum(float(np.sum(r)) for r in rest) + 100.0 * sum(
            float(np.sum(v)) for v in named.values())

    f = synk.function(spread, bcast_inputs=["rest", "named"], reduce="sum")
    d = synk.data(np.ones(4))
    w = synk.shared(np.full(2, 3.0))
    small = np.arange(3.0)
    for _ in range(2):
        assert f(d, w, small, a=w, b=2) == 4.0 + 2 * (6.0 + 3.0) + 2 * 100.0 * (6.0 + 2.0)
    small[0] = 10.0
    assert f(d, w, small, a=w, b=2) == 4.0 + 2 * (6.0 + 13.0) + 2 * 100.0 * (6.0 + 2.0)
    assert f(d, w, small, b=2, a=w) == 4.0 + 2 * (6.0 + 13.0) + 2 * 100.0 * (6.0 + 2.0)


def test_rows_chosen_anew_at_every_call(two):
    """A call with ``batch=``, ``local_batch=`` or ``num_slices=`` between calls of all the
    rows plans its own rows, and a bad ``num_slices`` is refused at every call."""
    x = np.arange(10.0) ** 2
    d = synk.data(x)
    f = synk.function(lambda x: x.copy(), reduce="gather")
    for _ in range(2):
        np.testing.assert_array_equal(f(d), x)
        np.testing.assert_array_equal(f(d, batch=[7, 1, 1]), x[[7, 1, 1]])
        np.testing.assert_array_equal(f(d, batch=slice(2, 9, 3)), x[2:9:3])
        np.testing.assert_array_equal(f(d, num_slices=3), x)
        np.testing.assert_array_equal(f(d, local_batch=2), x[[0, 1, 5, 6]])
        np.testing.assert_array_equal(f(d), x)
        with pytest.raises(TypeError, match="num_slices"):
            f(d, num_slices=1.0)
    g = synk.function(lambda x: len(x), reduce="sum")
    assert g(d) == 10
    d.set_value(np.ones(6))  # another length
    assert g(d) == 6
    assert g(d) == 6


def _weighted(x, big, small, scale):
    """What a training step's gradient function sees: its rows, a large and a small array
    passed whole (weights), a number."""
    return np.array([float(v) for v in (x.sum(), big.sum(), big[-1, -1], small.sum(),
                                         small[0])]) * scale


def test_weights_changed_every_call_reach_every_rank_as_they_are_now(two):
    """Route A of docs/training.md: the same objects every call, their bytes changed in
    place between calls (a large array staged in shared memory, a small one sent with the
    call); then another shape, and a call after a freed Data."""
    d = synk.data(np.arange(20.0).reshape(10, 2))
    big = np.ones((300, 40))  # 96 KB: staged, not inside the message
    small = np.zeros(3)
    f = synk.function(_weighted, bcast_inputs=["big", "small", "scale"], reduce="sum")

    def expect(batch):
        rows = np.arange(20.0).reshape(10, 2)[batch]
        return np.array([rows.sum(), 2 * big.sum(), 2 * big[-1, -1], 2 * small.sum(),
                         2 * small[0]]) * 0.5

    for step in range(4):
        batch = [step, 9 - step, 4]
        np.testing.assert_array_equal(f(d, big, small, 0.5, batch=batch), expect(batch))
        big[-1, -1] += 1.0 + step
        small += np.array([1.0, 2.0, 3.0])
    other = synk.data(np.ones(4))
    f(other, big, small, 0.5)
    other.free()
    small[0] = -7.0
    big[0, 0] = 5.0
    np.testing.assert_array_equal(f(d, big, small, 0.5, batch=[1, 2]), expect([1, 2]))
    big = np.ones((200, 40))  # another shape
    np.testing.assert_array_equal(f(d, big, small, 0.5, batch=[3, 8]), expect([3, 8]))
    small = small[:2].copy()
    np.testing.assert_array_equal(f(d, big, small, 0.5, batch=[3, 8]), expect([3, 8]))


def _named(x, b=5.0, c=6.0):
    return float(np.sum(x)) + 10.0 * b + c


def _any_args(x, *args, **kw):
    return float(len(args) * 10 + len(kw))


def test_the_same_values_bound_to_other_parameters_are_another_call(two):
    """``f(x, c=7.0)`` then ``f(x, 7.0)``: the same values, the second binds 7.0 to ``b``."""
    x = synk.data(np.zeros((4, 2)))
    f = synk.function(_named, inputs=["x"], reduce=None)
    assert f(x, c=7.0) == [57.0, 57.0]
    assert f(x, 7.0) == [76.0, 76.0]
    assert f(x, c=7.0) == [57.0, 57.0]
    v = synk.function(_any_args, inputs=["x"], reduce=None)
    assert v(x, k=2) == [1.0, 1.0]
    assert v(x, 2) == [10.0, 10.0]
