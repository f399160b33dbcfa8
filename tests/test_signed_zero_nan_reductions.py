"""The same program gives the same bits on every back end.

``max`` and ``min`` of floats: IEEE 754-2019 maximum and minimum (a NaN wins, -0.0 < +0.0),
a NaN result always the dtype's quiet NaN of numpy (``np.nan``'s bits), on CPU ranks and on
GPU ranks, through ``synk.comm.allreduce`` of device and host arrays and through a
function's outputs (small ones combined on the host, large ones on NCCL). The simulated
NCCL and CuPy give CUDA's bits (PTX's max/min). int64 arrays made as ``np.longlong`` ("q")
on some ranks and ``np.int_`` ("l") on others are one dtype to the GPU path's checks."""
import os

import mpirun
import numpy as np
import pytest
from conftest import two_sim_comms

import synk
from synk import simulator
from synk.simulator import cupy as cp

pytestmark = pytest.mark.timeout(120)

DTYPES = [np.float16, np.float32, np.float64]
UINTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}
NAN_WITH_PAYLOAD = {2: 0xFE01, 4: 0xFFC00123, 8: 0xFFF8000000000123}  # negative, quiet


def _pairs(dtype) -> tuple:
    """(rank 0's values, rank 1's): signed zeros against each other and against numbers,
    NaNs of either sign (one with a payload) against each other and against numbers."""
    nan, inf = np.nan, np.inf
    payload = np.array(NAN_WITH_PAYLOAD[np.dtype(dtype).itemsize],
                       UINTS[np.dtype(dtype).itemsize]).view(dtype)[()]
    pairs = [(0.0, -0.0), (-0.0, 0.0), (-0.0, -0.0), (0.0, 0.0), (-0.0, -1.0), (0.0, 1.0),
             (-0.0, 1.0), (0.0, -1.0), (inf, -0.0), (-inf, 0.0), (nan, -nan), (-nan, nan),
             (-nan, -nan), (nan, 1.0), (-1.0, -nan), (payload, 2.0), (-0.0, payload)]
    return tuple(np.array([p[r] for p in pairs], dtype) for r in (0, 1))


