"""A communicator for GPU ranks without NCCL between them: device arrays staged through the
host, where the call's host communicator runs the collective.

::

    device array -> the host (copied on the caller's stream) -> HostCommunicator's collective
                 -> the result back on the device (on the caller's stream)
"""
from __future__ import annotations

import numpy as np

from ... import _reduction
from ..communicator import Communicator, Packed
from ..handle import Handle


class StagedCommunicator(Communicator):
    """One GPU rank's end of the host-staged communicator, chosen at ``fork()`` where ranks
    share a GPU and NCCL cannot take them (before 2.30, or refusing), and for one GPU rank
    alone. NCCL's answers by numpy's rules, at host speed; the non-blocking forms complete
    before returning; only inside a call (its host communicator is the call's)."""

    combines_outputs = "replies"  # the outputs come to the host, as on CPU ranks

    def __init__(self, device, size: int, rank: int) -> None:
        self.device, self.xp, self.size, self.rank = device, device.xp, int(size), int(rank)

    @classmethod
    def join(cls, device, how: tuple, size: int, rank: int, **_) -> StagedCommunicator:
        """This rank's end (``how``: ("staged",); nothing to connect)."""
        return cls(device, size, rank)

    def to_host(self, x) -> np.ndarray:
        """``x`` copied to the host on the stream current at the call (the caller's)."""
        return np.asarray(self.device.to_host(x, stream=self.device.current_stream()),
                          order="C")  # (numpy's ascontiguousarray makes a 0-d array 1-d)

    def _back(self, result):
        """``result`` on the device, copied on the stream current at the call."""
        return self.device.to_device(np.asarray(result), self.device.current_stream())

    def supports(self, dtype, op: str) -> bool:
        return self.host.supports(dtype, op)

    def allreduce(self, x, op: str = "sum", *, weights: list | None = None, out=None):
        if self.size == 1:
            return self.xp.array(_reduction.combine(op, [(1, x)], self.xp), copy=True)
        return self._back(self.host.allreduce(self.to_host(x), op, weights=weights))

    def allreduce_many(self, packed: Packed, op: str, agree, wait: bool = True,
                       label: str | None = None):
        results = self.host.allreduce_many(
            Packed(packed.head, [self.to_host(b) for b in packed.buffers],
                   weighted=packed.weighted, passed=packed.passed), op, agree, label=label)
        results = [self._back(r) for r in results]
        return results if wait else Handle.done(results)

    def reduce(self, x, op: str = "sum", root: int = 0, *, weights: list | None = None):
        result = self.host.reduce(self.to_host(x), op, root, weights=weights)
        return None if result is None else self._back(result)

    def gather(self, x, counts: list, root: int = 0, *, tail=(), dtype=None):
        dtype = x.dtype if dtype is None else dtype
        mine = None if x is None else self.to_host(x)
        result = self.host.gather(mine, counts, root, tail=tail, dtype=dtype)
        return None if result is None else self._back(result)

    def scatter(self, parts, root: int, shape, dtype):
        if parts is not None:
            parts = [self.to_host(p) if self.device.is_device_array(p) else p for p in parts]
        return self._back(self.host.scatter(parts, root, shape, dtype))

    def broadcast(self, x, root: int = 0, *, shape=None, dtype=None, out=None):
        if self.size == 1:
            return x
        mine = self.to_host(x) if self.rank == root else None
        return self._back(self.host.broadcast(mine, root))

    def allgather(self, x, counts=None, out=None):
        if self.size == 1:
            return self.xp.atleast_1d(self.xp.array(x, copy=True))
        return self._back(self.host.allgather(self.to_host(x)))

    def reduce_scatter(self, x, op: str = "sum", bounds=None, out=None):
        if self.size == 1:
            return self.allreduce(x, op)
        return self._back(self.host.reduce_scatter(self.to_host(x), op, bounds))

    def alltoall(self, parts: list, specs: list) -> list:
        got = self.host.alltoall([self.to_host(p) for p in parts], specs)
        return [self._back(g) for g in got]

    def barrier(self) -> None:
        self.host.barrier()

    def abort(self, reason: str = "aborted") -> None:
        pass  # nothing of its own waits: the host communicator's waits end with the call
