"""The check a ``reachable.Snapshot`` runs: generated once per snapshot from how each kind
of object is compared (``SECTIONS``), it takes from every object the references it holds
and its other values (lengths, bytes), object by object where there are few of a kind and
in one C loop over them where there are many (``compile_check``)."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np

from .. import _arrays

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
# How each kind of object is compared (the module's docstring says why)
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
    "sampled framework array": (_VALUE(("_framed_sample",), beside=True),),
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


def _framed(value) -> tuple:
    """A framework value's frame, and its native array's form and bytes."""
    array, frame = _arrays.native(value)
    return frame, array.shape, array.strides, array.dtype, array.tobytes()


def _framed_sample(value, where: np.ndarray) -> tuple:
    """``_framed`` with the elements at ``where`` (of its flattened native array) alone."""
    array, frame = _arrays.native(value)
    return frame, array.shape, array.strides, array.dtype, array.take(where).tobytes()


NAMESPACE: dict[str, Any] = {
    "_chain": itertools.chain.from_iterable, "_values": operator.methodcaller("values"),
    "_get": dict.get, "_cell": operator.attrgetter("cell_contents"),
    "_cell_or_empty": cell_or_empty, "_flat": operator.attrgetter("flat"),
    "_form": operator.attrgetter("shape", "strides", "dtype"),
    "_tobytes": operator.methodcaller("tobytes"), "_take": np.ndarray.take,
    "_flat_at": _flat_at, "_getitem": operator.getitem,
    "_framed": _framed, "_framed_sample": _framed_sample,
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
    """The check for ``sections`` (names of ``SECTIONS``, or (kind, names) for objects
    whose named attributes are references: kind "attributes", or "slots" where some may be
    unset). With ``groups`` (a list of objects and a list beside it, per section): a
    function of nothing, for those objects; without: a function of such lists. Either
    returns (references, values). The same parts are spelled object by object (quicker
    for a few) or as C loops (for many)."""
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
