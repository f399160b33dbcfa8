"""Structures of arrays (a list, tuple or dict, nested), such as a model's gradients: taken
apart into leaves and a template (``flatten``) and put back together (``rebuild``), by every
part of synk that combines them leaf by leaf (``synk.comm.allreduce``, a function's
structured outputs).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple


class Flat(NamedTuple):
    """A value taken apart once, where a collective takes it (``apart``): the value itself,
    its leaves and its template; what follows reads these, never the value again."""

    value: Any
    leaves: list
    structure: Any


def apart(value: Any) -> Flat:
    """``value`` with its leaves and template (``flatten``)."""
    leaves, structure = flatten(value)
    return Flat(value, leaves, structure)


def flatten(value: Any) -> tuple[list, Any]:
    """(leaves, template) of ``value``; a value that is no list, tuple or dict is a leaf.

    A template describes a structure without its leaves: None for a leaf, else ``(kind,
    items)`` with kind ``"list"``, ``"tuple"``, ``"dict"`` (a dict's items are ``(key,
    template)`` pairs, in its order) or, for a named tuple, its class. Templates pickle small
    (a named tuple's class by reference, or by value when it lives in a script) and rebuild
    anywhere; equal templates mean equal structures. Other tuple subclasses come back as
    tuples, dict subclasses as dicts."""
    plain = type(value)
    if plain is list or plain is tuple:  # (a flat one, such as a model's gradients, in short)
        for item in value:
            if isinstance(item, (list, tuple, dict)):
                break
        else:
            return list(value), ("list" if plain is list else "tuple", (None,) * len(value))
    if isinstance(value, dict):
        leaves: list = []
        items: list = []
        for key, item in value.items():
            sub, template = flatten(item)
            leaves += sub
            items.append((key, template))
        return leaves, ("dict", tuple(items))
    if isinstance(value, (list, tuple)):
        leaves, items = [], []
        for item in value:
            sub, template = flatten(item)
            leaves += sub
            items.append(template)
        if isinstance(value, list):
            kind: Any = "list"
        else:
            kind = type(value) if hasattr(value, "_fields") else "tuple"
        return leaves, (kind, tuple(items))
    return [value], None


def map_leaves(value: Any, leaf: Callable, deepest: float = math.inf, depth: int = 0) -> Any:
    """``value`` with ``leaf`` applied to what lists, tuples (named ones too) and dicts hold,
    nested to ``deepest`` levels, in new containers of the same kinds; else ``leaf(value)``."""
    kind = type(value)
    if depth > deepest:
        return leaf(value)
    if kind is list:
        return [map_leaves(v, leaf, deepest, depth + 1) for v in value]
    if isinstance(value, tuple):
        items = [map_leaves(v, leaf, deepest, depth + 1) for v in value]
        return kind(*items) if hasattr(value, "_fields") else kind(items)
    if isinstance(value, dict):
        mapped = value.copy()
        for key, v in value.items():
            mapped[key] = map_leaves(v, leaf, deepest, depth + 1)
        return mapped
    return leaf(value)


def count(template: Any) -> int:
    """How many leaves a structure with ``template`` has."""
    if template is None:
        return 1
    kind, items = template
    if kind != "dict" and None in items and items.count(None) == len(items):
        return len(items)  # (a flat list or tuple)
    if kind == "dict":
        return sum(count(t) for _, t in items)
    return sum(count(t) for t in items)


def rebuild(template: Any, leaves: Iterator) -> Any:
    """The structure of ``template`` around ``leaves`` (an iterator, consumed in order)."""
    if template is None:
        return next(leaves)
    kind, items = template
    if kind == "dict":
        return {key: rebuild(t, leaves) for key, t in items}
    built = [rebuild(t, leaves) for t in items]
    if kind == "list":
        return built
    return tuple(built) if kind == "tuple" else kind(*built)
