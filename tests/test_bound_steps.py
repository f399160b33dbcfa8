"""A bound step (``Function.bind``): a Data and a shared variable bound are live (every call
sees their contents now), every other bound value is the one it had when bound, the
arguments of a call are added as ``functools.partial`` adds them, and a step ends with its
group or ``close()``. On 2 CPU ranks and 2 simulated GPUs (``two``); checked against numpy."""
import numpy as np
import pytest

import synk

pytestmark = pytest.mark.timeout(120)


def _weighted(x, w, scale=1.0):
    return (x * w).sum(axis=1) * scale


def _gathered(**kwargs):
    return synk.function(_weighted, bcast_inputs=["w", "scale"], reduce="gather", **kwargs)


def test_bound_data_and_shared_are_live_and_plain_values_are_kept_as_bound(two):
    x = np.arange(12.0).reshape(6, 2)
    d = synk.data(x.copy())
    w = synk.shared(np.array([1.0, 2.0]))
    f = _gathered()
    step = f.bind(d, w)
    np.testing.assert_array_equal(step(), _weighted(x, [1.0, 2.0]))
    d[...] = 1.0  # in place: every rank reads it now
    w.set_value(np.array([3.0, -1.0]))
    np.testing.assert_array_equal(step(), _weighted(np.ones((6, 2)), [3.0, -1.0]))

    plain_w = np.array([1.0, 1.0])
    plain_x = x.copy()
    kept = f.bind(plain_x, plain_w, scale=2.0)
    plain_x[...] = -5.0  # changed after bind: the step keeps what it was bound with
    plain_w[0] = 100.0
    np.testing.assert_array_equal(kept(), _weighted(x, [1.0, 1.0], 2.0))
    np.testing.assert_array_equal(kept(scale=3.0), _weighted(x, [1.0, 1.0], 3.0))
    np.testing.assert_array_equal(kept(), _weighted(x, [1.0, 1.0], 2.0))  # (not kept)
    kept.rebind(plain_x, plain_w)
    np.testing.assert_array_equal(kept(), _weighted(plain_x, plain_w))


def test_per_call_arguments_and_options_follow_the_bound_ones(two):
    x = np.arange(20.0).reshape(10, 2)
    f = _gathered()
    step = f.bind(synk.data(x))
    for w in ([1.0, 0.0], [0.5, 2.0]):
        np.testing.assert_array_equal(step(np.array(w)), _weighted(x, w))
        np.testing.assert_array_equal(step(np.array(w), batch=[9, 0, 3]),
                                      _weighted(x[[9, 0, 3]], w))
        np.testing.assert_array_equal(step(w=np.array(w), scale=-1.0), _weighted(x, w, -1.0))
    with pytest.raises(TypeError, match="multiple values"):
        f.bind(x, np.ones(2))(1.0, w=np.ones(2))
    with pytest.raises(TypeError, match="options of each call"):
        f.bind(x, batch=3)


def test_a_keyword_bound_then_a_value_by_position_bind_each_to_its_parameter(two):
    def f(x, b=5.0, c=6.0):
        return x.sum() * 0 + 10 * b + c

    F = synk.function(f, bcast_inputs=["b", "c"], reduce="max")
    x = np.ones(4)
    assert F.bind(x, c=7.0)() == 57.0
    assert F.bind(x, 7.0)() == 76.0
    assert F.bind(x)(7.0, c=1.0) == 71.0


def test_a_closed_step_and_a_step_of_an_ended_group_raise(two):
    f = _gathered()
    step = f.bind(np.ones((4, 2)), np.ones(2))
    step.close()
    with pytest.raises(synk.StepClosedError, match="closed"):
        step()
    with f.bind(np.ones((4, 2)), np.ones(2)) as other:
        assert len(other()) == 4
    with pytest.raises(synk.StepClosedError):
        other.submit()
    old = f.bind(np.ones((4, 2)), np.ones(2))
    synk.close()
    synk.fork(2, backend=two)
    with pytest.raises(synk.StepClosedError, match="another group"):
        old()
    with pytest.raises(synk.StepClosedError, match="another group"):
        old.rebind(np.ones((4, 2)), np.ones(2))
    assert len(f.bind(np.ones((4, 2)), np.ones(2))()) == 4  # bound again: fine


def _parts(x, big, small, k):
    return np.array([float(v) for v in (x.sum(), big.sum(), big[-1, -1], small.sum(), k)])


