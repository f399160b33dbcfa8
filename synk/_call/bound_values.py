"""The arguments of a bound step (``Function.bind``): a ``Data`` or shared variable passed
live at every call, every other argument taken by value when the step is bound
(``snapshot``); the master keeps a step's prepared values (``BoundArguments``), a worker the
values it was sent (``WorkerKept``).
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np

from .. import _tree
from .._arrays import adapter_of
from .._process import PROCESS
from .._wire.arrays import SharedData
from ..errors import SynkError
from . import replica_tensors
from .kept import Replicated

_AS_IS = (int, float, complex, bool, str, bytes, type(None), range, slice, frozenset)
_LIVE = (SharedData, Replicated)


def snapshot(value: Any) -> Any:
    """``value`` as a bound step keeps it: a ``Data`` or a shared variable as it is (live);
    anything else by value, so that changing the caller's object later does not change the
    step: arrays and tensors copied, lists, tuples and dicts rebuilt around their items'
    snapshots, other objects (their subclasses too) deep-copied, immutable values kept."""
    if isinstance(value, _LIVE) or type(value) in _AS_IS:
        return value
    if type(value) is np.ndarray:
        kept = value.copy()
        kept.flags.writeable = False
        return kept
    if PROCESS.replica_tensors and replica_tensors.in_module(value):
        raise replica_tensors.passed_module("a bound value")
    if type(value) is list:
        return [snapshot(v) for v in value]
    if type(value) is tuple:
        return tuple(snapshot(v) for v in value)
    if type(value) is dict:
        return {k: snapshot(v) for k, v in value.items()}
    if adapter_of(value) is not None:  # a JAX array (immutable) or a torch tensor
        if type(value).__module__.startswith(("jax", "jaxlib")):
            return value
        return value.detach().clone()
    return copy.deepcopy(value)


class Kept:
    """One bound value as the call path keeps it: the snapshot passed at every call
    (``source``), rank 0's value of it, the workers' (``remote``, their wire form), its
    frame (a torch tensor's or JAX array's) and its rows, where scattered."""

    __slots__ = ("source", "local", "remote", "frame", "rows")

    def __init__(self, source, local, remote, frame, rows: int | None) -> None:
        self.source, self.local, self.remote = source, local, remote
        self.frame, self.rows = frame, rows


class BoundArguments:
    """A bound step's plain values, prepared once and kept by the workers under the step's
    ``number``. The workers hold the values sent with call ``held`` until they drop what they
    keep (``clock.dropped``); the next call sends them again. A Data or shared variable is live,
    never kept. A call passing only the step's all-plain arguments is prepared once (``whole``)
    and its whole task kept by the same rule (``whole_held``)."""

    __slots__ = ("number", "args", "kwargs", "plain", "sources", "entries", "held",
                 "generation", "whole", "whole_held", "__weakref__")

    def __init__(self, number: int, args: tuple, kwargs: dict) -> None:
        self.number = number
        self.args, self.kwargs = args, kwargs  # the step's own (a call passing exactly
        # these passes nothing more)
        values = [*args, *kwargs.values()]
        self.plain = not any(isinstance(v, _LIVE) for v in _tree.flatten(values)[0])
        self.sources = {id(v): v for v in values if not isinstance(v, _LIVE)}  # by identity
        self.entries: dict[str, Kept] = {}  # label -> its kept value, once prepared
        self.held: int | None = None  # the call that last sent the values to the workers
        self.generation = -1  # the group its entries were prepared in
        self.whole: Any = None  # the preparation of a call passing nothing more
        self.whole_held: int | None = None  # the call that last sent its task to the workers

    def prepared_in(self, generation: int) -> None:
        """A call on the group of ``generation``: the entries of another group (one that
        broke and was replaced: its blocks and workers are gone) are prepared again."""
        if generation != self.generation:
            self.entries.clear()
            self.whole = self.held = self.whole_held = None
            self.generation = generation

    def passes_nothing_more(self, args, kwargs) -> bool:
        """Whether a call's ``args`` and ``kwargs`` are the step's own, nothing added."""
        return args is self.args and kwargs is self.kwargs

    def kept(self, label: str, value) -> Kept | None:
        """The kept value of ``label`` where ``value`` is the step's own (None: prepare it,
        or pass it as any argument)."""
        entry = self.entries.get(label)
        if entry is not None and entry.source is value:
            return entry
        return None

    def owns(self, value) -> bool:
        """Whether ``value`` is one of the step's bound plain values."""
        return self.sources.get(id(value)) is value

    def keep(self, label: str, entry: Kept) -> None:
        self.entries[label] = entry
        self.held = self.whole_held = None  # (the workers have not got this one yet)
        self.whole = None

    def wire(self, clock) -> tuple | None:
        """The values as the CALL carries them for the workers to keep (labels, values), or
        None while they hold them."""
        held = self.held
        if held is not None and held >= clock.dropped:
            return None
        labels = tuple(self.entries)
        return labels, tuple(self.entries[k].remote for k in labels)

    def whole_is_held(self, clock) -> bool:
        """Whether the workers hold the task of the call passing nothing more."""
        held = self.whole_held
        return held is not None and held >= clock.dropped

    def forgotten(self) -> None:
        """A call failed: a worker may not have kept what it sent (sent again)."""
        self.held = self.whole_held = None


class WorkerKept:
    """A worker's values of bound steps: step number -> {label: value}, and the whole task
    of a step's call that passes nothing more; dropped with every block released or moved
    (their views may map them), a step closed, or the group."""

    __slots__ = ("steps", "tasks")

    def __init__(self) -> None:
        self.steps: dict[int, dict] = {}
        self.tasks: dict[int, tuple] = {}  # number -> (args, kwargs, spos, skeys, plan, frames)

    def keep(self, number: int, labels: tuple, values: tuple) -> None:
        self.steps[number] = dict(zip(labels, values))

    def values(self, number: int) -> dict:
        return self._held(self.steps, number)

    def keep_task(self, number: int, task: tuple) -> None:
        self.tasks[number] = task

    def task(self, number: int) -> tuple:
        return self._held(self.tasks, number)

    @staticmethod
    def _held(kept: dict, number: int):
        values = kept.get(number)
        if values is None:
            raise SynkError(
                f"synk: this worker does not hold the values of bound step {number} (an "
                "internal error: the call was not run; the next call sends them again)")
        return values

    def forget(self, numbers) -> None:
        for number in numbers:
            self.steps.pop(number, None)
            self.tasks.pop(number, None)

    def clear(self) -> None:
        self.steps.clear()
        self.tasks.clear()
