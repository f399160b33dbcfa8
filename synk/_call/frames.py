"""torch tensors and JAX arrays in a call: they travel as numpy arrays with their frames
(``synk._arrays.Frame``); ``fn`` gets its rows, and the caller its outputs, back in their
framework, dtype and device. A call with no framework value has no frames (None).
"""
from __future__ import annotations

import warnings

import numpy as np

from .. import _arrays, _tree
from .._process import PROCESS
from .._wire.arrays import read_only
from ..errors import outside_synk
from .ops import HOST, PLAIN_OUTPUTS, combine_slices


def native_input(value, label: str = "") -> tuple:
    """``(value as numpy, frame)`` of an argument (``label``: its name, for a warning): a framework
    value (or a structure holding some) becomes numpy on the host (frame None for anything else)."""
    if type(value) is np.ndarray:
        return value, None
    native, frames = _arrays.natives(value)
    if frames is None:
        return value, None
    if any(isinstance(f, _arrays.Frame) and f.grad for f in _tree.flatten(frames)[0]):
        warnings.warn(NO_GRADIENT_PATH.format(label=label or "an argument"), UserWarning,
                      stacklevel=outside_synk())
    return _host(native), frames


NO_GRADIENT_PATH = (
    "synk.function: {label} is a torch tensor that requires grad, but a synk call gives back "
    "values, not a path for gradients: its result will not lead back to {label} (backward() "
    "would say only 'element 0 of tensors does not require grad'). Take gradients inside "
    "the function (loss.backward() or torch.autograd.grad there; synk.comm's collectives "
    "carry them between the ranks), or pass {label}.detach() to say that none are wanted")

def _host(tree):
    """``tree`` with device arrays (a CUDA tensor's CuPy view) copied to the host."""
    if isinstance(tree, (list, tuple, dict)):
        leaves, template = _tree.flatten(tree)
        return _tree.rebuild(template, iter([_arrays.host(leaf) for leaf in leaves]))
    return _arrays.host(tree)


def framed_arguments(args, kwargs, frames, device=None, copies: list | None = None) -> tuple:
    """``args`` and ``kwargs`` (as a rank gives them to ``fn``) with the framed ones back in
    their framework (``device``: the rank's, for its device arrays). ``copies``: where to
    note ``(tensor, array)`` for each torch tensor given as a copy of its array rather than
    a view of it (``share.run_pieces`` copies its updates back into the array)."""
    positions, keys = frames
    views = PROCESS.replica_views
    views.clear()  # (the last call's)
    replicas = {id(v): sid for sid, v in PROCESS.replicas.copy().items()}

    def restored(value, frame):
        sid = replicas.get(id(value))
        if sid is None:
            given = _arrays.restores(value, frame, device)
            if copies is not None and _is_torch(given) and not shares_memory(given, value):
                copies.append((given, value))
            return given
        if getattr(frame, "kind", None) == "jax":  # (never the replica's memory itself)
            given = _jax_replica(sid, value, frame, device, views)
            views[id(given)] = (sid, given, True)
        else:  # a replica: synk.assign finds it; a copy is written back
            given = _arrays.restores(value, frame, device)
            views[id(given)] = (sid, given, not shares_memory(given, value))
        return given

    if positions:
        args = list(args)
        for i, frame in positions.items():
            args[i] = restored(args[i], frame)
    if keys:
        kwargs = dict(kwargs)
        for key, frame in keys.items():
            kwargs[key] = restored(kwargs[key], frame)
    return args, kwargs


def _jax_replica(sid: int, value, frame, device, views: dict):
    """What ``fn`` gets of JAX replica ``sid``: a copy, since ``synk.assign`` writes the replica
    while ``fn`` may keep it. On the host, the last call's JAX array while the replica holds its
    exact bytes (comparing 100 KB is cheaper than a new array), never one given for another
    replica in this call (``views``): ``synk.assign`` tells them apart by it."""
    if not isinstance(value, np.ndarray):
        return _arrays.restores(value.copy(), frame, device)
    kept = PROCESS.replica_arrays.get(sid)
    if kept is not None and views.get(id(kept.array), (sid,))[0] == sid and kept.holds(value):
        return kept.array
    given = _arrays.restores(read_only(value), frame, device)
    PROCESS.replica_arrays[sid] = _arrays.jax_kept(given, kept)
    return given


