"""Outputs that are structures: a list, tuple or dict of arrays (nested), such as a model's
gradients, reduced leaf by leaf and given back in the same structure.

A *template* describes a structure without its leaves: None for a leaf, else
``(kind, items)`` with kind ``"list"``, ``"tuple"`` or ``"dict"`` (a dict's items are
``(key, template)`` pairs, in its order). Templates pickle small and rebuild anywhere;
named tuples come back as plain tuples.
"""
from __future__ import annotations


def flatten(value) -> tuple[list, object]:
    """(leaves, template) of ``value``; a value that is no list, tuple or dict is a leaf."""
    if isinstance(value, dict):
        leaves, items = [], []
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
        return leaves, ("list" if isinstance(value, list) else "tuple", tuple(items))
    return [value], None


def count(template) -> int:
    """How many leaves a structure with ``template`` has."""
    if template is None:
        return 1
    kind, items = template
    if kind == "dict":
        return sum(count(t) for _, t in items)
    return sum(count(t) for t in items)


def rebuild(template, leaves):
    """The structure of ``template`` around ``leaves`` (an iterator, consumed in order)."""
    if template is None:
        return next(leaves)
    kind, items = template
    if kind == "dict":
        return {key: rebuild(t, leaves) for key, t in items}
    built = [rebuild(t, leaves) for t in items]
    return built if kind == "list" else tuple(built)
