"""Array kinds at synk's edge: one adapter per kind (numpy, CuPy, torch, JAX), so that
everything below the edge sees numpy or CuPy arrays only::

    torch tensor or JAX array  -> native()  -> native array (numpy on the host, CuPy on a
                                               GPU; through DLPack where the framework
                                               allows it, without a copy) and its Frame
    native result and Frame    -> restore() -> the framework's value
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any

import numpy as np

from .. import _tree
from ._frame import Frame

__all__ = ["Frame", "adapter_of", "framed", "native", "natives", "restore", "restores", "host",
           "as_array", "to_numpy", "zero_like", "is_traced", "jax_staging", "jax_kept",
           "on_stream", "written", "shippable", "pickling_hint"]


# Types no framework owns: answered without looking at their module.
_PLAIN = frozenset([np.ndarray, int, float, bool, complex, str, bytes, type(None), list, tuple,
                    dict])


_BY_TYPE: dict = {}  # type -> its adapter or None, once looked at (a cache of types only)


def adapter_of(x) -> Any:
    """The adapter of a torch tensor or a JAX array (tracers too), else None (numpy, CuPy, numbers,
    anything else). Cheap for numpy users: a value is looked at only by its type, and torch and JAX
    are imported only once a value of theirs is seen (its type's module says so), never before."""
    kind = type(x)
    if kind in _PLAIN:
        return None
    try:
        return _BY_TYPE[kind]
    except KeyError:
        pass
    module = kind.__module__
    adapter: Any = None
    if module.startswith("torch") or not module.startswith(("numpy", "cupy", "synk", "jax")) \
            and "torch" in sys.modules and _torch_type(kind):  # (a user's subclass of Tensor)
        from . import _torch

        adapter = _torch.ADAPTER if issubclass(kind, _torch.torch.Tensor) else None
    elif module.startswith(("jax", "jaxlib")):
        from . import _jax

        adapter = _jax.ADAPTER if _jax.owns(x) else None
    _BY_TYPE[kind] = adapter
    return adapter


def _torch_type(kind: type) -> bool:
    """A subclass of ``torch.Tensor`` defined elsewhere (a user's)."""
    return any(base.__module__.startswith("torch") for base in kind.__mro__[1:-1])


def framed(tree) -> bool:
    """Whether ``tree`` (a value, or a list, tuple or dict of them, nested) holds a torch
    tensor or a JAX array."""
    kind = type(tree)
    if kind is np.ndarray:
        return False
    if kind in (list, tuple, dict) or isinstance(tree, (list, tuple, dict)):
        return _framed_in(tree.values() if isinstance(tree, dict) else tree)
    return adapter_of(tree) is not None


_LEAVES = frozenset([np.ndarray, int, float, bool, complex, str, bytes, type(None),
                     np.float64, np.float32])  # (leaves no framework owns, in short)


def _framed_in(items) -> bool:
    for item in items:
        kind = type(item)
        if kind in _LEAVES:
            continue
        if kind in (list, tuple, dict) or isinstance(item, (list, tuple, dict)):
            if _framed_in(item.values() if isinstance(item, dict) else item):
                return True
        elif adapter_of(item) is not None:
            return True
    return False


def native(x, math: bool = False) -> tuple:
    """``(native array, Frame)`` of a framework value ``x`` (``(x, None)`` for anything
    else): numpy for host values, CuPy for GPU ones. bfloat16 has no numpy type: it moves
    as its 16-bit bytes (``uint16``), or, with ``math`` (a reduction that does arithmetic on
    it), as float32, rounded back to bfloat16 once by ``restore``."""
    adapter = adapter_of(x)
    if adapter is None:
        return x, None
    return adapter.native(x, math)


def natives(tree, math: bool = False) -> tuple:
    """``(tree with every framework leaf native, the frames)``; the frames are None when no
    leaf is a framework value, else a structure like ``tree`` of Frame or None per leaf."""
    if not isinstance(tree, (list, tuple, dict)):
        return native(tree, math)
    leaves, template = _tree.flatten(tree)
    pairs = [native(leaf, math) for leaf in leaves]
    if all(frame is None for _, frame in pairs):
        return tree, None
    return (_tree.rebuild(template, iter([v for v, _ in pairs])),
            _tree.rebuild(template, iter([f for _, f in pairs])))


def restore(value, frame: Frame | None, device=None):
    """The framework value of a native array ``value`` with ``frame`` (None: ``value``
    itself). ``device``: the rank's synk device, for a CuPy array of a GPU rank (given to
    the framework through DLPack where it has the device, else copied to the host)."""
    if frame is None or value is None or (isinstance(value, (int, float, complex))
                                          and not isinstance(value, np.generic)):
        return value  # (a Python number in a structure stays one; numpy's float64, a
        # float too, is a 0-d result: GPU ranks' small outputs combined on the host)
    return _adapter(frame.kind).restore(value, frame, device)


def restores(tree, frames, device=None):
    """``restore`` leaf by leaf (``frames`` as ``natives`` gave them)."""
    if frames is None:
        return tree
    if isinstance(frames, Frame):
        return restore(tree, frames, device)
    leaves, template = _tree.flatten(tree)
    kinds = _tree.flatten(frames)[0]
    if len(kinds) != len(leaves):
        return tree
    return _tree.rebuild(template, iter([restore(v, f, device) for v, f in zip(leaves, kinds)]))


def host(value) -> np.ndarray:
    """A native array on the host (a CuPy array copied there)."""
    if type(value) is np.ndarray or not hasattr(value, "get"):
        return value
    return value.get()


def as_array(value, what: str, fix: str, dtype=None) -> np.ndarray:
    """``np.asarray(value, dtype)``; for a ragged nested sequence (items of different
    lengths or shapes, of which numpy makes no array) a ``ValueError`` that says what
    ``what`` (the argument) is and what to do (``fix``), rather than numpy's "setting an
    array element with a sequence" (chained)."""
    try:
        return np.asarray(value, dtype=dtype)
    except ValueError as err:
        if "inhomogeneous" not in str(err) and "with a sequence" not in str(err):
            raise
        raise ValueError(f"{what} is a ragged nested sequence (its items have different "
                         f"lengths or shapes), which is no array: {fix}") from err


RAGGED_IN_COMM = (
    "synk.comm moves arrays of one shape each. Pass an array (pad the rows to one length, "
    "or move each row as an array of its own), or send Python objects with "
    "synk.comm.broadcast_object, allgather_object, gather_object or scatter_object")


RAGGED_IN_MEMORY = (
    "it holds one array of one shape. Pad the rows to one length, or keep each row as an "
    "array of its own")


def on_stream(device):
    """``with``: torch queues its work on the GPU rank's stream while the user's function runs
    (``_torch.on_stream``); JAX picks its own streams, ordered through DLPack's stream exchange
    where arrays cross. Nothing without torch's CUDA."""
    if "torch" not in sys.modules or getattr(device, "stream", None) is None:
        return contextlib.nullcontext()
    from . import _torch

    return _torch.on_stream(device.stream.ptr, device.device_id)


def written(buffers: list) -> None:
    """synk wrote ``buffers`` (framework values given as ``out=``, through their native
    views) on the current CuPy stream: a framework that queues its work on another stream
    waits for it (torch: ``_torch.written``)."""
    tensors = [b for b in buffers if type(b).__module__.startswith("torch")
               and getattr(getattr(b, "device", None), "type", None) == "cuda"]
    if tensors:
        import cupy

        from . import _torch

        _torch.written(tensors, cupy.cuda.get_current_stream().ptr)


def shippable(fn):
    """``fn`` as it can be pickled for the workers: a ``torch.compile``'d function as what it was
    compiled from, compiled again on each rank (``_torch.Recompiled``); anything else as it is."""
    if "torch" not in sys.modules or getattr(fn, "_torchdynamo_orig_callable", None) is None:
        return fn
    from . import _torch

    parts = _torch.compiled_parts(fn)
    return fn if parts is None else _torch.Recompiled(*parts)


def pickling_hint(err: BaseException) -> str:
    """What to do about ``err``, an error pickling a function for the workers, where it
    comes of a framework's object ("" where none is known)."""
    if "torch" in sys.modules and "ConfigModule" in str(err):
        return ("; a torch.compile'd function that it uses (a global or a closure's) cannot "
                "be pickled: give the compiled function to synk.function itself (each rank "
                "then compiles it), or compile inside the function")
    return ""


def to_numpy(x):
    """``x`` as numpy if it is a framework value (an index array given as a tensor), else
    ``x`` itself."""
    if type(x) is np.ndarray or adapter_of(x) is None:
        return x
    return host(native(x)[0])


def _adapter(kind: str):
    adapter = _BY_KIND.get(kind)  # (each restore asks: no import statement once known)
    if adapter is None:
        if kind == "torch":
            from . import _torch

            adapter = _torch.ADAPTER
        else:
            adapter = _jax_side().ADAPTER
        _BY_KIND[kind] = adapter
    return adapter


_BY_KIND: dict = {}  # a frame's kind -> its adapter


def zero_like(frame: Frame, device=None):
    """A 0-d zero of ``frame``'s framework and dtype: what a rank gets where a collective
    gives it nothing (a send, a rooted collective off its root), to connect to its loss."""
    return _adapter(frame.kind).zero(frame, device)


def is_traced(x) -> bool:
    """Whether ``x`` is a JAX tracer (inside ``jax.grad``, ``jax.jit``, ``jax.vmap``...)."""
    if "jax" not in sys.modules or not type(x).__module__.startswith("jax"):
        return False
    from . import _jax

    return _jax.traced(x)


def jax_kept(array, previous=None):
    """JAX array ``array`` on the host, kept as what a replica holds (``_jax.Kept``: its
    ``holds(arr)`` tells whether numpy array ``arr`` has exactly its shape, dtype and
    bytes; ``host``, its numpy view as synk moves it). ``previous``: the replica's last."""
    return _jax_side().Kept(array, previous)


def jax_staging() -> bool:
    """Whether JAX is tracing a function for ``jax.jit`` here (False at once without JAX)."""
    if _JAX_SIDE not in sys.modules and "jax" not in sys.modules:
        return False
    return _jax_side().staging()


_JAX_SIDE = __name__ + "._jax"


def _jax_side() -> Any:
    """``_jax``, found without an import statement once imported (every synk.comm call
    asks ``jax_staging``)."""
    jax_side = sys.modules.get(_JAX_SIDE)
    if jax_side is None:
        from . import _jax as jax_side
    return jax_side
