"""A transport for GPU ranks without NCCL between them: device arrays staged through the host.

Chosen at ``fork()`` when several ranks share a GPU and NCCL cannot have them in one
communicator (NCCL before 2.30, or NCCL refusing). Each operation copies the rank's device
array to the host, runs the host transport's collective over the ranks' mesh (sockets for
small arrays, shared memory for large ones, read in place), and copies the result back to
the device: the same answers as NCCL's, by numpy's rules, at host speed. The non-blocking
forms complete before they return. Used only inside a call (the mesh belongs to it).
"""
from __future__ import annotations

import numpy as np

from . import _collectives as _c, _context
from ._transport import Communicator, register


class _Done:
    """A finished operation, as a handle."""

    def __init__(self, value) -> None:
        self._value = value

    def wait(self):
        return self._value


@register("staged")
class StagedTransport(Communicator):
    """One GPU rank's end of the host-staged transport."""

    combines_on_device = False  # outputs are combined on the host, as on CPU ranks

    def __init__(self, device, size: int, rank: int) -> None:
        self.device, self.size, self.rank = device, int(size), int(rank)

    def _host(self, x) -> np.ndarray:
        return np.ascontiguousarray(self.device.to_host(x))

    def _run(self, what: str, fn, *args):
        """``fn(mesh, rank, size, tag, *args)`` on the host; its result on the device."""
        mesh = _context.current.mesh if _context.current.active else None
        if mesh is None:
            raise RuntimeError(f"the staged transport's {what} runs only inside a call")
        result = fn(mesh, self.rank, self.size, _context.next_tag(f"staged {what}"), *args)
        return self.device.to_device(np.asarray(result))

    def allreduce(self, x, op: str = "sum"):
        return self._run("allreduce", _c.allreduce, self._host(x), op)

    def iallreduce(self, x, op: str = "sum"):
        return _Done(self.allreduce(x, op))

    def broadcast(self, x, root: int = 0, *, shape=None, dtype=None):
        mine = self._host(x) if self.rank == root else None
        return self._run("broadcast", _c.broadcast, mine, root)

    def ibroadcast(self, x, root: int = 0, *, shape=None, dtype=None):
        return _Done(self.broadcast(x, root, shape=shape, dtype=dtype))

    def allgather(self, x, counts=None):
        return self._run("allgather", _c.allgather, self._host(x))

    def iallgather(self, x, counts=None):
        return _Done(self.allgather(x))

    def reduce_scatter(self, x, op: str = "sum"):
        return self._run("reduce_scatter", _c.reduce_scatter, self._host(x), op)

    def ireduce_scatter(self, x, op: str = "sum"):
        return _Done(self.reduce_scatter(x, op))

    def send(self, x, peer: int) -> None:
        raise NotImplementedError("synk.comm.send sends device arrays through the host itself")

    def recv(self, peer: int, shape, dtype):
        raise NotImplementedError("synk.comm.recv receives device arrays through the host itself")

    def barrier(self) -> None:
        self._run("barrier", _c.allgather, np.empty(0))

    def abort(self, reason: str = "aborted") -> None:
        pass  # nothing of its own waits: the mesh's waits end with the call

    def close(self) -> None:
        pass
