"""``Data``: a numpy-like array in OS shared memory, created and owned by the master and mapped
without copying by every rank, whose handle follows the master's ``Data`` when it moves to a
new block (``_wire.data_updates``).
"""
from __future__ import annotations

import itertools
import math
import os
import weakref
from collections.abc import Sequence
from multiprocessing.shared_memory import SharedMemory

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from . import _arrays, _data_blocks as _blocks, _data_sizes as _sizes
from ._call import kept as _kept
from ._devices import device_dtypes
from ._process import PROCESS
from ._wire import shm as _shm
from ._wire.arrays import SharedData, dtype_token
from ._wire.shm import ATTACHED
from .errors import GroupBrokenError, ReentrantCallError, SynkError

MODES = ("replicate", "shard")
_keys = itertools.count()  # a Data's identity, kept across its blocks


def _freed() -> SynkError:
    return SynkError(
        "this synk.Data was freed (by .free() or synk.close()); make a new one with "
        "synk.data(...)"
    )


def _after_submitted_calls() -> None:
    """Before the master changes a Data through its methods: the submitted calls still
    outstanding, which read it when the ranks run them (maybe after ``submit`` returned),
    end first, their replies read, so that none reads the change. Not from inside a call
    of the group (its own share runs after them), nor on a broken group (they failed: each
    future has its error, and the change goes on)."""
    group = PROCESS.group
    if group is None or not group.outstanding() or group.broken is not None:
        return
    try:
        with group.exclusive("a change of a synk.Data"):
            pass
    except (ReentrantCallError, GroupBrokenError):
        pass


