"""The master's JAX and torch settings hold on every rank: 64-bit JAX, torch's default dtype
and float32 matmul precision (TF32), given to the workers before a call whenever they
changed, and to a worker that loads the framework later when it loads it; no rank loads a
framework the program did not. And a worker's JAX does not preallocate GPU memory and sees
its rank's GPU alone (under the simulator JAX has no GPU: the settings JAX reads are
checked, not what its GPU client does with them)."""

import warnings

import numpy as np
import pytest
from conftest import on_every_rank, run_script, use_devices

import synk

jax = pytest.importorskip("jax", reason="needs JAX: pip install 'synk[jax]'")
jnp = pytest.importorskip("jax.numpy")
torch = pytest.importorskip("torch", reason="needs torch: pip install 'synk[torch]'")
pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(300)]


# JAX's variables of its GPU memory (jaxlib/xla_client.py, generate_pjrt_gpu_plugin_options)
PREALLOCATION_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_CLIENT_MEM_FRACTION",
                      "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")


def _fp32_precision_holders() -> list:
    """torch's objects with an ``fp32_precision`` (torch >= 2.9; none before)."""
    b = torch.backends
    return [obj for obj in (b, b.cuda.matmul, b.cudnn, b.cudnn.conv, b.cudnn.rnn, b.mkldnn,
                            b.mkldnn.matmul, b.mkldnn.conv, b.mkldnn.rnn)
            if hasattr(obj, "fp32_precision")]


@pytest.fixture
def masters_settings():
    """The test changes the master's JAX and torch settings; they are restored after,
    through JAX's and torch's own API (torch's legacy flags first, each of which sets some
    ``fp32_precision`` entries too, then every ``fp32_precision`` entry)."""
    b = torch.backends

    def read(get):
        try:
            return get()
        except RuntimeError:  # (torch refuses to read a legacy flag when the APIs were mixed)
            return None

    x64, matmul = jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision
    dtype = torch.get_default_dtype()
    legacy = [(read(torch.get_float32_matmul_precision), torch.set_float32_matmul_precision),
              (read(lambda: b.cuda.matmul.allow_tf32),
               lambda value: setattr(b.cuda.matmul, "allow_tf32", value)),
              (read(lambda: b.cudnn.allow_tf32),
               lambda value: setattr(b.cudnn, "allow_tf32", value))]
    precisions = [(obj, obj.fp32_precision) for obj in _fp32_precision_holders()]
    yield
    jax.config.update("jax_enable_x64", x64)
    jax.config.update("jax_default_matmul_precision", matmul)
    torch.set_default_dtype(dtype)
    with warnings.catch_warnings():  # (torch's notes on mixing its legacy and new API)
        warnings.simplefilter("ignore")
        for value, put in legacy:
            if value is not None:
                put(value)
        for obj, value in precisions:
            obj.fp32_precision = value


def _jax_itemsize(arg):
    import jax.numpy as jnp

    return jnp.zeros(()).dtype.itemsize  # 8 with 64-bit JAX, else 4


def _torch_state(arg):
    import torch

    def read(get):
        try:
            return get()
        except RuntimeError:  # (torch refuses to read a legacy flag when the APIs were mixed)
            return "refused"

    b = torch.backends
    return tuple(read(get) for get in (
        lambda: str(torch.get_default_dtype()), torch.get_float32_matmul_precision,
        lambda: b.cuda.matmul.allow_tf32, lambda: b.cudnn.allow_tf32,
        lambda: b.cuda.matmul.fp32_precision, lambda: b.cudnn.conv.fp32_precision,
        lambda: b.cudnn.rnn.fp32_precision, lambda: b.mkldnn.matmul.fp32_precision))


def test_a_float64_sum_of_jax_rows_keeps_its_low_bits_when_the_master_enabled_x64(
        masters_settings):
    jax.config.update("jax_enable_x64", True)
    rows = 1.0 + np.arange(12) * 2.0 ** -30  # float32 would round every row to 1.0
    x = jnp.asarray(rows)
    assert x.dtype == jnp.float64
    synk.fork(3)
    try:
        got = synk.function(lambda x: x.sum(), reduce="sum")(x)
        assert got.dtype == jnp.float64
        assert float(got) - 12.0 == pytest.approx(66 * 2.0 ** -30, rel=1e-9)
        parts = synk.function(lambda x: x.sum(), reduce=None)(x)
        assert [float(p) for p in parts] == [float(rows[i:i + 4].sum()) for i in (0, 4, 8)]
    finally:
        synk.close()


