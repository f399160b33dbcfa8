"""``Data``: a numpy-like array in OS shared memory that every rank maps without copying.

The master creates and owns each block; a ``Data`` pickles by name, so a rank that receives
one maps the same block (cached by name, so the second call maps nothing). Growing a ``Data``
moves it to a new, larger block under a new name. With its next message the master tells the
ranks which blocks to unmap and where each changed ``Data`` now lives, so a rank's handle on a
``Data`` (even one captured in a shipped function's closure) follows it to the new block.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from multiprocessing.shared_memory import SharedMemory

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._engine import shm as _shm
from ._engine.shm import ATTACHED
from .errors import SynkError

_PREFIX = _shm.session_prefix()
_keys = itertools.count()  # a Data's identity, kept across its blocks
_blocks = itertools.count()
_live: weakref.WeakSet[Data] = weakref.WeakSet()
# Master: what the ranks must hear at their next message.
_released: list[str] = []  # blocks freed or replaced: unmap them
_moved: dict[int, tuple] = {}  # key -> ref of each Data whose block, shape or dtype changed
# Worker: the latest ref of every Data the master has changed.
_current: dict[int, tuple] = {}


def take_updates() -> tuple:
    """(block names to unmap, refs of changed Data) since the last call, for the ranks."""
    released, moved = tuple(_released), tuple(_moved.values())
    del _released[:]
    _moved.clear()
    return released, moved


def restore_updates(released, moved) -> None:
    """Put back updates taken for a message that could not be sent."""
    _released[:0] = released
    for ref in moved:
        _moved.setdefault(ref[0], ref)  # a newer change since then wins


def apply_updates(released, moved) -> None:
    """On a rank: unmap ``released`` blocks and note where changed Data live now."""
    for name in released:
        ATTACHED.release(name)
    for ref in moved:
        _current[ref[0]] = ref


def free_all() -> None:
    """Free every live ``Data`` of this process (used by ``synk.close()``)."""
    for d in list(_live):
        d.free()


def as_shape(shape) -> tuple:
    """``shape`` as a tuple of ints (an int n means ``(n,)``)."""
    if np.ndim(shape) == 0:
        return (int(shape),)
    return tuple(int(s) for s in shape)


def _check_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(
            f"synk.data cannot hold dtype {dtype}: shared memory holds raw bytes, not Python "
            "objects. Use a numeric, bool or fixed-size string dtype"
        )
    return dtype


def _freed() -> SynkError:
    return SynkError(
        "this synk.Data was freed (by .free() or synk.close()); make a new one with "
        "synk.data(...)"
    )


class Data:
    """A numpy-like array in OS shared memory, which every rank maps without copying.

    ``synk.data(...)`` is the usual way to make one; ``synk.Data(shape=(0,),
    dtype=numpy.float64)`` makes zeros of that shape and dtype.
    Passed to a synk function as a scattered input it is split along axis 0, and inside
    the function it arrives as a numpy array (a ``Data`` nested inside another object, such
    as a list, arrives as a ``Data``). It is not an ndarray subclass: numpy functions
    accept it through ``__array__`` (``np.sum(d)``, ``np.ones(3) + d``), but operators on
    the ``Data`` itself (``d + 1``) do not work; use ``d.array``.

    * ``np.asarray(d)`` and ``d.__array__(dtype=None, copy=None)`` give the view of the
      block; a copy when ``copy`` is true; converted with ``astype`` when ``dtype`` is
      given (``ValueError`` if that would need a copy and ``copy`` is False).
    * ``len(d)`` is ``shape[0]`` (``TypeError`` for a 0-d ``Data``); ``d[index]`` is
      ``d.array[index]`` (basic indexing gives a view of the block) and ``d[index] = value``
      writes through it.
    * ``repr(d)``: ``synk.Data(shape=..., dtype=..., name=...)``, or ``synk.Data(<freed>)``.

    **Pickling.** A ``Data`` pickles as ``ref()`` only, never its bytes. Unpickling, in any
    process on the same machine while the block exists, maps the same block (once per
    process) and gives a ``Data`` that does not own it: it reads and writes the same
    memory, and its ``free()`` only drops its own handle. On the ranks such a handle follows
    the master's ``Data``: after ``set_value`` or ``resize`` in the master, the next call
    tells every rank, so a ``Data`` captured in a shipped function's closure sees the new
    block and shape.

    **Lifetime.** The block is destroyed by ``free()``, when the owning ``Data`` is
    garbage-collected, or by ``synk.close()``, which frees every ``Data`` of the process.
    ``shape``, ``dtype``, ``ndim``, ``size`` and ``nbytes`` still answer after ``free()``;
    anything that touches the block raises ``SynkError`` ("this synk.Data was freed ...").
    """

    _shm: SharedMemory | None  # the owner's block (not set on a rank's handle); None once freed
    _finalizer: weakref.finalize  # destroys the owner's block
    _view: np.ndarray | None

    def __init__(self, shape=(0,), dtype=np.float64, *, _attach: tuple | None = None):
        self._view = None
        self._freed = False
        if _attach is not None:  # a rank's handle on a block the master owns
            self._owner = False
            self._set_ref(_attach)
            return
        self._owner, self._key = True, next(_keys)
        self._shm = None
        self._shape, self._dtype = as_shape(shape), _check_dtype(dtype)
        self._allocate(self.nbytes)
        _live.add(self)

    # -- block management -------------------------------------------------------------
    def _set_ref(self, ref: tuple) -> None:
        self._key, self._name, shape, dtype = ref
        self._shape, self._dtype, self._view = tuple(shape), np.dtype(dtype), None

    def _allocate(self, nbytes: int) -> None:
        shm = _shm.create(f"{_PREFIX}d{next(_blocks)}", nbytes)
        if self._shm is not None:
            self._retire()
        self._shm, self._name = shm, shm.name
        self._finalizer = weakref.finalize(self, _shm.destroy, shm)
        self._view = None

    def _retire(self) -> None:
        self._finalizer()
        ATTACHED.release(self._name)  # handles unpickled in this process, if any
        _released.append(self._name)

    def _block(self):
        """The mapped block, following the master's moves when this is a rank's handle."""
        if self._freed:
            raise _freed()
        if self._owner:
            return self._shm
        ref = _current.get(self._key)
        if ref is not None and ref[1:] != (self._name, self._shape, self._dtype.str):
            self._set_ref(ref)
        try:
            return ATTACHED.get(self._name)
        except FileNotFoundError:
            raise _freed() from None

    # -- numpy-like surface -------------------------------------------------------------
    @property
    def name(self) -> str:
        """Name of the shared-memory block; it changes when the data moves to a larger
        block. Raises ``SynkError`` once freed."""
        self._block()
        return self._name

    @property
    def shape(self) -> tuple:
        """Tuple of ints."""
        if not self._owner:
            self._block()
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The ``numpy.dtype``."""
        if not self._owner:
            self._block()
        return self._dtype

    @property
    def ndim(self) -> int:
        """``len(shape)``."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """The number of elements."""
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        """``size * dtype.itemsize``."""
        return self.size * self._dtype.itemsize

    @property
    def array(self) -> np.ndarray:
        """The numpy view of the block; writes through it are seen by every rank.

        Take it again after ``set_value`` or ``resize``: an earlier view keeps pointing at
        the old block if the data moved. Raises ``SynkError`` once freed.
        """
        shm = self._block()
        view = self._view
        if view is None:
            view = self._view = _shm.ndarray(shm, self._shape, self._dtype)
        return view

    def __array__(self, dtype=None, copy=None):
        arr = self.array
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ValueError(
                    f"a {arr.dtype} synk.Data cannot be viewed as {dtype} without a copy")
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d synk.Data")
        return self._shape[0]

    def __getitem__(self, index):
        return self.array[index]

    def __setitem__(self, index, value) -> None:
        self.array[index] = value

    def __repr__(self) -> str:
        if self._freed:
            return "synk.Data(<freed>)"
        return f"synk.Data(shape={self._shape}, dtype={self._dtype}, name={self._name!r})"

    # -- changing contents and size ----------------------------------------------------
    def set_value(self, value) -> None:
        """Replace the contents with ``np.asarray(value)``, taking its shape and dtype.

        If it needs more bytes than the block holds, the data moves to a new block (a new
        ``name``); otherwise the block is reused.

        Raises:
            TypeError: ``value`` has an object dtype.
            SynkError: this process does not own the ``Data`` ("only the master can change
                a synk.Data's shape or dtype"), or it was freed.
        """
        value = np.asarray(value)
        self._reshape(value.shape, _check_dtype(value.dtype))
        self.array[...] = value

    def resize(self, shape) -> None:
        """Change the shape like ``ndarray.resize``: the contents are kept in flat (C)
        order, truncated or padded with zeros.

        The data moves to a new block when it grows beyond the block's size; shrinking
        keeps the block.

        Raises:
            SynkError: this process does not own the ``Data``, or it was freed.
        """
        shape = as_shape(shape)
        keep = self.array.reshape(-1).copy()
        self._reshape(shape, self._dtype)
        flat = self.array.reshape(-1)
        n = min(flat.size, keep.size)
        flat[:n] = keep[:n]
        flat[n:] = 0

    def _reshape(self, shape, dtype) -> None:
        shm = self._block()
        if not self._owner:
            raise SynkError("only the master can change a synk.Data's shape or dtype")
        old = (self._name, self._shape, self._dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > shm.size:
            self._allocate(nbytes)
        self._shape, self._dtype, self._view = tuple(shape), dtype, None
        if (self._name, self._shape, self._dtype) != old:
            _moved[self._key] = self.ref()  # the ranks' handles follow at the next call

    def free(self) -> None:
        """Release the block now. Idempotent.

        Afterwards anything that touches the block (``array``, ``name``, indexing,
        ``set_value``, ``resize``, ``ref``, pickling, passing it to a function) raises
        ``SynkError``. Views taken earlier stay readable until they are dropped.
        """
        if self._freed:
            return
        self._freed, self._view = True, None
        if self._owner:
            self._retire()
            _live.discard(self)
            _moved.pop(self._key, None)
            self._shm = None

    # -- shipping to ranks ---------------------------------------------------------------
    def ref(self) -> tuple:
        """What another process needs to map this data: ``(key, name, shape, dtype_str)``;
        ``key`` identifies the ``Data`` across the blocks it moves through."""
        self._block()
        return (self._key, self._name, self._shape, self._dtype.str)

    def __reduce__(self):
        return _attach_data, (self.ref(),)


def _attach_data(ref: tuple) -> Data:
    return Data(_attach=ref)


def data(value: ArrayLike | None = None, *, shape: int | Sequence[int] | None = None,
         dtype: DTypeLike | None = None) -> Data:
    """Make a ``Data``: an array in OS shared memory, owned by this process.

    No running group is needed.

    Args:
        value: the contents: a copy of ``np.asarray(value, dtype=dtype)``, reshaped to
            ``shape`` when ``shape`` is given and differs. Without it, zeros of ``shape``
            (default ``(0,)``, to fill later with ``set_value``) and ``dtype`` (default
            float64).
        shape: an int or a tuple of ints.
        dtype: anything ``numpy.dtype`` accepts, except dtypes that hold Python objects.

    Returns:
        The new ``Data``.

    Raises:
        TypeError: a dtype that holds Python objects ("synk.data cannot hold dtype
            object ..."). numpy's own errors come from a ``value`` that cannot be
            converted or reshaped.
    """
    if value is not None:
        arr = np.asarray(value, dtype=dtype)
        if shape is not None and as_shape(shape) != arr.shape:
            arr = arr.reshape(shape)
        d = Data(arr.shape, arr.dtype)
        d.array[...] = arr
        return d
    return Data((0,) if shape is None else shape, np.float64 if dtype is None else dtype)
