"""What each rank passed to a reduction, exchanged and named where a transport finds that the
ranks disagree, so that every rank raises the same error.

::

    the ranks disagree (``_reduction.disagreement``) -> ``named``: each rank's
      ``Passed``, sent to every rank -> ``described``: one ``ValueError`` on every rank
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from .. import _reduction

_LONG = 160  # characters of one rank's structure past which the message names one leaf


class Passed(NamedTuple):
    """What one rank passed to a reduction: the collective and op, whether it gave a
    weight, the value as text (each leaf's shape and dtype, in its structure), that text
    with every leaf as ``*``, each leaf's text and each leaf's place (``[0]['w']``)."""

    kind: str
    op: str
    weighted: bool
    text: str
    skeleton: str
    leaves: tuple
    paths: tuple


def leaf_text(x) -> str:
    """``x``'s shape and dtype (``(3,) float32``), or its type's name for a number."""
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return type(x).__name__
    try:
        dtype = np.dtype(dtype)
    except TypeError:  # (a framework's own dtype)
        pass
    return f"{tuple(shape)} {dtype}"


def of_array(kind: str, op: str, x) -> Passed:
    """What a rank passed that gave ``kind`` (``"allreduce"``...) one array ``x``."""
    text = leaf_text(x)
    return Passed(kind, op, False, text, "*", (text,), ("",))


def of_value(op: str, weighted: bool, template: Any, leaves: list) -> Passed:
    """What a rank passed that gave ``allreduce`` a value of ``_tree`` ``template`` and
    ``leaves`` (one array: template None)."""
    texts = [leaf_text(x) for x in leaves]
    paths: list = []
    text = _shown(template, iter(texts), paths, "")
    return Passed("allreduce", op, weighted, text,
                  _shown(template, iter(["*"] * len(texts)), [], ""), tuple(texts), tuple(paths))


def _shown(template: Any, leaves: Iterator[str], paths: list, at: str) -> str:
    """A structure of ``template`` as text, its leaves' texts in their places (each place
    appended to ``paths``)."""
    if template is None:
        paths.append(at)
        return next(leaves)
    kind, items = template
    if kind == "dict":
        return "{" + ", ".join(f"{key!r}: {_shown(t, leaves, paths, f'{at}[{key!r}]')}"
                               for key, t in items) + "}"
    inner = ", ".join(_shown(t, leaves, paths, f"{at}[{i}]") for i, t in enumerate(items))
    if kind == "list":
        return f"[{inner}]"
    if kind == "tuple":
        return f"({inner},)" if len(items) == 1 else f"({inner})"
    return f"{getattr(kind, '__name__', 'tuple')}({inner})"


def named(error: ValueError, mine: Passed | None,
          exchange: Callable[[Any], list]) -> ValueError:
    """The error of ranks that disagree, found here as ``error``, naming what each passed
    (``exchange(mine)`` gives every rank's, in rank order, under the collective's tag); else
    ``error`` (no longer a disagreement) where the exchange fails or names nothing. Needed
    since a transport sees a part only (a peer's chunk, a fused structure's digest); every
    rank finds the disagreement (each way's rule), so every rank takes part."""
    _reduction.settled(error)  # (named once)
    try:
        everyone = exchange(mine)
    except Exception:  # (a rank failed or left meanwhile: its own error is the call's)
        return error
    return described(everyone) or error


def described(everyone: list) -> ValueError | None:
    """The error naming what each rank passed (``everyone``: each rank's ``Passed``, in
    rank order); None where they are alike or one is unknown."""
    if any(type(p) is not Passed for p in everyone) or len(set(everyone)) == 1:
        return None
    first = everyone[0]
    if any((p.kind, p.op) != (first.kind, first.op) for p in everyone):
        listing = ", ".join(f"rank {r}: {p.kind} {p.op}" for r, p in enumerate(everyone))
        return ValueError(f"the ranks called different collectives at the same point "
                          f"({listing}); every rank must call the same collectives, with the "
                          "same op and root, in the same order")
    if any(p.weighted != first.weighted for p in everyone):
        given = [r for r, p in enumerate(everyone) if p.weighted]
        missing = [r for r, p in enumerate(everyone) if not p.weighted]
        return ValueError(f"the ranks passed different weights to {first.kind} {first.op}: "
                          f"rank(s) {given} gave weight= and others not (rank(s) {missing}); "
                          "give every rank its weight (0 for a rank with no rows), or none")
    if all(p.skeleton == "*" for p in everyone):
        return ValueError(_reduction.arrays_differ(first.op, ", ".join(
            f"rank {r}: {p.text}" for r, p in enumerate(everyone))))
    return ValueError(f"the ranks passed different structures to {first.kind} "
                      f"({_structures(everyone)}); every rank must pass the same structure: "
                      "the same keys, shapes and dtypes")


def _structures(everyone: list) -> str:
    """Each rank's structure, or, where they are long and alike but for their leaves, the
    first leaf that differs on each rank."""
    if max(len(p.text) for p in everyone) <= _LONG:
        return ", ".join(f"rank {r}: {p.text}" for r, p in enumerate(everyone))
    first = everyone[0]
    if all(p.skeleton == first.skeleton for p in everyone):
        for i, path in enumerate(first.paths):
            if any(p.leaves[i] != first.leaves[i] for p in everyone):
                return f"at {path}: " + ", ".join(f"rank {r}: {p.leaves[i]}"
                                                  for r, p in enumerate(everyone))
    return ", ".join(f"rank {r}: {p.text[:_LONG]}{'...' if len(p.text) > _LONG else ''}"
                     for r, p in enumerate(everyone))