def test_a_setting_changed_between_calls_holds_on_every_rank_at_the_next_call(
        masters_settings):
    synk.fork(3)
    try:
        assert on_every_rank(_jax_itemsize) == [4, 4, 4]
        jax.config.update("jax_enable_x64", True)
        assert on_every_rank(_jax_itemsize) == [8, 8, 8]
        jax.config.update("jax_enable_x64", False)
        assert on_every_rank(_jax_itemsize) == [4, 4, 4]
        torch.set_default_dtype(torch.float64)
        assert [s[0] for s in on_every_rank(_torch_state)] == ["torch.float64"] * 3
        torch.set_default_dtype(torch.float32)
        assert [s[0] for s in on_every_rank(_torch_state)] == ["torch.float32"] * 3
    finally:
        synk.close()


@pytest.mark.parametrize("how", ["legacy API", "fp32_precision API"])
def test_torchs_default_dtype_and_float32_precision_are_the_masters_on_every_rank(
        masters_settings, how):
    torch.set_default_dtype(torch.float64)
    if how == "legacy API":
        torch.set_float32_matmul_precision("high")  # TF32 in cuBLAS matmuls
        torch.backends.cudnn.allow_tf32 = False  # none in cuDNN convolutions
    else:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    want = _torch_state(None)
    assert want[0] == "torch.float64" and "tf32" in want
    synk.fork(3)
    try:
        assert on_every_rank(_torch_state) == [want] * 3
    finally:
        synk.close()


def test_a_worker_loads_no_framework_for_the_master_and_sets_it_when_fn_loads_it(tmp_path):
    # (a script: the functions of a test module would load what the module imports)
    out = run_script(tmp_path / "later.py", """
import sys
import numpy as np
import torch
import synk

torch.set_default_dtype(torch.float64)
synk.fork(3)
def loaded(x):
    return "torch" in sys.modules
def loads(x):
    import torch
    return str(torch.get_default_dtype()), str(torch.ones(1).dtype)
x = np.zeros((3, 2))
print(synk.function(loaded, reduce=None)(x))
print(list(zip(*synk.function(loads, reduce=None)(x))))
synk.close()
""")
    loaded, loads = out.splitlines()
    assert loaded == "[True, False, False]"
    assert loads == str([("torch.float64", "torch.float64")] * 3)


def test_a_program_without_torch_or_jax_loads_neither_on_any_rank(tmp_path):
    out = run_script(tmp_path / "plain.py", """
import sys
import numpy as np
import synk

synk.fork(2)
def loaded(x):
    return sum(name in sys.modules for name in ("torch", "jax"))
print(synk.function(loaded, reduce=None)(np.zeros((2, 2))),
      sum(name in sys.modules for name in ("torch", "jax")))
synk.close()
""")
    assert out.split() == ["[0,", "0]", "0"]


# -- a worker's JAX on GPUs -----------------------------------------------------------------
def _jax_gpu_settings(arg):
    import os

    import jax
    import jax.numpy as jnp

    assert float(jnp.arange(3.0).sum()) == 3.0  # (JAX still works: on the CPU here)
    return (os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE"),
            os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            jax.config.read("jax_cuda_visible_devices"))


@pytest.mark.gpu
@pytest.mark.one_gpu_per_rank(2)
def test_a_gpu_workers_jax_does_not_preallocate_and_sees_its_ranks_gpu_alone(monkeypatch):
    for var in PREALLOCATION_VARS:
        monkeypatch.delenv(var, raising=False)
    use_devices(monkeypatch, 2)
    synk.fork(3, backend="gpu")  # ranks on devices 0, 1, 0
    try:
        got = on_every_rank(_jax_gpu_settings)
        assert got[1:] == [("false", None, "1"), ("false", None, "0")]
        assert got[0][:2] == (None, None)  # the master's process is the user's
    finally:
        synk.close()


@pytest.mark.gpu
@pytest.mark.one_gpu_per_rank(2)
def test_the_users_own_jax_memory_setting_is_kept_in_the_workers(monkeypatch):
    for var in PREALLOCATION_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".2")
    use_devices(monkeypatch, 2)
    synk.fork(2, backend="gpu", devices=[1, 0])
    try:
        assert on_every_rank(_jax_gpu_settings)[1] == (None, ".2", "0")
    finally:
        synk.close()


def test_a_cpu_workers_jax_does_not_preallocate_and_keeps_every_device(monkeypatch):
    for var in PREALLOCATION_VARS:
        monkeypatch.delenv(var, raising=False)
    synk.fork(2, backend="cpu")
    try:
        assert on_every_rank(_jax_gpu_settings)[1] == ("false", None, "all")
    finally:
        synk.close()
