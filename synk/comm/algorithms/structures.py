"""A structure of arrays (a list, tuple or dict, nested) in one buffer, for ``broadcast``
and ``allgather`` of structures (``moves``): every leaf travels in one collective in all,
as ``allreduce``'s leaves do (``fused``).

::

    sender    tree --describe--> its description --pack--> one buffer (leaves _ALIGN'ed)
                   --host_message--> on the host: one message, the pickled description first
    receiver  --read_message, unpack--> the structure around views of the buffer, no copy
"""
from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from ... import _reduction, _tree
from ..._wire.arrays import dtype_token, dumps
from ..communicator import message_offsets

_ALIGN = 16
MARK = "synk_structure"  # field name that marks a host message holding a structure
STRUCTURES = (list, tuple, dict)


def _offsets(specs) -> tuple[list, int]:
    """Where each leaf of ``specs`` [(shape, dtype)] starts in the buffer, and its size: a
    multiple of ``_ALIGN`` too, so that in an allgather's joined buffers every rank's, and
    so every leaf, starts aligned (a CUDA kernel reading a misaligned element corrupts the
    device's context)."""
    sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
             for shape, dtype in specs]
    offsets, at = message_offsets(0, sizes, _ALIGN)
    return offsets, at + -at % _ALIGN


def describe(tree, comm) -> tuple:
    """(description, leaves as arrays of ``comm``'s, each leaf's kind of value)."""
    leaves, template = _tree.flatten(tree)
    arrays = [comm.xp.asarray(leaf, order="C") for leaf in leaves]
    specs = [(tuple(a.shape), dtype_token(a.dtype)) for a in arrays]
    return (template, specs, [int(_reduction.kind_of(leaf)) for leaf in leaves]), arrays


def pack(xp, arrays: list, specs) -> Any:
    """The leaves' bytes in one uint8 buffer of ``xp`` (a numpy or CuPy array), one after
    another, each at a multiple of ``_ALIGN`` bytes, so that the receiver reads every leaf
    as a view of it, without a copy (``unpack``)."""
    offsets, total = _offsets(specs)
    buffer = xp.empty(total, xp.uint8)
    for a, at in zip(arrays, offsets):
        if a.nbytes:
            buffer[at:at + a.nbytes] = a.reshape(-1).view(xp.uint8)
    return buffer


def unpack(buffer, description, restore: bool = True):
    """The structure of ``description`` around views of ``buffer`` (numbers back as
    numbers when ``restore``)."""
    template, specs, kinds = description
    offsets, _ = _offsets(specs)
    leaves = []
    for (shape, dtype), at, kind in zip(specs, offsets, kinds):
        dtype = np.dtype(dtype)
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        leaf = buffer[at:at + size].view(dtype).reshape(shape)
        leaves.append(_reduction.restore_kind(leaf, kind) if restore else leaf)
    return _tree.rebuild(template, iter(leaves))


def host_message(description, buffer: np.ndarray) -> np.ndarray:
    """One host message: the pickled description's length (8 bytes), the description,
    padding, then the buffer."""
    head = dumps(description, "a structure's description")  # (a script's named tuple too)
    start = 8 + len(head)
    start += -start % _ALIGN
    message = np.empty(start + buffer.nbytes, np.uint8)
    message[:8] = np.frombuffer(np.int64(len(head)).tobytes(), np.uint8)
    message[8:8 + len(head)] = np.frombuffer(head, np.uint8)
    message[start:] = buffer
    return message.view([(MARK, "u1")])


def read_message(message: np.ndarray) -> tuple:
    """(description, buffer) of a ``host_message``; the buffer a view of the message."""
    raw = message.view(np.uint8).reshape(-1)
    length = int(raw[:8].view(np.int64)[0])
    description = pickle.loads(raw[8:8 + length].tobytes())
    start = 8 + length
    return description, raw[start + -start % _ALIGN:]