def test_the_workers_keep_a_steps_values_and_get_them_again_when_they_drop_them(two):
    """A step's plain values (a large array staged in the step's own block, a small one, a
    number) are sent once and kept by the workers under the step's number: the one rule
    is that the workers drop them with every released or moved block (and a failed call
    may leave them unkept), after which the next call sends them again. Each case below
    fails if that rule is wrong (a worker refuses a step it does not hold, or reads a
    value it dropped)."""
    d = synk.data(np.arange(20.0).reshape(10, 2))
    big = np.arange(12_000.0).reshape(300, 40)  # 96 KB: staged, not inside the message
    small = np.array([1.0, 2.0, 3.0])
    f = synk.function(_parts, bcast_inputs=["big", "small", "k"], reduce="gather")
    step = f.bind(d, big, small, 7)
    other = f.bind(d, np.ones((300, 40)), np.zeros(3), 1)  # its own number and block

    def expect(s, b, k, rows=slice(None)):
        x = np.arange(20.0).reshape(10, 2)[rows]
        per_rank = [x[:len(x) // 2 + len(x) % 2], x[len(x) // 2 + len(x) % 2:]]
        return np.array([[p.sum(), b.sum(), b[-1, -1], s.sum(), k] for p in per_rank])

    want = expect(small, big, 7.0).reshape(-1)
    for _ in range(2):
        np.testing.assert_array_equal(step(), want)
        np.testing.assert_array_equal(other(), expect(np.zeros(3), np.ones((300, 40)),
                                                      1.0).reshape(-1))
    temporary = synk.data(np.ones(4))
    del temporary  # released: the workers drop what they keep with the next call
    np.testing.assert_array_equal(step(batch=[0, 1, 2, 3]),
                                  expect(small, big, 7.0, [0, 1, 2, 3]).reshape(-1))
    np.testing.assert_array_equal(other(), expect(np.zeros(3), np.ones((300, 40)),
                                                  1.0).reshape(-1))
    d.set_value(np.arange(20.0).reshape(10, 2))  # (the same block: nothing dropped)
    with pytest.raises(TypeError, match="too many positional"):
        step(1)  # (refused before anything is sent)
    np.testing.assert_array_equal(step(), want)
    other.close()  # its values and its block go with the next call
    np.testing.assert_array_equal(step(), want)
    np.testing.assert_array_equal(step.submit().result(), want)


def _fails_when(x, small, fail):
    if fail and synk.rank() == 1:
        raise ValueError("rank 1 fails")
    return x.sum() + small.sum()


def test_a_step_after_a_failed_call_sends_its_values_again(two):
    f = synk.function(_fails_when, bcast_inputs=["small", "fail"], reduce="sum")
    step = f.bind(synk.data(np.ones(6)), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="rank 1 fails"):
        step(True)  # (its first call: a worker may not have kept the values)
    assert step(False) == 6.0 + 2 * 3.0
    with pytest.raises(ValueError, match="rank 1 fails"):
        step(True)
    assert step(False) == 6.0 + 2 * 3.0


def test_a_step_called_with_nothing_more_is_held_whole_and_sent_again_when_dropped(two):
    """A step whose bound values are all plain, called with nothing more, is the same call
    every time: the workers keep its whole task under the step's number, by the rule of its
    values (dropped with every released block, a closed step, a failed call). Each case
    fails if that rule is wrong: a worker refuses a task it does not hold, or runs one it
    should have dropped."""
    x = np.arange(20.0).reshape(10, 2)
    big = np.arange(12_000.0).reshape(300, 40)  # staged in the step's own block
    small = np.array([1.0, 2.0, 3.0])
    f = synk.function(_parts, bcast_inputs=["big", "small", "k"], reduce="gather")
    step = f.bind(x, big, small, 7)

    def expect(xs, b, s, k):
        halves = [xs[:len(xs) - len(xs) // 2], xs[len(xs) - len(xs) // 2:]]
        return np.array([[h.sum(), b.sum(), b[-1, -1], s.sum(), k] for h in halves]).ravel()

    want = expect(x, big, small, 7.0)
    for _ in range(3):  # the first sends the task whole, the others its number
        np.testing.assert_array_equal(step(), want)
    np.testing.assert_array_equal(step(batch=[0, 1, 2, 3]), expect(x[:4], big, small, 7.0))
    np.testing.assert_array_equal(step(), want)
    temporary = synk.data(np.ones(4))
    del temporary  # released: the workers drop what they keep with the next call
    np.testing.assert_array_equal(step(), want)
    np.testing.assert_array_equal(step(), want)
    other = f.bind(np.ones((4, 2)), np.zeros((300, 40)), np.zeros(3), 1)
    np.testing.assert_array_equal(other(), expect(np.ones((4, 2)), np.zeros((300, 40)),
                                                  np.zeros(3), 1.0))
    other.close()  # its number goes with the next call; this step's task stays
    np.testing.assert_array_equal(step(), want)
    futures = [step.submit() for _ in range(5)]
    for future in futures:
        np.testing.assert_array_equal(future.result(), want)
    step.rebind(x[:6], big * 2, small, 9)
    np.testing.assert_array_equal(step(), expect(x[:6], big * 2, small, 9.0))
    np.testing.assert_array_equal(step(), expect(x[:6], big * 2, small, 9.0))


def _fails_at_second_call(x, small):
    import builtins
    calls = getattr(builtins, "_synk_test_bound_calls", 0)
    builtins._synk_test_bound_calls = calls + 1
    if synk.rank() == 1 and calls == 1:
        raise ValueError("rank 1 fails")
    return x.sum() + small.sum()


def test_a_step_held_whole_is_sent_again_after_a_failed_call(two):
    f = synk.function(_fails_at_second_call, bcast_inputs=["small"], reduce="sum")
    step = f.bind(np.ones(6), np.array([1.0, 2.0]))
    try:
        assert step() == 6.0 + 2 * 3.0
        with pytest.raises(ValueError, match="rank 1 fails"):
            step()
        for _ in range(2):
            assert step() == 6.0 + 2 * 3.0
    finally:
        import builtins
        vars(builtins).pop("_synk_test_bound_calls", None)


class Tagged(list):
    """A list with an attribute of its own."""


def _described(v):
    return type(v).__name__, getattr(v, "tag", None), list(v)


def test_a_bound_list_subclass_arrives_as_itself(two):
    """Bound, as passed per call: the subclass and its attributes (a plain list, tuple or
    dict is kept item by item)."""
    tagged = Tagged([1, 2])
    tagged.tag = "x"
    f = synk.function(_described, bcast_inputs=["v"], reduce=None)
    want = (["Tagged"] * 2, ["x"] * 2, [[1, 2]] * 2)  # (each output: every rank's)
    assert f(tagged) == f.bind(tagged)() == f.bind(v=tagged)() == want
