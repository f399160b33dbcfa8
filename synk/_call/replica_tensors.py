"""torch tensors over replicas: a module's parameters and buffers as shared variables, each
tensor pointed at its rank's replica of its variable::

    synk.shared(module)   each tensor -> rank 0's replica (register)
    shipping              pickled as its variable (reduce_tensor) -> a tensor over each
                          rank's replica (rank_tensor)
    each share            pointed again (point_at_replicas); copies written back (write_back)
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

from .. import _arrays
from .._process import PROCESS
from .frames import shares_memory, store


class TensorEntry:
    """A registered tensor: a weak reference to it, its variable's id (and the variable itself in
    the master, kept alive with it), the replica it views now, whether it holds a copy of that
    replica rather than a view, and the address of the memory synk gave it (``followed``)."""

    __slots__ = ("tensor", "sid", "variable", "frame", "replica", "copied", "pointer")

    def __init__(self, tensor, sid: int, variable, frame) -> None:
        self.tensor = weakref.ref(tensor, functools.partial(_forget, id(tensor)))
        self.sid, self.variable, self.frame = sid, variable, frame
        self.replica: Any = None
        self.copied = False
        self.pointer = 0


def _forget(key: int, _dead=None) -> None:
    PROCESS.replica_tensors.pop(key, None)


def register(tensor, variable, frame) -> None:
    """Point ``tensor`` (a parameter or buffer) at the replica of ``variable`` in this
    process (``tensor.data``), and keep it pointed there: ``synk.shared(module)`` makes each
    parameter and buffer of a torch module a shared variable and registers its tensor here."""
    entry = TensorEntry(tensor, variable.id, variable, frame)  # (the entry keeps the
    PROCESS.replica_tensors[id(tensor)] = entry  # variable alive while the tensor lives)
    _point(entry, tensor, None)


def is_registered(value) -> bool:
    """Whether ``value`` is a registered tensor that still holds the memory synk gave it
    (one given other memory since is shared anew by ``synk.shared(module)``)."""
    entry = PROCESS.replica_tensors.get(id(value))
    return entry is not None and entry.tensor() is value and (
        entry.variable is None or value.data_ptr() == entry.pointer)


def in_module(value) -> bool:
    """Whether ``value`` is a torch module with registered tensors (a shared module)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module) and any(
        is_registered(t) for t in [*value.parameters(), *value.buffers()])


def passed_module(what: str) -> TypeError:
    """The error of a shared module passed to a call or bound to a step (``what``)."""
    return TypeError(
        f"{what} is a shared torch module (synk.shared(module)): it reaches each rank "
        "through the function that captures it, with that rank's replicas as its "
        "parameters; use it from the function's closure or globals (or an object the "
        "function holds) rather than passing or binding it")


def variables_of(module) -> list:
    """The shared variables of a module's registered parameters and buffers, in order
    (each once)."""
    found: dict = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        entry = PROCESS.replica_tensors.get(id(tensor))
        if entry is not None and entry.tensor() is tensor and entry.variable is not None:
            found.setdefault(entry.sid, entry.variable)
    return list(found.values())


def reduce_tensor(obj, found: dict):
    """How shipping pickles ``obj`` if it is a registered tensor: as its variable, rebuilt by
    ``rank_tensor`` on each rank (its variable noted in ``found``); else None. So each rank's copy
    of a module a function captures computes on, and updates in place, that rank's replicas."""
    entry = PROCESS.replica_tensors.get(id(obj))
    if entry is None or entry.tensor() is not obj:
        return None
    found[entry.sid] = entry.variable
    parameter = type(obj).__name__ == "Parameter"
    return rank_tensor, (entry.sid, entry.frame, parameter, bool(obj.requires_grad))


def rank_tensor(sid: int, frame, parameter: bool, requires_grad: bool):
    """On a rank: a tensor of the master's kind over its replica of variable ``sid`` (a
    ``Parameter`` where the master's was one), registered here."""
    import torch

    value = _arrays.restore(PROCESS.replicas[sid], frame)
    tensor = torch.nn.Parameter(value, requires_grad=requires_grad) if parameter else value
    entry = TensorEntry(tensor, sid, None, frame)
    PROCESS.replica_tensors[id(tensor)] = entry
    entry.replica = PROCESS.replicas[sid]
    entry.copied = not shares_memory(tensor, entry.replica)
    return tensor


def point_at_replicas(device=None) -> list:
    """Before a share: point every registered tensor of this process at its replica as it is now (a
    replica can be replaced by another array); returns the entries given a copy instead (where the
    framework cannot view the replica, e.g. a GPU replica under the simulator), which ``write_back``
    writes back when the share ends (on the master before each call too, ``copies_held``)."""
    copies = []
    for entry in list(PROCESS.replica_tensors.values()):
        tensor = entry.tensor()
        replica = PROCESS.replicas.get(entry.sid)
        if tensor is None or replica is None:
            continue
        if replica is not entry.replica or entry.copied:
            _point(entry, tensor, device)
        if entry.copied:
            copies.append(entry)
    return copies


def check_followed() -> None:
    """Before a call, on the master: ``TypeError`` where a shared module's tensor no longer
    holds the memory synk gave it (``module.float()``, ``.to()``, ``.cuda()``, or an
    assignment to ``.data`` after ``synk.shared(module)``): its replicas would no longer
    follow it, and the ranks would compute on different values."""
    for entry in list(PROCESS.replica_tensors.values()):
        tensor = entry.tensor()
        if tensor is None or is_registered(tensor):
            continue
        raise TypeError(
            f"a tensor of a shared torch module (shared variable {entry.variable.name!r}) "
            "was given other memory after synk.shared(module) (module.float(), .double(), "
            ".to(), .cuda(), or an assignment to its .data): its ranks' replicas no longer "
            "follow it. Convert or move the module before sharing it, or share it again "
            "(synk.shared(module)) after the change")


def copies_held() -> list:
    """The entries of this process's tensors that hold copies of their replicas: on the
    master, written back before each call (``share``), so that what the master did to
    them between calls is in its replicas when the call looks for changes and ships."""
    return [e for e in PROCESS.replica_tensors.values() if e.copied]


def write_back(copies: list, device=None) -> None:
    """After a share: the tensors that hold copies of their replicas written into them
    (``device``: the rank's)."""
    for entry in copies:
        tensor = entry.tensor()
        if tensor is not None and entry.sid in PROCESS.replicas:
            store(entry.sid, tensor.detach(), device)


def _point(entry: TensorEntry, tensor, device) -> None:
    import torch

    replica = PROCESS.replicas[entry.sid]
    value = _arrays.restore(replica, entry.frame, device)
    with torch.no_grad():
        tensor.data = value
    entry.replica, entry.copied = replica, not shares_memory(value, replica)
    entry.pointer = tensor.data_ptr()
