"""What a call does inside, where no public handle shows it: the frames of the array kinds at
synk's edge (torch tensors and JAX arrays to numpy and back, without a copy where the
framework allows it), JAX's own put making a rank's JAX arrays of numpy memory, the device
copies each rank keeps of a resident Data, and the modules of a call's hot path that read
the profiler's clock.

It reaches synk's internals (``synk._testing``) for those records alone; the behaviour around
them is tested through the public API in test_arrays.py, test_frameworks_jax.py,
test_resident.py and test_profile.py."""
import sys
import time

import numpy as np
import pytest
from conftest import REAL, on_every_rank, use_devices

import synk
from synk._testing import PROFILED_MODULES, arrays, jax_direct_put, process


# ================================================ array frames (from test_arrays.py)
# (no public handle: the zero-copy view synk takes of a tensor inside calls and comm)
@pytest.mark.frameworks
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_torch_round_trips_without_copies():
    torch = pytest.importorskip("torch", reason="needs torch: pip install 'synk[torch]'")
    for dtype in (torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                  torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint16):
        t = torch.ones(3, dtype=dtype)
        native, frame = arrays.native(t)
        assert isinstance(native, np.ndarray) and native.ctypes.data == t.data_ptr()
        back = arrays.restore(native, frame)
        assert back.dtype == dtype and back.data_ptr() == t.data_ptr()
    b = torch.tensor([1.0, -2.5, 3e38], dtype=torch.bfloat16)
    native, frame = arrays.native(b)
    assert native.dtype == np.uint16 and native.ctypes.data == b.data_ptr()  # 16 bits
    assert torch.equal(arrays.restore(native, frame), b)
    as_float, _ = arrays.native(b, math=True)
    assert as_float.dtype == np.float32 and torch.equal(arrays.restore(as_float * 1, frame), b)
    graded = torch.ones(2, requires_grad=True)
    assert arrays.native(graded)[1].grad
    read_only = np.ones(3)
    read_only.flags.writeable = False
    copied = arrays.restore(read_only, frame.replace(dtype="float64"))
    assert copied.data_ptr() != read_only.ctypes.data  # a shared input: torch gets a copy
    # a 0-d result combined on the host (a GPU rank's small output) can be numpy's float64,
    # which is also a Python float: a tensor again all the same; a Python number stays one
    scalar = arrays.restore(np.float64(2.5), frame.replace(dtype="float64"))
    assert isinstance(scalar, torch.Tensor) and scalar.dtype == torch.float64
    assert scalar.item() == 2.5 and arrays.restore(2.5, frame) == 2.5
    with pytest.raises(TypeError, match=r"torch.complex32 .* x.to\(torch.complex64\)"):
        arrays.native(torch.zeros(2, dtype=torch.complex32))
    with pytest.raises(TypeError, match="dense"):
        arrays.native(torch.zeros(2, 2).to_sparse())


@pytest.mark.frameworks
def test_jax_round_trips():
    jax = pytest.importorskip("jax", reason="needs JAX: pip install 'synk[jax]'")
    import jax.numpy as jnp

    x = jax.device_put(jnp.arange(6.0).reshape(2, 3), jax.devices("cpu")[0])  # (a GPU
    native, frame = arrays.native(x)  # array's native is CuPy's: tests/test_gpu*.py)
    assert isinstance(native, np.ndarray) and frame.kind == "jax"
    back = arrays.restore(native, frame)
    assert isinstance(back, jax.Array) and back.dtype == x.dtype
    b = jnp.asarray([1.0, 2.5], jnp.bfloat16)
    native, frame = arrays.native(b)
    assert native.dtype == np.uint16
    assert arrays.restore(native, frame).dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="float8"):
        arrays.native(jnp.zeros(2, jnp.float8_e4m3fn))
    block = synk.data(np.zeros(1 << 16, np.float32))  # page-aligned shared memory
    try:
        aliased = arrays.restore(block.array, frame.replace(dtype="float32"))
        assert aliased.unsafe_buffer_pointer() == block.array.ctypes.data  # no copy
    finally:
        block.free()


# ================================================ JAX's put (from test_frameworks_jax.py)
# (no public handle: which of JAX's ways made the rank's arrays of numpy memory)
@pytest.fixture(params=["cpu", "gpu"])
def two_ranks(request, monkeypatch):
    """2 CPU ranks, then 2 simulated GPUs (on real GPUs a rank's JAX arrays are made of
    its device memory by DLPack, not by JAX's put: test_framework_values_on_real_gpus.py)."""
    pytest.importorskip("jax", reason="the JAX tests need JAX: pip install 'synk[jax]'")
    if request.param == "gpu":
        if REAL:
            pytest.skip("JAX's put of host memory: on real GPUs the arrays come by DLPack")
        use_devices(monkeypatch, 2)
    synk.fork(2, backend=request.param)
    yield
    synk.close()


