"""synk's XLA FFI target on the CPU (``csrc/jax_ffi.cc``, built at install as
``synk.comm.autograd._jax_ffi``), which every ``synk.comm`` operation of a compiled function
calls: it calls the operation's Python function (``add``) with XLA's buffers, in place; what
that raises is kept (``callback_errors``), its text in XLA's error."""
from __future__ import annotations

import ctypes
import importlib.util
import itertools
import math
import weakref

import numpy as np

from ...errors import SynkError
from . import callback_errors as _callback_errors

TARGET = "synk_comm"
_MESSAGE = 4096  # the bytes of an error's text the target hands XLA (csrc/jax_ffi.cc)
_RUN = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p),
                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
_FUNCTIONS: dict = {}  # number -> fn, while its executable holds it
_NUMBERS = itertools.count(1)
_LOADED: list = []  # the run function's address, once the target is registered


@_RUN
def _from_xla(number, inputs, outputs, message):
    """The operation's function on its buffers' addresses; 1 where it raised."""
    try:
        _FUNCTIONS[number](inputs, outputs)
        return 0
    except BaseException as exc:
        _callback_errors.keep(exc)
        text = f"{type(exc).__name__}: {str(exc)[:_callback_errors.SAID]}".encode(errors="replace")
        text = text[:_MESSAGE - 1].decode(errors="ignore").encode() + b"\0"
        ctypes.memmove(message, text, len(text))
        return 1


def add(fn, keep_with) -> dict:
    """The target's attributes for an operation running ``fn(inputs, outputs)`` (each a
    list of buffer addresses: ``view`` makes arrays of them), kept as long as ``keep_with``
    (the module's host callbacks: the executable's) holds it."""
    if not _LOADED:
        _register()
    number = next(_NUMBERS)
    _FUNCTIONS[number] = fn
    keep_with(fn)
    weakref.finalize(fn, _FUNCTIONS.pop, number, None)
    return {"index": np.int64(number), "run": np.int64(_LOADED[0])}


def _register() -> None:
    import jax

    spec = importlib.util.find_spec(f"{__package__}._jax_ffi")
    if spec is None or spec.origin is None:
        raise SynkError(
            "synk.comm under jax.jit on the CPU runs through synk's compiled XLA handler, which "
            "was not built when synk was installed (the build needs a C++17 compiler, such as "
            "g++). Install one, then reinstall synk (pip install --force-reinstall --no-deps "
            "synk); or call synk.comm outside jax.jit")
    library = ctypes.CDLL(spec.origin)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.SynkComm), platform="cpu")
    _LOADED.append(ctypes.cast(_from_xla, ctypes.c_void_p).value)


def spec(shape, dtype) -> tuple:
    """``view``'s description of an array: its shape, dtype, and its bytes' ctypes type."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    return shape, dtype, (ctypes.c_char * nbytes) if nbytes else None


def view(address: int | None, spec: tuple, writable: bool) -> np.ndarray:
    """The array of ``spec`` (``spec()``) in XLA's buffer at ``address``."""
    shape, dtype, block = spec
    if block is None or not address:
        return np.empty(shape, dtype)
    array = np.frombuffer(block.from_address(address), dtype)
    if len(shape) != 1:
        array = array.reshape(shape)
    if not writable:
        array.flags.writeable = False
    return array
