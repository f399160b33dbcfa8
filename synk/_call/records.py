"""The records one call is made of (``FunctionSpec``, ``ShareTask``, ``Marks``, ``Share``,
``ShareResult``), in the order the call meets them, and their wire form.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from .._arrays._frame import Frame, frame_of
from .._reduction import KINDS, Kind
from .._wire.arrays import DtypeToken, InlineArray, SharedArray, _attach, _rebuild
from .kept import ReplicaRef, ResidentRef, _resident, replica
from .rows import Plan

Reduce = Any  # one op name (or None), or a tuple of them: see ops.check_reduce
_KIND_BYTES = tuple(bytes((kind,)) for kind in KINDS)  # one output's kinds on the wire


class FunctionSpec(Protocol):
    """What a rank runs in a call: a ``Function`` in the master, a ``Shipped`` on a worker."""

    @property
    def fn(self) -> Callable: ...

    @property
    def name(self) -> str: ...

    @property
    def reduce(self) -> Reduce: ...


class Shipped(NamedTuple):
    """A function as a worker holds it once shipped (see ``FunctionSpec``)."""

    fn: Callable
    name: str
    reduce: Reduce


class OutRef(NamedTuple):
    """An output left in shared memory: where it is and what it is."""

    name: str
    offset: int
    shape: tuple
    dtype: DtypeToken


_BUILDERS = (_rebuild, _attach, replica, _resident, OutRef, frame_of)  # rebuild each stand-in
_CODES = {builder: code for code, builder in enumerate(_BUILDERS, 1)}
_STAND_INS = frozenset([InlineArray, SharedArray, ReplicaRef, ResidentRef])
_FRAME_CODE = _CODES[frame_of]


def encoded(values) -> tuple:
    """``values`` (a sequence) as a message carries them: ``(codes, items)``, each
    stand-in among them replaced by its fields and its code (the number of the function
    that rebuilds it) in ``codes`` (bytes, 0 for the others; None when there is none):
    pickle would write, and look up, the name of each kind's rebuilding function."""
    codes = None
    items = values
    for i, value in enumerate(values):
        kind = type(value)
        if kind in _STAND_INS:
            builder, fields = value.__reduce__()
            code = _CODES[builder]
        elif kind is OutRef:
            code, fields = _CODES[OutRef], tuple(value)
        elif kind is Frame:
            code, fields = _FRAME_CODE, value._fields()
        else:
            continue
        if codes is None:
            codes, items = bytearray(len(values)), list(values)
        codes[i] = code
        items[i] = fields
    return None if codes is None else bytes(codes), tuple(items)


def decoded(wire: tuple) -> tuple:
    """The values ``encoded`` gave ``wire`` for, each stand-in rebuilt."""
    codes, items = wire
    if codes is None:
        return items
    return tuple([_BUILDERS[code - 1](*item) if code else item
                  for code, item in zip(codes, items)])


class ShareTask:
    """One rank's share of a call: everything it needs besides its own state. ``args``/``kwargs``
    as this rank gets them (rank 0's own arrays, the workers' references to shared memory);
    ``spos``/``skeys``: the scattered ones; ``plan``: the rows each rank takes; ``frames``: of
    the torch/JAX arguments, or None; ``inline_outputs``: outputs ride the reply whatever their
    size (a submitted call); ``steps``: a call of many steps' plan per step, else None."""

    __slots__ = ("fid", "args", "kwargs", "spos", "skeys", "plan", "call_id", "profile",
                 "frames", "inline_outputs", "steps")

    def __init__(self, fid: int, args: list | tuple, kwargs: dict, spos: tuple, skeys: tuple,
                 plan: Plan, call_id: int, profile: bool, frames: tuple | None = None,
                 inline_outputs: bool = False, steps: tuple | None = None) -> None:
        self.fid, self.args, self.kwargs = fid, args, kwargs
        self.spos, self.skeys, self.plan = spos, skeys, plan
        self.call_id, self.profile, self.frames = call_id, profile, frames
        self.inline_outputs, self.steps = inline_outputs, steps

    def step(self, plan: Plan) -> ShareTask:
        """One step of a call of many steps: this task with ``plan``'s rows."""
        return ShareTask(self.fid, self.args, self.kwargs, self.spos, self.skeys, plan,
                         self.call_id, False, self.frames, True)

    def wire(self, bound: tuple | None = None) -> tuple:
        """The task as the plain tuple a CALL carries, tagged ``TASK`` (all but its call
        number, which is the CALL's request id: ``from_wire``); ``bound``: a bound step's
        part (``bound_wire``), or None. Tasks and shares travel as plain tuples: an object
        with ``__reduce__`` costs a sixth of a small call more to pickle."""
        frames = None if self.frames is None else _frames_wire(self.frames)
        steps = None if self.steps is None else tuple(tuple(p) for p in self.steps)
        return (TASK, self.fid, encoded(self.args), self.kwargs, self.spos, self.skeys,
                encoded(self.plan), self.profile, frames, bound, self.inline_outputs, steps)

    def wire_held(self, number: int, dropped: tuple) -> tuple:
        """The task as a CALL carries it where the workers hold it whole under bound step
        ``number`` (``bound_wire``'s ``whole``), tagged ``HELD_TASK``: its number in place
        of its arguments and plan."""
        return (HELD_TASK, self.fid, number, self.profile, self.inline_outputs, dropped)

    @classmethod
    def from_wire(cls, fields: tuple, call_id: int, kept: Any = None) -> ShareTask:
        """The task a CALL carries (``wire`` or ``wire_held``), of call ``call_id`` (the CALL's
        request id; ``kept``: a worker's ``bound_values.WorkerKept``, the values of bound steps)."""
        if fields[0] == HELD_TASK:
            _, fid, number, profile, inline, dropped = fields
            if dropped:
                kept.forget(dropped)
            args, kwargs, spos, skeys, plan, frames = kept.task(number)
            return cls(fid, list(args), dict(kwargs), spos, skeys, plan, call_id, profile,
                       frames, inline)
        _, fid, args, kwargs, spos, skeys, plan, profile, frames, bound, inline, steps = fields
        args = decoded(args)
        if frames is not None:
            where, positions, names, values = frames
            frames = (dict(zip(where, decoded(positions))), dict(zip(names, decoded(values))))
        plan = Plan(*decoded(plan))
        if bound is not None:
            number, values, places, dropped, whole = bound
            if dropped:
                kept.forget(dropped)
            if places:
                if values is not None:
                    labels, wired = values
                    kept.keep(number, labels, decoded(wired))
                held = kept.values(number)
                args = list(args)
                for in_kwargs, where, label in places:
                    if in_kwargs:
                        kwargs[where] = held[label]
                    else:
                        args[where] = held[label]
            if whole:
                kept.keep_task(number, (tuple(args), dict(kwargs), spos, skeys, plan,
                                        frames))
        if steps is not None:
            steps = tuple(Plan(*p) for p in steps)
        return cls(fid, args, kwargs, spos, skeys, plan, call_id, profile, frames, inline,
                   steps)


