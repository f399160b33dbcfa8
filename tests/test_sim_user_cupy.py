"""User CuPy code under the CUDA simulator: CuPy's array API served from numpy by one
mechanism (synk/_devices/sim/cupy/_generic.py), CuPy's user kernels run from their source
strings (_kernels.py, _cexpr.py), ``fuse``, ``RandomState``, and a clear ``NotModelled``
for what the simulator lacks. Each is checked against numpy on the same data, and the
simulator's stream rules hold for the new kernels too; tests ported from CuPy's own suite
say which."""
import numpy as np
import pytest

from synk import simulator as sim
from synk.simulator import cupy

cuda = cupy.cuda
pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("two_sim_devices")]


RNG = np.random.default_rng(7)
A = RNG.standard_normal((6, 5))
V = RNG.integers(0, 9, 12)
S = np.sort(RNG.standard_normal(10))

# (label, f(xp, a, v, s)): each run on numpy and on the simulator's cupy, on the same data
CALLS = [
    ("bincount", lambda xp, a, v, s: xp.bincount(v)),
    ("bincount minlength", lambda xp, a, v, s: xp.bincount(v, minlength=12)),
    ("r_", lambda xp, a, v, s: xp.r_[v, v[:3], 7]),
    ("c_", lambda xp, a, v, s: xp.c_[v, v]),
    ("mgrid", lambda xp, a, v, s: xp.mgrid[0:3, 0:4]),
    ("median", lambda xp, a, v, s: xp.median(a, axis=0)),
    ("percentile", lambda xp, a, v, s: xp.percentile(a, 30, axis=1)),
    ("unique counts", lambda xp, a, v, s: xp.unique(v, return_counts=True)),
    ("diff", lambda xp, a, v, s: xp.diff(a, axis=1)),
    ("searchsorted", lambda xp, a, v, s: xp.searchsorted(s, s[::3])),
    ("histogram", lambda xp, a, v, s: xp.histogram(s, bins=4)),
    ("pad", lambda xp, a, v, s: xp.pad(a, 1)),
    ("kron", lambda xp, a, v, s: xp.kron(a[:2, :2], a[:2, :2])),
    ("meshgrid", lambda xp, a, v, s: xp.meshgrid(s[:3], s[:2])),
    ("cumsum nan", lambda xp, a, v, s: xp.nancumsum(a, axis=0)),
    # CuPy's argmax has dtype= (the index dtype), numpy's has not
    ("argmax dtype", lambda xp, a, v, s: np.argmax(a, axis=1).astype(np.int32) if xp is np
     else xp.argmax(a, axis=1, dtype=np.int32)),
    ("argmax positional dtype", lambda xp, a, v, s: np.argmax(a, 1).astype(np.int32)
     if xp is np else xp.argmax(a, 1, np.int32)),
    ("histogram2d weights", lambda xp, a, v, s: xp.histogram2d(s, s, bins=2, weights=s)),
    ("left_shift", lambda xp, a, v, s: xp.left_shift(v, 2)),
    ("divmod", lambda xp, a, v, s: xp.divmod(v, 4)),
    ("add.reduce", lambda xp, a, v, s: xp.add.reduce(a, axis=1)),
    ("maximum.accumulate", lambda xp, a, v, s: xp.maximum.accumulate(v)),
    ("fft", lambda xp, a, v, s: xp.fft.rfft(s)),
    ("linalg.pinv", lambda xp, a, v, s: xp.linalg.pinv(a)),
    ("linalg.eigvalsh", lambda xp, a, v, s: xp.linalg.eigvalsh(a[:5] @ a[:5].T)),
    ("alltrue (numpy 1's name)", lambda xp, a, v, s: xp.all(a > -9) if xp is np else
     xp.alltrue(a > -9)),
    ("vectorize", lambda xp, a, v, s: xp.vectorize(lambda t: t * 2 if t > 3 else -t)(v)),
    ("ndarray.ptp", lambda xp, a, v, s: xp.ptp(a, axis=0) if xp is np else a.ptp(axis=0)),
    ("ndarray.searchsorted", lambda xp, a, v, s: s.searchsorted(0.0)),
    ("ndarray xor", lambda xp, a, v, s: v ^ 5),
]


def _host(result):
    if isinstance(result, cupy.ndarray):
        return result.get()
    if isinstance(result, (tuple, list)):
        return [_host(r) for r in result]
    return result


