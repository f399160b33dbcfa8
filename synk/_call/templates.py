"""A call that passes the same arguments as the function's last one: prepared once, sent once.

A training loop calls one function again and again with the same ``Data`` and shared
variables (and the same numbers), only its rows (``batch=``) changing. The first such call
is prepared as any is (``args``), and what it made is kept as the function's ``Template``:
what rank 0 and the workers get, which inputs are scattered, the frames, the workers'
part encoded (``records``). A later call that passes the same objects, each still what it
was then, reuses them: only the plan of rows is made again (a call of all the rows, in
one slice, reuses the plan too: ``Template.whole``). The workers keep their decoded
arguments too (``Kept``), under the template's number, and the CALL then carries that
number in place of the arguments (``ShareTask.wire``).

Nothing stale is ever used:

* Only these arguments make a template: a ``Data`` (in the same block, not on the
  devices, with the same frame: ``_shared_array_ref`` is made anew whenever its block,
  shape or dtype change), a shared variable (installed on this group, the same frame;
  each rank looks its replica up again at every call: ``set_value`` or ``synk.assign`` may
  replace it), a plain array of at most ``COMPARED_BYTES`` (the same shape and dtype; its
  bytes compared at every call, and where they changed sent with the CALL, which the
  workers put in place of the kept ones: ``patches``), a plain array staged in shared
  memory (larger than a message carries: the same shape and dtype; its bytes are copied
  into its staging block again at every call, as any call does, before the CALL goes, and
  the workers' kept view is of that block), and numbers or strings (equal ones of the
  same type count as the same; a float or a complex only as the same object: ``-0.0 ==
  0.0``). A call with a plain array carried inside the message (between the two sizes), a
  framework array or a list makes none.
* A worker drops all it keeps when a CALL tells it of blocks released or moved, or of
  Data that left the devices (its views of them would outlive their mappings); the master's
  clock notes such a call (``dropped``), after which a template is sent whole again. So it
  is after any call that failed, and in a new group.
"""
from __future__ import annotations

import itertools
import weakref
from typing import Any

import numpy as np

from .._process import PROCESS
from .._wire.arrays import InlineArray, SharedArray, SharedData, read_only
from ..errors import SynkError
from .records import ShareTask
from .replicas import Replicated, replica

_EQUAL = frozenset({int, bool, str, bytes, type(None)})  # equal values are the same value
_SAME = frozenset({float, complex})  # the same object only
COMPARED_BYTES = 4096  # a plain array up to this size is compared by its bytes
# the kinds of rank 0's arguments made again at each call
_DATA, _SHARED, _ARRAY, _STAGED = 0, 1, 2, 3
_VALUE, _OBJECT, _REF, _BYTES, _SHAPE = 0, 1, 2, 3, 4  # how a given argument is compared

_numbers = itertools.count(1)


def _reusable(value) -> bool:
    kind = type(value)
    if kind in _EQUAL or kind in _SAME or isinstance(value, Replicated):
        return True
    if kind is np.ndarray:  # (a larger one: where it is staged, ``_refs``)
        return not value.dtype.hasobject
    return isinstance(value, SharedData) and value.on_device is None


