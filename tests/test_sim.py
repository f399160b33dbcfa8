"""The CUDA simulator's own strictness: every check that stands in for a GPU's behaviour."""
import pickle

import numpy as np
import pytest

from synk import simulator as sim
from synk.simulator import cupy as cp

runtime = cp.cuda.runtime

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("two_sim_devices")]


MESSAGE = ("Implicit conversion to a NumPy array is not allowed. "
           "Please use `.get()` to construct a NumPy array explicitly.")


def test_implicit_conversion_to_numpy_raises_as_cupy_does():
    x = cp.asarray(np.arange(6.0).reshape(2, 3))
    for convert in (np.asarray, np.array, lambda a: np.concatenate([a.get(), a])):
        with pytest.raises(TypeError) as err:
            convert(x)
        assert str(err.value) in (MESSAGE, f"Unsupported type {np.ndarray}")
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    np.testing.assert_array_equal(x.get(), np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(cp.asnumpy(x), np.arange(6.0).reshape(2, 3))
    one = x[1, 2]
    assert one.item() == 5.0 and float(one) == 5.0 and int(one) == 5 and bool(one)
    with pytest.raises(ValueError, match="size 1"):
        x.item()


def test_host_arrays_in_device_math_raise():
    x = cp.ones(3)
    with pytest.raises(TypeError, match="Unsupported type"):
        x + np.ones(3)
    with pytest.raises(TypeError, match="Unsupported type"):
        np.ones(3) * x
    with pytest.raises(TypeError, match="Unsupported type"):
        cp.maximum(x, np.zeros(3))
    with pytest.raises(TypeError, match="Unsupported type"):
        x[:2] = np.zeros(2)
    x[:2] = 7  # scalars are fine
    assert x.get().tolist() == [7.0, 7.0, 1.0]


def test_math_matches_numpy():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 4)).astype(np.float32)
    b = rng.standard_normal((4, 3)).astype(np.float32)
    da, db = cp.asarray(a), cp.asarray(b)
    checks = [
        (cp.mean(da), a.mean()), (cp.sum(da, axis=0, keepdims=True), a.sum(0, keepdims=True)),
        (da @ db, a @ b), (cp.dot(da, db), a.dot(b)), (cp.exp(da), np.exp(a)),
        (cp.log(cp.abs(da)), np.log(np.abs(a))), (cp.tanh(da), np.tanh(a)),
        (cp.maximum(da, 0), np.maximum(a, 0)), (cp.where(da > 0, da, -da), np.abs(a)),
        (cp.concatenate([da, da]), np.concatenate([a, a])), (cp.stack([da, da]), np.stack([a, a])),
        (da[1:3, ::2], a[1:3, ::2]), (da[cp.asarray([4, 0])], a[[4, 0]]),
        (da[da > 0], a[a > 0]), (da.reshape(2, 10), a.reshape(2, 10)), (da.T, a.T),
        (da.astype(cp.float64), a.astype(np.float64)), (da.max(axis=1), a.max(1)),
        (cp.argmax(da, axis=0), a.argmax(0)), (da.std(), a.std()), (np.mean(da, axis=1), a.mean(1)),
        (cp.arange(5), np.arange(5)), (cp.zeros((2, 2)), np.zeros((2, 2))),
        (cp.linalg.norm(da), np.linalg.norm(a)), (-da, -a), (da ** 2, a ** 2), (2 - da, 2 - a),
    ]
    for got, want in checks:
        assert isinstance(got, cp.ndarray), type(got)
        np.testing.assert_allclose(got.get(), want, rtol=1e-6)
    c = da.copy()
    c += 1
    c[0] = 0
    want = a + 1
    want[0] = 0
    np.testing.assert_allclose(c.get(), want, rtol=1e-6)
    assert isinstance(cp.random.randn(3, 2), cp.ndarray)
    assert pickle.loads(pickle.dumps(da)).get().tolist() == a.tolist()


def test_uninitialised_memory_is_poisoned():
    with cp.cuda.Stream():  # a stream of its own: fresh memory, not a block reused from the pool
        assert np.isnan(cp.empty(4).get()).all()
        assert (cp.empty(4, dtype=cp.int32).get() == -1).all()


def test_unmodelled_numpy_function_raises_clearly():
    with pytest.raises(sim.NotModelled, match="numpy.fft"):
        np.fft.fft(cp.ones(4))