def _same(got, want) -> None:
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
        return
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)
    assert np.asarray(got).dtype == np.asarray(want).dtype


@pytest.mark.parametrize("label, call", CALLS, ids=[c[0] for c in CALLS])
def test_numpys_functions_on_device_arrays_match_numpy(label, call):
    """Names the simulator did not define used to raise a bare AttributeError."""
    device = [cupy.asarray(x) for x in (A, V, S)]
    got = call(cupy, *device)
    for part in got if isinstance(got, (tuple, list)) else [got]:
        assert isinstance(part, cupy.ndarray), type(part)  # device arrays, not numpy
        assert part.device.id == 0
    _same(_host(got), call(np, A, V, S))


def test_results_are_on_the_current_device_and_host_arrays_are_refused():
    with cuda.Device(1):
        x = cupy.asarray(V)
        assert cupy.bincount(x).device.id == 1
        with pytest.raises(ValueError, match="different from the current device"):
            with cuda.Device(0):
                cupy.bincount(x)
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        cupy.bincount(V)  # as CuPy's kernels refuse host arrays


def test_arrays_from_host_data_are_copied_to_the_device():
    sim.reset_transfer_counts()
    x = cupy.frombuffer(np.arange(4, dtype=np.float32).tobytes(), np.float32)
    assert isinstance(x, cupy.ndarray) and x.get().tolist() == [0, 1, 2, 3]
    assert sim.transfer_counts()["h2d"] == 16


def test_a_scalar_from_host_data_keeps_its_zero_dimensions():
    # CuPy: cupy.asanyarray(3).shape == () (cupy/_creation/from_data.py: asanyarray is
    # asarray, which keeps numpy's shape)
    for x in (cupy.asanyarray(3), cupy.asarray_chkfinite(np.float32(2.5))):
        assert isinstance(x, cupy.ndarray) and x.shape == () and x.ndim == 0
    assert cupy.asanyarray(3).get() == 3 and cupy.asanyarray([3]).shape == (1,)


def test_the_general_mechanism_keeps_the_stream_rules():
    """A served function is a kernel on the current stream: reading an array written on
    another stream without an event is the simulator's RaceError; in-place functions write
    their argument (copyto, put), so overwriting what another stream reads is one too."""
    s1, s2 = cuda.Stream(non_blocking=True), cuda.Stream(non_blocking=True)
    with s1:
        x = cupy.arange(10.0)
    with s2, pytest.raises(sim.RaceError):
        cupy.median(x)
    s1.synchronize()
    with s1:
        cupy.bincount(cupy.arange(3))  # reads on s1
        busy = cupy.sum(x)
    with s2, pytest.raises(sim.RaceError, match="overwritten while being read"):
        cupy.copyto(x, cupy.zeros(10))
    with s2, pytest.raises(sim.RaceError):
        x.put([0], [1.0])
    s1.synchronize()
    with s2:
        cupy.copyto(x, cupy.zeros(10))  # after the synchronisation: ordered
    s2.synchronize()
    assert float(busy) == 45.0 and x.get().tolist() == [0.0] * 10


def test_a_keyword_numpy_lacks_is_refused_unless_at_cupys_default():
    x = cupy.asarray(A)
    np.testing.assert_allclose(cupy.percentile(x, 50, interpolation=None).get(),
                               np.percentile(A, 50))
    with pytest.raises(sim.NotModelled, match=r"cupy.percentile\(interpolation=...\)"):
        cupy.percentile(x, 50, interpolation="linear")


@pytest.mark.parametrize("use", [
    lambda: cupy.RawKernel("extern \"C\" __global__ void f() {}", "f"),
    lambda: cupy.RawModule(code=""),
    lambda: cupy.fromDlpack(None),
    lambda: cupy.get_default_pinned_memory_pool(),
    lambda: cupy.testing.assert_allclose,
    lambda: cupy.poly1d([1, 2]),
    lambda: cupy.apply_along_axis(sum, 0, cupy.zeros(3)),
    lambda: cupy.random.XORWOW(),
    lambda: cupy.fft.config.get_plan_cache(),
    lambda: cupy.zeros(3).base,
    lambda: cupy.zeros(3).toDlpack(),
], ids=["RawKernel", "RawModule", "fromDlpack", "pinned pool", "testing", "poly1d",
        "apply_along_axis", "XORWOW", "fft.config", "ndarray.base", "ndarray.toDlpack"])
