"""Everything reachable from some objects, and a fast exact check that none of it changed
(for ``captures.Captures``)::

    roots --walk--> every object reached, by what cloudpickle ships by value
          --> a check generated once (compile_check): references in one tuple, other values
              in another; object by object for few of a kind, a C loop for many
    unchanged: the same objects in the first tuple, equal values in the second
"""
from __future__ import annotations

import abc
import collections
import dataclasses
import datetime
import decimal
import enum
import fractions
import functools
import io
import itertools
import operator
import pathlib
import pickle
import re
import types
import uuid
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

from .. import _arrays

# -- the generated check ---------------------------------------------------------------------------

PROTOCOL = pickle.HIGHEST_PROTOCOL
EMPTY = object()  # an empty closure cell or an unset slot


def cell_or_empty(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return EMPTY


def slot_getter(names: tuple) -> Callable:
    def slots(obj):
        return tuple(getattr(obj, name, EMPTY) for name in names)
    return slots


@dataclasses.dataclass(frozen=True)
class _Part:
    """What the check takes of each object of one section: ``steps`` (names of functions
    in ``NAMESPACE``) applied in turn to the object (the first one also to the object's
    ``beside`` item, where ``beside``), giving a reference (compared as the same object) or
    a value (compared equal), or, where ``many``, an iterable of them."""

    refs: bool
    many: bool
    steps: tuple = ()
    beside: bool = False


_REF, _REFS = functools.partial(_Part, True, False), functools.partial(_Part, True, True)
_VALUE, _VALUES = functools.partial(_Part, False, False), functools.partial(_Part, False, True)
# How each kind of object is compared (``Snapshot._visit`` says why)
SECTIONS = {
    "sequence": (_REFS(), _VALUE(("len",))),  # list, set, deque: the items
    "mapping": (_REFS(), _REFS(("_values",)), _VALUE(("len",))),
    "attributes": (_REFS(("_dict",)), _REFS(("_dict", "_values")), _VALUE(("_dict", "len"))),
    "empty": (_VALUE(("len",)),),  # (a container empty when the snapshot was taken)
    "no attributes": (_VALUE(("_dict", "len")),),
    "globals": (_REF(("_get",), beside=True),),  # a function's globals, a name in them
    "cells": (_REF(("_cell",)),),
    "cells, some empty": (_REF(("_cell_or_empty",)),),
    "objects array": (_REFS(("_flat",)), _VALUES(("_form",))),
    "array": (_VALUES(("_form",)), _VALUE(("_tobytes",))),
    "sampled array": (_VALUES(("_form",)), _VALUE(("_take", "_tobytes"), beside=True)),
    "sampled strided array": (_VALUES(("_form",)),
                              _VALUE(("_flat_at", "_tobytes"), beside=True)),
    "bytearray": (_VALUE(("bytes",)),),
    "sampled bytearray": (_VALUE(("len",)), _VALUE(("_getitem",), beside=True)),
    "framework array": (_VALUE(("_framed",)),),  # a torch tensor on the CPU
    "sampled framework array": (_VALUE(("_framed",), beside=True),),
    "pickled": (_VALUE(("_pickle",)),),
    "cloudpickled": (_VALUE(("_cloudpickle",)),),
}
ATTRIBUTES = {  # objects whose named attributes are references
    "function": ("__code__", "__defaults__", "__kwdefaults__"),
    "class": ("__class__", "__bases__"),
    "instance": ("__class__",),
    "partial": ("func", "args"),
    "default factory": ("default_factory",),
}


def _flat_at(array: np.ndarray, where: np.ndarray) -> np.ndarray:
    return array.flat[where]


def _framed(value, where: np.ndarray | None = None) -> tuple:
    """A framework value's frame, and its native array's form and bytes (with ``where``:
    those of the elements at ``where`` of the flattened array alone)."""
    array, frame = _arrays.native(value)
    sample = array if where is None else array.take(where)
    return frame, array.shape, array.strides, array.dtype, sample.tobytes()


NAMESPACE: dict[str, Any] = {
    "_chain": itertools.chain.from_iterable, "_values": operator.methodcaller("values"),
    "_get": dict.get, "_cell": operator.attrgetter("cell_contents"),
    "_cell_or_empty": cell_or_empty, "_flat": operator.attrgetter("flat"),
    "_form": operator.attrgetter("shape", "strides", "dtype"),
    "_tobytes": operator.methodcaller("tobytes"), "_take": np.ndarray.take,
    "_flat_at": _flat_at, "_getitem": operator.getitem,
    "_framed": _framed,
    "_dict": operator.attrgetter("__dict__"),
    "_pickle": functools.partial(pickle.dumps, protocol=PROTOCOL),
    "_cloudpickle": functools.partial(cloudpickle.dumps, protocol=PROTOCOL),
}
_UNROLLED = 16  # objects of one section above which the check loops over them in C


def _spell(part: _Part, group: str, beside: str, count: int | None) -> list:
    """The check's expressions for ``part`` of the objects in the list ``group`` (with the
    list ``beside``): one C loop over them all when ``count`` is None, else one expression
    for each of the ``count`` objects, named ``{group}_{k}`` (and ``{beside}_{k}``)."""
    first, *rest = part.steps or ("",)
    if count is None:  # map(f, objects) ... then the next steps over that
        out = f"map({first}, {group}, {beside})" if part.beside else (
            f"map({first}, {group})" if first else group)
        for step in rest:
            out = f"map({step}, {out})"
        return [f"*_chain({out})" if part.many else f"*{out}"]
    spelled = []
    for k in range(count):
        out = f"{group}_{k}"
        if first:
            out = f"{first}({out}, {beside}_{k})" if part.beside else f"{first}({out})"
        for step in rest:
            out = f"{step}({out})"
        spelled.append(f"*{out}" if part.many else out)
    return spelled


def compile_check(sections: list, groups: list | None) -> Callable:
    """The check for ``sections`` (names of ``SECTIONS``, or (kind, names): "attributes", or
    "slots" where some may be unset): with ``groups`` (objects and a list beside them per
    section) a function of nothing, else of such lists; either returns (references, values)."""
    refs: list[str] = []
    values: list[str] = []
    params: list[str] = []
    unpack: list[str] = []
    namespace = dict(NAMESPACE)
    for i, key in enumerate(sections):
        g, a = f"g{i}", f"a{i}"
        params += [g, a]
        count = None if groups is None or len(groups[2 * i]) > _UNROLLED else len(
            groups[2 * i])
        if count is not None:
            unpack += [f"    {g}_{k}, {a}_{k} = {g}[{k}], {a}[{k}]\n" for k in range(count)]
        if isinstance(key, tuple):
            kind, names = key
            namespace[f"h{i}"] = (operator.attrgetter(*names) if kind == "attributes"
                                  else slot_getter(names))
            parts: tuple = (_Part(True, kind != "attributes" or len(names) > 1, (f"h{i}",)),)
        else:
            parts = SECTIONS[key]
        for part in parts:
            (refs if part.refs else values).extend(_spell(part, g, a, count))
    body = (f"return ({''.join(r + ', ' for r in refs)}), "
            f"({''.join(v + ', ' for v in values)})\n")
    if groups is None:
        code = f"def take({', '.join(params)}):\n    {body}"
    else:
        code = (f"def bind({', '.join(params)}):\n{''.join(unpack)}"
                f"    def take():\n        {body}    return take\n")
    exec(code, namespace)  # noqa: S102
    return namespace["take"] if groups is None else namespace["bind"](*groups)


# -- what cloudpickle ships by value ---------------------------------------------------------------

def pickled_by_reference(obj) -> bool:
    """Whether cloudpickle pickles the function or class ``obj`` by reference (the workers
    import it) rather than by value."""
    return cloudpickle.cloudpickle._should_pickle_by_reference(obj)


def global_names(code) -> tuple:
    """The global names the code (and the code nested in it) reads, as cloudpickle finds them."""
    return tuple(cloudpickle.cloudpickle._extract_code_globals(code))


class _Probe(pickle.Pickler):
    """Plain pickle, noting whether it met a function or class cloudpickle would pickle
    by value (which plain pickle pickles by name)."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.by_value = False

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and not pickled_by_reference(obj):
            self.by_value = True
        return NotImplemented


def plain_pickle_will_do(obj) -> bool:
    """Whether plain pickle pickles ``obj`` as cloudpickle ships it (the quicker one)."""
    probe = _Probe(io.BytesIO())
    try:
        probe.dump(obj)
    except Exception:
        return False
    return not probe.by_value


# -- everything reachable --------------------------------------------------------------------------

LARGE = 8 << 10  # bytes: a larger array is sampled, a larger pickled object not compared
SAMPLE = 64  # elements of a large array compared

_ABC_DATA = type(abc.ABC._abc_impl)  # type: ignore[attr-defined]
_DATACLASS_MARKER = dataclasses._FIELD_BASE  # type: ignore[attr-defined]  # (private: no stub)
_IMMUTABLE = frozenset({
    type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis),
    type(NotImplemented), types.CodeType, types.BuiltinFunctionType,
    types.WrapperDescriptorType, types.MethodWrapperType, types.MethodDescriptorType,
    types.ClassMethodDescriptorType, types.GetSetDescriptorType, types.MemberDescriptorType,
    np.ufunc, datetime.date, datetime.datetime, datetime.time, datetime.timedelta,
    datetime.timezone, decimal.Decimal, fractions.Fraction, uuid.UUID, re.Pattern, _ABC_DATA,
    _DATACLASS_MARKER,  # (dataclasses' markers: compared as the same object)
})
_IMMUTABLE_KINDS = (np.dtype, enum.Enum, pathlib.PurePath)
_CONTAINERS = (list, set, collections.deque, dict, types.MappingProxyType,
               collections.OrderedDict, collections.Counter, collections.defaultdict,
               tuple, frozenset)
_EQUAL_IF_SAME_TYPE = frozenset({int, bool, str, bytes, type(None)})
_is = operator.is_


def _synk_own(kind: type) -> str:
    """"synk" for synk's own classes, "simulated" for the CUDA simulator's (which stand
    for CuPy's extension types, so are compared as those are), else ""."""
    module = kind.__module__ or ""
    if module.startswith("synk._devices.sim."):
        return "simulated"
    return "synk" if module == "synk" or module.startswith("synk.") else ""


def _adds_c_state(kind: type) -> bool:
    """Whether ``kind`` adds state at C level to its base (more than the pointers a Python
    class adds for its slots, ``__weakref__`` and ``__dict__``), as CPython's own check
    that an object pickles by its attributes counts it."""
    base = kind.__base__
    if base is None:
        return False
    own = kind.__dict__.get("__slots__", ())
    own = (own,) if isinstance(own, str) else own
    python = 8 * sum(name not in ("__dict__", "__weakref__") for name in own)
    python += 8 * bool(kind.__weakrefoffset__ and not base.__weakrefoffset__)
    python += 8 * bool(kind.__dictoffset__ > 0 and not base.__dictoffset__)
    return kind.__itemsize__ != base.__itemsize__ or (
        kind.__basicsize__ - base.__basicsize__ > python)


@functools.lru_cache(maxsize=1024)
def _state_base(kind: type) -> type:
    """The first class of ``kind``'s MRO that keeps state at C level (``object`` for a
    class whose instances keep all of it in ``__dict__`` and ``__slots__``)."""
    return next((c for c in kind.__mro__ if c is object or _adds_c_state(c)), object)


def _slot_names(kind: type) -> tuple:
    names = []
    for klass in kind.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name.startswith("__") and not name.endswith("__"):  # (mangled)
                name = f"_{klass.__name__.lstrip('_')}{name}"
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


def _unchanged(a, b) -> bool:
    """Whether ``a``, found where ``b`` was, leaves the state as it was: the same object,
    or an equal immutable value of the same type (floats and numpy scalars bit for bit)."""
    if a is b:
        return True
    kind = type(a)
    if kind is not type(b):
        return False
    if kind in _EQUAL_IF_SAME_TYPE:
        return a == b
    if kind is float or kind is complex:
        return repr(a) == repr(b)  # (0.0 vs -0.0, nan)
    return isinstance(a, np.generic) and not isinstance(a, np.void) and a.tobytes() == b.tobytes()


@dataclasses.dataclass
class _Node:
    """One object (or one name of a function's globals) in one section of the check, and
    what it held when the snapshot was taken (its references and values alone)."""

    section: int
    obj: object
    beside: object
    label: str
    held: tuple = ()


@dataclasses.dataclass
class Large:
    """An object whose changes may go unseen: compared by a sample or as the same object."""

    label: str
    what: str  # e.g. "a numpy array of 40000 bytes"
    how: str  # how it is compared
    node: int | None = None  # its place in the snapshot's check (None: by identity alone)


NOW = object()  # ``Snapshot.settle``'s default: take the state now
SAME = object()  # what ``Snapshot.take`` gives when the state is what the snapshot holds


class Snapshot:
    """The state of everything reachable from ``roots`` (pairs of a label and an object),
    taken now. ``follow(obj)``: whether a function or class pickled by reference is walked
    all the same (by default none is). The snapshot holds a reference to everything it
    compares, so an ``id`` is never reused."""

    def __init__(self, roots: list, follow: Callable | None = None) -> None:
        self.roots, self.follow = roots, follow
        self._nodes: list = []
        self._keys: list = []  # the sections used, in order
        self._seen: set = set()
        self._keep: list = []  # what the walk looked at, alive until it is done
        self.large: list = []
        for label, obj in roots:
            self._walk(obj, label)
        self._keep = []
        groups: list = [[] for _ in range(2 * len(self._keys))]
        for node in self._nodes:
            groups[2 * node.section].append(node.obj)
            groups[2 * node.section + 1].append(node.beside)
        self._take = compile_check(self._keys, groups)
        # for one object at a time: a check of its section alone, for each section
        self._take_section = [compile_check([key], None) for key in self._keys]
        self.refs, self.values = self._take()
        for node in self._nodes:
            node.held = self._take_one(node)
        self.size = len(self.refs) + len(self.values)

    def changed(self) -> str | None:
        """The label of a root whose reachable state changed since, or None."""
        if not self._nodes:
            return None
        try:
            refs, values = self._take()
        except Exception:  # (a slot deleted, a cell emptied, an array resized: changed)
            return self._nodes[0].label
        if values == self.values and len(refs) == len(self.refs):
            if all(map(_is, refs, self.refs)):
                return None
            if all(map(_unchanged, refs, self.refs)):
                self.refs = refs  # only equal immutable values were new: keep them
                return None
        for node in self._nodes:
            try:
                refs, values = self._take_one(node)
            except Exception:
                return node.label
            held_refs, held_values = node.held
            if values != held_values or len(refs) != len(held_refs) or not all(
                    map(_unchanged, refs, held_refs)):
                return node.label
        return self._nodes[0].label  # (a change no single object shows: a change still)

    def take(self) -> tuple | object | None:
        """What is reachable as it is now, as ``settle`` takes it: ``SAME`` where it is what
        the snapshot holds (nothing to settle), None where it cannot be taken (a slot
        deleted, a cell emptied...)."""
        if not self._nodes:
            return SAME
        try:
            refs, values = taken = self._take()
        except Exception:
            return None
        if values == self.values and len(refs) == len(self.refs) and all(
                map(_is, refs, self.refs)):
            return SAME
        return taken

    def settle(self, taken: tuple | None | object = NOW) -> bool:
        """Take what is reachable as it is now (or as ``taken`` from ``take`` had it) as the state
        to compare with (after a call: the function's own changes to what it reaches), where the
        same objects are reached; False where others are (the caller takes a new snapshot)."""
        if taken is NOW:
            taken = self.take()
        if taken is SAME:
            return True
        if not isinstance(taken, tuple):
            return False
        refs, values = taken
        held = self.refs
        if len(refs) != len(held) or not (all(map(_is, refs, held))
                                          or all(map(_unchanged, refs, held))):
            return False
        if values != self.values:
            self.refs, self.values = refs, values
            for node in self._nodes:
                node.held = self._take_one(node)
        return True

    def holds_as_taken(self, large: Large) -> bool:
        """Whether ``large`` (of ``self.large``) holds what it held when the snapshot was
        taken (or settled), as far as it is compared."""
        if large.node is None:
            return True
        node = self._nodes[large.node]
        try:
            refs, values = self._take_one(node)
        except Exception:
            return False
        held_refs, held_values = node.held
        return values == held_values and len(refs) == len(held_refs) and all(
            map(_unchanged, refs, held_refs))

    def _take_one(self, node: _Node) -> tuple:
        return self._take_section[node.section]([node.obj], [node.beside])

    def _add(self, key, obj, label: str, beside=None) -> None:
        """Compare ``obj`` in the section ``key``."""
        if key not in self._keys:
            self._keys.append(key)
        self._nodes.append(_Node(self._keys.index(key), obj, beside, label))

    # the walk ------------------------------------------------------------------------

    def _walk(self, root, label: str) -> None:
        """Add everything reachable from ``root`` (container items and keys, attributes and slots,
        functions' code, globals, cells and defaults, classes' attributes), stopping at what goes by
        reference: modules, functions and classes of importable modules, builtins."""
        stack = [(root, label)]
        while stack:
            obj, label = stack.pop()
            if id(obj) in self._seen:
                continue
            self._seen.add(id(obj))
            self._keep.append(obj)
            try:
                children = self._visit(obj, label)
            except Exception:  # (an object that resists looking into: said, not hidden)
                self.large.append(Large(label, f"a {type(obj).__qualname__} synk cannot "
                                        "look into", "its identity alone"))
                continue
            stack.extend(reversed(children))

    def _visit(self, obj, label: str) -> list:
        """Add the nodes that compare ``obj``; return what it references as (object, label) pairs.
        Immutable values: the same or an equal object of the same type (floats bit for bit);
        containers, instances, functions, classes: every reference they hold the same object;
        arrays and C-level state: ``_object``."""
        kind: type = type(obj)
        if kind in _IMMUTABLE or isinstance(obj, _IMMUTABLE_KINDS):
            if kind is types.BuiltinFunctionType:  # (a bound one pickles its object)
                owner = obj.__self__
                return [] if isinstance(owner, types.ModuleType) else [(owner, label)]
            return [(kind, label)] if isinstance(obj, enum.Enum) else []
        if kind in _CONTAINERS:
            return self._container(obj, label)
        if kind is types.FunctionType:
            return self._function(obj, label)
        if isinstance(obj, type):
            return self._class(obj, label)
        if kind is types.MethodType:
            return [(obj.__func__, label), (obj.__self__, label)]
        if isinstance(obj, types.ModuleType):
            return []
        return self._object(obj, kind, label)

    def _object(self, obj, kind: type, label: str) -> list:
        """``_visit`` of an object of no builtin kind: arrays by ``_array``/``_framework_array``;
        an object with C-level state (a ``random.Random``, a torch tensor) by its pickled bytes.
        Except a wrapper of a Python ``__wrapped__`` with only its own C state (``jax.jit``): the
        same object, its function compared as functions are, which is what pickling ships (its
        pickled bytes would cost milliseconds at every call)."""
        own = _synk_own(kind)
        if own == "simulated":
            return self._pickled(obj, label)
        if own:
            return []  # a Data is shared memory, always current; a Shared is refused
        if kind in (staticmethod, classmethod):
            return [(obj.__func__, label)]
        if kind is property:
            return [(obj.fget, label), (obj.fset, label), (obj.fdel, label)]
        if kind is functools.partial:
            return self._partial(obj, label)
        if isinstance(obj, np.ndarray):
            children = self._array(obj, label)
            return children + self._instance(obj, label) if kind is not np.ndarray else children
        if isinstance(obj, np.generic) and kind is not np.void:
            return []
        if kind is bytearray:
            return self._bytearray(obj, label)
        if kind.__module__.startswith(("torch", "jax")):  # (a torch tensor, a JAX array)
            framed = self._framework_array(obj, label)
            if framed is not None:
                return framed
        base = _state_base(kind)
        if base is object:
            return self._instance(obj, label)
        if base in _CONTAINERS:  # (a Python subclass of one)
            return self._instance(obj, label) + self._container(obj, label)
        wrapped = getattr(obj, "__wrapped__", None)
        if type(wrapped) is types.FunctionType and base is kind:
            return [(wrapped, label)]  # (a C wrapper of a Python function: see above)
        return self._pickled(obj, label)

    def _container(self, obj, label: str) -> list:
        if isinstance(obj, (tuple, frozenset)):  # (immutable: only their items can change)
            return [(item, label) for item in obj]
        if isinstance(obj, (dict, types.MappingProxyType)):
            self._add("mapping" if obj else "empty", obj, label)
            children = [*obj, *obj.values()]
            if isinstance(obj, collections.defaultdict):
                self._add(("attributes", ATTRIBUTES["default factory"]), obj, label)
                children.append(obj.default_factory)
        else:
            self._add("sequence" if obj else "empty", obj, label)
            children = list(obj)
        return [(child, label) for child in children]

    def _instance(self, obj, label: str) -> list:
        """An object pickled by its attributes: its class, ``__dict__`` and slots, even where it has
        its own ``__getstate__`` or ``__reduce__``, which are not called at each check."""
        kind = type(obj)
        self._add(("attributes", ATTRIBUTES["instance"]), obj, label)
        children: list = [kind]
        if hasattr(obj, "__dict__"):
            self._add("attributes" if vars(obj) else "no attributes", obj, label)
            children += [*vars(obj), *vars(obj).values()]
        slots = _slot_names(kind)
        if slots:
            values = [getattr(obj, name, EMPTY) for name in slots]
            self._add(("attributes", slots) if EMPTY not in values else ("slots", slots),
                      obj, label)
            children += values
        return [(child, label) for child in children]

    def _function(self, fn, label: str) -> list:
        if pickled_by_reference(fn) and not (self.follow and self.follow(fn)):
            return []
        name = fn.__qualname__
        own = f"{name} (its code, defaults or attributes)"
        self._add(("attributes", ATTRIBUTES["function"]), fn, own)
        self._add("attributes" if vars(fn) else "no attributes", fn, own)
        children = [(fn.__defaults__, f"the default values of {name}"),
                    (fn.__kwdefaults__, f"the default values of {name}")]
        children += [(child, f"the attributes of {name}")
                     for child in (*vars(fn), *vars(fn).values())]
        env = fn.__globals__
        for key in global_names(fn.__code__):  # (a missing one too: it may come later)
            what = f"the global {key!r} of {name}"
            self._add("globals", env, what, key)
            if key in env:
                children.append((env[key], what))
        for key, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            what = f"the variable {key!r} of {name}'s closure"
            value = cell_or_empty(cell)
            self._add("cells" if value is not EMPTY else "cells, some empty", cell, what)
            children.append((value, what))
        return children

    def _class(self, cls: type, label: str) -> list:
        if pickled_by_reference(cls) and not (self.follow and self.follow(cls)):
            return []
        what = f"the class attributes of {cls.__qualname__}"
        self._add(("attributes", ATTRIBUTES["class"]), cls, what)
        self._add("mapping", vars(cls), what)  # (a live view of the class's attributes)
        return [(child, what) for child in (type(cls), *cls.__bases__, *vars(cls).values())]

    def _partial(self, p, label: str) -> list:
        self._add(("attributes", ATTRIBUTES["partial"]), p, label)
        self._add("mapping" if p.keywords else "empty", p.keywords, label)
        self._add("attributes" if vars(p) else "no attributes", p, label)
        return [(child, label) for child in (p.func, *p.args, *p.keywords,
                                              *p.keywords.values(), *vars(p),
                                              *vars(p).values())]

    def _array(self, a: np.ndarray, label: str) -> list:
        """A numpy array of up to ``LARGE`` bytes: its shape, strides, dtype and bytes,
        exactly; a larger one by its shape, strides, dtype and ``SAMPLE`` elements at fixed
        positions, evenly spaced, the first and last included (reported in ``large``); an
        array of Python objects by its items, as a list."""
        if a.dtype.hasobject:
            if a.dtype != object:  # (records holding objects)
                return self._pickled(a, label)
            self._add("objects array", a, label)
            return [(item, label) for item in a.flat]
        if a.nbytes <= LARGE:
            self._add("array", a, label)
            return []
        where = np.unique(np.linspace(0, a.size - 1, SAMPLE).astype(np.intp))
        self._add("sampled array" if a.flags.c_contiguous else "sampled strided array", a,
                  label, where)
        self.large.append(Large(label, f"a numpy array of {a.nbytes} bytes",
                                f"its shape, dtype and {len(where)} of its {a.size} "
                                "elements", len(self._nodes) - 1))
        return []

    def _framework_array(self, obj, label: str) -> list | None:
        """A torch tensor on the CPU: its frame and numpy view, compared as an array is
        (sampled when large); a JAX array, which never changes: as the same object. None
        for anything else (a GPU tensor: by its pickled bytes, as any C-level object)."""
        if _arrays.adapter_of(obj) is None:
            return None
        try:
            native, frame = _arrays.native(obj)
        except Exception:
            return None
        if frame.kind == "jax":
            return []
        if type(native) is not np.ndarray:
            return None
        if native.nbytes <= LARGE:
            self._add("framework array", obj, label)
            return [(type(obj), label)]
        where = np.unique(np.linspace(0, native.size - 1, SAMPLE).astype(np.intp))
        self._add("sampled framework array", obj, label, where)
        self.large.append(Large(label, f"a {type(obj).__qualname__} of {native.nbytes} bytes",
                                f"its shape, dtype and {len(where)} of its {native.size} "
                                "elements", len(self._nodes) - 1))
        return [(type(obj), label)]

    def _bytearray(self, b: bytearray, label: str) -> list:
        if len(b) <= LARGE:
            self._add("bytearray", b, label)
            return []
        step = len(b) // SAMPLE
        self._add("sampled bytearray", b, label, slice(None, None, step))
        self.large.append(Large(label, f"a bytearray of {len(b)} bytes",
                                f"its length and every {step}th byte", len(self._nodes) - 1))
        return []

    def _pickled(self, obj, label: str) -> list:
        """An object compared by its pickled bytes: plain pickle where that pickles it as
        cloudpickle would, else cloudpickle; where those exceed ``LARGE`` bytes, only as the
        same object (reported in ``large``); one that cannot be pickled, only as the same
        object (shipping the function then fails anyway)."""
        key = "pickled" if plain_pickle_will_do(obj) else "cloudpickled"
        try:
            size = len(NAMESPACE["_pickle" if key == "pickled" else "_cloudpickle"](obj))
        except Exception:
            return []  # not picklable: compared as the same object (shipping fails)
        if size > LARGE:
            self.large.append(Large(label, f"a {type(obj).__qualname__} of {size} bytes "
                                    "pickled", "its identity alone"))
            return []
        self._add(key, obj, label)
        return [(type(obj), label)]
