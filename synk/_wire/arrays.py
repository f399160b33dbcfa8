"""How arrays travel inside control messages: by name when they are in shared memory,
as raw bytes when they are small. Both stand-ins turn into plain numpy arrays when the
receiving process unpickles them, and both pickle much faster than an ndarray does.
"""
from __future__ import annotations

import io
import marshal
import pickle
import threading
import types

import cloudpickle
import numpy as np

from .._process import PROCESS
from ..errors import add_note
from .shm import ATTACHED

INLINE_BYTES = 64 * 1024  # arrays up to this size may travel as bytes


class SharedData:
    """An array in a named shared-memory block that every rank maps (``synk.Data``): a call
    passes it by reference (``ref()``), never a copy of it."""

    frame = None  # made from a torch tensor or a JAX array: its frame (``synk._arrays``)

    @property
    def array(self) -> np.ndarray:
        """The master's view of it."""
        raise NotImplementedError

    @property
    def version(self) -> int:
        """Bumped by every change of its contents that synk sees."""
        raise NotImplementedError

    @property
    def on_device(self) -> str | None:
        """``"shard"`` or ``"replicate"`` while resident on the devices, else None."""
        raise NotImplementedError

    def ref(self) -> tuple:
        """(key, block name, shape, dtype token): where the ranks find it."""
        raise NotImplementedError

    def _shared_array_ref(self) -> SharedArray:
        """How a call on one host passes it: a writable ``SharedArray`` of its block (the
        same object until the data moves, so that a call makes none)."""
        view = self.array  # (made anew whenever the block, shape or dtype change)
        made = getattr(self, "_made_ref", None)
        if made is None or made[0] is not view:
            _, name, shape, dtype = self.ref()
            made = self._made_ref = (view, SharedArray(name, shape, dtype, 0, True))
        return made[1]

    def _keep_on_hosts(self) -> None:
        """Other hosts keep copies of it from now on, refreshed when ``version`` changes:
        the master's view becomes read-only, so that no write goes uncounted."""
        raise NotImplementedError


class SharedArray:
    """An array in a shared-memory block; the receiver maps the block (cached by name).
    Unless ``writable`` (a ``Data``), the receiver gets a read-only view: the ranks share
    the block, so a write by one would change what the others see."""

    __slots__ = ("name", "shape", "dtype", "offset", "writable")

    def __init__(self, name: str, shape, dtype, offset: int = 0, writable: bool = False) -> None:
        self.name, self.shape, self.dtype, self.offset = name, shape, dtype, offset
        self.writable = writable

    def __reduce__(self):
        return _attach, (self.name, self.shape, self.dtype, self.offset, self.writable)


def _attach(name: str, shape, dtype, offset: int, writable: bool = True) -> np.ndarray:
    remote = PROCESS.host_copies  # under MPI, on a host other than the master's: its copies
    if remote is not None:
        return remote.attach(name, shape, dtype, offset)
    view = ATTACHED.array(name, shape, dtype, offset)
    if not writable:
        view.flags.writeable = False
    return view


class InlineArray:
    """A small array sent as its bytes. The receiver gets a read-only array over them (an
    input, read-only as a large one's view is), or a writable copy (an output)."""

    __slots__ = ("array", "writable")

    def __init__(self, array: np.ndarray, writable: bool = False) -> None:
        self.array, self.writable = array, writable

    def __reduce__(self):
        a = self.array
        return _rebuild, (a.tobytes(), dtype_token(a.dtype), a.shape, self.writable)


def _rebuild(data: bytes, dtype, shape, writable: bool = False) -> np.ndarray:
    return np.frombuffer(bytearray(data) if writable else data, dtype).reshape(shape)


DtypeToken = str | np.dtype  # what ``dtype_token`` gives; np.dtype() makes it a dtype again


def dtype_token(dtype: np.dtype) -> DtypeToken:
    """What a message carries to rebuild ``dtype`` on the other side: its short string,
    which pickles fastest, or the dtype itself when the string would lose something (the
    fields of a record, a sub-array shape)."""
    if dtype.fields is None and dtype.subdtype is None:
        return dtype.str
    return dtype