def test_what_the_simulator_lacks_says_so_and_that_cupy_has_it(use):
    """docs/gpu.md promised an error naming what is not modelled; these raised a bare
    AttributeError."""
    with pytest.raises(sim.NotModelled, match="the CUDA simulator does not model cupy.*real "
                                              "CuPy has it"):
        use()


def test_numpy_functions_called_on_device_arrays_dispatch_here():
    x = cupy.asarray(V)
    counts = np.bincount(x)  # __array_function__: the simulator's bincount
    assert isinstance(counts, cupy.ndarray)
    np.testing.assert_array_equal(counts.get(), np.bincount(V))


# ---------------------------------------------------------------- ElementwiseKernel

def test_kmeans_var_kernel_matches_numpy():
    """CuPy's examples/kmeans/kmeans.py var_kernel, on device arrays."""
    var_kernel = cupy.ElementwiseKernel(
        'T x0, T x1, T c0, T c1', 'T out',
        'out = (x0 - c0) * (x0 - c0) + (x1 - c1) * (x1 - c1)', 'var_kernel')
    X, C = RNG.standard_normal((20, 2)), RNG.standard_normal((3, 2))
    x, c = cupy.asarray(X), cupy.asarray(C)
    got = var_kernel(x[:, None, 0], x[:, None, 1], c[None, :, 0], c[None, :, 1])
    np.testing.assert_allclose(got.get(), ((X[:, None, :] - C[None]) ** 2).sum(-1))
    assert got.shape == (20, 3) and got.dtype == np.float64


def test_manual_indexing():
    """CuPy's test_userkernel.py TestUserkernel.test_manual_indexing: raw arrays, i, size."""
    n = 100
    in1 = cupy.random.uniform(-1, 1, n).astype(cupy.float32)
    in2 = cupy.random.uniform(-1, 1, n).astype(cupy.float32)
    k1 = cupy.ElementwiseKernel('T x, T y', 'T z', '''
                z = x + y;
            ''', 'uesr_kernel_1')
    k2 = cupy.ElementwiseKernel('raw T x, raw T y', 'raw T z', '''
                z[i] = x[i] + y[i];
            ''', 'uesr_kernel_2')
    np.testing.assert_array_equal(k1(in1, in2).get(), k2(in1, in2, size=n).get())


@pytest.mark.parametrize("typ", [int, float, bool])
def test_python_scalar(typ):
    """CuPy's TestUserkernel.test_python_scalar: a scalar takes its parameter's dtype."""
    dtype = np.dtype(typ).type
    in1_cpu = np.random.randint(0, 1, (4, 5)).astype(dtype)
    kernel = cupy.ElementwiseKernel('T x, T y', 'T z', 'z = x + y;', 'uesr_kernel_1')
    out = kernel(cupy.array(in1_cpu), typ(2))
    np.testing.assert_array_equal(out.get(), in1_cpu + dtype(2))
    assert out.dtype == np.dtype(dtype)


def test_size_rules():
    """CuPy's TestElementwiseKernelSize: size only when every array is raw, and then it is
    needed."""
    a, b = cupy.array([1, 2], dtype="float32"), cupy.array([3, 4], dtype="float32")
    raws = cupy.ElementwiseKernel('raw float32 x0, raw float32 x1', 'float32 y0', '', 'kernel')
    raws(a, b, size=2)
    with pytest.raises(ValueError, match=r"^Loop size is undecided\."):
        raws(a, b)
    plain = cupy.ElementwiseKernel('float32 x0, float32 x1', 'float32 y0', '', 'kernel')
    with pytest.raises(ValueError, match=r"^Specified 'size' can"):
        plain(a, b, size=2)


def test_types_arguments_and_outputs_as_cupy_checks_them():
    """cupy/_core/_kernel.pyx: _decide_params_type_core, __call__, _get_out_args_with_params."""
    add = cupy.ElementwiseKernel('T x, T y', 'T z', 'z = x + y', 'add')
    with pytest.raises(TypeError, match="Type is mismatched"):
        add(cupy.zeros(3, np.float32), cupy.zeros(3, np.float64))
    with pytest.raises(TypeError, match="Wrong number of arguments for 'add'"):
        add(cupy.zeros(3))
    out = cupy.empty(3, np.float32)
    assert add(cupy.ones(3, np.float32), 1, out) is out and out.get().tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match="Out shape is mismatched"):
        add(cupy.ones(3, np.float32), 1, cupy.empty(1, np.float32))
    with pytest.raises(ValueError, match="Can not use 'i' as a parameter name"):
        cupy.ElementwiseKernel('T i', 'T z', 'z = i', 'bad')
    fixed = cupy.ElementwiseKernel('float32 x', 'float64 y', 'y = x * 2', 'fixed')
    with pytest.raises(TypeError, match="Type is mismatched"):
        fixed(cupy.zeros(3, np.float64))
    assert fixed(cupy.ones(3, np.float32)).dtype == np.float64
    empty = add(cupy.zeros((0, 3), np.float32), 1)  # nothing launched
    assert empty.shape == (0, 3)