class Template:
    """The arguments of a function's last call, as prepared for the group of generation
    ``generation`` (see the module): ``reuse`` gives them for a call that passes the same."""

    __slots__ = ("generation", "given", "keys", "refs", "args", "kwargs", "spos", "skeys",
                 "wargs", "wkwargs", "frames", "lengths", "number", "wire", "held",
                 "whole", "views")

    def __init__(self, generation: int, args: tuple, kwargs: dict, prep, refs: tuple,
                 lengths: dict) -> None:
        self.generation = generation
        self.given = tuple(_given(v) for v in args + tuple(kwargs.values()))  # to compare
        self.keys = tuple(kwargs)
        self.refs = refs
        # rank 0's arguments with those left out (made again at each call)
        fresh = {(r[0], r[1]) for r in refs}
        self.args = tuple(None if (False, i) in fresh else v for i, v in enumerate(prep.args))
        self.kwargs = {k: None if (True, k) in fresh else v for k, v in prep.kwargs.items()}
        self.spos, self.skeys, self.frames = prep.spos, prep.skeys, prep.frames
        self.wargs, self.wkwargs = prep.wargs, prep.wkwargs
        self.lengths = lengths  # (the same while the arguments are)
        self.number = next(_numbers)
        self.wire = ShareTask.arguments_wire(self.number, prep.wargs, prep.wkwargs,
                                             prep.frames)
        self.held: int | None = None  # the last call that sent it to the workers
        # the plan of a call of all the rows in one slice, once made (the same while the
        # arguments and the group are: ``lengths``)
        self.whole: Any = None
        self.views: dict = {}  # index -> (a plain array given, rank 0's read-only view of it)

    def reuse(self, generation: int, args: tuple, kwargs: dict, restage):
        """(rank 0's args, kwargs, patches) for a call that passes ``args``/``kwargs``, or
        None unless they are the same as this template's and each still what it was, but
        for the bytes of its arrays: a small one's that changed go to the workers in
        ``patches`` (``(in kwargs, where, value)`` each, or None), a staged one's are
        copied into its block again (``restage(label, array)``: ``(the workers'
        reference, rank 0's array)``)."""
        if generation != self.generation or PROCESS.dropped:
            return None
        given = self.given
        if kwargs:
            if tuple(kwargs) != self.keys:
                return None
            args = args + tuple(kwargs.values())
        elif self.keys:  # (the same values, bound by position where they were by keyword)
            return None
        if len(args) != len(given):
            return None
        changed: tuple | None = None  # the small arrays whose bytes are not the template's
        for i, (value, (how, kept)) in enumerate(zip(args, given)):
            if how == _VALUE:
                if type(value) is not type(kept) or value != kept:
                    return None
            elif how == _BYTES:
                if type(value) is not np.ndarray or value.shape != kept[0] or \
                        value.dtype != kept[1]:
                    return None
                if value.tobytes() != kept[2]:
                    changed = (changed or ()) + (i,)
            elif how == _SHAPE:
                if type(value) is not np.ndarray or value.shape != kept[0] or \
                        value.dtype != kept[1]:
                    return None
            elif (kept if how == _OBJECT else kept()) is not value:
                return None
        rank0 = list(self.args)
        kw = dict(self.kwargs) if self.kwargs else {}
        patches: tuple | None = None  # (in kwargs, where, what the workers get) of each one
        # changed
        for in_kwargs, where, kind, index, stand_in, frame in self.refs:
            source = args[index]
            if kind == _STAGED:  # (``frame``: its label; its bytes staged again)
                ref, source = restage(frame, source)
                if ref is not stand_in:  # (its block changed: prepared whole)
                    return None
            elif changed is not None and index in changed:
                patches = (patches or ()) + ((in_kwargs, where, InlineArray(source)),)
            if kind == _ARRAY or kind == _STAGED:  # (its read-only view of the last call,
                seen = self.views.get(index)  # for the same array)
                if seen is not None and seen[0] is source:
                    local = seen[1]
                else:
                    local = read_only(source)
                    self.views[index] = (source, local)
            elif source.frame is not frame:
                return None
            elif kind == _DATA:
                try:
                    if source.on_device is not None or \
                            source._shared_array_ref() is not stand_in:
                        return None
                except SynkError:  # (freed: the full path says so)
                    return None
                local = source.array
            else:
                if source._installed != generation:
                    return None
                local = PROCESS.replicas[source.id]
            if in_kwargs:
                kw[where] = local
            else:
                rank0[where] = local
        return rank0, kw, patches

    def sent_as(self, clock) -> Any:
        """What the CALL carries for these arguments: the number alone while the workers
        keep them (sent whole since they last dropped what they keep), else all of it."""
        held = self.held
        if held is not None and held >= clock.dropped:
            return self.number
        return self.wire