def _rule(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The answer by the rule, element by element."""
    out = np.empty_like(a)
    for i, (x, y) in enumerate(zip(a, b)):
        if np.isnan(x) or np.isnan(y):
            out[i] = np.nan
        elif x == 0 and y == 0:
            negative = (np.signbit(x) and np.signbit(y)) if op == "max" \
                else (np.signbit(x) or np.signbit(y))
            out[i] = -0.0 if negative else 0.0
        else:
            out[i] = max(x, y) if op == "max" else min(x, y)
    return out


def _bits(x) -> list:
    x = np.asarray(x)
    return [hex(int(v)) for v in x.view(UINTS[x.dtype.itemsize]).ravel()]


def _same_bits(got, want, what: str) -> None:
    got = np.asarray(got)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, not {want.dtype}"
    assert _bits(got) == _bits(want), f"{what}: {_bits(got)} != {_bits(want)}"


def _comm_fn(table, op):
    xp = synk.xp(table)
    mine = table[synk.comm.rank()]
    host = xp.asnumpy(mine) if hasattr(xp, "asnumpy") else np.asarray(mine)
    return synk.comm.allreduce(mine, op), synk.comm.allreduce(host, op)


@pytest.mark.parametrize("form", ["device arrays", "host arrays"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_allreduce_gives_the_rules_bits(two, op, form):
    """synk.comm.allreduce of device arrays (NCCL on GPU ranks, numpy's arrays on CPU
    ranks) and of numpy arrays (the host transport on either), every rank the same bits."""
    f = synk.function(_comm_fn, bcast_inputs=["table", "op"], reduce=None)
    which = 0 if form == "device arrays" else 1
    for dtype in DTYPES:
        a, b = _pairs(dtype)
        every = f(np.stack([a, b]), op)
        for rank, got in enumerate(every[which]):
            _same_bits(got, _rule(op, a, b), f"{dtype.__name__} {op} on rank {rank}")


def _output_fn(rows, table, reps):
    xp = synk.xp(table)
    mine = table[int(rows[0, 0])]  # (one row per piece: with num_slices=2, each a part)
    return mine, xp.tile(mine, reps)


@pytest.mark.parametrize("num_slices", [1, 2])
@pytest.mark.parametrize("size", ["small", "large"])
@pytest.mark.parametrize("op", ["max", "min"])
def test_function_outputs_give_the_rules_bits(two, op, size, num_slices):
    """reduce="max"/"min" of a function's outputs: small ones (a few bytes) are combined on
    the host on every back end, large ones (past 4 KiB) on NCCL on GPU ranks; with
    num_slices=2 each rank first combines its two pieces (with CuPy's maximum/minimum on
    GPU ranks)."""
    f = synk.function(_output_fn, inputs=["rows"], bcast_inputs=["table", "reps"], reduce=op)
    rows = np.arange(4).reshape(4, 1) if num_slices == 2 else np.array([[0], [1]])
    for dtype in DTYPES:
        a, b = _pairs(dtype)
        reps = 1 if size == "small" else 400  # (17 values: 6.8 KiB of float16)
        table = np.stack([a, b, b, a])  # (rank 0's pieces a, b; rank 1's b, a)
        small, large = f(rows, table, reps, num_slices=num_slices)
        got = small if size == "small" else large
        _same_bits(got, np.tile(_rule(op, a, b), reps), f"{dtype.__name__} {op}")


# -- across hosts, under MPI ---------------------------------------------------------------------
def _extrema_inside(table, op):
    comm, xp = synk.comm, synk.xp(table)
    mine = table[comm.rank() % 2]
    return {"allreduce": comm.allreduce(mine, op),
            "fused": comm.allreduce([mine[::-1].copy(), mine], op)[1],
            "iallreduce": comm.iallreduce(mine, op).wait(),
            "two rounds": comm.allreduce(xp.tile(mine, 100_000), op)[-mine.size:],
            "reduce": comm.reduce(mine, op, root=comm.size() - 1),
            "reduce_scatter": comm.reduce_scatter(xp.stack([mine] * comm.size()), op)[0]}


def check_every_rank(op: str, dtype) -> None:
    """The rule's bits of a function's small and large outputs and of ``synk.comm``'s
    ``max``/``min`` of host arrays, in a running group whose ranks hold ``_pairs``' values
    alternately (the even ranks rank 0's, the odd ones rank 1's)."""
    a, b = _pairs(dtype)
    want = _rule(op, a, b)
    n = synk.size()
    f = synk.function(_output_fn, inputs=["rows"], bcast_inputs=["table", "reps"], reduce=op)
    small, large = f(np.arange(n).reshape(n, 1), np.stack([a, b] * (n // 2)), 2000)
    _same_bits(small, want, f"{dtype.__name__} {op} of small outputs")
    _same_bits(large, np.tile(want, 2000), f"{dtype.__name__} {op} of large outputs")
    g = synk.function(_extrema_inside, bcast_inputs=["table", "op"], reduce=None)
    for rank, got in enumerate(g(np.stack([a, b]), op)):
        for key, value in got.items():
            if key == "reduce" and rank != n - 1:
                assert value is None
                continue
            _same_bits(value, want, f"{dtype.__name__} {op} {key} on rank {rank}")


MPI_JOB = """
import test_signed_zero_nan_reductions as rule

assert n == 4, n
print("BACKEND", synk.backend(), flush=True)
for op in ("max", "min"):
    for dtype in rule.DTYPES:
        rule.check_every_rank(op, dtype)
print("SIGNED ZEROS OK", flush=True)
"""


@pytest.mark.parametrize("gpus", [None, pytest.param("2", marks=pytest.mark.gpu)],
                         ids=["cpu", "gpu"])
def test_max_and_min_across_hosts_give_the_rules_bits(tmp_path, gpus):
    """4 ranks on 2 pretend hosts, on the CPU and on simulated GPUs (2 per host): large
    outputs combined by MPI's collectives, small ones in the replies, synk.comm over MPI's
    messages (and NCCL's collectives), with a signed zero (and NaN) on every host."""
    here = os.path.dirname(os.path.abspath(__file__))
    preamble = f"import sys\nsys.path.insert(0, {here!r})\n" + mpirun.PREAMBLE
    run = mpirun.run(tmp_path, MPI_JOB, preamble=preamble, timeout=150,
                     env={"SYNK_SIMULATE_GPUS": gpus} if gpus else None)
    assert run.rc == 0 and "SIGNED ZEROS OK" in run.out, run
    assert f"BACKEND backend '{'gpu' if gpus else 'cpu'}'" in run.out, run


def test_max_and_min_on_one_host_give_the_rules_bits(ranks2):
    """The same checks with two CPU ranks on one host: the reference of the test above."""
    for op in ("max", "min"):
        for dtype in DTYPES:
            check_every_rank(op, dtype)


# -- the simulator: NCCL's and CuPy's own bits ---------------------------------------------------
@pytest.fixture
def sim_devices(monkeypatch):
    monkeypatch.setenv("SYNK_SIMULATE_GPUS", "2")
    monkeypatch.setenv("SYNK_SIM_HANG_TIMEOUT", "5")
    for var in ("CUDA_VISIBLE_DEVICES", "SYNK_SIM_FAULTS", "SYNK_SIM_NCCL_VERSION"):
        monkeypatch.delenv(var, raising=False)
    cp.cuda.Device(0).use()
    yield
    simulator.reset_thread()
    simulator.clear_sticky_errors()


def _ptx(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """PTX's max/min: a NaN loses to a number, two NaNs give the canonical NaN, +0.0 >
    -0.0."""
    canonical = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FFFFFFFFFFFFFFF}[a.dtype.itemsize]
    out = _rule(op, np.where(np.isnan(a), b, a), np.where(np.isnan(b), a, b))
    both = np.isnan(a) & np.isnan(b)
    out.view(UINTS[a.dtype.itemsize])[both] = canonical
    return out


@pytest.mark.gpu
def test_the_simulated_nccl_gives_cudas_max_and_min_of_floats(sim_devices):
    """src/device/reduce_kernel.h (FuncMinMax, v2.30.7-1 lines 422-446): fmaxf/fminf,
    fmax/fmin, __hmax/__hmin, which are PTX's max/min: "If values of both inputs are 0.0,
    then +0.0 > -0.0" (PTX ISA); two NaNs give the canonical NaN (0x7fff, 0x7fffffff)."""
    import threading

    nccl = cp.cuda.nccl
    comms = two_sim_comms()
    codes = {np.float16: nccl.NCCL_FLOAT16, np.float32: nccl.NCCL_FLOAT32,
             np.float64: nccl.NCCL_FLOAT64}
    ops = {"max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
    outs: list = [{}, {}]

    def run(r):
        cp.cuda.Device(r).use()
        for dtype in DTYPES:
            for name, op in ops.items():
                x = cp.asarray(_pairs(dtype)[r])
                comms[r].allReduce(x.data.ptr, x.data.ptr, x.size, codes[dtype], op,
                                   cp.cuda.Stream.null.ptr)
                outs[r][dtype, name] = x.get()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    try:
        for dtype in DTYPES:
            a, b = _pairs(dtype)
            for name in ops:
                for r in (0, 1):
                    _same_bits(outs[r][dtype, name], _ptx(name, a, b),
                               f"{dtype.__name__} {name} on rank {r}")
    finally:
        for comm in comms:
            comm.destroy()


@pytest.mark.gpu
def test_the_simulated_cupy_maximum_and_minimum_are_cupys(sim_devices):
    """cupy/_math/misc.py (v14): maximum is ``(isnan(in0) | isnan(in1)) ? out0_type(NAN) :
    out0_type(max(in0, in1))``, NAN ``__int_as_float(0x7fffffff)``; fmax is CUDA's fmax."""
    cupy_nan = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FFFFFFFE0000000}
    for dtype in DTYPES:
        a, b = _pairs(dtype)
        size = np.dtype(dtype).itemsize
        for name, op in (("maximum", "max"), ("minimum", "min")):
            want = _rule(op, a, b)
            want.view(UINTS[size])[np.isnan(a) | np.isnan(b)] = cupy_nan[size]
            got = getattr(cp, name)(cp.asarray(a), cp.asarray(b)).get()
            _same_bits(got, want, f"cupy.{name} of {dtype.__name__}")
        for name, op in (("fmax", "max"), ("fmin", "min")):
            got = getattr(cp, name)(cp.asarray(a), cp.asarray(b)).get()
            _same_bits(got, _ptx(op, a, b), f"cupy.{name} of {dtype.__name__}")


# -- int64 by either name ------------------------------------------------------------------------
def _int64_fn(x, chars):
    xp = synk.xp(x)
    mine = xp.arange(24, dtype=np.dtype(chars[synk.comm.rank()]))
    part = x.reshape(-1)[:6]  # (the master's "q" array: "l" on a worker)
    return (synk.comm.allreduce(mine), synk.comm.allreduce(mine, "max"),
            synk.comm.allgather(mine), synk.comm.allreduce(part), synk.comm.allgather(part))


def test_int64_arrays_by_either_char_are_one_dtype(two):
    """np.dtype("q") == np.dtype("l") (int64 on Linux) though their .char and .num differ:
    ranks that pass one or the other, in any order after calls that agreed on either, and a
    master's "q" array that a worker holds as "l", are one dtype to every check."""
    f = synk.function(_int64_fn, bcast_inputs=["chars"], reduce=None)
    for chars in ("qq", "ll", "ql", "lq", "qq", "lq"):
        for x_char in "ql":
            x = np.arange(48, dtype=x_char).reshape(8, 6)
            total, top, joined, part_total, part_joined = f(x, chars)
            for r in (0, 1):
                assert total[r].dtype == np.int64 and total[r].tolist() == list(range(0, 48, 2))
                assert top[r].tolist() == list(range(24))
                assert joined[r].tolist() == list(range(24)) * 2
                assert part_total[r].tolist() == [24, 26, 28, 30, 32, 34]
                assert part_joined[r].tolist() == [0, 1, 2, 3, 4, 5, 24, 25, 26, 27, 28, 29]


def _other_dtype_fn(x, form):
    xp = synk.xp(x)
    dtype = np.int64 if synk.comm.rank() == 0 else np.int32
    if form == "allreduce":
        synk.comm.allreduce(xp.arange(24, dtype=np.int64))  # (agreed on every rank)
        return synk.comm.allreduce(xp.arange(24, dtype=dtype))
    return synk.comm.allgather(xp.arange(24, dtype=dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["allreduce", "allgather"])
def test_different_dtypes_on_gpu_ranks_still_raise_naming_them(gpus2, form):
    f = synk.function(_other_dtype_fn, bcast_inputs=["form"], reduce=None)
    with pytest.raises(ValueError, match=r"int64.*int32"):
        f(np.zeros((2, 1)), form)


@pytest.mark.gpu
def test_ncclint64_for_q_and_l_as_cupyx_distributed():
    """cupyx/distributed/_nccl_comm.py ``_nccl_dtypes``: "l" and "q" are ncclInt64, "L"
    and "Q" ncclUint64, keyed by dtype.char."""
    from synk.comm.nccl.nccl_types import tables

    nccl = cp.cuda.nccl
    dtypes, _ = tables(nccl)
    assert dtypes["q"] == dtypes["l"] == nccl.NCCL_INT64 == 4
    assert dtypes["Q"] == dtypes["L"] == nccl.NCCL_UINT64 == 5

