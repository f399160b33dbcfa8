"""What a function captured when it was shipped (``Captures``), and whether it has changed
since (then it is shipped again).
"""
from __future__ import annotations

import functools
import types
import warnings

from ..errors import outside_synk
from .snapshot import NOW, Snapshot, pickled_by_reference

BIG = 10_000  # references and values compared at each call above which synk warns
STREAK = 10  # calls in a row that ship the function again, after which synk warns


def _owner(fn):
    """The function (or class, for a callable object) whose code ``fn`` runs."""
    while isinstance(fn, (types.MethodType, functools.partial)):
        fn = fn.__func__ if isinstance(fn, types.MethodType) else fn.func
    return fn if isinstance(fn, (types.FunctionType, type)) else type(fn)


def _roots(fn, label: str) -> list:
    """(label, object) for what ``fn`` captures."""
    if isinstance(fn, types.MethodType):
        return [(f"{label}'s self", fn.__self__), (label, fn.__func__)]
    if isinstance(fn, functools.partial):
        return [(f"the arguments of {label}", fn)]
    if isinstance(fn, types.FunctionType):
        return [(label, fn)]
    return [(f"the state of {label}", fn)]


class Captures:
    """What a function captured when it was shipped (taken just after pickling it); ``previous``:
    its last shipping's, so that warnings are not repeated. Before each call it is compared with
    the snapshot (``changed``), since the workers run the shipped copy."""

    __slots__ = ("label", "shipped", "imported", "warned", "streak", "judged")

    def __init__(self, fn, label: str, previous: Captures | None = None) -> None:
        self.label = label
        self.warned: set = previous.warned if previous is not None else set()
        self.streak: int = previous.streak if previous is not None else 0
        owner = _owner(fn)
        module = getattr(owner, "__module__", None) or ""
        if module == "synk" or module.startswith("synk."):
            roots: list = []  # synk's own functions: each rank keeps its module state
        else:
            roots = _roots(fn, label)
        self.shipped = Snapshot(roots)
        self.imported = None
        if roots and isinstance(owner, types.FunctionType) and pickled_by_reference(owner):
            self.imported = Snapshot([(label, owner)],
                                     follow=lambda obj: obj.__module__ == module)
        self.judged = False  # whether its large values were judged (after a first call)
        self._warn_big()

    def changed(self) -> str | None:
        """What changed since shipping (its description), or None: then the function is
        shipped again; exact but for large values, compared by a sample. A function the
        workers import by name cannot be shipped with new globals: a change to what it
        reaches from its module is warned about here, saying what to do."""
        imported = self.imported
        if imported is not None:
            what = imported.changed()
            if what is not None:
                self.imported = Snapshot(imported.roots, follow=imported.follow)
                warnings.warn(
                    f"synk: {what} changed since {self.label} was shipped, and the "
                    f"workers import {self.label} by name (its module is importable), "
                    "so they keep their own copy of its module's globals and compute "
                    "with the old value: pass the value as an input (bcast_inputs) or "
                    "use synk.shared, instead of a global", RuntimeWarning,
                    stacklevel=outside_synk())
        what = self.shipped.changed()
        self.streak = 0 if what is None else self.streak + 1
        if self.streak == STREAK and "streak" not in self.warned:
            self.warned.add("streak")
            warnings.warn(
                f"synk: {self.label} was shipped to the workers again before each of its "
                f"last {STREAK} calls, because {what} changed each time; shipping costs a "
                "pickle and a round trip: pass what changes as an input (bcast_inputs) "
                "instead of capturing it", RuntimeWarning, stacklevel=outside_synk())
        return what

    def take(self) -> tuple:
        """The state ``settle`` takes, read now: in the master, once its own share of a
        call is done, while the workers still run theirs (the slow part of settling, off
        the call's path: nothing of the script runs in between)."""
        return tuple(NOW if snapshot is None else snapshot.take()
                     for snapshot in (self.shipped, self.imported))

    def settle(self, taken: tuple | None = None) -> None:
        """After a call that succeeded: what the function changed of what it reaches, while
        it ran, is each rank's own, not a change to ship: the snapshot takes it as it is.
        ``taken``: that state as ``take`` read it (None: read it now). After the first such
        call, the large values it reaches but did not change are warned about, once."""
        if not self.judged:
            self.judged = True
            self._warn_large([large for large in self.shipped.large
                              if self.shipped.holds_as_taken(large)])
        for name, state in zip(("shipped", "imported"), taken or (NOW, NOW)):
            snapshot = getattr(self, name)
            if snapshot is not None and not snapshot.settle(state):
                setattr(self, name, Snapshot(snapshot.roots, follow=snapshot.follow))

    def _warn_large(self, larges: list) -> None:
        new = [large for large in larges if (large.label, large.what) not in self.warned]
        if not new:
            return
        self.warned.update((large.label, large.what) for large in new)
        said = "; ".join(f"{large.label} ({large.what}, checked by {large.how})"
                         for large in new[:3])
        more = f"; and {len(new) - 3} more" if len(new) > 3 else ""
        warnings.warn(
            f"synk: {self.label} captures large values, shipped with it: {said}{more}. "
            "synk ships the function again when such a value is rebound or changed where "
            "it checks, but may miss a change to other parts of it in place. Pass it as "
            "an input (bcast_inputs) or make it a synk.shared variable instead",
            RuntimeWarning, stacklevel=outside_synk())

    def _warn_big(self) -> None:
        size = self.shipped.size
        if size > BIG and "big" not in self.warned:
            self.warned.add("big")
            warnings.warn(
                f"synk: {self.label} reaches {size} references and values, which synk "
                "compares before each call to see whether they changed (about 20 ns "
                "each): pass large data as inputs (synk.data, bcast_inputs) rather than "
                "capturing it", RuntimeWarning, stacklevel=outside_synk())
