"""torch's CUDA tensors and JAX's GPU arrays through synk on a machine with a GPU: what only
a real GPU shows (torch and JAX here are otherwise their CPU builds, and the simulator's
devices are CuPy's alone). Skipped without CUDA for torch, or a GPU for JAX."""
import numpy as np
import pytest
from conftest import REAL

import synk

pytestmark = [pytest.mark.gpu, pytest.mark.frameworks, pytest.mark.timeout(180)]


def _torch_cuda():
    torch = pytest.importorskip("torch")
    if not (REAL and torch.cuda.is_available()):
        pytest.skip("needs a GPU and torch's CUDA build")
    return torch


def _jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        if REAL and jax.devices("gpu"):
            return jax
    except RuntimeError:
        pass
    pytest.skip("needs a GPU and JAX's CUDA plugin")


def test_a_cuda_tensors_mean_comes_back_a_cuda_tensor():
    """A 0-d output is combined on rank 0's host, where it becomes numpy's float64, which
    is also a Python float: it still comes back a tensor, on the GPU, as on CPU ranks."""
    torch = _torch_cuda()
    x = torch.tensor(np.random.default_rng(0).standard_normal((10, 3)))
    synk.fork(1, backend="gpu")
    try:
        loss, total = synk.function(lambda x: ((x ** 2).mean(), x.sum(0)),
                                    reduce=("mean", "sum"))(x)
    finally:
        synk.close()
    assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float64
    assert loss.device.type == "cuda" and total.device.type == "cuda"
    torch.testing.assert_close(loss.cpu(), (x ** 2).mean())
    torch.testing.assert_close(total.cpu(), x.sum(0))


def _jax_collectives(x):
    import jax.numpy as jnp

    y = jnp.ones(3) * (synk.comm.rank() + 1)  # (JAX's default device: the GPU)
    total = synk.comm.allreduce(y)
    mean = synk.comm.allreduce([y, x.sum(0)], "mean", weight=len(x))
    return (str(next(iter(total.devices())).platform), np.asarray(total),
            np.asarray(mean[0]), np.asarray(mean[1]))


def _jax_outputs(x):
    import jax.numpy as jnp

    return x.sum(0), jnp.ones(2) * synk.comm.rank()


def test_jax_gpu_arrays_on_cpu_ranks_travel_through_the_host():
    """CPU ranks on a machine with a GPU: JAX puts the arrays the function makes on the
    GPU; synk.comm carries them over the host and gives them back on the GPU, and the
    function's outputs are combined on the host and come back on the GPU."""
    jax = _jax_gpu()
    import jax.numpy as jnp

    x = jnp.arange(12.0).reshape(6, 2)
    synk.fork(2, backend="cpu")
    try:
        got = synk.function(_jax_collectives, reduce=None)(x)
        total, mean = synk.function(_jax_outputs, reduce=("sum", "mean"))(x)
    finally:
        synk.close()
    assert isinstance(total, jax.Array) and isinstance(mean, jax.Array)
    np.testing.assert_allclose(np.asarray(total), np.arange(12.0).reshape(6, 2).sum(0))
    np.testing.assert_allclose(np.asarray(mean), [0.5, 0.5])
    for platform, total, mean0, mean1 in zip(*got):  # (each output: the ranks' values)
        assert platform == "gpu"
        np.testing.assert_array_equal(total, [3.0, 3.0, 3.0])
        np.testing.assert_allclose(mean0, [1.5, 1.5, 1.5])
        np.testing.assert_allclose(mean1, np.arange(12.0).reshape(6, 2).sum(0) / 2)


def _jax_inputs(x, y):
    return [(type(v).__name__, str(v.dtype), tuple(v.shape),
             sorted(d.platform for d in v.devices()), np.asarray(v).tolist()) for v in (x, y)]


def test_jax_inputs_on_gpu_ranks_are_jax_arrays_on_the_gpu():
    """GPU ranks: a JAX input's rows and a broadcast JAX value arrive in the function as
    JAX arrays on the GPU (made of the rank's device memory), with the dtype, shape and
    values of what was passed; the combined output comes back a JAX array on the GPU."""
    jax = _jax_gpu()
    import jax.numpy as jnp

    x = jnp.arange(6, dtype=jnp.float32).reshape(6, 1)
    y = jnp.asarray(np.int32(3))
    synk.fork(2, backend="gpu")
    try:
        got = synk.function(_jax_inputs, bcast_inputs=["y"], reduce=None)(x, y)
        total = synk.function(lambda x, y: x.sum() * y, bcast_inputs=["y"], reduce="sum")(x, y)
    finally:
        synk.close()
    for r, (xs, ys) in enumerate(got):
        assert xs == ("ArrayImpl", "float32", (3, 1), ["gpu"], [[3.0 * r + i] for i in range(3)])
        assert ys == ("ArrayImpl", "int32", (), ["gpu"], 3)
    assert isinstance(total, jax.Array) and sorted(d.platform for d in total.devices()) == ["gpu"]
    assert float(total) == 15.0 * 3
