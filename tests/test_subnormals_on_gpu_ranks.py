"""float32 and complex64 subnormals (magnitudes below 1.2e-38) give numpy's bits on GPU ranks.

CuPy compiles every kernel with ``-ftz=true``, so its float32 arithmetic, comparisons and
conversions read a subnormal as zero and write zero for a subnormal result (the simulated
CuPy does the same). synk's own arithmetic on device arrays keeps them: a mean's scaled
terms (one array, a fused list, weighted), an exact mean, scans, the logical ops, products
and maxloc, and a function's outputs combined by its reduce ops, give, on GPU ranks with
NCCL (one device per rank) and ranks sharing a device, the bits CPU ranks give, which are
numpy's; but for a mean that NCCL sums, whose terms each rank scaled on its device, within
the documented precision (tests/test_subnormal_means.py: CPU ranks average subnormals as
numpy does)."""
import numpy as np
import pytest
from conftest import REAL, use_devices

import synk

pytestmark = pytest.mark.timeout(180)

TINY = np.float32(np.finfo(np.float32).smallest_subnormal)
OPS = ["sum", "prod", "max", "land", "lor", "mean", "exact_mean", "maxloc"]


def _table(dtype) -> np.ndarray:
    """Two ranks' rows: subnormals (and a zero, a normal number, a number that scales to a
    subnormal), then 3000 finite numbers of every float32 exponent, in ``dtype``."""
    units = np.array([[3, -2, 5, 0, 7], [3, 1, -7, 2, -1]], np.float32)
    table = units * TINY
    table[:, 4] *= np.float32(2.0 ** 120)  # (normal: halved, or a product, past the range)
    table[0, 3] = np.float32(2e-38)  # (normal; its half is subnormal)
    rng = np.random.default_rng(7)
    spread = (rng.uniform(1, 2, (2, 3000)) * np.exp2(rng.integers(-149, 60, (2, 3000)))
              * rng.choice([-1, 1], (2, 3000))).astype(np.float32)
    table = np.concatenate([table, spread], axis=1)
    if np.dtype(dtype).kind == "c":
        return (table + 1j * table[::-1]).astype(dtype)
    return table.astype(dtype)


def _program(table, op):
    rank = synk.comm.rank()
    mine = table[rank]
    out = {"allreduce": synk.comm.allreduce(mine, op)}
    if op in ("mean", "exact_mean"):
        out["weighted"] = synk.comm.allreduce(mine, op, weight=rank + 1.0)
        out["fused"] = synk.comm.allreduce([mine, mine[::-1].copy()], op)
    elif op != "maxloc":
        out["scan"] = synk.comm.scan(mine, op)
        out["exscan"] = synk.comm.exscan(mine, op)
    return out