class Data(SharedData):
    """A numpy-like array in OS shared memory, which every rank maps without copying.

    ``synk.data(...)`` is the usual way to make one; ``synk.Data(shape=(0,),
    dtype=numpy.float64)`` makes zeros of that shape and dtype.
    Passed to a synk function as a scattered input it is split along axis 0, and inside
    the function it arrives as a numpy array (a ``Data`` nested inside another object, such
    as a list, arrives as a ``Data``). Unlike plain numpy inputs, which arrive read-only,
    it is writable on every rank of a job on one host: it is shared memory on purpose. It
    is not an ndarray subclass: numpy functions accept it through ``__array__``
    (``np.sum(d)``, ``np.ones(3) + d``), but operators on the ``Data`` itself (``d + 1``)
    do not work; use ``d.array``.

    * ``np.asarray(d)`` and ``d.__array__(dtype=None, copy=None)`` give the view of the
      block; a copy when ``copy`` is true; converted with ``astype`` when ``dtype`` is
      given (``ValueError`` if that would need a copy and ``copy`` is False).
    * ``len(d)`` is ``shape[0]`` (``TypeError`` for a 0-d ``Data``); ``d[index]`` is
      ``d.array[index]`` (basic indexing gives a view of the block) and ``d[index] = value``
      writes through it.
    * ``repr(d)``: ``synk.Data(shape=..., dtype=..., name=...)``, or ``synk.Data(<freed>)``.
    * ``set_value`` and ``resize`` change it; ``capacity`` is the block's size in bytes,
      ``shrink()`` trims it to the data, ``free()`` releases it.
    * ``to_device(mode)`` keeps a copy on every GPU rank's device across calls
      (``"replicate"``: the whole array; ``"shard"``: each rank's rows), ``to_host()``
      drops it, ``on_device`` says which; see [Device-resident data](gpu.md#device-resident-data).
      While resident, ``array`` is read-only: write with ``d[...] = value``, ``set_value``
      or ``resize`` (the next call refreshes the device copies), or call ``touch()`` after
      writing by any other route.
    * In an MPI job across hosts, the other hosts keep copies of the rows they read, sent
      again only when the ``Data`` changed: from its first call on, ``array`` is read-only
      as while resident (write with ``d[...] = value``, ``set_value`` or ``resize``), and
      the functions get it read-only on every rank; see
      [What crosses the network](cluster.md#what-crosses-the-network).

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

    def __init__(self, shape=(0,), dtype=np.float64, *, oversize: float = 1.0,
                 _attach: tuple | None = None):
        self._view = None
        self._freed = False
        self._version = 0  # bumped by every change the master makes to the contents
        self._residency: str | None = None
        self._on_hosts = False  # other hosts of an MPI job keep copies (see _keep_on_hosts)
        if _attach is not None:  # a rank's handle on a block the master owns
            self._owner = False
            self._set_ref(_attach)
            return
        self._owner, self._key = True, next(_keys)
        self._shm = None
        self._shape, self._dtype = _sizes.as_shape(shape), _sizes.check_dtype(dtype)
        oversize = _sizes.check_oversize(oversize)
        size = _sizes.block_bytes(_sizes.nbytes_of(self._shape, self._dtype), oversize)
        self._allocate(size, self._shape, self._dtype)
        PROCESS.live_data.add(self)

    # -- block management -------------------------------------------------------------
    def _set_ref(self, ref: tuple) -> None:
        self._key, self._name, shape, dtype = ref
        self._shape, self._dtype, self._view = tuple(shape), np.dtype(dtype), None

    def _allocate(self, nbytes: int, shape: tuple, dtype: np.dtype) -> None:
        shm = _shm.create(_blocks.new_name(), nbytes,
                          f"a synk.Data of shape {shape} and dtype {dtype}")
        if self._shm is not None:
            self._finalizer()  # (the old block goes)
        self._shm, self._name = shm, shm.name
        self._finalizer = weakref.finalize(self, _blocks.gone, shm, os.getpid())
        self._view = None

    def _block(self):
        """The mapped block, following the master's moves when this is a rank's handle."""
        if self._freed:
            raise _freed()
        if self._owner:
            return self._shm
        ref = PROCESS.data_places.get(self._key)
        if ref is not None and ref[1:] != (self._name, self._shape, dtype_token(self._dtype)):
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
        return math.prod(self._shape)

    @property
    def nbytes(self) -> int:
        """``size * dtype.itemsize``."""
        return self.size * self._dtype.itemsize

    @property
    def capacity(self) -> int:
        """Bytes of the block: ``nbytes`` can grow to this without moving to a new block."""
        return self._block().size

    @property
    def array(self) -> np.ndarray:
        """The numpy view of the block; writes through it are seen by every rank.

        Take it again after ``set_value`` or ``resize``: an earlier view keeps pointing at
        the old block if the data moved. While the Data is resident on the devices
        (``to_device``) the view is read-only, so that no write goes unseen by the device
        copies. Raises ``SynkError`` once freed.
        """
        shm = self._block()
        view = self._view
        if view is None:
            view = self._view = _shm.ndarray(shm, self._shape, self._dtype)
            if self._copied_elsewhere():
                view.flags.writeable = False
        return view

    def _copied_elsewhere(self) -> bool:
        """Devices or other hosts keep copies, refreshed by version: no silent writes."""
        return self._residency is not None or self._on_hosts

    def _writable(self) -> np.ndarray:
        """A writable view for the master's own changes (which bump the version)."""
        if not self._copied_elsewhere():
            return self.array
        return _shm.ndarray(self._block(), self._shape, self._dtype)

    @property
    def version(self) -> int:
        """A number that grows with every change the master makes to the contents
        (``d[...] = ``, ``set_value``, ``resize``, ``shrink``, ``touch``)."""
        return self._version

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
        _after_submitted_calls()
        self._writable()[index] = value
        self._version += 1

    def __repr__(self) -> str:
        if self._freed:
            return "synk.Data(<freed>)"
        return f"synk.Data(shape={self._shape}, dtype={self._dtype}, name={self._name!r})"

    # -- changing contents and size ----------------------------------------------------
    def set_value(self, value, force_cast: bool = False, oversize: float = 1.0) -> None:
        """Replace the contents with ``np.asarray(value)``, taking its shape, and its dtype
        unless ``force_cast``.

        If it needs more bytes than the block holds, the data moves to a new block (a new
        ``name``); otherwise the block is reused.

        Args:
            force_cast: keep this Data's dtype and cast the value to it as numpy's
                ``casting="unsafe"`` does (floats to ints truncate).
            oversize: >= 1; a block that has to be made is at least this multiple of the
                value's bytes, so that later growth up to it moves nothing (see
                ``capacity``, ``shrink``).

        Raises:
            TypeError: ``value`` has an object dtype.
            ValueError: ``oversize`` is not a finite number >= 1, or the block it asks for
                is too large to be a size.
            ShmSpaceError: ``/dev/shm`` or the machine's memory has no room for a larger
                block.
            SynkError: this process does not own the ``Data`` ("only the master can change
                a synk.Data's shape or dtype"), or it was freed.

        On an error the Data is unchanged: shape, dtype, contents and block.
        """
        oversize = _sizes.check_oversize(oversize)
        value, frame = _arrays.native(value)
        value = _arrays.as_array(_arrays.host(value), "set_value's value",
                                 _arrays.RAGGED_IN_MEMORY)
        if frame is not None:
            self.frame = frame.replace(grad=False)
        if force_cast and value.dtype != self._dtype:
            value = value.astype(self._dtype)  # before any change, should the cast fail
        _after_submitted_calls()
        self._reshape(value.shape, _sizes.check_dtype(value.dtype), oversize)
        self._writable()[...] = value
        self._version += 1

    def resize(self, shape, oversize: float = 1.0) -> None:
        """Change the shape like ``ndarray.resize``: the contents are kept in flat (C)
        order, truncated or padded with zeros.

        The data moves to a new block when it grows beyond the block's size (``oversize``
        as in ``set_value``); shrinking keeps the block.

        Raises:
            SynkError: this process does not own the ``Data``, or it was freed.
            ValueError: a shape no array can have (a negative length, or more bytes than
                an address can count), or an impossible ``oversize``.
            ShmSpaceError: ``/dev/shm`` or the machine's memory has no room for a larger
                block.

        On an error the Data is unchanged: shape, contents and block.
        """
        shape, oversize = _sizes.as_shape(shape), _sizes.check_oversize(oversize)
        self._owned_block()
        # ValueError before any copy:
        _sizes.block_bytes(_sizes.nbytes_of(shape, self._dtype), oversize)
        _after_submitted_calls()
        keep = self.array.reshape(-1).copy()
        self._reshape(shape, self._dtype, oversize)
        flat = self._writable().reshape(-1)
        n = min(flat.size, keep.size)
        flat[:n] = keep[:n]
        flat[n:] = 0
        self._version += 1

    def shrink(self) -> None:
        """Move to a block of exactly ``nbytes`` when the block is larger (headroom left
        by ``oversize`` or by a larger earlier value); contents are kept."""
        shm = self._owned_block()
        if shm.size > max(self.nbytes, 1):
            _after_submitted_calls()
            old = self.array
            self._allocate(self.nbytes, self._shape, self._dtype)
            self._writable()[...] = old
            self._version += 1
            PROCESS.moved[self._key] = self.ref()

    def _owned_block(self):
        shm = self._block()
        if not self._owner:
            raise SynkError("only the master can change a synk.Data's shape or dtype")
        return shm

    def _reshape(self, shape, dtype, oversize: float = 1.0) -> None:
        shm = self._owned_block()
        old = (self._name, self._shape, self._dtype)
        # (checked before any change)
        size = _sizes.block_bytes(_sizes.nbytes_of(tuple(shape), dtype), oversize)
        if size > shm.size:
            self._allocate(size, tuple(shape), dtype)
        self._shape, self._dtype, self._view = tuple(shape), dtype, None
        if (self._name, self._shape, self._dtype) != old:
            PROCESS.moved[self._key] = self.ref()  # the ranks' handles follow at the next call

    def free(self) -> None:
        """Release the block now. Idempotent.

        Afterwards anything that touches the block (``array``, ``name``, indexing,
        ``set_value``, ``resize``, ``ref``, pickling, passing it to a function) raises
        ``SynkError``. Views taken earlier stay readable until they are dropped.
        """
        if self._freed:
            return
        if self._owner:
            _after_submitted_calls()
        if self._residency is not None:
            self.to_host()
        self._freed, self._view = True, None
        if self._owner:
            self._finalizer()
            PROCESS.live_data.discard(self)
            PROCESS.moved.pop(self._key, None)
            self._shm = None

    # -- residency on the devices --------------------------------------------------------
    def to_device(self, mode: str = "replicate") -> None:
        """Keep a copy of this Data on every GPU rank's device across calls.

        The copies are made at the next call that uses the Data (each rank copies from
        shared memory, page-locked), and made again only after the master changes the
        contents (``d[...] = ``, ``set_value``, ``resize``, ``touch()``): a call never
        sees an old value. Calls then pick their rows on the devices: with ``batch=`` only
        the index moves. On the CPU backend the shared memory is the device: calls work the
        same and nothing is copied. While resident, ``array`` is read-only.

        Args:
            mode: ``"replicate"``: the whole array on every rank (any ``batch=``, also as a
                broadcast input); ``"shard"``: each rank keeps the rows it is given when the
                array is split, and calls use all of them, or some per rank with
                ``local_batch=`` (``batch=`` is refused: it would need other ranks' rows).

        Raises:
            ValueError: an unknown ``mode``, or ``"shard"`` for a 0-d Data.
            TypeError: a dtype the devices cannot hold (strings, bytes, records, long
                doubles).
            SynkError: this process does not own the Data, or it was freed.
        """
        self._owned_block()
        if mode not in MODES:
            raise ValueError(f"mode must be 'replicate' or 'shard', got {mode!r}")
        if self._dtype.kind not in "biufc" or device_dtypes.on_device(self._dtype) is None:
            raise TypeError(f"a synk.Data of dtype {self._dtype} cannot live on the devices "
                            f"({device_dtypes.why_not(self._dtype)}); use a numeric or bool "
                            "dtype")
        if mode == "shard" and not self._shape:
            raise ValueError("a 0-d synk.Data has no rows to shard; use mode='replicate'")
        if self._residency is not None and self._residency != mode:
            self.to_host()
        if self._residency is None:  # should the Data be collected, its copies go with it
            self._on_collect = weakref.finalize(self, _left_devices, self._key)
        self._residency = mode
        self._freeze_view()

    def _freeze_view(self) -> None:
        if self._view is not None:
            self._view.flags.writeable = False  # the view handed out before: no silent writes

    def _keep_on_hosts(self) -> None:
        """Under MPI, other hosts keep copies of this Data from its first call on (see
        [What crosses the network](cluster.md#what-crosses-the-network)); ``array`` is
        read-only from then on, as while resident on the devices."""
        if not self._on_hosts:
            self._owned_block()
            self._on_hosts = True
            self._freeze_view()

    def to_host(self) -> None:
        """Drop the device copies (each rank frees its copy at the next call); ``array``
        is writable again. Nothing happens if the Data is not resident."""
        if self._residency is None:
            return
        self._residency = None
        self._view = None
        self._on_collect.detach()
        _left_devices(self._key)

    @property
    def on_device(self) -> str | None:
        """``"replicate"`` or ``"shard"`` while resident on the devices (``to_device``),
        else None."""
        return self._residency

    def touch(self) -> None:
        """Say that the contents changed by a route synk cannot see (a view taken before
        ``to_device``, a write from a rank), so that the next call refreshes the device
        copies."""
        self._block()
        self._version += 1

    # -- shipping to ranks ---------------------------------------------------------------
    def ref(self) -> tuple:
        """What another process needs to map this data: ``(key, name, shape, dtype_str)``;
        ``key`` identifies the ``Data`` across the blocks it moves through."""
        self._block()
        return (self._key, self._name, self._shape, dtype_token(self._dtype))

    def __reduce__(self):
        return _attach_data, (self.ref(),)


