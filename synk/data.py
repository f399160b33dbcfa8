"""``Data``: a numpy-like array in OS shared memory that every rank maps without copying.

The master creates and owns each block; a ``Data`` pickles by name, so a rank that receives
one maps the same block (cached by name, so the second call maps nothing). Growing a ``Data``
moves it to a new, larger block under a new name; ranks map the new block the next time they
receive it and the master tells them to unmap the old one.
"""
from __future__ import annotations

import itertools
import weakref

import numpy as np

from . import _shm
from .errors import SynkError

#: Blocks this process has mapped by name (in workers: everything the master sent).
ATTACHED = _shm.Attachments()

_PREFIX = _shm.session_prefix()
_counter = itertools.count()
_live: "weakref.WeakSet[Data]" = weakref.WeakSet()
_released: list[str] = []  # names the ranks should unmap at their next message


def take_released() -> list[str]:
    """Names of blocks freed or replaced since the last call (for the ranks to unmap)."""
    out = _released[:]
    del _released[:]
    return out


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


class Data:
    """An array in shared memory, scattered along axis 0 when passed to a synk function.

    Create with ``synk.data(value)`` or ``synk.data(shape=..., dtype=...)``. Behaves like a
    numpy array for ``shape``, ``dtype``, ``len``, indexing and assignment; ``.array`` is the
    numpy view of the block and ``np.asarray(d)`` works too.
    """

    def __init__(self, shape=(0,), dtype=np.float64, *, _attach: tuple | None = None):
        self._view = None
        if _attach is not None:  # a rank's handle on a block the master owns
            self._name, shape, dtype = _attach
            self._shm, self._owner = ATTACHED.get(self._name), False
        else:
            self._shm, self._owner = None, True
            self._name = None
        self._shape = as_shape(shape)
        self._dtype = _check_dtype(dtype)
        if self._owner:
            self._finalizer = None
            self._allocate(self.nbytes)
            _live.add(self)

    # -- block management -------------------------------------------------------------
    def _allocate(self, nbytes: int) -> None:
        shm = _shm.create(f"{_PREFIX}d{next(_counter)}", nbytes)
        if self._shm is not None:
            self._retire()
        self._shm, self._name = shm, shm.name
        self._finalizer = weakref.finalize(self, _destroy, shm)
        self._view = None

    def _retire(self) -> None:
        self._finalizer()
        _released.append(self._name)

    def _alive(self):
        if self._shm is None:
            raise SynkError(
                "this synk.Data was freed (by .free() or synk.close()); "
                "make a new one with synk.data(...)"
            )
        return self._shm

    # -- numpy-like surface -------------------------------------------------------------
    @property
    def name(self) -> str:
        """Name of the shared-memory block (changes when the block grows)."""
        self._alive()
        return self._name

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self._dtype.itemsize

    @property
    def array(self) -> np.ndarray:
        """The numpy view of the block (writes are seen by every rank)."""
        view = self._view
        if view is None:
            view = self._view = _shm.ndarray(self._alive(), self._shape, self._dtype)
        return view

    def __array__(self, dtype=None, copy=None):
        arr = self.array
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            if copy is False:
                raise ValueError(f"a {arr.dtype} synk.Data cannot be viewed as {dtype} without a copy")
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of a 0-d synk.Data")
        return self._shape[0]

    def __getitem__(self, index):
        return self.array[index]

    def __setitem__(self, index, value) -> None:
        self.array[index] = value

    def __repr__(self) -> str:
        if self._shm is None:
            return "synk.Data(<freed>)"
        return f"synk.Data(shape={self._shape}, dtype={self._dtype}, name={self._name!r})"

    # -- changing contents and size ----------------------------------------------------
    def set_value(self, value) -> None:
        """Replace contents with ``value``, taking its shape and dtype (regrows if needed)."""
        value = np.asarray(value)
        self._reshape(value.shape, _check_dtype(value.dtype))
        self.array[...] = value

    def resize(self, shape) -> None:
        """Change shape like ``ndarray.resize``: contents kept in flat order, new bytes zero."""
        shape = as_shape(shape)
        keep = self.array.reshape(-1).copy()
        self._reshape(shape, self._dtype)
        flat = self.array.reshape(-1)
        n = min(flat.size, keep.size)
        flat[:n] = keep[:n]
        flat[n:] = 0

    def _reshape(self, shape, dtype) -> None:
        self._alive()
        if not self._owner:
            raise SynkError("only the master can change a synk.Data's shape")
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes > self._shm.size:
            self._allocate(nbytes)
        self._shape, self._dtype, self._view = tuple(shape), dtype, None

    def free(self) -> None:
        """Release the block now (idempotent). Later use of this ``Data`` raises SynkError."""
        if self._shm is None:
            return
        self._view = None
        if self._owner:
            self._retire()
            _live.discard(self)
        self._shm = None

    # -- shipping to ranks ---------------------------------------------------------------
    def ref(self) -> tuple:
        """What a rank needs to map this block: ``(name, shape, dtype)``."""
        self._alive()
        return (self._name, self._shape, self._dtype.str)

    def __reduce__(self):
        return _attach_data, self.ref()


def _destroy(shm) -> None:
    _shm.destroy(shm)


def _attach_data(name, shape, dtype) -> Data:
    return Data(_attach=(name, shape, dtype))


def data(value=None, *, shape=None, dtype=None) -> Data:
    """Make a shared-memory ``Data``: a copy of ``value``, or zeros of ``shape`` and ``dtype``.

    With neither, an empty ``Data`` of shape ``(0,)`` to fill later with ``set_value``.
    """
    if value is not None:
        arr = np.asarray(value, dtype=dtype)
        if shape is not None and as_shape(shape) != arr.shape:
            arr = arr.reshape(shape)
        d = Data(arr.shape, arr.dtype)
        d.array[...] = arr
        return d
    return Data((0,) if shape is None else shape, np.float64 if dtype is None else dtype)