def _bits(value):
    """Every array in ``value`` (a dict, tuple or list of them, or None) as a list of hex
    words, so that -0.0 and a subnormal compare as bits."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _bits(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_bits(v) for v in value]
    a = np.asarray(value)
    if a.dtype.kind in "fc":
        a = a.view({4: np.uint32, 8: np.uint64, 16: np.uint64}[a.dtype.itemsize])
    return [hex(int(v)) for v in a.ravel()]


def _run(dtype, op) -> list:
    f = synk.function(_program, bcast_inputs=["table", "op"], reduce=None)
    return f(_table(dtype), op)


@pytest.fixture(params=[pytest.param("nccl", marks=pytest.mark.gpu),
                        pytest.param("shared", marks=pytest.mark.gpu)])
def gpu_pair(request, monkeypatch):
    """Two GPU ranks: on two devices (NCCL), or sharing one (staged through the host)."""
    if request.param == "nccl":
        use_devices(monkeypatch, 2)
    elif REAL:
        monkeypatch.setenv("SYNK_TEST_SHARE_GPUS", "1")
    else:
        use_devices(monkeypatch, 1)
    yield request.param


@pytest.mark.parametrize("dtype", [np.float32, np.complex64], ids=["float32", "complex64"])
def test_gpu_ranks_give_numpys_bits_for_subnormals(gpu_pair, dtype):
    ops = [op for op in OPS if np.dtype(dtype).kind == "f" or op not in ("max", "maxloc")]
    synk.fork(2, backend="cpu")
    try:
        want = {op: _run(dtype, op) for op in ops}
    finally:
        synk.close()
    synk.fork(2, backend="gpu")
    try:
        for op in ops:
            got = _run(dtype, op)
            if gpu_pair == "nccl" and op == "mean":
                scale = np.abs(_table(dtype)).sum(axis=0)  # (sum_r |x_r|, of each element)
                for mine, cpus in zip(got, want[op]):
                    for key, value in mine.items():
                        scales = [scale, scale[::-1]] if key == "fused" else scale
                        _within_nccls_precision(value, cpus[key], scales, f"{op} {key}")
                continue
            assert _bits(got) == _bits(want[op]), \
                f"{np.dtype(dtype)} {op} on {gpu_pair}: {_bits(got)} != {_bits(want[op])}"
    finally:
        synk.close()


def _within_nccls_precision(got, want, scale, what: str) -> None:
    """A mean on NCCL sums the terms each rank scaled on its device (a weighted one's scaled
    twice: by a scale of its weight, then by its factor), where CPU ranks (and ranks sharing
    a device) average a term that underflows as numpy does: within 2 of float32's smallest
    subnormals (in each part of a complex number) and 4 eps of ``scale`` (``sum_r |x_r|``)
    of CPU ranks' answer. (``got``, ``want``, ``scale``: arrays, or lists of them.)"""
    if isinstance(got, list):
        for g, w, s in zip(got, want, scale):
            _within_nccls_precision(g, w, s, what)
        return
    error = np.abs(np.asarray(got).astype(np.complex128) - np.asarray(want))
    limit = 3 * float(TINY) + 4 * float(np.finfo(np.float32).eps) * scale
    assert (error <= limit).all(), f"{what}: {got} is not within {limit} of {want}"


def _outputs(rows, table, reps):
    xp = synk.xp(table)
    mine = table[int(rows[0, 0])]  # (one row per piece: with num_slices=2, each a part)
    return mine, xp.tile(mine, reps)  # (a few bytes: combined on the host; 1.4 MB: NCCL)


@pytest.mark.parametrize("op", ["sum", "prod", "max", "mean", "exact_mean"])
def test_function_outputs_of_subnormals_combine_to_numpys_bits(gpu_pair, op):
    """A function's outputs reduced by ``op``: small ones on the host, large ones on NCCL
    (or staged), with num_slices=2 each rank's two pieces first combined on its device."""
    table = _table(np.float32)[:, :5]
    table = np.concatenate([table, table[::-1]])  # (rank 0's pieces 0, 1; rank 1's 2, 3)
    rows = np.arange(4).reshape(4, 1)
    results = {}
    for backend in ("cpu", "gpu"):
        synk.fork(2, backend=backend)
        try:
            f = synk.function(_outputs, inputs=["rows"], bcast_inputs=["table", "reps"],
                              reduce=op)
            results[backend] = [f(rows, table, 70_000, num_slices=s) for s in (1, 2)]
        finally:
            synk.close()
    if gpu_pair == "nccl" and op == "mean":  # (the large outputs are NCCL's)
        scale = np.tile(np.abs(table).sum(axis=0), 70_000)
        for (small, large), (cpu_small, cpu_large) in zip(results["gpu"], results["cpu"]):
            assert _bits(small) == _bits(cpu_small), f"{op} on {gpu_pair}"
            _within_nccls_precision(large, cpu_large, scale, f"{op} on {gpu_pair}")
        return
    assert _bits(results["gpu"]) == _bits(results["cpu"]), f"{op} on {gpu_pair}"