def test_cuda_c_semantics_where_numpy_differs():
    """Integer / and % truncate toward zero (C), float literals are doubles unless ``f``,
    CUDA's max of floats ignores NaN (fmaxf), if/else, locals, casts."""
    a = cupy.asarray(np.array([-7, 7, -7, 6]))
    b = cupy.asarray(np.array([2, -2, -2, 4]))
    divide = cupy.ElementwiseKernel('T x, T y', 'T q, T r', 'q = x / y; r = x % y', 'cdiv')
    q, r = divide(a, b)
    assert q.get().tolist() == [-3, -3, 3, 1] and r.get().tolist() == [-1, 1, -1, 2]
    x = cupy.asarray(np.array([1.0, np.nan, 3.0], np.float32))
    body = '''
        float h = x * 0.5f;
        double wide = x * 0.1;
        if (x > 2.0f) { y = max(x, 10.0f); } else { y = h; }
        w = wide + static_cast<double>((int)(x * 2.9f));
        m = max(x, 2.0f);
    '''
    k = cupy.ElementwiseKernel('float32 x', 'float32 y, float64 w, float32 m', body, 'c')
    y, w, m = k(x)
    assert y.get().tolist()[::2] == [0.5, 10.0] and np.isnan(y.get()[1])
    np.testing.assert_allclose(w.get()[::2], [np.float32(1) * 0.1 + 2,
                                              np.float32(3) * 0.1 + 8])
    assert m.get().tolist() == [2.0, 2.0, 3.0]  # fmaxf(NaN, 2) is 2


def test_what_a_kernel_body_cannot_be_is_refused_when_it_is_called():
    loop = cupy.ElementwiseKernel('T x', 'T y', 'for (int k = 0; k < 3; ++k) y += x;', 'loop')
    with pytest.raises(sim.NotModelled, match="'for'"):
        loop(cupy.ones(3))
    call = cupy.ElementwiseKernel('T x', 'T y', 'y = my_helper(x)', 'helper')
    with pytest.raises(sim.NotModelled, match="my_helper"):
        call(cupy.ones(3))
    with pytest.raises(sim.NotModelled, match="preamble"):
        cupy.ElementwiseKernel('T x', 'T y', 'y = f(x)', 'pre', preamble='__device__ float '
                               'f(float v) { return v; }')(cupy.ones(3))


def test_elementwise_kernels_keep_the_stream_rules():
    double = cupy.ElementwiseKernel('T x', 'T y', 'y = 2 * x', 'double')
    s1, s2 = cuda.Stream(non_blocking=True), cuda.Stream(non_blocking=True)
    with s1:
        x = cupy.arange(4.0)
    with pytest.raises(sim.RaceError):
        double(x, stream=s2)
    s1.synchronize()
    y = double(x, stream=s2)
    s2.synchronize()  # (y was written on s2: reading it on the null stream needs this)
    assert y.get().tolist() == [0, 2, 4, 6]


# ---------------------------------------------------------------- ReductionKernel

def test_kmeans_reduction_kernels_match_numpy():
    """CuPy's examples/kmeans/kmeans.py sum_kernel and count_kernel."""
    sum_kernel = cupy.ReductionKernel('T x, S mask', 'T out', 'mask ? x : 0', 'a + b',
                                      'out = a', '0', 'sum_kernel')
    count_kernel = cupy.ReductionKernel('T mask', 'float32 out', 'mask ? 1.0 : 0.0', 'a + b',
                                        'out = a', '0.0', 'count_kernel')
    X = RNG.standard_normal((30, 2))
    labels = RNG.integers(0, 3, 30)
    mask_np = labels == np.arange(3)[:, None]
    x, mask = cupy.asarray(X), cupy.asarray(mask_np)
    np.testing.assert_allclose(sum_kernel(x, mask[:, :, None], axis=1).get(),
                               np.where(mask_np[:, :, None], X, 0).sum(axis=1))
    counts = count_kernel(mask, axis=1)
    assert counts.dtype == np.float32 and counts.get().tolist() == mask_np.sum(1).tolist()


