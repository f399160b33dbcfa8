"""The array kinds at synk's edge (synk._arrays), in one process: a plain numpy program
never imports torch or JAX; torch tensors and JAX arrays go to numpy and back keeping their
dtype (bfloat16 as its 16 bits), without a copy where the framework allows it; dtypes numpy
has no type for are refused, saying what to do."""
import os
import subprocess
import sys

import numpy as np
import pytest

import synk


def test_numpy_programs_import_no_framework():
    code = ("import numpy as np, sys, synk\n"
            "synk.fork(2)\n"
            "f = synk.function(lambda x: (x.sum(), [x[:1]]), reduce=('sum', 'gather'))\n"
            "f(np.ones((4, 2)))\n"
            "synk.close()\n"
            "print(sorted(m for m in ('torch', 'jax') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.frameworks
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_torch_round_trips_without_copies():
    torch = pytest.importorskip("torch", reason="needs torch: pip install 'synk[torch]'")
    # (no public handle: the zero-copy view synk takes of a tensor inside calls and comm)
    from synk._testing import arrays

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

    from synk._testing import arrays

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


def test_libraries_imported_during_a_group_get_the_ranks_thread_caps():
    """The master sets the threads' variables as its workers have them while a group runs
    (none set by the user), so torch imported by rank 0's function runs as many OpenMP
    threads as each worker (one per rank's share of the cores), not one per core."""
    code = ("import os, synk\n"
            "synk.fork(2)\n"
            "during = os.environ.get('OMP_NUM_THREADS')\n"
            "synk.close()\n"
            "print(during, os.environ.get('OMP_NUM_THREADS'))\n")
    env = {k: v for k, v in os.environ.items() if not k.endswith(
        ("_NUM_THREADS", "_MAXIMUM_THREADS"))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    cores = len(os.sched_getaffinity(0))
    assert out.stdout.split() == [str(max(1, cores // 2)), "None"]
