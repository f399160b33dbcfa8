"""Everything reachable from some objects, and a fast exact check that none of it changed
(``_call.captures`` uses it for what a function captures).

The walk follows what cloudpickle ships by value: the items of lists, tuples, sets, dicts
and deques (keys included), the attributes of objects (``__dict__`` and ``__slots__``), the
code, globals, closure cells, defaults and attributes of functions, the attributes of
classes, and what those reference, without end. It stops at what goes by reference (the
workers import it): modules, functions and classes of importable modules, builtins. Each
object reached is compared by one rule:

* immutable values (numbers, strings, bytes, ``None``, dtypes, dates, ...): as the same
  object, or an equal one of the same type, wherever they are referenced from;
* containers, objects, functions, classes: every reference they hold (items, keys,
  attributes, globals, cells, defaults, their class) must be the same object;
* a numpy array of up to ``LARGE`` bytes: its shape, strides, dtype and bytes, exactly; a
  larger one by its shape, strides, dtype and ``SAMPLE`` elements at fixed positions, evenly
  spaced, the first and last included (it is reported in ``Snapshot.large``); an array of
  Python objects, by its items, as a list;
* anything else (an object with its own ``__reduce__`` or ``__getstate__``, an extension
  type): by its pickled bytes (plain pickle where that pickles all of it as cloudpickle
  would, else cloudpickle); when those exceed ``LARGE`` bytes, only as the same object
  (reported in ``Snapshot.large``); an object that cannot be pickled, only as the same object
  (shipping the function then fails anyway).

The snapshot holds a reference to everything it compares, so an ``id`` is never reused.
Checking runs one function generated when the snapshot is taken: it gathers every
reference in one tuple and every other value in another, in one Python frame, so the cost
per call is about 20 ns per reference and the time to copy the small arrays' bytes.
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
import operator
import pathlib
import pickle
import re
import types
import uuid
from collections.abc import Callable

import cloudpickle
import numpy as np

LARGE = 8 << 10  # bytes: a larger array is sampled, a larger pickled object not compared
SAMPLE = 64  # elements of a large array compared
PROTOCOL = pickle.HIGHEST_PROTOCOL

_ABC_DATA = type(abc.ABC._abc_impl)  # type: ignore[attr-defined]
_IMMUTABLE = frozenset({
    type(None), bool, int, float, complex, str, bytes, range, slice, type(Ellipsis),
    type(NotImplemented), types.CodeType, types.BuiltinFunctionType,
    types.WrapperDescriptorType, types.MethodWrapperType, types.MethodDescriptorType,
    types.ClassMethodDescriptorType, types.GetSetDescriptorType, types.MemberDescriptorType,
    np.ufunc, datetime.date, datetime.datetime, datetime.time, datetime.timedelta,
    datetime.timezone, decimal.Decimal, fractions.Fraction, uuid.UUID, re.Pattern, _ABC_DATA,
    dataclasses._FIELD_BASE,  # (dataclasses' markers: compared as the same object)
})
_IMMUTABLE_KINDS = (np.dtype, enum.Enum, pathlib.PurePath)
_CONTAINERS = (list, set, collections.deque, dict, types.MappingProxyType,
               collections.OrderedDict, collections.Counter, collections.defaultdict,
               tuple, frozenset)
_EQUAL_IF_SAME_TYPE = frozenset({int, bool, str, bytes, type(None)})
_EMPTY = object()  # an empty closure cell or an unset slot
_is = operator.is_
_CELL = operator.attrgetter("cell_contents")


def _cell_or_empty(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY


def _synk_own(kind: type) -> bool:
    """Whether ``kind`` is one of synk's own classes (not the simulator's CuPy ones, which
    are compared as CuPy's are)."""
    module = kind.__module__ or ""
    return module == "synk" or (module.startswith("synk.")
                                and not module.startswith("synk._devices.sim."))


