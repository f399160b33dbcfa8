"""The CuPy and NCCL names synk uses: the one list that the CUDA simulator and the real
libraries are both checked against (tests/test_contract.py).
"""
from __future__ import annotations

import importlib
from types import ModuleType

_UFUNCS = """add subtract multiply divide true_divide floor_divide power mod remainder negative
positive absolute abs sign sqrt square exp expm1 log log1p log2 log10 tanh sinh cosh sin cos
tan arctan arcsin arccos maximum minimum fmax fmin equal not_equal less less_equal greater
greater_equal logical_and logical_or logical_not logical_xor isnan isinf isfinite floor ceil
reciprocal logaddexp invert bitwise_and bitwise_or bitwise_xor matmul"""

_FUNCTIONS = """asarray array asnumpy get_array_module result_type ascontiguousarray asfortranarray
zeros ones
empty full zeros_like ones_like empty_like full_like arange linspace eye identity copy
concatenate stack vstack hstack reshape transpose ravel squeeze expand_dims split array_split
tile repeat flip broadcast_to moveaxis swapaxes atleast_1d atleast_2d roll take where clip
sort argsort nonzero diag tril triu sum mean prod max min amax amin argmax argmin std var
cumsum cumprod any all count_nonzero dot vdot inner outer tensordot einsum trace isclose
allclose array_equal average round around"""

_TYPES = """ndarray dtype bool_ int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16
float32 float64 complex64 complex128"""

_CONSTANTS = "newaxis pi e inf nan"

_NCCL_CONSTANTS = """NCCL_INT8 NCCL_CHAR NCCL_UINT8 NCCL_INT32 NCCL_INT NCCL_UINT32 NCCL_INT64
NCCL_UINT64 NCCL_FLOAT16 NCCL_HALF NCCL_FLOAT32 NCCL_FLOAT NCCL_FLOAT64 NCCL_DOUBLE
NCCL_BFLOAT16 NCCL_SUM NCCL_PROD NCCL_MAX NCCL_MIN NCCL_AVG"""

# Every name must exist in CuPy 14 with the argument list the simulator gives it; the simulator
# provides every name here and no other public name; ``_devices/cuda.py`` and ``comm/nccl/``
# reach CuPy only through these names. Add a name here first when synk starts using it.
#: namespace -> names used in it. A namespace is a module or a class, spelled from "cupy".
NAMES: dict = {
    "cupy": tuple((_UFUNCS + " " + _FUNCTIONS + " " + _TYPES + " " + _CONSTANTS).split())
    + ("cuda", "random", "linalg", "get_default_memory_pool"),
    "cupy.ndarray": tuple("""T all any argmax argmin argsort astype clip conj conjugate copy
        cumprod cumsum data device diagonal dot dtype fill flags flatten get imag item itemsize
        max mean min nbytes ndim nonzero prod ravel real repeat reshape round set shape size
        sort squeeze std strides sum swapaxes take tobytes tolist trace transpose var
        view""".split()),
    "cupy.random": tuple("""seed rand randn random random_sample normal uniform randint
        permutation shuffle choice standard_normal""".split()),
    "cupy.linalg": tuple("norm inv solve svd qr cholesky eigh det".split()),
    "cupy.cuda": ("Device", "Stream", "Event", "MemoryPointer", "MemoryPool",
                  "get_current_stream", "get_device_id", "is_available", "runtime", "nccl",
                  "alloc_pinned_memory"),
    "cupy.cuda.Device": ("id", "use", "synchronize"),
    "cupy.cuda.Stream": ("null", "use", "synchronize", "record", "wait_event", "done",
                         "is_non_blocking", "priority", "launch_host_func"),
    "cupy.cuda.Event": ("record", "synchronize", "done"),
    "cupy.cuda.MemoryPointer": ("ptr", "device_id", "device", "mem"),
    "cupy.cuda.MemoryPool": ("used_bytes", "free_bytes", "total_bytes", "n_free_blocks",
                             "free_all_blocks"),
    "cupy.cuda.runtime": ("CUDARuntimeError", "getDeviceCount", "getDevice", "setDevice",
                          "deviceSynchronize", "hostRegister", "hostUnregister",
                          "getDeviceProperties", "eventQuery", "streamQuery",
                          "eventSynchronize", "streamSynchronize",
                          "runtimeGetVersion", "driverGetVersion"),
    "cupy.cuda.nccl": tuple(_NCCL_CONSTANTS.split()) + (
        "NcclCommunicator", "NcclConfig", "NcclError", "get_unique_id", "get_version",
        "get_build_version", "groupStart", "groupEnd", "available"),
    "cupy.cuda.nccl.NcclCommunicator": ("allReduce", "reduce", "broadcast", "bcast",
                                        "reduceScatter", "allGather", "send", "recv", "abort",
                                        "destroy", "check_async_error", "rank_id", "size",
                                        "device_id", "comm", "initAll"),
    "cupy.cuda.nccl.NcclConfig": ("split_share",),
}

#: names that are ufuncs (compared by their number of inputs, not an argument list)
UFUNCS = frozenset(_UFUNCS.split())
#: names that are the very numpy objects in CuPy too
SHARED_WITH_NUMPY = frozenset((_TYPES + " " + _CONSTANTS).split()) - {"ndarray"}


def resolve(root, path: str):
    """The object at ``path`` ("cupy.cuda.Stream") under the module ``root`` (cupy or the
    simulator's stand-in), importing submodules as needed (``cupy.cuda.nccl`` is not an
    attribute of ``cupy.cuda`` until imported)."""
    obj = root
    for part in path.split(".")[1:]:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            if not isinstance(obj, ModuleType):
                raise
            obj = importlib.import_module(f"{obj.__name__}.{part}")
    return obj


def nccl_module(xp) -> ModuleType:
    """``xp.cuda.nccl``, imported (CuPy loads it only on request)."""
    return importlib.import_module(f"{xp.__name__}.cuda.nccl")
