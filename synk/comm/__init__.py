"""``synk.comm``: communication between the ranks from inside a synk function.

Call these only inside a function wrapped with ``synk.function``, while it runs: every
rank of the call takes part. Collectives must be called by every rank, in the same order.
Messages belong to their call: what one call sent cannot be received by the next.

    def step(x, w):
        g = grad(x, w)                      # this rank's rows
        g = synk.comm.allreduce(g, "sum")   # summed over every rank
        w -= lr * g

On CPU ranks a socketpair joins every two ranks, served by a progress thread in each rank,
and arrays of 64 KiB and more travel through shared memory (``_shm_channel``): the receiver
reads them where the sender put them. On GPU ranks, device arrays are reduced and gathered
on NCCL, on the rank's stream, and come back as device arrays (see ``_device``); numpy
arrays still take the host transport.
If a rank's function raises, the other ranks' waits in that call raise ``CommAborted``.
A rank that skips a collective makes the others wait: give the call a ``timeout=``.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .._reduction import canonical
from . import _collectives as _c, _device, _fused
from ._context import current as _current, next_tag as _next_tag, require as _require
from ._mesh import _WAIT_SLICE, CommAborted, CommError

__all__ = [
    "rank", "size", "allreduce", "broadcast", "allgather", "reduce_scatter", "send", "recv",
    "iallreduce", "ibroadcast", "iallgather", "ireduce_scatter", "isend", "irecv", "barrier",
    "Handle", "CommError", "CommAborted",
]


class Handle:
    """A non-blocking operation under way, returned by the ``i...`` forms.

    Do not change an array being sent until ``wait()`` has returned.
    """

    def __init__(self, wait) -> None:
        self._wait, self._done, self._result = wait, False, None

    def wait(self):
        """Finish the operation and return its result (the same result on every call)."""
        if not self._done:
            self._result, self._done = self._wait(), True
        return self._result


def _in_background(fn, *args) -> Handle:
    box: dict = {}

    def run():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # handed to wait()
            box["error"] = exc

    thread = threading.Thread(target=run, name="synk-comm-op", daemon=True)
    thread.start()

    def wait():
        while thread.is_alive():
            thread.join(_WAIT_SLICE)  # in slices, so that an interrupt of the master lands
        if "error" in box:
            raise box["error"]
        return box["result"]

    return Handle(wait)


def _args(what: str):
    c = _require(what)
    return c.mesh, c.rank, c.size


def rank() -> int:
    """This rank's number in the running call (0 is the master)."""
    return _require("rank").rank


def size() -> int:
    """The number of ranks in the running call."""
    return _require("size").size


def _collective(what: str):
    mesh, r, n = _args(what)
    return mesh, r, n, _next_tag(what.removeprefix("i"))  # iallreduce matches allreduce


def _numbers(x, what: str) -> list:
    """The leaves of ``x`` (an array or a structure of them), each checked to hold numbers."""
    leaves = _fused.flatten(x)[0]
    for leaf in leaves:
        _c.check_numbers(leaf, what)
    return leaves


def _on_device(pending) -> Handle:
    """A Handle of an operation on device arrays, launched on the transport's stream: its
    ``wait()`` waits on the CUDA event recorded after it."""
    return Handle(pending.wait)


def allreduce(x: Any, op: str = "sum", *, weight: float | None = None) -> Any:
    """``x`` combined over every rank with ``op`` (``"sum"``, ``"prod"``, ``"max"``,
    ``"min"``, ``"mean"``), on every rank. Booleans sum to counts, as in numpy. A device
    array (GPU ranks) is reduced on NCCL and the result is a device array.

    ``x`` may also be a list, tuple or dict of arrays (nested too), such as a model's
    gradients: they are reduced in one fused buffer per dtype (one collective each, not
    one per array) and come back in the same structure. Every rank must pass the same
    structure.

    ``weight`` (with ``op="mean"``): this rank's share of the average, typically the rows
    it processed, so that uneven shares average exactly: the result is
    ``sum(weight_r * x_r) / sum(weight_r)``. A rank with weight 0 contributes nothing.
    Every mean, weighted or not, accumulates in float64 on every back end, GPU ranks
    included, and is cast back to ``x``'s float dtype (see "How mean is computed").

        grads = synk.comm.allreduce(grads, "mean", weight=len(x))

    Raises:
        ValueError: ``x`` has different shapes (or structures) on different ranks, ``op``
            is unknown, ``weight`` is given with another op, is negative or not finite,
            or is given on some ranks only, or the weights sum to 0.
        TypeError: an array is not numeric (bool, integers, floats, complex), or device
            and host arrays are mixed.
    """
    op = canonical(op)
    weight = _fused.check_weight(weight, op)
    mesh, r, n, tag = _collective("allreduce")
    _numbers(x, "allreduce")
    return _allreduce(mesh, r, n, tag, x, op, weight)


def _allreduce(mesh, r, n, tag, x, op, weight):
    if isinstance(x, (list, tuple, dict)) or op == "mean":  # (mean: weights agreed on)
        if _current.device is not None and not _current.device.is_host and any(
                _device.is_device(_current, leaf) for leaf in _fused.flatten(x)[0]):
            return _fused.allreduce_device(_current, tag, x, op, weight)
        return _fused.allreduce(mesh, r, n, tag, x, op, weight)
    if _device.is_device(_current, x):
        return _device.allreduce(_current, x, op)
    return _c.allreduce(mesh, r, n, tag, x, op)