def test_reductions_with_post_map_axes_and_identity():
    """CuPy's documentation's l2norm (a post-map ``y = sqrt(a)``), a mean through
    _in_ind/_out_ind, a max by a ternary (folded pairwise) with an identity, keepdims and
    axis tuples, and identity '' on a zero-size input (cupy/_core/_reduction.pyx)."""
    X = RNG.standard_normal((4, 5, 6))
    x = cupy.asarray(X)
    l2norm = cupy.ReductionKernel('T x', 'T y', 'x * x', 'a + b', 'y = sqrt(a)', '0', 'l2norm')
    np.testing.assert_allclose(l2norm(x, axis=2).get(), np.linalg.norm(X, axis=2))
    mean = cupy.ReductionKernel('T x', 'T y', 'x', 'a + b',
                                'y = a / _in_ind.size() * _out_ind.size()', '0', 'mean')
    np.testing.assert_allclose(mean(x, axis=(0, 2)).get(), X.mean(axis=(0, 2)))
    biggest = cupy.ReductionKernel('T x', 'T y', 'x', 'a > b ? a : b', 'y = a', '-1e300',
                                   'biggest')
    got = biggest(x, axis=1, keepdims=True)
    assert got.shape == (4, 1, 6)
    np.testing.assert_array_equal(got.get(), X.max(axis=1, keepdims=True))
    np.testing.assert_allclose(float(l2norm(x)), np.linalg.norm(X))
    no_identity = cupy.ReductionKernel('T x', 'T y', 'x', 'a + b', 'y = a', '', 'nosum')
    with pytest.raises(ValueError, match="zero-size array to reduction operation nosum "
                                         "which has no identity"):
        no_identity(cupy.zeros((0, 3)), axis=0)
    assert no_identity(cupy.ones(4)).get() == 4.0


def test_int8_sum():
    """CuPy's test_reduction.py TestReductionKernel.check_int8_sum: an int8 'my_sum' wraps
    in int8."""
    my_sum = cupy.ReductionKernel('T x', 'T out', 'x', 'a + b', 'out = a', '0', 'my_sum')
    for n in (2 ** 7 - 1, 2 ** 7, 2 ** 7 + 1, 500):
        host = (np.arange(n) % 3).astype(np.int8)
        got = my_sum(cupy.asarray(host))
        assert got.dtype == np.int8 and got.get() == host.sum(dtype=np.int8)


# ---------------------------------------------------------------- fuse, RandomState

def test_fuse_as_decorator_with_and_without_arguments():
    @cupy.fuse()
    def squared_diff(x, y):
        return (x - y) * (x - y)

    @cupy.fuse(kernel_name="plus")
    def plus(x, y):
        return x + y

    fused_max = cupy.fuse(lambda x: cupy.max(x))
    x, y = cupy.asarray(A), cupy.asarray(A[::-1].copy())
    np.testing.assert_allclose(squared_diff(x, y).get(), (A - A[::-1]) ** 2)
    np.testing.assert_allclose(plus(x, 1.5).get(), A + 1.5)
    assert float(fused_max(x)) == A.max() and plus.__name__ == "plus"


def test_random_state_is_per_seed_reproducible_and_draws_on_the_device():
    a = cupy.random.RandomState(5).normal(size=(3, 2), dtype=np.float32)
    b = cupy.random.RandomState(5).normal(size=(3, 2), dtype=np.float32)
    assert isinstance(a, cupy.ndarray) and a.dtype == np.float32 and a.shape == (3, 2)
    np.testing.assert_array_equal(a.get(), b.get())
    cupy.random.seed(3)
    first = cupy.random.gamma(2.0, size=4).get()
    cupy.random.get_random_state().seed(3)
    np.testing.assert_array_equal(first, cupy.random.gamma(2.0, size=4).get())
    x = cupy.arange(10)
    cupy.random.RandomState(1).shuffle(x)
    assert sorted(x.get().tolist()) == list(range(10))
    draw = cupy.random.default_rng(4).standard_normal(3)
    assert isinstance(draw, cupy.ndarray) and draw.shape == (3,)
