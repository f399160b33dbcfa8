"""The frameworks' process-wide settings that decide what a function computes (JAX's
``_JAX``, torch's ``_torch_read``), made the same on every rank; and a worker's JAX kept to
its rank's GPU, without preallocating (``prepare_worker``)::

    master, at every call   read() -> if they differ from the workers' last: SETTINGS first
    worker                  apply() -> to a loaded framework at once; to another, when its
                            function loads it (``on_import``)
"""
from __future__ import annotations

import functools
import os
import sys
import warnings

from . import on_import

_MODULES = sys.modules

#: JAX's variables of its GPU memory (jaxlib/xla_client.py, generate_pjrt_gpu_plugin_options)
PREALLOCATION_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_CLIENT_MEM_FRACTION",
                      "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")

_JAX = ("jax_enable_x64", "jax_default_matmul_precision")

# torch's (backend, op) pairs of fp32_precision (torch/backends/__init__.py, cuda, cudnn,
# mkldnn): "all" of a backend holds for its ops left at "none", "generic" for the backends
_TORCH_PAIRS = (("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"),
                ("cuda", "rnn"), ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"),
                ("mkldnn", "rnn"))


# -- the master ----------------------------------------------------------------------------
def read() -> tuple:
    """This thread's settings of the loaded frameworks: ``(("jax", values), ("torch", values))``,
    each only if loaded; () when neither is. Without them a fresh worker's JAX would compute in
    32 bits where the master enabled 64, its torch in float32 or with TF32 against the master's
    choice. No worker loads a framework for the master's sake."""
    jax, torch = _MODULES.get("jax"), _MODULES.get("torch")
    if jax is None and torch is None:
        return ()
    got = []
    if jax is not None:
        try:
            config = jax.config
        except AttributeError:  # (being imported by another thread: nothing set yet)
            pass
        else:
            got.append(("jax", (config.jax_enable_x64, config.jax_default_matmul_precision)))
    if torch is not None:
        try:
            got.append(("torch", _torch_read(torch)))
        except AttributeError:  # (being imported by another thread)
            pass
    return tuple(got)


def _torch_read(torch) -> tuple:
    """The default dtype; the legacy flags (float32 matmul precision, cuBLAS's and cuDNN's
    allow_tf32; each None where torch refuses to read it, the legacy and new API mixed); every
    (backend, op)'s fp32_precision (torch >= 2.9), always carried."""
    read = _TORCH_READERS.get(torch)
    if read is None:
        read = _TORCH_READERS[torch] = _torch_reader(torch)
    return read()


_TORCH_READERS: dict = {}  # the torch module -> its reader (its C functions bound once)


def _torch_reader(torch):
    C = torch._C
    dtype_of, precision_of = torch.get_default_dtype, C._get_float32_matmul_precision
    cublas_of, cudnn_of = C._get_cublas_allow_tf32, C._get_cudnn_allow_tf32
    get = getattr(C, "_get_fp32_precision_getter", None)
    names: dict = {}  # dtype -> its name (str() of a dtype costs a call of its own)

    def read() -> tuple:
        dtype = dtype_of()
        name = names.get(dtype)
        if name is None:
            name = names[dtype] = str(dtype)
        try:
            precision = precision_of()
        except RuntimeError:
            precision = None
        try:
            cublas = cublas_of()
        except RuntimeError:
            cublas = None
        try:
            cudnn = cudnn_of()
        except RuntimeError:
            cudnn = None
        if get is None:  # torch < 2.9: the legacy flags are the whole state
            return name, precision, cublas, cudnn
        return (name, precision, cublas, cudnn, get("generic", "all"), get("cuda", "all"),
                get("cuda", "matmul"), get("cuda", "conv"), get("cuda", "rnn"),
                get("mkldnn", "all"), get("mkldnn", "matmul"), get("mkldnn", "conv"),
                get("mkldnn", "rnn"))

    return read


# -- a worker ------------------------------------------------------------------------------
def apply(settings: tuple) -> None:
    """Set this worker's frameworks as ``read()`` found the master's: a loaded one now, another when
    it is imported (what was waiting for it from earlier settings is replaced)."""
    for name, values in settings:
        fn = _APPLY.get(name)
        if fn is not None:
            on_import.when_imported(name, "settings",
                                    functools.partial(_applied, name, fn, values))


def _applied(name: str, fn, values, module) -> None:
    try:
        with warnings.catch_warnings():  # (torch's notes on its legacy API: not this rank's)
            warnings.simplefilter("ignore")
            fn(module, values)
    except Exception as err:
        raise RuntimeError(f"synk could not set {name} in this worker as the master has it "
                           f"({values!r}): {type(err).__name__}: {err}") from err


def _jax_apply(jax, values) -> None:
    for option, value in zip(_JAX, values):
        jax.config.update(option, value)


def _torch_apply(torch, values) -> None:
    """The legacy flags first (each sets some fp32_precision entries too), then every
    fp32_precision entry as the master has it."""
    dtype, precision, cublas, cudnn, *entries = values
    torch.set_default_dtype(getattr(torch, dtype.rpartition(".")[2]))
    C = torch._C
    if cublas is not None:
        C._set_cublas_allow_tf32(cublas)
    if precision is not None:
        torch.set_float32_matmul_precision(precision)
    if cudnn is not None:
        C._set_cudnn_allow_tf32(cudnn)
    for (backend, op), value in zip(_TORCH_PAIRS, entries):
        C._set_fp32_precision_setter(backend, op, value)


_APPLY = {"jax": _jax_apply, "torch": _torch_apply}


def _one_gpu(ordinal: str, jax) -> None:
    """A GPU rank's JAX, just imported: the rank's GPU made its only one."""
    config = jax.config
    if config.read("jax_cuda_visible_devices") != "all":  # (set by the program: MPI)
        return
    try:
        from jax._src import xla_bridge

        started = xla_bridge.backends_are_initialized()
    except Exception:  # (a JAX laid out otherwise: assume it has not started)
        started = False
    if started:
        warnings.warn(
            "JAX had already started in this rank before synk.fork(): it sees every GPU "
            "and its default device is GPU 0, not this rank's; start JAX's first "
            "operation after synk.fork() (see docs/frameworks.md)", RuntimeWarning,
            stacklevel=2)
        return
    config.update("jax_cuda_visible_devices", ordinal)


def prepare_worker(backend: str, device_id: int | None) -> None:
    """First thing in a worker, before anything can start JAX's GPU client:
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless a JAX memory variable is set (else JAX takes
    75% of every GPU it sees, in every worker: docs.jax.dev gpu_memory_allocation), and on a GPU
    rank ``jax_cuda_visible_devices`` set to its device once JAX is imported, unless set."""
    if not any(var in os.environ for var in PREALLOCATION_VARS):
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if backend == "cuda" and device_id is not None:
        on_import.when_imported("jax", "gpu", functools.partial(_one_gpu, str(device_id)))