def made(generation: int, args: tuple, kwargs: dict, prep, sources: list,
         lengths: dict) -> Template | None:
    """The template of a call prepared as ``prep`` from ``args``/``kwargs`` (``sources``:
    ``(in kwargs, where, value)`` of each of rank 0's arguments, ``lengths``: the rows of
    the scattered ones), or None when some argument cannot be reused (see the module)."""
    for value in args:
        if not _reusable(value):
            return None
    for value in kwargs.values():
        if not _reusable(value):
            return None
    refs = _refs(args + tuple(kwargs.values()), prep, sources)
    return None if refs is None else Template(generation, args, kwargs, prep, refs, lengths)


def _refs(given: tuple, prep, sources: list) -> tuple | None:
    """``(in kwargs, where, kind, index in given, the workers' stand-in, frame)`` of each
    of rank 0's arguments made again at each call (a staged array's label in place of its
    frame); None if one is not among ``given``, or a plain array larger than
    ``COMPARED_BYTES`` went inside the message."""
    refs: list = []
    for in_kwargs, where, source, label in sources:
        stand_in = (prep.wkwargs if in_kwargs else prep.wargs)[where]
        frame = getattr(source, "frame", None)
        if isinstance(source, SharedData):
            kind = _DATA
        elif isinstance(source, Replicated):
            kind = _SHARED
        elif type(source) is not np.ndarray:
            continue
        elif source.nbytes <= COMPARED_BYTES:
            kind = _ARRAY
        elif type(stand_in) is SharedArray:
            kind, frame = _STAGED, label
        else:
            return None
        index = next((i for i, v in enumerate(given) if v is source), None)
        if index is None:
            return None
        refs.append((in_kwargs, where, kind, index, stand_in, frame))
    return tuple(refs)


def _given(value) -> tuple:
    """How a call's argument is compared with the next call's: (how, what is kept)."""
    if type(value) in _EQUAL:
        return _VALUE, value
    if type(value) in _SAME:
        return _OBJECT, value
    if type(value) is np.ndarray:
        if value.nbytes > COMPARED_BYTES:  # (staged: its bytes copied again at every call)
            return _SHAPE, (value.shape, value.dtype)
        return _BYTES, (value.shape, value.dtype, value.tobytes())
    return _REF, weakref.ref(value)  # (a Data or a shared variable: not kept alive)


class Kept:
    """A worker's decoded arguments of templates, one per function (see the module)."""

    __slots__ = ("by_function",)

    def __init__(self) -> None:
        self.by_function: dict = {}

    def keep(self, fid: int, number: int, args: tuple, kwargs: dict, frames) -> None:
        """Keep function ``fid``'s decoded arguments of template ``number``; the replicas
        among them are looked up again at each call."""
        replicas = {id(v): sid for sid, v in PROCESS.replicas.items()}
        slots = tuple((i, replicas[id(v)]) for i, v in enumerate(args) if id(v) in replicas)
        kslots = tuple((k, replicas[id(v)]) for k, v in kwargs.items() if id(v) in replicas)
        self.by_function[fid] = (number, args, slots, kwargs, kslots, frames)

    def get(self, fid: int, number: int) -> tuple:
        """(args, kwargs, frames) of template ``number`` of function ``fid``."""
        entry = self.by_function.get(fid)
        if entry is None or entry[0] != number:
            raise SynkError(
                f"synk: this worker does not hold the arguments of call template {number} "
                "(an internal error: the call was not run; the next call sends them again)")
        _, args, slots, kwargs, kslots, frames = entry
        if slots:
            args = list(args)
            for i, sid in slots:
                args[i] = replica(sid)
        if kslots:  # (else the kept dict itself: every user of a task's kwargs copies them
            kwargs = dict(kwargs)  # before changing them)
            for key, sid in kslots:
                kwargs[key] = replica(sid)
        return args, kwargs, frames

    def clear(self) -> None:
        self.by_function.clear()

    def forget(self, fids) -> None:
        for fid in fids:
            self.by_function.pop(fid, None)

