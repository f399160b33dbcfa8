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
