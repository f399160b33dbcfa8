"""What a function captured when it was shipped, and whether it has changed since.

A function is shipped to the workers once (cloudpickle), with what it captures: the module
globals its code reads, its closure cells, the ``self`` of a bound method (or the state of
a callable object), a ``functools.partial``'s arguments. Rank 0 runs the live function;
the workers would run the shipped copy. So before each call synk looks again, cheaply,
at everything captured: a value rebound (``W = W * 2``, ``self.w = ...``), a list or dict
whose items were replaced, or a small array (up to ``HASHED`` bytes) changed in place makes
synk ship the function again, with the current state. A large captured array is followed
by identity and by a sample of its elements, so synk warns once, when shipping, that a
change to a few of its elements in place may go unseen, and says what to do instead (pass
it as an input, or use ``synk.shared``). A function the workers import by name rather than
receive by value (defined in an importable module) cannot be shipped with new globals: a
change to those is warned about at the call, saying what to do.

Not looked into: ``synk.Data`` (shared memory, always current), modules, classes.
"""
from __future__ import annotations

import functools
import itertools
import types
import warnings
import zlib

import numpy as np

HASHED = 8 << 10  # bytes of an array hashed whole at each call; larger ones are sampled
_SAMPLE = 64  # elements sampled of a larger array
_ITEMS = 64  # items of a list or dict looked at
_DEPTH = 3  # how deep into lists, dicts and helper functions


def mark(value, depth: int = 0):
    """A cheap fingerprint of ``value``: equal while it is unchanged (as far as it tells)."""
    kind = type(value)
    if value is None or kind in (bool, int, float, complex, str, bytes):
        return value
    if kind is np.ndarray:
        return (id(value), value.shape, value.dtype.str, value.__array_interface__["data"][0],
                _content(value))
    if isinstance(value, np.generic):
        return (kind, value.tobytes())
    if depth < _DEPTH and kind in (list, tuple):
        return (id(value), len(value), tuple(mark(v, depth + 1) for v in value[:_ITEMS]))
    if depth < _DEPTH and kind is dict:
        items = itertools.islice(value.items(), _ITEMS)
        return (id(value), len(value), tuple((k, mark(v, depth + 1)) for k, v in items))
    return id(value)


def _content(array: np.ndarray) -> int:
    if array.dtype.hasobject:
        return id(array)  # (objects: their identity only)
    if array.nbytes <= HASHED:
        flat = array if array.flags.c_contiguous else np.ascontiguousarray(array)
        return zlib.crc32(flat.view(np.uint8).reshape(-1)) if flat.dtype.itemsize else 0
    sample = array.reshape(-1)[::max(1, array.size // _SAMPLE)][:_SAMPLE]
    return zlib.crc32(np.ascontiguousarray(sample).view(np.uint8).reshape(-1))


def _names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _function_slots(fn, label: str, depth: int, seen: set) -> list:
    """[(what, getter)] for what the plain function ``fn`` captures."""
    if id(fn) in seen or depth > _DEPTH:
        return []
    seen.add(id(fn))
    slots = []
    module = fn.__module__
    env = fn.__globals__
    for name in sorted(_names(fn.__code__)):
        if name not in env:
            continue
        value = env[name]
        if isinstance(value, (types.ModuleType, type)):
            continue
        slots.append((f"the global {name!r} of {label}",
                      functools.partial(env.get, name)))
        if isinstance(value, types.FunctionType) and value.__module__ == module:
            slots += _function_slots(value, value.__qualname__, depth + 1, seen)
    names = fn.__code__.co_freevars
    for name, cell in zip(names, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # not yet assigned
            continue
        slots.append((f"the variable {name!r} of {label}'s closure",
                      functools.partial(getattr, cell, "cell_contents")))
        if isinstance(value, types.FunctionType):
            slots += _function_slots(value, value.__qualname__, depth + 1, seen)
    return slots


def _state_slots(obj, label: str) -> list:
    """[(what, getter)] for the attributes of an object shipped by value."""
    state = getattr(obj, "__dict__", None)
    if state is None:
        return []
    slots = [(f"the attributes of {label}", lambda: tuple(sorted(state)))]
    for name in sorted(state):
        slots.append((f"{label}.{name}", functools.partial(state.get, name)))
    return slots


def slots_of(fn, label: str) -> list:
    """Everything ``fn`` captures, as [(what, getter)] (nothing for synk's own functions,
    whose module state each rank keeps itself)."""
    module = getattr(getattr(fn, "__func__", fn), "__module__", None) or ""
    if module == "synk" or module.startswith("synk."):
        return []
    seen: set = set()
    if isinstance(fn, types.MethodType):
        return (_state_slots(fn.__self__, f"{label}'s self")
                + _function_slots(fn.__func__, label, 0, seen))
    if isinstance(fn, functools.partial):
        return ([(f"the arguments of {label}", lambda: (fn.args, fn.keywords))]
                + slots_of(fn.func, label))
    if isinstance(fn, types.FunctionType):
        return _function_slots(fn, label, 0, seen)
    call = vars(type(fn)).get("__call__")
    slots = _state_slots(fn, label)
    if isinstance(call, types.FunctionType):
        slots += _function_slots(call, label, 0, seen)
    return slots


def by_value(fn) -> bool:
    """Whether cloudpickle ships ``fn`` by value (with its globals), not by reference."""
    target = fn.__func__ if isinstance(fn, types.MethodType) else fn
    if isinstance(target, functools.partial):
        target = target.func
    if not isinstance(target, types.FunctionType):
        return True  # an object: its state goes by value
    try:
        from cloudpickle import cloudpickle as _cp

        return not _cp._should_pickle_by_reference(target)
    except (ImportError, AttributeError):  # (an internal of cloudpickle's)
        return target.__module__ == "__main__"


class Captures:
    """What a function captured when it was (about to be) shipped."""

    __slots__ = ("fn", "label", "slots", "marks", "by_value")

    def __init__(self, fn, label: str) -> None:
        self.fn, self.label = fn, label
        self.slots = slots_of(fn, label)
        self.marks = [mark(get()) for _, get in self.slots]
        self.by_value = by_value(fn)
        self._warn_large()

    def changed(self) -> str | None:
        """What changed since shipping (its description), or None."""
        for i, ((what, get), old) in enumerate(zip(self.slots, self.marks)):
            now = mark(get())
            if now != old:
                if not self.by_value and "global" in what:  # shipping again cannot help
                    self.marks[i] = now
                    warnings.warn(
                        f"synk: {what} changed since {self.label} was shipped, and the "
                        f"workers import {self.label} by name (its module is importable), "
                        "so they keep their own copy of its module's globals and compute "
                        "with the old value: pass the value as an input (bcast_inputs) or "
                        "use synk.shared, instead of a global", RuntimeWarning, stacklevel=4)
                    continue
                return what
        return None

    def _warn_large(self) -> None:
        for what, get in self.slots:
            value = get()
            if type(value) is np.ndarray and value.nbytes > HASHED:
                warnings.warn(
                    f"synk: {self.label} captures {what}, a numpy array of {value.nbytes} "
                    "bytes, shipped with the function: synk ships it again when it is "
                    "rebound or changed as a whole, but may miss a change to a few of its "
                    "elements in place. Pass it as an input (bcast_inputs) or make it a "
                    "synk.shared variable instead", RuntimeWarning, stacklevel=5)
                return