def test_cpu_ranks_give_numpys_answer_for_subnormals():
    """The reference the GPU ranks are held to: numpy's own sums, truths and means."""
    table = _table(np.float32)
    synk.fork(2, backend="cpu")
    try:
        got = _run(np.float32, "sum")
        mean = _run(np.float32, "mean")
        land = _run(np.float32, "land")
    finally:
        synk.close()
    np.testing.assert_array_equal(got[0]["allreduce"], table[0] + table[1])
    np.testing.assert_array_equal(got[1]["scan"], table[0] + table[1])
    np.testing.assert_array_equal(mean[0]["allreduce"], np.mean(table, axis=0))
    np.testing.assert_array_equal(land[0]["allreduce"], (table[0] != 0) & (table[1] != 0))
    assert land[0]["allreduce"][:3].all()  # (subnormals are true)


# -- CuPy's -ftz, and the simulator's ------------------------------------------------------------
def _cupy_on_subnormals(x):
    """What CuPy (or the simulated CuPy) makes of float32 subnormals ``x`` on this rank."""
    xp = synk.xp(x)
    wide = xp.asarray(np.array([1e-45, 2e-45]))
    bits = xp.ElementwiseKernel("float32 v", "uint32 b", "b = __float_as_uint(v);", "bits")
    twice = xp.ElementwiseKernel("float32 v", "float32 y", "y = v * 2.0f;", "twice")
    big = xp.full(2, 1e10, np.float32)
    got = {"scalar": big * xp.asarray(np.array([1, -1], np.float32)) * 1e-40,
           "ufunc scalar": xp.multiply(big, 1e-40), "normal scalar": big * 1e-30,
           "float64 scalar": big.astype(np.float64) * 1e-40, "sum": x + x, "nonzero": x != 0,
           "to float64": x.astype(np.float64),
           "to float32": xp.asarray(np.array([1e-40])).astype(np.float32), "copy": x.copy(),
           "float64 sum": wide + wide, "bits": bits(x), "kernel": twice(x)}
    return {k: xp.asnumpy(v).tolist() for k, v in got.items()}


@pytest.mark.gpu
def test_cupy_flushes_float32_subnormals_and_the_simulator_does_too(monkeypatch):
    """cupy/cuda/compiler.py (v14, ``_compile_with_cache_cuda``): ``options +=
    ('-ftz=true',)``; PTX's ``.ftz``: subnormal inputs and results to sign-preserving zero.
    Copies and the bits keep them; float64 keeps them. A Python float operand of a float32
    ufunc is a float32 parameter of its kernel (cupy/_core/_kernel.pyx,
    ``set_scalar_dtypes``), read flushed where it is subnormal as one. The same program on a
    GPU rank, under the simulator here and on a real GPU with CUDA."""
    use_devices(monkeypatch, 1)
    synk.fork(1, backend="gpu")
    try:
        x = np.array([3, -2], np.float32) * TINY
        got = synk.function(_cupy_on_subnormals, bcast_inputs=["x"], reduce=None)(x)[0]
    finally:
        synk.close()
    assert got["sum"] == [0.0, 0.0] and np.signbit(got["sum"][1])
    assert got["nonzero"] == [False, False]
    assert got["to float64"] == [0.0, 0.0]
    assert got["to float32"] == [0.0]
    assert got["copy"] == x.tolist()
    assert got["float64 sum"] == [2e-45, 4e-45]
    assert got["bits"] == [3, 0x80000002]
    assert got["kernel"] == [0.0, 0.0]
    assert got["scalar"] == [0.0, 0.0] and list(np.signbit(got["scalar"])) == [False, True]
    assert got["ufunc scalar"] == [0.0, 0.0]
    assert got["normal scalar"] == [np.float32(1e-20)] * 2
    assert got["float64 scalar"] == [1e10 * 1e-40] * 2
