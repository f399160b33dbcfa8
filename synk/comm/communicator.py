"""The one communicator interface (``Communicator``): one rank's end of a group's
communication for one kind of array, which ``synk.comm`` and synk's own exchanges are
written against, asking ``route`` for the communicator of the array at hand.

::

    synk.comm, algorithms --route--> Communicator  "host":   numpy arrays (shm mesh, MPI)
                                                   "nccl":   device arrays, on the GPUs
                                                   "staged": device arrays, through the host
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import numpy as np

from .handle import Handle
from .host.mailbox import ANY
from .status import Status


def usable(out, shape, dtype, reads: tuple = (), xp=np) -> bool:
    """Whether a result of ``shape`` and ``dtype`` can be written straight into ``out``: an
    array of ``xp`` (others are refused by ``deliver`` afterwards) apart from ``reads``, the
    host arrays it is computed from (the ranks' parts combine in rank order, so writing into
    an input would overwrite it before it is read: that one is copied)."""
    return (isinstance(out, xp.ndarray) and tuple(out.shape) == tuple(shape)
            and out.dtype == dtype and out.flags.c_contiguous
            and not any(np.may_share_memory(out, r) for r in reads))


class Packed:
    """The buffers of a fused collective (``fused``): a small int64 ``head`` every rank
    checks (the structure's digest, a weight) and one flat buffer per dtype (``buffers``,
    ``buffer_bytes``), packed on first use. ``message`` is one block of them (the head, then
    each buffer at a multiple of 64 bytes; ``nbytes``), or ``pack_into`` packs them into a
    block of the communicator's (the board's slot), so the data is copied once."""

    __slots__ = ("head", "buffer_bytes", "dtypes", "offsets", "nbytes", "pack_part", "_pack",
                 "_buffers", "_message", "weighted", "into", "passed")

    def __init__(self, head, buffers: list | None = None, *,
                 pack: Callable | None = None, pack_part: Callable | None = None,
                 buffer_bytes: list | None = None, dtypes: list | None = None,
                 offsets: list | None = None, nbytes: int = 0, weighted: bool = False,
                 passed: Callable | None = None) -> None:
        """Either ``buffers`` (``message`` is None then), or ``pack(block)``, which packs the head
        and buffers into ``block`` (``nbytes``, each buffer at ``offsets``; None: a block of its
        own) and returns ``(block, buffers)``, with ``pack_part(g, lo, hi, dest)``, which packs
        elements ``lo:hi`` of buffer ``g`` into ``dest`` (a reduce-scatter's chunk) and returns
        their head (its own where a mean's scaling underflowed). ``weighted``: a weighted mean's,
        whose factors the heads give. ``into`` (a blocking call's on the host): per buffer, the
        caller's ``out=`` arrays, ``[(first, end, flat array)]``, apart from each other and from
        unscaled inputs; a host communicator may write results there and give ``WRITTEN``.
        ``passed()``: what this rank passed (``passed.Passed``), to name it where the ranks
        disagree."""
        self.head, self._pack, self.pack_part = head, pack, pack_part
        self.weighted, self.passed = weighted, passed
        self.into: list | None = None
        self._buffers, self._message = buffers, None
        if buffers is not None:
            buffer_bytes, dtypes = [b.nbytes for b in buffers], [b.dtype for b in buffers]
        assert buffer_bytes is not None and dtypes is not None
        self.buffer_bytes, self.dtypes = buffer_bytes, dtypes
        if offsets is None:
            offsets, nbytes = message_offsets(head.nbytes, buffer_bytes)
        self.offsets, self.nbytes = offsets, nbytes

    @property
    def buffers(self) -> list:
        if self._buffers is None:
            self._packed()
        return self._buffers  # type: ignore[return-value]  # (packed now)

    @property
    def message(self):
        """The contiguous block of head and buffers, or None where there is none."""
        if self._buffers is None:
            self._packed()
        return self._message

    def _packed(self) -> None:
        assert self._pack is not None
        self._message, self._buffers = self._pack(None)

    @property
    def packs_into(self) -> bool:
        """Whether ``pack_into`` can put it in a block of the communicator's."""
        return self._pack is not None and self._buffers is None

    def pack_into(self, block) -> None:
        """Pack the head and buffers into ``block`` (``nbytes`` of uint8), which then holds
        them (``message``)."""
        assert self._pack is not None
        self._message, self._buffers = self._pack(block)


#: ``allreduce_many``'s result for a buffer it wrote into ``Packed.into``
WRITTEN = "written into the caller's arrays"


def message_offsets(head_bytes: int, buffers_bytes: list, align: int = 64) -> tuple[list, int]:
    """Where each buffer starts in a ``Packed.message`` (after the head, each at a multiple
    of ``align`` bytes: a cache line), and the message's size."""
    offsets, at = [], head_bytes
    for nbytes in buffers_bytes:
        at += -at % align
        offsets.append(at)
        at += nbytes
    return offsets, at


class Communicator(abc.ABC):
    """One rank's end of a group communicator; every rank calls its collectives in the same
    order. ``weights`` (of a ``"mean"``): every rank's, agreed beforehand, in rank order;
    None averages equally. ``out``: an array the result may be written into where it fits
    (``_out.usable``), else ``synk.comm`` copies it there. The ``i...`` forms return a
    ``Handle``; one a communicator cannot overlap completes before returning."""

    rank: int
    size: int
    xp: Any  # the array module of the arrays it moves (numpy, cupy)
    host: Any = None  # the running call's host communicator, which carries what a device
    # communicator stages through the host (small headers, point-to-point messages)
    # How functions' outputs are combined into the master: "replies" (the master combines
    # the replies, reading large ones in place) or "collectives" (a reduce or gather into
    # rank 0 inside the call). See synk._call.share.
    combines_outputs = "replies"
    # Whether the communicator sums the terms each rank scaled (by ``1 / size``, or a scale
    # of its weight) of a ``"mean"`` as they are (NCCL); else the parts reach the host's
    # combine, where a part sent as it is (its scaling underflowed, or it is a device's)
    # is scaled by ``_reduction``'s rule, which keeps a subnormal term's bits.
    prescaled_means = False
    # Every communicator raises the same ValueError on every rank where the ranks' arrays
    # differ in shape (NCCL's reductions by a check beside the operation: nccl_agree).
    @property
    def aborted(self) -> bool:
        """(NCCL's) Whether its communicator was aborted, so the ranks' must be renewed."""
        return False

    @property
    def poisoned(self) -> str | None:
        """(NCCL's) Why this rank's process must not be reused, or None."""
        return None

    @classmethod
    def join(cls, device, how: tuple, size: int, rank: int, *, deadline: float,
             should_stop=None, setup_stop=None, exit_when_poisoned: bool = False
             ) -> Communicator:
        """A device communicator's: this rank's end of the communicator ``how`` (its name,
        then what rank 0 made for the others), which every rank makes by ``deadline``."""
        raise NotImplementedError(f"{cls.__name__} is not a device communicator")

    @abc.abstractmethod
    def supports(self, dtype, op: str) -> bool:
        """Whether ``allreduce``/``reduce`` take arrays of ``dtype`` with ``op``."""

    @abc.abstractmethod
    def allreduce(self, x, op: str = "sum", *, weights: list | None = None, out=None):
        """``x`` combined over every rank with ``op``; every rank gets the result."""

    def iallreduce(self, x, op: str = "sum", *, weights: list | None = None,
                   out=None) -> Handle:
        return Handle.done(self.allreduce(x, op, weights=weights, out=out))

    @abc.abstractmethod
    def allreduce_many(self, packed: Packed, op: str, agree: Callable, wait: bool = True,
                       label: str | None = None):
        """Every rank's ``packed.head`` handed to ``agree`` (which raises if the ranks
        disagree, else gives the weights), then each of ``packed.buffers`` allreduced with
        them: the results, or (``wait=False``) a Handle. ``label``: the caller's op, to name
        the collective (``op`` may be a sum of a mean's scaled parts)."""

    @abc.abstractmethod
    def reduce(self, x, op: str = "sum", root: int = 0, *, weights: list | None = None):
        """``x`` combined over every rank with ``op``, on rank ``root`` (None elsewhere)."""

    def ireduce(self, x, op: str = "sum", root: int = 0, *,
                weights: list | None = None) -> Handle:
        return Handle.done(self.reduce(x, op, root, weights=weights))

    @abc.abstractmethod
    def gather(self, x, counts: list, root: int = 0, *, tail=(), dtype=None):
        """Every rank's rows (``counts[r]`` rows of shape ``tail`` and ``dtype`` from rank
        r; ``x`` None where it has none) joined along axis 0 in rank order, on rank
        ``root`` (None elsewhere)."""

    def igather(self, x, counts: list, root: int = 0, *, tail=(), dtype=None) -> Handle:
        return Handle.done(self.gather(x, counts, root, tail=tail, dtype=dtype))

    @abc.abstractmethod
    def scatter(self, parts, root: int, shape, dtype):
        """Rank ``root``'s ``parts[r]`` (host arrays, or arrays of this communicator's;
        None elsewhere) on each rank r, which gets an array of ``shape`` and ``dtype`` in
        the communicator's array module."""

    def iscatter(self, parts, root: int, shape, dtype) -> Handle:
        return Handle.done(self.scatter(parts, root, shape, dtype))

    @abc.abstractmethod
    def to_host(self, x):
        """``x`` (an array of this communicator's) as a numpy array."""

    @abc.abstractmethod
    def broadcast(self, x, root: int = 0, *, shape=None, dtype=None, out=None):
        """Rank ``root``'s ``x`` on every rank (``shape``/``dtype``: the receive buffer's,
        where a communicator needs them)."""

    def ibroadcast(self, x, root: int = 0, *, shape=None, dtype=None, out=None) -> Handle:
        return Handle.done(self.broadcast(x, root, shape=shape, dtype=dtype, out=out))

    @abc.abstractmethod
    def allgather(self, x, counts=None, out=None):
        """Every rank's ``x`` joined along axis 0 in rank order."""

    def iallgather(self, x, counts=None, out=None) -> Handle:
        return Handle.done(self.allgather(x, counts, out))

    @abc.abstractmethod
    def reduce_scatter(self, x, op: str = "sum", bounds=None, out=None):
        """Rank r's share of ``x`` split along axis 0 (rows ``bounds[r]:bounds[r + 1]``;
        None: as synk splits rows), combined over every rank."""

    def ireduce_scatter(self, x, op: str = "sum", bounds=None, out=None) -> Handle:
        return Handle.done(self.reduce_scatter(x, op, bounds, out))

    @abc.abstractmethod
    def alltoall(self, parts: list, specs: list) -> list:
        """Each ``parts[p]`` (C-contiguous arrays of this communicator's) to rank p; the
        arrays every rank sent this one, in rank order (``specs[r]``: the shape and dtype
        of rank r's), this rank's own part copied."""

    def ialltoall(self, parts: list, specs: list) -> Handle:
        return Handle.done(self.alltoall(parts, specs))

    def isend(self, x, peer: int, tag: int = 0) -> Handle:
        """Start sending ``x`` to rank ``peer``, matched by ``irecv(rank, tag)`` there: a
        buffered send, as MPI's, so two ranks that send to each other first never
        deadlock. Here: through the host communicator (a device array arrives as one)."""
        return self.host.isend(x, peer, tag)

    def send(self, x, peer: int, tag: int = 0) -> None:
        self.isend(x, peer, tag).wait()

    def irecv(self, peer: int = ANY, tag=ANY, status: Status | None = None) -> Handle:
        """Receive what rank ``peer`` sent with ``tag`` (either may be ``ANY``), described
        in ``status`` if given; ``wait()`` gives it."""
        return self.host.irecv(peer, tag, status)

    def recv(self, peer: int = ANY, tag=ANY, status: Status | None = None):
        return self.irecv(peer, tag, status).wait()

    def probe(self, peer: int = ANY, tag=ANY) -> Status:
        """The ``Status`` of the message ``recv(peer, tag)`` would take, once it is in."""
        return self.host.probe(peer, tag)

    def iprobe(self, peer: int = ANY, tag=ANY) -> Status | None:
        """``probe``'s ``Status`` if the message is in, else None."""
        return self.host.iprobe(peer, tag)

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    def ibarrier(self) -> Handle:
        """Non-blocking ``barrier``; ``wait()`` returns None. Here: over the host."""
        return self.host.ibarrier()

    @abc.abstractmethod
    def abort(self, reason: str = "aborted") -> None:
        """Give up: unfinished operations end on this rank and fail on the others."""

    def close(self) -> None:  # noqa: B027 (most have nothing of their own to release)
        """Release the communicator after the last operation."""