def read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (the master's share of a plain numpy input)."""
    view = array.view()
    view.flags.writeable = False
    return view


def wrap(value, writable: bool = False):
    """``value`` ready to pickle: small plain arrays as InlineArray, else unchanged."""
    if type(value) is np.ndarray and value.nbytes <= INLINE_BYTES and not value.dtype.hasobject:
        return InlineArray(value, writable)
    return value


# dtypes whose 0-d arrays travel as the Python number itself, which pickles several times
# faster and becomes an array of the same dtype again in np.asarray
_AS_NUMBER = frozenset(np.dtype(t) for t in (np.float64, np.bool_, np.complex128,
                                            np.asarray(0).dtype))


def wrap_output(value):
    """An output ready to pickle: a 0-d array of a dtype that Python numbers keep as the
    number, other small arrays as bytes (rebuilt writable)."""
    if type(value) is np.ndarray and value.ndim == 0 and value.dtype in _AS_NUMBER:
        return value.item()
    return wrap(value, True)


_PICKLERS = threading.local()  # each thread's _Pickler
# Pickled messages up to this size are searched for "__main__"; larger ones, whose bytes
# are mostly arrays', are pickled again by the hook pickler (cheaper than the search).
_SCANNED_BYTES = 8192


class _Pickler(pickle.Pickler):
    """``pickle``'s own (C) pickler, noting whether it pickled a reference to something of a
    ``__main__`` script (a class, a function, an instance of a class of it). Its hook is
    called for every object but the plain ones (numbers, strings, bytes, lists, tuples,
    dicts, sets): so the bytes of arrays, which travel as bytes, are never looked at."""

    names_main = False

    def __init__(self, out: io.BytesIO, protocol: int) -> None:
        super().__init__(out, protocol=protocol)
        self.out = out

    def pickle(self, obj) -> bytes:
        """``obj`` pickled (this pickler is reused: one per thread)."""
        out, self.names_main = self.out, False
        try:
            self.dump(obj)
            return out.getvalue()
        finally:  # (keep neither the bytes nor the objects pickled: the memo holds them)
            out.seek(0)
            out.truncate()
            self.clear_memo()

    def reducer_override(self, obj):
        if not self.names_main:
            module = (getattr(obj, "__module__", None) if isinstance(obj, type) or callable(obj)
                      else getattr(type(obj), "__module__", None))
            self.names_main = module == "__main__"
        return NotImplemented


def dumps_to_master(obj, what: str) -> bytes:
    """``obj`` pickled by a worker for the master: by ``pickle``, else by ``cloudpickle``
    (TypeError naming ``what`` if neither can). Nothing is searched for ``__main__``: a
    worker's ``__main__`` is synk's, where a reference to the user's script fails to pickle
    (and cloudpickle sends the thing by value), or, under MPI, the master's own script."""
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        pass
    return _by_cloudpickle(obj, f"{what} cannot be pickled to send to the master")


def dumps(obj, what: str) -> bytes:
    """``obj`` pickled for another rank: by ``pickle`` (fast), or by ``cloudpickle`` where pickle
    fails or names something of a ``__main__`` script, which the other process (whose ``__main__``
    is another script) cannot look up; TypeError naming ``what`` if neither can."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) <= _SCANNED_BYTES:  # the usual, small message: a look at its bytes
            if b"__main__" not in data:  # is cheaper than the hook below (a match in an
                return data  # array's bytes only sends it by cloudpickle, as correct)
        else:
            pickler = getattr(_PICKLERS, "pickler", None)
            if pickler is None:
                pickler = _PICKLERS.pickler = _Pickler(io.BytesIO(), pickle.HIGHEST_PROTOCOL)
            data = pickler.pickle(obj)
            if not pickler.names_main:
                return data
    except Exception:
        pass
    return _by_cloudpickle(obj, f"{what} cannot be pickled to send to the ranks")


def _by_cloudpickle(obj, refusal: str) -> bytes:
    """``obj`` pickled by ``cloudpickle``; TypeError ``refusal`` where it has no pickled form (a
    lock, a socket); an exception raised by the object's own code (``__reduce__``...) as
    itself, noted with ``refusal``, as synk raises a user function's errors."""
    try:
        return dumps_by_value(obj)
    except _REFUSALS as err:
        raise TypeError(f"{refusal}: {err}") from err
    except Exception as err:
        add_note(err, f"synk: {refusal}: this error was raised while pickling it")
        raise


# What pickle raises of itself for what it cannot pickle (any other exception came from the
# object's own code): a PicklingError, or a TypeError ("cannot pickle '_thread.lock'
# object") or an AttributeError ("Can't pickle local object") by Python's version.
_REFUSALS = (pickle.PickleError, TypeError, AttributeError)


def dumps_by_value(obj, reduce=None) -> bytes:
    """``obj`` pickled by ``cloudpickle``, whose functions sent by value keep the file they
    were written in (see ``_ByValue``). ``reduce(obj)``: how to pickle an object instead of
    the usual way (a ``__reduce__`` tuple), or None for the usual way."""
    with io.BytesIO() as file:
        _ByValue(file, protocol=pickle.HIGHEST_PROTOCOL, reduce=reduce).dump(obj)
        return file.getvalue()


class _ByValue(cloudpickle.Pickler):
    """cloudpickle's pickler, except that code goes whole (``marshal``, as Python caches it
    in ``.pyc`` files): from 3.1.3 cloudpickle writes "<dynamic-code>" for its file name,
    which took the file and the source line out of the traceback of a user's function that
    raised on a rank. (The ranks run the same Python version, as cloudpickle's code needs.)"""

    def __init__(self, file, protocol: int, reduce=None) -> None:
        super().__init__(file, protocol=protocol)
        self.reduce = reduce

    def reducer_override(self, obj):
        if type(obj) is types.CodeType:
            return marshal.loads, (marshal.dumps(obj),)
        if self.reduce is not None:
            reduced = self.reduce(obj)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)