TASK, HELD_TASK = 0, 1  # the tags of a ShareTask's two wire forms


def bound_wire(*, number: int, values: tuple | None, places: tuple, dropped: tuple,
               whole: bool) -> tuple:
    """A bound step's part of a task's wire: ``values`` (labels, wire values) for the workers to
    keep under ``number``, or None while they hold them; ``places``: where they go;
    ``dropped``: closed steps to forget; ``whole``: keep the whole task too (``wire_held``)."""
    return number, values, places, dropped, whole


def _frames_wire(frames: tuple) -> tuple:
    positions, keys = frames
    return (tuple(positions), encoded(tuple(positions.values())), tuple(keys),
            encoded(tuple(keys.values())))


class Marks:
    """When the parts of one rank's share of a profiled call began and ended
    (``time.perf_counter``); the master adds when the replies were in and when the outputs
    were combined."""

    __slots__ = ("begin", "share", "taken", "computed", "replied", "combined")

    def __init__(self) -> None:
        self.begin = time.perf_counter()  # the call (master) or the request (worker)
        self.share = self.taken = self.computed = self.replied = self.combined = 0.0

    def record(self, end: float, combining: float, moved: dict, now: dict) -> tuple:
        """This rank's part of the call for ``Profile``: (input, compute, output and collectives
        seconds, bytes host->device, device->host). ``end``: when its reply was ready;
        ``combining``: seconds combining on the devices; ``moved``/``now``: transfer counts before
        and after."""
        return (self.taken - self.begin, self.computed - self.taken,
                end - self.computed - combining, combining,
                now["h2d"] - moved["h2d"], now["d2h"] - moved["d2h"])


class Share(NamedTuple):
    """What one rank computed in a call. ``outputs``: one ``(Kind, value)`` per output, or per
    leaf of a list, tuple or dict combined leaf by leaf, each output's structure then in
    ``templates`` (``_tree``; None for a leaf), else None. ``frames``: per entry of ``outputs``,
    a torch/JAX output's frame, or None when none was."""

    weight: int  # the rows it processed
    multi: bool  # fn returned a tuple: several outputs
    outputs: tuple  # ((Kind, value), ...)
    templates: tuple | None = None
    frames: tuple | None = None

    def layout(self) -> tuple:
        """What must agree between the ranks: (multi, templates, number of outputs)."""
        return self.multi, self.templates, len(self.outputs)

    def wire(self) -> tuple:
        """The share as the plain tuple a reply carries (kinds as ints)."""
        outputs = self.outputs
        frames = None if self.frames is None else encoded(self.frames)
        if len(outputs) == 1:  # (the usual case, in short)
            kind, value = outputs[0]
            return (self.weight, self.multi, _KIND_BYTES[kind], encoded((value,)),
                    self.templates, frames)
        return (self.weight, self.multi, bytes([kind for kind, _ in outputs]),
                encoded([value for _, value in outputs]), self.templates, frames)

    @classmethod
    def from_wire(cls, fields: tuple) -> Share:
        weight, multi, kinds, values, templates, frames = fields
        values = decoded(values)
        if frames is not None:
            frames = decoded(frames)
        return cls(weight, multi, tuple(zip([KINDS[k] for k in kinds], values)),
                   templates, frames)

    def replace_outputs(self, outputs) -> Share:
        return self._replace(outputs=tuple(outputs))


DONE_OUTPUT = (Kind.DONE, None)  # an output combined on the devices already


class ShareResult(NamedTuple):
    """A rank's share at its end (``share.run``)."""

    share: Share | None  # what it replies with (None: it had no rows)
    combined: dict | None  # rank 0: {output index: result} combined on the devices already
    combining: float  # the seconds combining outputs on the devices took here