def shares_memory(given, value) -> bool:
    """Whether the framework value ``given`` (a torch tensor, a JAX array) is the memory of
    ``value`` (a numpy or CuPy array) itself."""
    try:
        pointer = given.data_ptr() if hasattr(given, "data_ptr") else \
            given.unsafe_buffer_pointer()
    except Exception:
        return False
    where = value.data.ptr if hasattr(value, "data") and hasattr(value.data, "ptr") else \
        value.__array_interface__["data"][0]
    return pointer == where


def _is_torch(value) -> bool:
    return type(value).__module__.startswith("torch") and _arrays.adapter_of(value) is not None


def write_back(device=None) -> None:
    """After ``fn``: each replica it got as a torch tensor that is a copy (where torch
    cannot view the device's memory) gets the tensor's value back, so that updates in
    place persist as they do in the replica's own memory."""
    for sid, given, copy in PROCESS.replica_views.values():
        if copy and _is_torch(given):
            store(sid, given, device)


def store(sid: int, value, device=None) -> None:
    """``value`` (a framework value, or numpy) into this rank's replica ``sid``, in place."""
    replica = PROCESS.replicas[sid]
    kept = PROCESS.replica_arrays.pop(sid, None)
    if kept is not None and type(replica) is np.ndarray:
        kept = kept.successor(value)
        if kept is not None:
            # a JAX array on the host like the one fn got: fn gets it at the next call if
            # the replica still holds exactly its bytes then
            replica[...] = kept.host
            PROCESS.replica_arrays[sid] = kept
            return
    copy_into(replica, value, device)


def copy_into(target, value, device=None) -> None:
    """``value`` (a framework value, or numpy) into the array ``target``, in place."""
    native = _arrays.host(_arrays.native(value)[0])
    if device is not None and not device.is_host and device.is_device_array(target):
        target[...] = device.to_device(np.ascontiguousarray(native, dtype=target.dtype))
    else:
        target[...] = native


def native_outputs(results: list, on_host: bool = False) -> tuple:
    """``[(weight, fn's value)]`` with framework values as numpy or CuPy arrays (bfloat16 as
    float32, exactly), and the frames of the outputs: one per output (a structure of them
    for a list, tuple or dict), or None when no output is a framework value. ``on_host``
    (a CPU rank): GPU values as host copies; their frames give them back on the GPU."""
    for _, value in results:
        if type(value) not in PLAIN_OUTPUTS and _arrays.framed(value):
            break
    else:
        return results, None
    converted, frames = [], None
    for weight, value in results:
        multi = isinstance(value, tuple)
        outs = value if multi else (value,)
        pairs = [_arrays.natives(out, math=True) for out in outs]
        mine = tuple(f for _, f in pairs)
        if frames is None and any(f is not None for f in mine):
            frames = mine
        natives = tuple(_host(n) if on_host else n for n, _ in pairs)
        converted.append((weight, natives if multi else natives[0]))
    return converted, frames


def framed_share(results: list, reduce, fname: str, listed: bool, values=HOST):
    """The ``Share`` ``ops.combine_slices`` makes of ``results`` (``[(weight, fn's
    value)]``), the framework outputs combined as numpy (or CuPy) arrays and their frames
    noted in it, one per entry of its outputs (on a CPU rank, ``values`` the host's:
    ``native_outputs``' ``on_host``)."""
    results, frames = native_outputs(results, values is HOST)
    share = combine_slices(results, reduce, fname, listed, values)
    if frames is None:
        return share
    if share.templates is not None:  # per leaf for outputs combined leaf by leaf
        leaves: list = []
        for frame, template in zip(frames, share.templates):
            if template is None:
                leaves.append(frame)
            else:
                n = _tree.count(template)
                leaves += _tree.flatten(frame)[0] if frame is not None else [None] * n
        frames = tuple(leaves)
    return share._replace(frames=frames)


def restore_outputs(results: list, frames: tuple, ops) -> list:
    """The combined outputs (``results``, one per entry) back in their frameworks; an output
    with op None is a list with each rank's (or piece's) value."""
    out = []
    for value, frame, op in zip(results, frames, ops):
        if frame is None:
            out.append(value)
        elif op is None and isinstance(value, list):
            out.append([_restore_kept(v, frame) for v in value])
        else:
            out.append(_arrays.restores(value, frame))
    return out


def _restore_kept(value, frame):
    if isinstance(value, list) and not isinstance(frame, list):  # (each piece's, listed)
        return [_arrays.restores(v, frame) for v in value]
    return _arrays.restores(value, frame)