def _pickled_by_reference(obj) -> bool:
    """Whether cloudpickle pickles the function or class ``obj`` by reference (the workers
    import it) rather than by value."""
    try:
        return cloudpickle.cloudpickle._should_pickle_by_reference(obj)
    except (AttributeError, TypeError):  # (an internal of cloudpickle's)
        return getattr(obj, "__module__", None) not in ("__main__", None)


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


def _entries(expr: str, mapping) -> list:
    """The generated check's expressions for the keys and values of ``mapping`` (found at
    ``expr``): none while it is empty, as its length, compared too, tells."""
    return [f"*{expr}", f"*{expr}.values()"] if mapping else []


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


def _slot_getter(names: tuple) -> Callable:
    def slots(obj):
        return tuple(getattr(obj, name, _EMPTY) for name in names)
    return slots


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
    """One object compared: the expressions that take its references and its values (in
    the generated check), and how many references it holds: ``fixed`` plus, for each
    (value index, factor) in ``counted``, that value times the factor. ``parts``: a label
    for each of its references, where they differ (a function's globals)."""

    label: str
    refs: list
    values: list
    fixed: int = 0
    counted: tuple = ()
    parts: tuple = ()


@dataclasses.dataclass
class Large:
    """An object whose changes may go unseen: compared by a sample or as the same object."""

    label: str
    what: str  # e.g. "a numpy array of 40000 bytes"
    how: str  # how it is compared