def iallreduce(x: Any, op: str = "sum", *, weight: float | None = None) -> Handle:
    """Non-blocking ``allreduce`` (structures and ``weight`` as there); ``wait()`` returns
    the result. On device arrays the reduction runs on NCCL's own stream while the rank's
    stream computes, and ``wait()`` waits on the CUDA event recorded after it (the small
    exchange that checks structures and weights is done before returning)."""
    op = canonical(op)
    weight = _fused.check_weight(weight, op)
    mesh, r, n, tag = _collective("iallreduce")
    leaves = _numbers(x, "iallreduce")
    if _current.device is not None and not _current.device.is_host and any(
            _device.is_device(_current, leaf) for leaf in leaves):
        if isinstance(x, (list, tuple, dict)) or op == "mean":
            return _on_device(_fused.allreduce_device(_current, tag, x, op, weight, wait=False))
        return _on_device(_device.allreduce(_current, x, op, wait=False))
    return _in_background(_allreduce, mesh, r, n, tag, x, op, weight)


def broadcast(x, root: int = 0) -> np.ndarray:
    """Rank ``root``'s ``x`` on every rank (the others may pass None); a device array
    everywhere when it is one at the root."""
    mesh, r, n, tag = _collective("broadcast")
    if _current.device is not None and not _current.device.is_host:
        return _device.broadcast(_current, tag, x, root)
    return _c.broadcast(mesh, r, n, tag, x, root)


def ibroadcast(x, root: int = 0) -> Handle:
    """Non-blocking ``broadcast``; ``wait()`` returns the result."""
    mesh, r, n, tag = _collective("ibroadcast")
    if _current.device is not None and not _current.device.is_host:
        return _on_device(_device.broadcast(_current, tag, x, root, wait=False))
    return _in_background(_c.broadcast, mesh, r, n, tag, x, root)


def allgather(x) -> np.ndarray:
    """Every rank's ``x`` joined along axis 0 in rank order (lengths may differ; 0-d values
    become one row each), on every rank."""
    mesh, r, n, tag = _collective("allgather")
    if _device.is_device(_current, x):
        return _device.allgather(_current, x)
    return _c.allgather(mesh, r, n, tag, x)


def iallgather(x) -> Handle:
    """Non-blocking ``allgather``; ``wait()`` returns the result."""
    mesh, r, n, tag = _collective("iallgather")
    if _device.is_device(_current, x):
        return _on_device(_device.allgather(_current, x, wait=False))
    return _in_background(_c.allgather, mesh, r, n, tag, x)


def reduce_scatter(x, op: str = "sum") -> np.ndarray:
    """Split ``x`` along axis 0 into one part per rank (as synk splits rows); rank r gets
    part r combined over every rank with ``op``. ``x`` must be numeric (as for
    ``allreduce``), else TypeError."""
    op = canonical(op)
    mesh, r, n, tag = _collective("reduce_scatter")
    _c.check_numbers(x, "reduce_scatter")
    if _device.is_device(_current, x):
        return _device.reduce_scatter(_current, x, op)
    if n == 1:
        return _c._combine(op, [np.asarray(x)], [0])
    return _c.reduce_scatter(mesh, r, n, tag, x, op)


def ireduce_scatter(x, op: str = "sum") -> Handle:
    """Non-blocking ``reduce_scatter``; ``wait()`` returns the result."""
    op = canonical(op)
    mesh, r, n, tag = _collective("ireduce_scatter")
    _c.check_numbers(x, "ireduce_scatter")
    if _device.is_device(_current, x):
        return _on_device(_device.reduce_scatter(_current, x, op, wait=False))
    if n == 1:
        return Handle(lambda: _c._combine(op, [np.asarray(x)], [0]))
    return _in_background(_c.reduce_scatter, mesh, r, n, tag, x, op)


def barrier() -> None:
    """Wait until every rank of the call has reached this point."""
    mesh, r, n, tag = _collective("barrier")
    if n > 1:
        _c.barrier(mesh, r, n, tag)


def _p2p(what: str, peer: int, tag: int):
    mesh, r, n = _args(what)
    if not isinstance(peer, (int, np.integer)) or not 0 <= peer < n or peer == r:
        raise ValueError(f"synk.comm.{what}: rank {peer!r} is not another rank of this call "
                         f"(ranks 0..{n - 1}; this is rank {r})")
    return mesh, (_current.call_id, "p", tag)


def isend(x, dest: int, tag: int = 0) -> Handle:
    """Start sending array ``x`` to rank ``dest``; ``wait()`` returns once it is out.
    Do not change ``x`` before that. A device array is copied to the host first and
    arrives as a device array."""
    mesh, key = _p2p("isend", dest, tag)
    if _device.is_device(_current, x):
        x = _device.wrap(_current, x)
    send = mesh.post(dest, key, x)
    return Handle(lambda: mesh.wait_sent(send))


def send(x, dest: int, tag: int = 0) -> None:
    """Send array ``x`` to rank ``dest`` (matched by ``recv(source, tag)`` there)."""
    isend(x, dest, tag).wait()


def irecv(source: int, tag: int = 0) -> Handle:
    """Receive from rank ``source``; ``wait()`` returns the array."""
    mesh, key = _p2p("irecv", source, tag)
    context = _current
    return Handle(lambda: _device.unwrap(context, mesh.take(source, key)))


def recv(source: int, tag: int = 0) -> np.ndarray:
    """The next array sent to this rank by ``source`` with ``tag``, waiting for it."""
    return irecv(source, tag).wait()
