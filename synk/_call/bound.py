"""The arguments of a bound step (``Function.bind``): what is live and what is taken by
value.

A ``Data`` and a shared variable are live references: every call of the step passes the
object, so the ranks see its current contents. Every other argument is taken by value when
the step is bound (``snapshot``): a numpy array or torch tensor is copied, a list, tuple or
dict is rebuilt around its items' snapshots, and another object is deep-copied (numbers,
strings, JAX arrays and other immutable values are kept as they are), so that changing the
caller's object later does not change the step.
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np

from .._arrays import adapter_of
from .._wire.arrays import SharedData
from ..errors import SynkError
from .replicas import Replicated

_AS_IS = (int, float, complex, bool, str, bytes, type(None), range, slice, frozenset)


def snapshot(value: Any) -> Any:
    """``value`` as a bound step keeps it (see the module)."""
    if isinstance(value, (SharedData, Replicated)) or type(value) in _AS_IS:
        return value
    if type(value) is np.ndarray:
        kept = value.copy()
        kept.flags.writeable = False
        return kept
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
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
    """A bound step's plain values, prepared once (rank 0's value, the staging of a large
    array into the step's own block, the workers' wire form) and kept by the workers under
    the step's ``number``: the one cache of a call's arguments. Its rule: the workers hold
    the values sent with the call numbered ``held`` until they drop what they keep (a
    block released or moved, a Data leaving the devices: ``clock.dropped``), after which
    the next call sends them again; a Data or shared variable is never kept (it is live:
    prepared at every call)."""

    __slots__ = ("number", "sources", "entries", "held", "generation", "__weakref__")

    def __init__(self, number: int, values) -> None:
        self.number = number
        self.sources = {id(v): v for v in values if not isinstance(v, _LIVE)}  # by identity
        self.entries: dict[str, Kept] = {}  # label -> its kept value, once prepared
        self.held: int | None = None  # the call that last sent the values to the workers
        self.generation = -1  # the group its entries were prepared in

    def prepared_in(self, generation: int) -> None:
        """A call on the group of ``generation``: the entries of another group (one that
        broke and was replaced: its blocks and workers are gone) are prepared again."""
        if generation != self.generation:
            self.entries.clear()
            self.held, self.generation = None, generation

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
        self.held = None  # (the workers have not got this one yet)

    def wire(self, clock) -> tuple | None:
        """The values as the CALL carries them for the workers to keep (labels, values), or
        None while they hold them."""
        held = self.held
        if held is not None and held >= clock.dropped:
            return None
        labels = tuple(self.entries)
        return labels, tuple(self.entries[k].remote for k in labels)


_LIVE = (SharedData, Replicated)


class WorkerKept:
    """A worker's values of bound steps: step number -> {label: value}; dropped with every
    block released or moved (their views may map them), a step closed, or the group."""

    __slots__ = ("steps",)

    def __init__(self) -> None:
        self.steps: dict[int, dict] = {}

    def keep(self, number: int, labels: tuple, values: tuple) -> None:
        self.steps[number] = dict(zip(labels, values))

    def values(self, number: int) -> dict:
        values = self.steps.get(number)
        if values is None:
            raise SynkError(
                f"synk: this worker does not hold the values of bound step {number} (an "
                "internal error: the call was not run; the next call sends them again)")
        return values

    def forget(self, numbers) -> None:
        for number in numbers:
            self.steps.pop(number, None)

    def clear(self) -> None:
        self.steps.clear()