_HELD: list = []


def _keep_and_describe(x, y):
    """Whether a rank's JAX inputs are like jnp.asarray's; the inputs kept so far, as they
    read now; whether JAX's put made them directly."""
    import jax.numpy as jnp

    _HELD.append(x)
    return ([_description(v) == _description(jnp.asarray(np.asarray(v))) for v in (x, y)],
            [np.asarray(v).ravel().tolist() for v in _HELD],
            jax_direct_put() is not None)


def _description(value) -> tuple:
    return (type(value), value.dtype, value.shape, value.aval.weak_type,
            getattr(value, "_committed", None), value.sharding)


@pytest.mark.frameworks
@pytest.mark.timeout(300)
def test_jax_arrays_synk_makes_are_what_jnp_asarray_makes(two_ranks):
    """The JAX arrays synk makes of its memory (the rows and broadcast values a function
    gets, the combined outputs the caller gets) are like jnp.asarray's in type, dtype,
    weak type, placement and value, are made by JAX's put itself on every rank (JAX on the
    host, simulated GPU ranks included), and keep their values when synk writes that memory
    again."""
    jnp = pytest.importorskip("jax.numpy")
    describe = synk.function(_keep_and_describe, bcast_inputs=["y"], reduce=None)
    total = synk.function(lambda x, y: x.sum() * y, bcast_inputs=["y"], reduce="sum")
    _HELD.clear()
    try:
        for call in range(3):
            x = jnp.arange(6, dtype=jnp.float32).reshape(6, 1) + 10 * call
            y = jnp.asarray(np.int32(call + 2))
            alikes, kepts, directs = describe(x, y)
            for r, (alike, kept, direct) in enumerate(zip(alikes, kepts, directs)):
                assert alike == [True, True], (call, r)
                assert kept == [[10.0 * c + 3 * r + i for i in range(3)]
                                for c in range(call + 1)], (call, r)
                assert direct, r
            out = total(x, y)
            assert _description(out) == _description(jnp.asarray(np.asarray(out)))
            assert float(out) == float(x.sum()) * (call + 2)
    finally:
        _HELD.clear()


# ================================================ device copies a rank keeps
# (from test_resident.py)
# (no public handle: which device copies each rank holds, synk's record of them)
X = np.random.default_rng(0).standard_normal((23, 3))


def _sum(x):
    return x.sum(axis=0)


def test_free_and_to_host_drop_the_device_copies(gpu_ranks_then_cpu):
    ranks = gpu_ranks_then_cpu
    if synk.devices()[0] is None:
        pytest.skip("GPU ranks keep device copies")
    x, y = synk.data(X), synk.data(X * 2)
    for d in (x, y):
        d.to_device("shard")
    f = synk.function(_sum, reduce="sum")
    f(x)
    f(y)

    def resident(arg):
        return sorted(process().resident)

    held = on_every_rank(resident)
    assert all(len(keys) == 2 for keys in held)
    x.free()
    y.to_host()
    assert on_every_rank(resident) == [[]] * ranks
    z = synk.data(X)
    z.to_device("replicate")
    f(z)
    assert all(len(keys) == 1 for keys in on_every_rank(resident))
    del z  # collected: its device copies go too
    import gc

    gc.collect()
    assert on_every_rank(resident) == [[]] * ranks


# ================================================ the profiler's clock (from test_profile.py)
# (no public handle: the modules of a call's hot path that read the profiler's clock; others,
# such as the waits for replies, read the same clock for their own ends)
def test_profiling_is_off_by_default_and_does_no_timing(ranks2, monkeypatch):
    f = synk.function(lambda x: x.sum(), reduce="sum")
    assert f.profile is None
    f(np.ones(4))

    class NoClock:  # the profiler's clock, refused; every other use of time allowed
        def perf_counter(self):
            raise AssertionError("the clock was read with profiling off")

        def __getattr__(self, name):
            return getattr(time, name)

    for module in PROFILED_MODULES:
        monkeypatch.setattr(sys.modules[module], "time", NoClock())
    assert f(np.ones(4)) == 4
    assert f(np.ones((6, 2)), batch=[0, 2]) == 4