class Snapshot:
    """The state of everything reachable from ``roots`` (pairs of a label and an object),
    taken now. ``follow(obj)``: whether a function or class pickled by reference is walked
    all the same (by default none is)."""

    def __init__(self, roots: list, follow: Callable | None = None) -> None:
        self.roots, self.follow = roots, follow
        self._nodes: list = []
        self._names: dict = {}
        self._seen: set = set()
        self._keep: list = []  # what the walk looked at, alive until it is done
        self.large: list = []
        for label, obj in roots:
            self._walk(obj, label)
        self._keep = []
        self._take = self._compile()
        self.refs, self.values = self._take()
        self.size = len(self.refs) + len(self.values)

    def changed(self) -> str | None:
        """The label of a root whose reachable state changed since, or None."""
        if not self._nodes:
            return None
        try:
            refs, values = self._take()
        except Exception:  # (a slot deleted, a cell emptied, an array resized: changed)
            return self._nodes[0].label
        if values == self.values and len(refs) == len(self.refs) and all(
                map(_is, refs, self.refs)):
            return None
        return self._which(refs, values)

    def _which(self, refs: tuple, values: tuple) -> str | None:
        nodes, at, start = self._nodes, 0, 0
        if values != self.values:
            for node in nodes:
                end = at + len(node.values)
                if values[at:end] != self.values[at:end]:
                    return node.label
                at = end
            return nodes[-1].label
        for node in nodes:
            count = node.fixed + sum(values[at + i] * k for i, k in node.counted)
            end = start + count
            for i, (a, b) in enumerate(zip(refs[start:end], self.refs[start:end])):
                if not _unchanged(a, b):
                    return node.parts[i] if node.parts else node.label
            start, at = end, at + len(node.values)
        self.refs = refs  # only equal immutable values were new: same state, keep them
        return None

    def _compile(self) -> Callable:
        refs = "".join(f"{r}, " for node in self._nodes for r in node.refs)
        values = "".join(f"{v}, " for node in self._nodes for v in node.values)
        return eval(f"lambda: (({refs}), ({values}))", self._names)  # noqa: S307

    # the walk ------------------------------------------------------------------------

    def _name(self, value) -> str:
        name = f"_{len(self._names)}"
        self._names[name] = value
        return name

    def _walk(self, root, label: str) -> None:
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
        """Add the nodes that compare ``obj``; return what it references, as (object,
        label) pairs."""
        kind = type(obj)
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
        if _synk_own(kind):
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
        base = _state_base(kind)
        if base is object:
            return self._instance(obj, label)
        if base in _CONTAINERS:  # (a Python subclass of one)
            return self._instance(obj, label) + self._container(obj, label)
        return self._pickled(obj, label)

    def _container(self, obj, label: str) -> list:
        if isinstance(obj, (tuple, frozenset)):  # (immutable: only their items can change)
            return [(item, label) for item in obj]
        o = self._name(obj)
        if isinstance(obj, (dict, types.MappingProxyType)):
            refs, fixed = _entries(o, obj), 0
            children = [*obj, *obj.values()]
            if isinstance(obj, collections.defaultdict):
                refs.append(f"{o}.default_factory")
                fixed = 1
                children.append(obj.default_factory)
            self._nodes.append(_Node(label, refs, [f"len({o})"], fixed, ((0, 2),)))
        else:
            self._nodes.append(_Node(label, [f"*{o}"] if obj else [], [f"len({o})"], 0,
                                     ((0, 1),)))
            children = list(obj)
        return [(child, label) for child in children]

    def _instance(self, obj, label: str) -> list:
        """An object pickled by its attributes: its class, ``__dict__`` and slots."""
        o, kind = self._name(obj), type(obj)
        refs, values, counted, children = [f"{o}.__class__"], [], (), [kind]
        if hasattr(obj, "__dict__"):
            refs += _entries(f"{o}.__dict__", vars(obj))
            values.append(f"len({o}.__dict__)")
            counted = ((0, 2),)
            children += [*vars(obj), *vars(obj).values()]
        slots = _slot_names(kind)
        if slots:
            refs.append(f"*{self._name(_slot_getter(slots))}({o})")
            children += [getattr(obj, name, None) for name in slots]
        self._nodes.append(_Node(label, refs, values, 1 + len(slots), counted))
        return [(child, label) for child in children]

    def _function(self, fn, label: str) -> list:
        if _pickled_by_reference(fn) and not (self.follow and self.follow(fn)):
            return []
        o, name = self._name(fn), fn.__qualname__
        own = f"{name} (its code, defaults or attributes)"
        self._nodes.append(_Node(own, [f"{o}.__code__", f"{o}.__defaults__",
                                       f"{o}.__kwdefaults__",
                                       *_entries(f"{o}.__dict__", vars(fn))],
                                 [f"len({o}.__dict__)"], 3, ((0, 2),)))
        children = [(fn.__defaults__, f"the default values of {name}"),
                    (fn.__kwdefaults__, f"the default values of {name}")]
        children += [(child, f"the attributes of {name}")
                     for child in (*vars(fn), *vars(fn).values())]
        names = _global_names(fn.__code__)  # (a missing one too: it may be defined later)
        if names:
            parts = tuple(f"the global {key!r} of {name}" for key in names)
            self._nodes.append(_Node(
                own, [f"*map({self._name(fn.__globals__.get)}, {self._name(names)})"], [],
                len(names), parts=parts))
            children += [(fn.__globals__[key], what) for key, what in zip(names, parts)
                         if key in fn.__globals__]
        cells = fn.__closure__ or ()
        if cells:
            values = [_cell_or_empty(cell) for cell in cells]
            get = _CELL if _EMPTY not in values else _cell_or_empty
            parts = tuple(f"the variable {key!r} of {name}'s closure"
                          for key in fn.__code__.co_freevars)
            self._nodes.append(_Node(
                own, [f"*map({self._name(get)}, {self._name(cells)})"], [], len(cells),
                parts=parts))
            children += list(zip(values, parts))
        return children

    def _class(self, cls: type, label: str) -> list:
        if _pickled_by_reference(cls) and not (self.follow and self.follow(cls)):
            return []
        o, attributes = self._name(cls), vars(cls)
        d = self._name(attributes)  # (a live view of the class's attributes)
        what = f"the class attributes of {cls.__qualname__}"
        self._nodes.append(_Node(what, [f"{o}.__class__", f"{o}.__bases__",
                                        *_entries(d, attributes)],
                                 [f"len({d})"], 2, ((0, 2),)))
        return [(child, what) for child in (type(cls), *cls.__bases__, *vars(cls).values())]

    def _partial(self, p, label: str) -> list:
        o = self._name(p)
        self._nodes.append(_Node(
            label, [f"{o}.func", f"{o}.args", *_entries(f"{o}.keywords", p.keywords),
                    *_entries(f"{o}.__dict__", vars(p))],
            [f"len({o}.keywords)", f"len({o}.__dict__)"], 2, ((0, 2), (1, 2))))
        return [(child, label) for child in (p.func, *p.args, *p.keywords,
                                              *p.keywords.values(), *vars(p),
                                              *vars(p).values())]

    def _array(self, a: np.ndarray, label: str) -> list:
        o = self._name(a)
        form = [f"{o}.shape", f"{o}.strides", f"{o}.dtype"]
        if a.dtype.hasobject:
            if a.dtype != object:  # (records holding objects)
                return self._pickled(a, label)
            self._nodes.append(_Node(label, [f"*{o}.flat"], [*form, f"{o}.size"], 0,
                                     ((3, 1),)))
            return [(item, label) for item in a.flat]
        if a.nbytes <= LARGE:
            self._nodes.append(_Node(label, [], [*form, f"{o}.tobytes()"]))
            return []
        where = np.unique(np.linspace(0, a.size - 1, SAMPLE).astype(np.intp))
        sample = (f"{o}.take({self._name(where)})" if a.flags.c_contiguous
                  else f"{o}.flat[{self._name(where)}]")
        self._nodes.append(_Node(label, [], [*form, f"{sample}.tobytes()"]))
        self.large.append(Large(label, f"a numpy array of {a.nbytes} bytes",
                                f"its shape, dtype and {len(where)} of its {a.size} "
                                "elements"))
        return []

    def _bytearray(self, b: bytearray, label: str) -> list:
        o = self._name(b)
        if len(b) <= LARGE:
            self._nodes.append(_Node(label, [], [f"bytes({o})"]))
            return []
        step = len(b) // SAMPLE
        self._nodes.append(_Node(label, [], [f"len({o})", f"{o}[::{step}]"]))
        self.large.append(Large(label, f"a bytearray of {len(b)} bytes",
                                f"its length and every {step}th byte"))
        return []

    def _pickled(self, obj, label: str) -> list:
        """An object compared by its pickled bytes (see the module's docstring)."""
        dumps = _dumps_for(obj)
        try:
            size = len(dumps(obj))
        except Exception:
            return []  # not picklable: compared as the same object (shipping fails)
        if size > LARGE:
            self.large.append(Large(label, f"a {type(obj).__qualname__} of {size} bytes "
                                    "pickled", "its identity alone"))
            return []
        self._nodes.append(_Node(label, [], [f"{self._name(dumps)}({self._name(obj)})"]))
        return [(type(obj), label)]


def _global_names(code) -> tuple:
    """The global names the code (and the code nested in it) reads, as cloudpickle finds
    them."""
    try:
        return tuple(cloudpickle.cloudpickle._extract_code_globals(code))
    except AttributeError:  # (an internal of cloudpickle's)
        names = list(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names += _global_names(const)
        return tuple(dict.fromkeys(names))


class _Probe(pickle.Pickler):
    """Plain pickle, noting whether it met a function or class cloudpickle would pickle
    by value (which plain pickle pickles by name)."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.by_value = False

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and not _pickled_by_reference(obj):
            self.by_value = True
        return NotImplemented


def _dumps_for(obj) -> Callable:
    """The quickest pickler that pickles ``obj`` as cloudpickle ships it."""
    probe = _Probe(io.BytesIO())
    try:
        probe.dump(obj)
        if not probe.by_value:
            return functools.partial(pickle.dumps, protocol=PROTOCOL)
    except Exception:
        pass
    return functools.partial(cloudpickle.dumps, protocol=PROTOCOL)
