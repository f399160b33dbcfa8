"""How cloudpickle ships an object: a function or class by reference (the workers import
it) or by value, and whether plain pickle (the quicker) pickles something as cloudpickle
would. Used by the capture check (``reachable``)."""
from __future__ import annotations

import io
import pickle
import types

import cloudpickle

from .reachable_check import PROTOCOL


def pickled_by_reference(obj) -> bool:
    """Whether cloudpickle pickles the function or class ``obj`` by reference (the workers
    import it) rather than by value."""
    try:
        return cloudpickle.cloudpickle._should_pickle_by_reference(obj)
    except (AttributeError, TypeError):  # (an internal of cloudpickle's)
        return getattr(obj, "__module__", None) not in ("__main__", None)


def global_names(code) -> tuple:
    """The global names the code (and the code nested in it) reads, as cloudpickle finds
    them."""
    try:
        return tuple(cloudpickle.cloudpickle._extract_code_globals(code))
    except AttributeError:  # (an internal of cloudpickle's)
        names = list(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names += global_names(const)
        return tuple(dict.fromkeys(names))


class _Probe(pickle.Pickler):
    """Plain pickle, noting whether it met a function or class cloudpickle would pickle
    by value (which plain pickle pickles by name)."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=PROTOCOL)
        self.by_value = False

    def reducer_override(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and not pickled_by_reference(obj):
            self.by_value = True
        return NotImplemented


def plain_pickle_will_do(obj) -> bool:
    """Whether plain pickle pickles ``obj`` as cloudpickle ships it (the quicker one)."""
    probe = _Probe(io.BytesIO())
    try:
        probe.dump(obj)
    except Exception:
        return False
    return not probe.by_value
