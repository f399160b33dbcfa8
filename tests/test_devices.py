"""The device layer on the CPU and on the CUDA simulator: transfers, counters, page-locking,
discovery and its errors, and one function running unchanged on both."""
import sys
import threading
import warnings

import numpy as np
import pytest

from synk import simulator as sim

# No public handle: device discovery's cache, and page-locking of a segment of one's own:
# the device layer checked on its own.
from synk._testing import devices, discovery, shm as _shm
from synk.simulator import cupy as sim_cupy


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("SYNK_SIMULATE_GPUS", raising=False)
    discovery._probed.clear()
    yield
    discovery._probed.clear()
    sim.reset_thread()


@pytest.fixture
def simulated(monkeypatch):
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "2")
    discovery._probed.clear()


def loss(x, w):
    """A user's function: the same source on numpy and on device arrays."""
    xp = devices.array_module(x)
    return xp.mean(xp.tanh(x @ w), axis=0)


def test_cpu_device_is_the_identity():
    dev = devices.open("cpu")
    dev.bind()
    x = np.arange(4.0)
    assert dev.is_host and dev.xp is np and dev.device_id is None and dev.name == "cpu"
    assert dev.to_device(x) is x and dev.to_host(x) is x
    assert dev.is_device_array(x) and not dev.register(x)
    assert dev.transfer_counts() == {"h2d": 0, "d2h": 0}


@pytest.mark.gpu
def test_simulated_cuda_device_transfers_and_counts(simulated):
    dev = devices.open("cuda", 1)
    assert (dev.name, dev.device_id, dev.is_host, dev.xp) == ("cuda", 1, False, sim_cupy)
    with pytest.raises(RuntimeError, match="bind"):
        dev.to_device(np.ones(2))
    dev.bind()
    assert sim_cupy.cuda.runtime.getDevice() == 1
    assert sim_cupy.cuda.get_current_stream() == dev.stream and dev.stream.ptr != 0
    sim.reset_transfer_counts()
    host = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = dev.to_device(host)
    assert dev.is_device_array(x) and not dev.is_device_array(host)
    assert x.device.id == 1 and dev.to_device(x) is x
    y = x * 2  # computed on the rank's stream, which bind made current
    np.testing.assert_array_equal(dev.to_host(y), host * 2)
    out = np.empty((3, 4), np.float32)
    assert dev.to_host(y, out=out) is out
    assert dev.to_host(3.5) == 3.5  # host values pass through
    dev.to_device(host[:, ::2])  # not contiguous: copied contiguous first
    dev.synchronize()
    expected = {"h2d": host.nbytes + host.nbytes // 2, "d2h": 2 * host.nbytes}
    assert dev.transfer_counts() == expected == sim.transfer_counts()


@pytest.mark.gpu
def test_same_function_on_cpu_and_on_simulated_device(simulated):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((8, 3)), rng.standard_normal((3, 2))
    want = loss(x, w)
    dev = devices.open("cuda", 0)
    dev.bind()
    got = loss(dev.to_device(x), dev.to_device(w))
    assert devices.array_module(got) is sim_cupy
    np.testing.assert_allclose(dev.to_host(got), want)
    with pytest.raises(TypeError, match="Unsupported type"):
        loss(dev.to_device(x), w)  # forgot to move w: fails as on a GPU


@pytest.mark.gpu
def test_page_locking_once_per_block_with_fallback(simulated):
    dev = devices.open("cuda", 0)
    dev.bind()
    block = _shm.create(_shm.session_prefix() + "pin", 3 * 4096 + 100)
    try:
        view = np.ndarray(100, np.uint8, buffer=block.buf, offset=4096 + 8)
        assert dev.register(block.buf)
        assert dev.register(view)  # the same mapping: registered once, no error 712
        runtime = sim_cupy.cuda.runtime
        with pytest.raises(runtime.CUDARuntimeError):  # really registered, whole pages
            runtime.hostRegister(view.ctypes.data, 1, 0)
        dev.unregister(view)
        dev.unregister(block.buf)  # no longer registered: nothing to do, no error 713
        base = np.frombuffer(block.buf, np.uint8).ctypes.data
        runtime.hostRegister(base, 4096, 0)  # someone else holds it: synk falls back
        from synk._testing import cuda_host

        cuda_host._warned.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not dev.register(block.buf)
            assert not dev.register(block.buf)
        assert len(caught) == 1 and "pageable" in str(caught[0].message)
        runtime.hostUnregister(base)
    finally:
        dev.close()
        _shm.destroy(block)
    assert not sim.page_locked()


def test_discovery_without_gpu_falls_back_and_explains(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # as if CuPy were not installed
    assert devices.resolve_backend("auto") == "cpu"
    assert devices.resolve_backend("cpu") == "cpu"
    with pytest.raises(devices.GpuUnavailableError, match=r'CuPy is not installed \(pip install '
                                                          r'"synk\[gpu\]"\)'):
        devices.resolve_backend("gpu")
    assert "CuPy is not installed" in devices.describe()
    with pytest.raises(ValueError, match="unknown backend"):
        devices.resolve_backend("tpu")


@pytest.mark.gpu
def test_discovery_of_simulated_devices(monkeypatch, simulated):
    assert devices.resolve_backend("auto") == "gpu"
    status = devices.gpu_status()
    assert (status.kind, status.devices, status.xp) == ("sim", [0, 1], sim_cupy)
    assert "2 simulated CUDA devices" in devices.describe()
    with pytest.raises(ValueError, match=r"one of the visible CUDA devices \[0, 1\]"):
        devices.open("cuda", 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(devices.GpuUnavailableError,
                       match=r"no simulated CUDA device visible \(CUDA_VISIBLE_DEVICES=''\)"):
        devices.resolve_backend("gpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert devices.gpu_status().devices == [0]
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "two")
    with pytest.raises(devices.GpuUnavailableError, match="SYNK_SIMULATE_GPUS must be a number"):
        devices.resolve_backend("gpu")


def test_array_module():
    assert devices.array_module(np.ones(2)) is np
    assert devices.array_module(1.5) is np
    assert devices.array_module(np.float32(1)) is np


@pytest.mark.gpu
def test_array_module_of_simulated_arrays(simulated):
    assert devices.array_module(sim_cupy.ones(2)) is sim_cupy


@pytest.mark.gpu
def test_a_new_thread_starts_on_device_zero(simulated):
    dev = devices.open("cuda", 1)
    dev.bind()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(sim_cupy.cuda.runtime.getDevice()))
    thread.start()
    thread.join()
    assert seen == [0]  # as in CUDA: work from other threads must select the device itself
