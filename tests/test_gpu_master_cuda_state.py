"""Outside synk's calls the master's CUDA state is the user's: fork() on GPUs leaves the
master's current device and stream as they were (the script's own CuPy work between calls
stays ordered with the legacy default stream, where torch and Numba work), and so do calls
and close(). Under the simulator here; for real with CUDA."""
import numpy as np
import pytest
from conftest import REAL, use_devices

import synk

pytestmark = pytest.mark.gpu


@pytest.fixture
def xp(monkeypatch):
    """The CuPy the group runs on (the simulator's here), its thread state reset after."""
    use_devices(monkeypatch, 2)
    xp = pytest.importorskip("cupy") if REAL else synk.simulator.cupy
    xp.cuda.Device(0).use()
    yield xp
    xp.cuda.Device(0).use()
    if not REAL:
        synk.simulator.reset_thread()


def _state(xp):
    return xp.cuda.runtime.getDevice(), xp.cuda.get_current_stream().ptr


def _double(x):
    return x * 2


def _column_sums(x):
    return (x * 2).sum(axis=0)


@pytest.mark.parametrize(
    "devices", [None, pytest.param([1, 0], marks=pytest.mark.one_gpu_per_rank(2))],
    ids=["default", "devices=[1, 0]"])
def test_fork_calls_and_close_leave_the_masters_device_and_stream_as_they_were(xp, devices):
    before = _state(xp)  # device 0, its default stream (the legacy null stream)
    synk.fork(2, backend="gpu", devices=devices)
    try:
        assert _state(xp) == before, "fork() changed the master's current device or stream"
        f = synk.function(_double, reduce="gather")
        x = np.arange(12.0).reshape(6, 2)
        np.testing.assert_array_equal(f(x), x * 2)
        assert _state(xp) == before, "a call changed the master's current device or stream"
        last = xp.cuda.runtime.getDeviceCount() - 1  # another device, where there is one
        with xp.cuda.Device(last):
            s = xp.cuda.Stream(non_blocking=True)
            with s:  # the user's own stream (on another device), current across a call
                np.testing.assert_array_equal(f(x), x * 2)
                assert _state(xp) == (last, s.ptr)
        assert _state(xp) == before
    finally:
        synk.close()
    assert _state(xp) == before, "close() left the master on another device or stream"


def test_the_scripts_cupy_work_between_calls_stays_ordered_with_the_null_stream(xp):
    """An array the script makes between calls is written on its current stream; torch,
    Numba and ``Stream.null`` work on the legacy default stream, which waits for blocking
    streams only: had fork() left synk's non-blocking stream current, the read below would
    be unordered with the write (the simulator's RaceError; wrong values on a GPU)."""
    synk.fork(2, backend="gpu")
    try:
        f = synk.function(_column_sums, reduce="sum")
        assert f(np.ones((4, 3))).tolist() == [8.0, 8.0, 8.0]
        a = xp.arange(1000, dtype=xp.float32)  # the script's own work, between calls
        with xp.cuda.Stream.null:  # as torch's or Numba's default stream
            b = a * 2
        np.testing.assert_array_equal(b.get(), np.arange(1000, dtype=np.float32) * 2)
        assert f(np.ones((4, 3))).tolist() == [8.0, 8.0, 8.0]
    finally:
        synk.close()


def _add_one(w):
    w += 1
    return float(w.sum())


def test_synks_work_in_the_master_is_ordered_with_the_scripts_current_stream(xp):
    """The script's own stream and synk's meet through events: synk's work is ordered after
    what the script queued on its current stream (the master's replica written in place),
    and the script's later work after synk's (a replica set by synk, read by the script)."""
    before = _state(xp)
    synk.fork(2, backend="gpu")
    try:
        w = synk.shared(np.zeros(1000, np.float32))
        f = synk.function(_add_one, reduce=None)
        assert f(w) == [1000.0, 1000.0]
        w.value[...] = 5.0  # the master's replica, written by the script on its stream
        assert f(w) == [6000.0, 2000.0]
        w.set_value(np.full(1000, 2.0, np.float32))  # synk writes every replica
        assert float((w.value * 2).sum()) == 4000.0  # the script reads it on its stream
        assert _state(xp) == before
    finally:
        synk.close()