def test_arrays_belong_to_their_device():
    x = cp.ones(3)
    with cp.cuda.Device(1):
        with pytest.raises(ValueError, match=r"resides \(0\) is different from the current "
                                             r"device \(1\)"):
            x * 2
        y = cp.ones(3)
    assert y.device.id == 1
    with pytest.raises(ValueError, match="Peer access is unavailable"):
        x + y
    s = cp.cuda.Stream()
    with cp.cuda.Device(1):
        with pytest.raises(RuntimeError, match=r"stream is created on \(0\) does not match"):
            s.use()


def test_unsynchronised_use_across_streams_is_a_race():
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with s1:
        x = cp.arange(4.0) * 2
    with s2:
        with pytest.raises(sim.RaceError, match="race"):
            x + 1
    event = s1.record()
    s2.wait_event(event)
    with s2:
        assert (x + 1).get(stream=s2).tolist() == [1.0, 3.0, 5.0, 7.0]
    with s1:
        y = cp.ones(2)
    s1.synchronize()  # the host saw s1 finish: work launched after it is ordered after it
    with s2:
        assert (y * 3).get(stream=s2).tolist() == [3.0, 3.0]
    with s2:
        with pytest.raises(sim.RaceError, match="overwritten while being read"):
            z = x[:2] + y  # x read on s2 ...
            with s1:
                x[0] = 5  # ... then written on s1 without waiting for s2
        del z


def test_missing_synchronisation_leaves_poison_in_pinned_memory():
    s = cp.cuda.Stream(non_blocking=True)
    host = np.zeros(1024, np.float64)
    ptr = host.ctypes.data
    runtime.hostRegister(ptr, host.nbytes, 0)
    try:
        with s:
            x = cp.arange(1024, dtype=cp.float64)
        x.get(stream=s, out=host, blocking=False)
        assert np.isnan(host).all()  # read before synchronising: garbage, not the numbers
        s.synchronize()
        np.testing.assert_array_equal(host, np.arange(1024.0))
        # host -> device from pinned memory reads the source when the stream gets to it
        host[:] = 1
        d = cp.empty(1024, cp.float64)
        with s:
            d.set(host, stream=s)
        host[:] = 2  # changed before the copy ran: the device sees the change
        assert d.get(stream=s)[0] == 2
    finally:
        runtime.hostUnregister(ptr)
    host[:] = 3  # pageable again: the copy takes the data when called
    d.set(host, stream=s)
    host[:] = 4
    assert d.get(stream=s)[0] == 3


def test_host_register_errors_are_cudas():
    buf = np.zeros(4096, np.uint8)
    ptr = buf.ctypes.data
    runtime.hostRegister(ptr, 4096, 0)
    try:
        with pytest.raises(runtime.CUDARuntimeError) as err:
            runtime.hostRegister(ptr, 4096, 0)
        assert err.value.status == 712
        assert str(err.value).startswith("cudaErrorHostMemoryAlreadyRegistered: part or all of "
                                         "the requested memory range is already mapped")
        with pytest.raises(runtime.CUDARuntimeError) as err:
            runtime.hostRegister(ptr + 1024, 1024, 0)  # overlapping counts too
        assert err.value.status == 712
        with pytest.raises(runtime.CUDARuntimeError) as err:
            runtime.hostUnregister(ptr + 1024)
        assert err.value.status == 713
        assert str(err.value).startswith("cudaErrorHostMemoryNotRegistered: pointer does not "
                                         "correspond to a registered memory region")
    finally:
        runtime.hostUnregister(ptr)
    with pytest.raises(runtime.CUDARuntimeError) as err:
        runtime.hostUnregister(ptr)
    assert err.value.status == 713
    again = pickle.loads(pickle.dumps(err.value))
    assert again.status == 713 and str(again) == str(err.value)


@pytest.mark.parametrize("count, visible, expected", [
    ("4", None, 4), ("4", "1,3", 2), ("4", "2,7,1", 1), ("4", "0,0", 1), ("2", "-1", 0),
    ("2", "", 0), ("3", "2", 1),
])
def test_device_count_honours_cuda_visible_devices(monkeypatch, count, visible, expected):
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", count)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert sim.device_count() == expected
    if expected:
        assert runtime.getDeviceCount() == expected
        with pytest.raises(runtime.CUDARuntimeError) as err:
            runtime.setDevice(expected)
        assert err.value.status == 101
    else:
        with pytest.raises(runtime.CUDARuntimeError) as err:
            runtime.getDeviceCount()
        assert err.value.status == 100


def test_transfer_counters():
    sim.reset_transfer_counts()
    x = cp.asarray(np.ones(100, np.float32))
    x.get()
    float(x.sum())
    y = cp.empty(10, cp.float64)
    y.set(np.zeros(10))
    assert sim.transfer_counts() == {"h2d": 400 + 80, "d2h": 400 + 4}
