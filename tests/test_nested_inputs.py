"""Broadcast inputs that are lists, tuples and dicts of arrays (a model's parameters) reach
GPU ranks on the device, nested ones too, as top-level arrays do; an object holding arrays
is refused at the call, naming the argument and what to do. On CPU ranks they arrive as
they are."""
from collections import namedtuple

import numpy as np
import pytest

import synk

Layer = namedtuple("Layer", "w b")
X = np.random.default_rng(0).standard_normal((10, 3))
W1, B1 = np.random.default_rng(1).standard_normal((3, 4)), np.ones(4)
W2, B2 = np.random.default_rng(2).standard_normal((4, 2)), np.zeros(2)


def forward(x, params):
    xp = synk.xp(x)
    (w1, b1), second = params["layers"][0], params["layers"][1]
    h = xp.tanh(x @ w1 + b1)
    return (h @ second.w + second.b) * params["scale"][0]


def test_arrays_nested_in_broadcast_lists_tuples_and_dicts_reach_the_device(two):
    params = {"layers": [(W1, B1), Layer(W2, B2)], "scale": [np.float64(2.0)]}

    def kinds(x, params):
        xp = synk.xp(x)
        leaves = [params["layers"][0][0], params["layers"][0][1], params["layers"][1].w]
        return [type(params["layers"][1]).__name__, all(isinstance(v, xp.ndarray)
                                                        for v in leaves)]

    f = synk.function(forward, bcast_inputs=["params"], reduce="gather")
    np.testing.assert_allclose(f(X, params), forward(X, params))
    got = synk.function(kinds, bcast_inputs=["params"], reduce=None)(X, params)
    assert got == [["Layer", True]] * 2
    assert type(params["layers"][0][0]) is np.ndarray  # the caller's containers untouched


class Model:
    def __init__(self):
        self.w, self.name = W1, "m"


def test_an_object_holding_arrays_is_refused_at_the_call_on_gpu_ranks(two):
    f = synk.function(lambda x, model: x @ model.w, bcast_inputs=["model"], reduce="gather")
    if two == "cpu":  # host arrays are what CPU ranks compute on
        np.testing.assert_allclose(f(X, Model()), X @ W1)
        return
    with pytest.raises(TypeError, match=r"broadcast input 'model' holds numpy arrays in a "
                                        r"Model object \(attribute 'w'\)"):
        f(X, Model())
    g = synk.function(lambda x, w: x @ w[0], bcast_inputs=["w"], reduce="gather")
    np.testing.assert_allclose(g(X, [W1]), X @ W1)  # the arrays themselves: moved


def test_synk_objects_nested_in_broadcast_inputs_pass_as_they_are(two):
    data = synk.data(np.arange(12.0).reshape(4, 3))  # a Data holds its array by reference

    def total(x, pair):
        return float(pair[0].array.sum()) * pair[1]

    f = synk.function(total, bcast_inputs=["pair"], reduce=None)
    assert f(X, (data, 2.0)) == [132.0, 132.0]