def _left_devices(key: int) -> None:
    """A Data's device copies are to go (``to_host``, ``free``, or the Data was collected):
    the ranks hear of it with the next message, the master's own copy goes now."""
    PROCESS.left_devices.append(key)
    _kept.forget(keys=(key,))


def _attach_data(ref: tuple) -> Data:
    if PROCESS.host_copies is not None:  # under MPI, on a host other than the master's
        raise SynkError(
            "a synk.Data reached a rank on another host inside another object (a closure, a "
            "list, ...); only a Data passed to a synk function directly as an argument is "
            "copied to other hosts. Pass it as an argument")
    return Data(_attach=ref)


def data(value: ArrayLike | None = None, *, shape: int | Sequence[int] | None = None,
         dtype: DTypeLike | None = None, oversize: float = 1.0) -> Data:
    """Make a ``Data``: an array in OS shared memory, owned by this process.

    No running group is needed.

    Args:
        value: the contents: a copy of ``np.asarray(value, dtype=dtype)``, reshaped to
            ``shape`` when ``shape`` is given and differs. Without it, zeros of ``shape``
            (default ``(0,)``, to fill later with ``set_value``) and ``dtype`` (default
            float64).
        shape: an int or a tuple of ints.
        dtype: anything ``numpy.dtype`` accepts, except dtypes that hold Python objects.
        oversize: >= 1: make the block that multiple of the bytes needed, so that the Data
            can grow up to it without moving (see ``Data.capacity``).

    Returns:
        The new ``Data``.

    Raises:
        TypeError: a dtype that holds Python objects ("synk.data cannot hold dtype
            object ..."). numpy's own errors come from a ``value`` that cannot be
            converted or reshaped.
        ValueError: ``oversize`` is not a finite number >= 1, or the shape or ``oversize``
            asks for more bytes than any array can have.
        ShmSpaceError: ``/dev/shm`` or the machine's memory has no room for it (checked
            before anything is made).
    """
    if value is not None:
        value, frame = _arrays.native(value)  # (a torch tensor, a JAX array: given back so)
        arr = _arrays.as_array(_arrays.host(value), "synk.data's value",
                               _arrays.RAGGED_IN_MEMORY, dtype)
        if shape is not None and _sizes.as_shape(shape) != arr.shape:
            arr = arr.reshape(shape)
        d = Data(arr.shape, arr.dtype, oversize=oversize)
        d.array[...] = arr
        if frame is not None and dtype is None:
            d.frame = frame.replace(grad=False)
        return d
    return Data((0,) if shape is None else shape, np.float64 if dtype is None else dtype,
                oversize=oversize)
