"""torch tensors at synk's edge: a CPU tensor is its numpy view (``Tensor.numpy()``, no
copy), a CUDA tensor its CuPy array (``cupy.from_dlpack``, no copy); back again with
``torch.from_numpy`` and ``torch.from_dlpack``. Imported only once a tensor is seen."""
from __future__ import annotations

import numpy as np
import torch

from . import _cupy
from ._frame import Frame

# torch dtypes numpy (synk's wire) has no type for, and what to convert them to
_NO_NUMPY = {"complex32": "torch.complex64", "float8_e4m3fn": "torch.float16",
             "float8_e5m2": "torch.float16", "float8_e4m3fnuz": "torch.float16",
             "float8_e5m2fnuz": "torch.float16", "float8_e8m0fnu": "torch.float16",
             "float4_e2m1fn_x2": "torch.float16"}

_SUB_BYTE = {f"{u}int{n}" for u in ("", "u") for n in range(1, 8)}  # torch.int4, uint3...


_NAMES: dict = {}  # dtype -> its name, for the dtypes synk carries (filled by _checked)


def _checked(t: torch.Tensor) -> str:
    name = str(t.dtype).rpartition(".")[2]  # torch.float32 -> float32
    if name in _NO_NUMPY or name in _SUB_BYTE or name.startswith(("q", "bits")):
        better = _NO_NUMPY.get(name, "a standard dtype (torch.float32, torch.int64...)")
        raise TypeError(f"synk cannot carry a torch.{name} tensor: numpy, in which synk moves "
                        f"and combines arrays, has no such type, and synk never casts "
                        f"silently; convert it first, e.g. x.to({better})")
    if t.layout != torch.strided:
        raise TypeError(f"synk carries dense (strided) torch tensors, not {t.layout}; convert "
                        "it with x.to_dense()")
    _NAMES[t.dtype] = name
    return name


class TorchAdapter:
    kind = "torch"

    @staticmethod
    def native(x: torch.Tensor, math: bool = False) -> tuple:
        name = _NAMES.get(x.dtype) or _checked(x)
        device = x.device
        frame = Frame("torch", name, "cpu" if device.type == "cpu" else str(device),
                      x.requires_grad and torch.is_grad_enabled())
        t = x.detach()
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        if name == "bfloat16":  # its 16 bits (moving), or float32 (arithmetic)
            t = t.float() if math else t.view(torch.uint16)
        if t.layout is not torch.strided:
            _checked(t)  # (raises)
        if device.type == "cpu":
            return t.numpy(), frame
        if device.type == "cuda":
            return _cupy.from_framework(t), frame
        raise TypeError(f"synk carries torch tensors on the CPU and on CUDA devices, not on "
                        f"{t.device}; move it first, e.g. x.cpu()")

    @staticmethod
    def restore(value, frame: Frame, device=None) -> torch.Tensor:
        if isinstance(value, (np.ndarray, np.generic)):
            t = torch.from_numpy(_owned(np.asarray(value)))
        elif _cupy.is_real(value) and torch.cuda.is_available():
            t = torch.from_dlpack(value)  # a real CuPy array: the same device memory
        else:  # a simulated device's array (no CUDA for torch here): through the host
            t = torch.from_numpy(_owned(np.asarray(
                device.to_host(value) if device is not None else value.get())))
        if frame.dtype == "bfloat16":
            t = t.view(torch.bfloat16) if t.dtype == torch.uint16 else t.to(torch.bfloat16)
        if t.device.type == "cpu" and frame.device.startswith("cuda") and \
                torch.cuda.is_available():  # (a CUDA tensor's result, combined on the host)
            t = t.to(_cuda_device(frame, device))
        return t

    @staticmethod
    def zero(frame: Frame, device=None) -> torch.Tensor:
        return torch.zeros((), dtype=getattr(torch, frame.dtype))


def _cuda_device(frame: Frame, device) -> str:
    """Where a CUDA tensor's value goes: this rank's GPU, else the one it came from."""
    ordinal = getattr(device, "device_id", None)
    return frame.device if ordinal is None else f"cuda:{ordinal}"


def _owned(arr: np.ndarray) -> np.ndarray:
    """``arr`` as ``torch.from_numpy`` takes it without a warning: writable (torch has no read-only
    tensors: a read-only array, which other ranks share, is copied) and in native byte order."""
    if not arr.flags.writeable or not arr.dtype.isnative:
        return np.array(arr, dtype=arr.dtype.newbyteorder("="))
    return arr


