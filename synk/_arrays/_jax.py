"""JAX arrays at synk's edge: a host array is its numpy view (``np.asarray``, no copy), a
GPU array its CuPy array (DLPack); back again with ``jax.dlpack.from_dlpack`` where JAX can
alias the memory and nothing but the user writes it (a ``Data``'s page-aligned shared
memory: no copy), else ``jnp.asarray``. Imported only
once a JAX array is seen. Tracers (inside ``jax.grad``, ``jax.jit``...) have no values:
``synk.comm`` runs them as primitives (``synk.comm.autograd``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _cupy
from ._frame import Frame

_ALIAS_FROM = 1 << 16  # bytes from which a host array is handed to JAX without a copy
_BFLOAT16 = np.dtype(jnp.bfloat16)


def owns(x) -> bool:
    return isinstance(x, jax.Array)


def traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def staging() -> bool:
    """Whether JAX is tracing a function to compile it (``jax.jit``) in this thread: Python
    code then runs once, at tracing, and never when the compiled function runs."""
    try:
        from jax._src import core  # (no public handle on the current trace)

        trace = core.trace_ctx.trace
        while trace is not None:
            if type(trace).__name__ == "DynamicJaxprTrace":
                return True
            trace = getattr(trace, "parent_trace", None)
    except Exception:
        return False
    return False


def device_of(x) -> str:
    try:
        dev = next(iter(x.devices()))
        return f"{dev.platform}:{dev.id}"
    except Exception:  # (a tracer)
        return jax.default_backend()


def host_form(arr: np.ndarray, math: bool, name: str) -> np.ndarray:
    """A numpy array of JAX's as synk moves it: bfloat16 as its 16 bits (``math``: as
    float32); other types numpy lacks are refused."""
    if arr.dtype == _BFLOAT16:
        return arr.astype(np.float32) if math else arr.view(np.uint16)
    if arr.dtype.kind == "V":
        raise TypeError(f"synk cannot carry a JAX array of dtype {name}: numpy, in which synk "
                        "moves and combines arrays, has no such type, and synk never casts "
                        "silently; convert it first, e.g. x.astype(jnp.float32)")
    return arr


class JaxAdapter:
    kind = "jax"

    @staticmethod
    def native(x, math: bool = False) -> tuple:
        name = dtype_name(x.dtype)
        if traced(x):
            raise TypeError("a traced JAX value has no data to move; synk.comm runs it as a "
                            "primitive (this is a bug of synk's if you see it)")
        device = device_of(x)
        frame = Frame("jax", name, device, False)
        if device.startswith(("gpu", "cuda")):
            arr = _cupy.from_framework(x)
            if name == "bfloat16":
                arr = arr.view(np.uint16)
                if math:
                    raise TypeError("a bfloat16 JAX array on a GPU is combined in float32: "
                                    "convert it first, x.astype(jnp.float32)")
            return arr, frame
        return host_form(np.asarray(x), math, name), frame

    @staticmethod
    def restore(value, frame: Frame, device=None):
        if not isinstance(value, (np.ndarray, np.generic)):
            if _cupy.is_real(value) and frame.device.startswith(
                    ("gpu", "cuda")):
                return jax.dlpack.from_dlpack(value)
            value = device.to_host(value) if device is not None else value.get()
        arr = np.asarray(value)
        if frame.dtype == "bfloat16":
            arr = arr.view(_BFLOAT16) if arr.dtype == np.uint16 else arr.astype(_BFLOAT16)
        if frame.device.startswith(("gpu", "cuda")):  # (a GPU array's value, from the host)
            gpus = _gpus()
            if gpus:
                ordinal = getattr(device, "device_id", None) or 0
                return jax.device_put(arr, gpus[min(ordinal, len(gpus) - 1)])
        return _to_jax(arr)

    @staticmethod
    def zero(frame: Frame, device=None):
        return jnp.zeros((), dtype=frame.dtype)


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # (no GPU backend here)
        return []


def _to_jax(arr: np.ndarray):
    """A JAX array of ``arr``: its memory itself where JAX can alias it (large, aligned,
    writable: a ``Data``'s shared memory), else a copy. A JAX array must never change, and
    synk writes read-only memory again itself (its staging blocks, at the next call), so
    that is copied; so is a replica, which ``synk.assign`` writes (``frames``)."""
    if arr.nbytes >= _ALIAS_FROM and arr.ctypes.data % 64 == 0 and arr.flags.c_contiguous \
            and arr.flags.writeable:
        try:
            return jax.dlpack.from_dlpack(arr)
        except Exception:  # (an alignment or a dtype DLPack refuses)
            pass
    return jnp.asarray(arr)


ADAPTER = JaxAdapter()
