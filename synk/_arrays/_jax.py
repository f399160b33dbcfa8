"""JAX arrays at synk's edge: a host array is its numpy view (no copy), a GPU array its CuPy
array (DLPack); back again by ``jax.dlpack.from_dlpack`` where JAX can alias memory only the
user writes (a ``Data``'s page-aligned shared memory), else a copy (``_jax_put``). Imported
once a JAX array is seen. Tracers have no values: ``synk.comm.autograd`` runs them."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as _core  # (no public handle on the current trace)

from . import _cupy, _jax_put
from ._frame import Frame, frame_of

_ALIAS_FROM = 1 << 16  # bytes from which a host array is handed to JAX without a copy
_COPIES_COMPARED = 4096  # bytes up to which a replica is compared as two copies of its
# bytes rather than through memcmp by pointer (a ctypes call costs five times more)
_BFLOAT16 = np.dtype(jnp.bfloat16)


def owns(x) -> bool:
    return isinstance(x, jax.Array)


def traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


_NAMES: dict = {}  # dtype -> its name (numpy computes a dtype's name anew each time)


def dtype_name(dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        name = _NAMES[dtype] = np.dtype(dtype).name
        return name


def staging() -> bool:
    """Whether JAX is tracing a function to compile it (``jax.jit``) in this thread: Python
    code then runs once, at tracing, and never when the compiled function runs."""
    try:
        trace = _core.trace_ctx.trace
        while trace is not None:
            if type(trace).__name__ == "DynamicJaxprTrace":
                return True
            trace = getattr(trace, "parent_trace", None)
    except Exception:
        return False
    return False


_DEVICE_NAMES: dict = {}  # JAX device -> "platform:id"


def device_of(x) -> str:
    try:
        dev = next(iter(x.devices()))
    except Exception:  # (a deleted array: its conversion then raises JAX's own error)
        return jax.default_backend()
    name = _DEVICE_NAMES.get(dev)
    if name is None:
        name = _DEVICE_NAMES[dev] = f"{dev.platform}:{dev.id}"
    return name


def host_form(arr: np.ndarray, math: bool) -> np.ndarray:
    """A numpy array of JAX's as synk moves it: bfloat16 as its 16 bits (``math``: as
    float32); other types numpy lacks are refused."""
    if arr.dtype == _BFLOAT16:
        return arr.astype(np.float32) if math else arr.view(np.uint16)
    _check_carried(arr.dtype)
    return arr


def _check_carried(dtype: np.dtype) -> None:
    """Refuse the types numpy has no arithmetic of (float8, int4...; bfloat16 is moved as
    its 16 bits), on the host as on a GPU (where DLPack would refuse them less clearly)."""
    if dtype.kind == "V":
        raise TypeError(f"synk cannot carry a JAX array of dtype {dtype}: numpy, in which "
                        "synk moves and combines arrays, has no such type, and synk never casts "
                        "silently; convert it first, e.g. x.astype(jnp.float32)")


class JaxAdapter:
    kind = "jax"

    @staticmethod
    def native(x, math: bool = False) -> tuple:
        name = dtype_name(x.dtype)
        if traced(x):  # (synk.comm binds its primitive for traced values: a call cannot)
            raise TypeError(
                "a synk function was called with a value that JAX traces (inside jax.jit, "
                "jax.grad, jax.vmap...): a synk call runs on every rank at once and has no "
                "traced form, so JAX cannot compile or differentiate through it. Call the "
                "synk function outside the JAX transformation, and put the transformation "
                "inside the function you give synk.function (synk.function(jax.jit(step)), or "
                "jax.grad inside it); inside the function, synk.comm's collectives do work "
                "under jax.jit and jax.grad")
        device = device_of(x)
        frame = frame_of("jax", name, device, False)
        if device.startswith(("gpu", "cuda")):
            if name == "bfloat16":  # (its bits, or float32 to compute in, made on the
                x = x.astype(jnp.float32) if math else jax.lax.bitcast_convert_type(
                    x, jnp.uint16)  # device by JAX: CuPy has no bfloat16 of its own)
            else:
                _check_carried(np.dtype(x.dtype))
            return _cupy.from_framework(x), frame
        return host_form(np.asarray(x), math), frame

    @staticmethod
    def restore(value, frame: Frame, device=None):
        if not isinstance(value, (np.ndarray, np.generic)):
            if _cupy.is_real(value) and frame.device.startswith(
                    ("gpu", "cuda")):
                got = jax.dlpack.from_dlpack(value)
                if frame.dtype == "bfloat16":  # (its bits, or a float32 result)
                    got = jax.lax.bitcast_convert_type(got, jnp.bfloat16) \
                        if got.dtype == jnp.uint16 else got.astype(jnp.bfloat16)
                return got
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


class Kept:
    """A host JAX array a replica was handed over or assigned as, and its own host buffer
    (bfloat16 as 16 bits): while the replica holds exactly its bytes ``fn`` gets it again.
    ``previous``: the replica's last one (its look at the memory kept); ``placed``: its
    ``_placement``, where known."""

    __slots__ = ("array", "host", "_pointer", "_replica", "_replica_pointer", "_placed")

    def __init__(self, array, previous: Kept | None = None, placed: tuple | None = None) -> None:
        self.array = array
        self._placed = placed
        self.host = host_form(np.asarray(array), False)  # (the buffer itself, no copy)
        self._pointer = 0
        self._replica: np.ndarray | None = None
        self._replica_pointer = 0
        if previous is not None:
            self._replica, self._replica_pointer = previous._replica, previous._replica_pointer

    def holds(self, arr: np.ndarray) -> bool:
        """Whether the array still exists (not donated to a jitted function) and ``arr``
        has its shape, dtype (bfloat16 as its 16 bits) and bytes."""
        if self.array.is_deleted():
            return False
        host = self.host
        if host.shape != arr.shape or host.dtype != arr.dtype:
            return False  # (fn assigned one broadcast or cast into the replica)
        if host.nbytes <= _COPIES_COMPARED or not (
                host.flags.c_contiguous and arr.flags.c_contiguous):
            return host.tobytes() == arr.tobytes()
        if arr is not self._replica:  # (a replica keeps its memory: its pointer, once)
            self._replica, self._replica_pointer = arr, arr.ctypes.data
        if not self._pointer:  # (of the host buffer compared: a GPU array's is a copy)
            self._pointer = host.ctypes.data
        return _memcmp()(self._pointer, self._replica_pointer, host.nbytes) == 0

    def successor(self, value) -> Kept | None:
        """The ``Kept`` of ``value``, a JAX array ``fn`` assigned to the replica, where it
        is on the device, and typed (weak or not), as this one, so that ``fn`` may get one
        where it got the other; else None."""
        try:
            if not isinstance(value, jax.Array) or traced(value) or value.is_deleted():
                return None
            placed = _placement(value)
            if self._placed is None:
                self._placed = _placement(self.array)
            if placed != self._placed:
                return None
        except Exception:  # (an array of a kind this does not know)
            return None
        return Kept(value, self, placed)


def _placement(x) -> tuple:
    """Where JAX array ``x`` is and how it is typed: its devices, weak type, committed."""
    return x.devices(), x.aval.weak_type, getattr(x, "_committed", None)


@functools.cache
def _memcmp():
    """The C library's ``memcmp`` (loaded once)."""
    import ctypes

    memcmp = ctypes.CDLL(None).memcmp
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return memcmp


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:  # (no GPU backend here)
        return []


def _to_jax(arr: np.ndarray):
    """A JAX array of ``arr``: its memory where JAX can alias it (large, aligned, writable: a
    ``Data``'s shared memory), else a copy (``_jax_put``): a JAX array must never change, and
    synk rewrites its read-only staging blocks and (``synk.assign``) replicas."""
    if arr.nbytes >= _ALIAS_FROM and arr.ctypes.data % 64 == 0 and arr.flags.c_contiguous \
            and arr.flags.writeable:
        try:
            return jax.dlpack.from_dlpack(arr)
        except Exception:  # (an alignment or a dtype DLPack refuses)
            pass
    return _jax_put.put(arr)


ADAPTER = JaxAdapter()