ADAPTER = TorchAdapter()


# -- torch's current CUDA stream and synk's ------------------------------------------------
# torch queues its kernels on its current stream (by default the legacy default stream of
# the device); synk's work on a GPU rank runs on the rank's non-blocking CuPy stream, which
# is not ordered with the legacy default stream. torch.distributed orders each collective
# with the caller's current stream (ProcessGroupNCCL's ``syncStream`` before the work and
# ``WorkNCCL::synchronizeStream`` after it); synk does the same with events, through torch's
# ``ExternalStream`` over synk's stream.

def on_stream(stream_ptr: int, device_id: int):
    """``with``: torch's current stream on device ``device_id`` is synk's (``stream_ptr``,
    a CuPy stream's handle) while the user's function runs, so that the torch work it queues
    is ordered with synk's copies, collectives and reuse of memory; on leaving, synk's
    stream waits for whatever stream the function left current in torch."""
    import contextlib

    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    return _OnStream(stream_ptr, device_id)


class _OnStream:
    __slots__ = ("synk", "context")

    def __init__(self, stream_ptr: int, device_id: int) -> None:
        self.synk = torch.cuda.ExternalStream(stream_ptr, device=f"cuda:{device_id}")
        self.context = torch.cuda.stream(self.synk)

    def __enter__(self):
        self.context.__enter__()
        return self

    def __exit__(self, *exc):
        left = torch.cuda.current_stream(self.synk.device)
        if left.cuda_stream != self.synk.cuda_stream:  # (the function made another current)
            self.synk.wait_stream(left)
        return self.context.__exit__(*exc)


def written(tensors: list, stream_ptr: int) -> None:
    """synk wrote ``tensors`` (CUDA tensors' memory, through their CuPy views) on the CuPy stream
    ``stream_ptr``: torch's current stream of each one's device waits for it, so that the kernels
    torch queues next read what synk wrote (the hand-off of ``synchronizeStream``)."""
    done = set()
    for t in tensors:
        device = t.device
        if device.type != "cuda" or device in done:
            continue
        done.add(device)
        current = torch.cuda.current_stream(device)
        if current.cuda_stream != stream_ptr:
            current.wait_stream(torch.cuda.ExternalStream(stream_ptr, device=device))


# -- torch.compile'd functions -------------------------------------------------------------
# A function torch.compile returns holds this process's compiler state (its closure reaches
# torch's config modules, which do not pickle). What it was made from does: the function
# itself and the backend torch.compile resolved (inductor's wrapper holds the mode and the
# options, a named backend its wrapper), with fullgraph and dynamic. So a worker compiles the
# same function with them, on its first call: each rank compiles for itself, as torch
# compiles once per process.

def compiled_parts(fn) -> tuple | None:
    """``(function, backend, fullgraph, dynamic)`` that ``torch.compile`` made ``fn`` of, or
    None if ``fn`` is not such a function; raises ``TypeError`` for one whose parts this
    torch does not show where synk looks for them."""
    original = getattr(fn, "_torchdynamo_orig_callable", None)
    if original is None or not callable(fn):
        return None
    try:
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        context = cells["self"].cell_contents  # (torch._dynamo.eval_frame.OptimizeContext)
        backend = context.callback._torchdynamo_orig_backend._torchdynamo_orig_backend
        return original, backend.__wrapped__, bool(context.fullgraph), context._dynamic
    except (AttributeError, KeyError, TypeError) as err:
        raise TypeError(
            f"synk cannot ship this torch.compile'd function to the workers (torch "
            f"{torch.__version__} keeps its options where synk does not find them: {err}); "
            "give synk.function the function itself and compile inside it, on each rank "
            "(e.g. make the compiled function on the first call and keep it in a global)"
        ) from None


class Recompiled:
    """A torch.compile'd function as a worker receives it: compiled there on its first
    call, from the same function, backend, fullgraph and dynamic (``compiled_parts``)."""

    def __init__(self, fn, backend, fullgraph: bool, dynamic) -> None:
        self.fn, self.backend, self.fullgraph, self.dynamic = fn, backend, fullgraph, dynamic
        self._compiled = None
        self.__wrapped__ = fn  # (inspect.signature: the function's own)

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, backend=self.backend,
                                           fullgraph=self.fullgraph, dynamic=self.dynamic)
        return self._compiled(*args, **kwargs)

    def __reduce__(self):
        return Recompiled, (self.fn, self.backend, self.fullgraph, self.dynamic)
