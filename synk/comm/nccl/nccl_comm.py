"""The NCCL communicator: collectives and messages between GPU ranks, on device arrays,
through ``cupy.cuda.nccl`` (the binding shipped with CuPy; not ``pynccl``).

::

    set-up     rank 0: ``make_id`` (128 bytes) -> the ranks, over synk's authenticated
               control channel -> ``NcclCommunicator.from_id`` by the deadline (nccl_setup)
    operation  the caller's stream -> event -> ``comm_stream``: NCCL (nccl_guard)
               -> event -> the caller's stream
"""
from __future__ import annotations

import numpy as np

from ..._devices.cuda_api import nccl_module
from .. import context as _context, stalls as _stalls
from ..communicator import Communicator, Packed, usable
from ..handle import Handle
from . import (
    nccl_reduce as reduction,
    nccl_setup as setup,
    nccl_types as types,
)
from .nccl_agree import Agreement
from .nccl_guard import CollectiveError, Guard
from .nccl_setup import CommInitError, CommInitTimeout, shared_gpu_plan
from .nccl_types import ID_BYTES, check_id, dtype_number, len_tail, make_id, tables

__all__ = ["NcclCommunicator", "CommInitError", "CommInitTimeout", "CollectiveError",
           "make_id", "check_id", "ID_BYTES", "tables",
           "shared_gpu_plan", "len_tail"]


class NcclCommunicator(Communicator):
    """One GPU rank's NCCL communicator. Every operation is ordered after and before the
    stream current on the rank's device at the call (the rank's own unless ``with s:``; at
    ``wait()`` for a non-blocking form),
    as cupyx.distributed orders its collectives: casts and buffers on that stream, NCCL on
    ``comm_stream``, events between them. Nothing waits by a blocking synchronisation, and
    buffers live until their operation has completed (``nccl_guard``)."""

    combines_outputs = "collectives"  # the ranks' outputs combined on the devices
    prescaled_means = True  # (NCCL sums the terms each rank scaled on its device)
    # (its reductions check what the ranks pass, beside the operation: nccl_agree)

    def __init__(self, device, comm, size: int, rank: int, should_stop=None,
                 exit_when_poisoned: bool = False) -> None:
        self.device, self.xp = device, device.xp
        self.nccl = nccl_module(device.xp)
        self.size, self.rank = int(size), int(rank)
        self.guard = Guard(self.xp, self.nccl, comm, self.rank, self.size, should_stop,
                           exit_when_poisoned)
        self.dtypes, self.ops = tables(self.nccl)
        self.host = None  # the running call's host communicator (set by synk.comm's route)
        self.agreement = Agreement(lambda: self.host, self.abort)
        with device.scope():
            self.comm_stream = self.xp.cuda.Stream(non_blocking=True)

    @classmethod
    def from_id(cls, device, comm_id: bytes, size: int, rank: int, *, deadline: float,
                should_stop=None, setup_stop=None, env=None,
                exit_when_poisoned: bool = False) -> NcclCommunicator:
        """Join the communicator ``comm_id`` as ``rank`` of ``size``, connected, by
        ``deadline`` (``time.monotonic()``) or raise ``CommInitTimeout`` (``CommInitError``
        once ``setup_stop()``, by default ``should_stop``, gives a reason). ``env``: as
        ``nccl_setup.process_env`` takes; ``exit_when_poisoned``: a worker's (``nccl_guard``)."""
        check_id(comm_id)
        if device.stream is None:
            raise RuntimeError(f"{device!r} is not bound: call bind() before making its "
                               "communicator")
        comm = setup.join(device, comm_id, size, rank, deadline,
                          setup_stop if setup_stop is not None else should_stop, env)
        return cls(device, comm, size, rank, should_stop, exit_when_poisoned)

    @staticmethod
    def new_id(device) -> bytes:
        """A fresh communicator id (rank 0 makes it and sends it to the others)."""
        return make_id(device.xp)

    @classmethod
    def join(cls, device, how: tuple, size: int, rank: int, *, deadline: float,
             should_stop=None, setup_stop=None,
             exit_when_poisoned: bool = False) -> NcclCommunicator:
        """``from_id`` with ``how``: ("nccl", the id rank 0 made[, the NCCL variables the
        group needs read: ``_nccl_setup.group_env``])."""
        return cls.from_id(device, how[1], size, rank, deadline=deadline,
                           should_stop=should_stop, setup_stop=setup_stop,
                           env=how[2] if len(how) > 2 else None,
                           exit_when_poisoned=exit_when_poisoned)

    # ------------------------------------------------------------ streams and waiting
    def scope(self):
        """The rank's device current in the calling thread, with the stream current on it
        (the caller's: the rank's own unless the caller made another current), pushed."""
        return self.device.scope(self.device.current_stream())

    def _begin(self) -> int:
        """The stream NCCL operations run on (``comm_stream``), ordered after the work
        launched so far on the current stream (the caller's); its handle. One stream for all
        of them keeps every rank's operations in the order they were called."""
        ready = self.xp.cuda.Event(disable_timing=True)
        ready.record()  # (on the current stream)
        self.comm_stream.wait_event(ready)
        return self.comm_stream.ptr

    def launch(self, what: str, call, keep: tuple):
        """``call(comm, stream)`` on the communication stream; the event after it (``keep``,
        its buffers, live until it has completed)."""
        c = _context.current
        if c.refused > c.cleared:  # (this rank refused a collective of the call: see there)
            _context.before_launch(self.guard.should_stop)
        _context.launching_nccl()
        stream = self._begin()
        self.guard.call(what, call, stream)
        return self.guard.launched(self.comm_stream, keep)

    def complete(self, what: str, done) -> None:
        """Wait for ``done`` (bounded, see ``Guard.wait``); the current stream after it."""
        self._complete(what, done, _context.running_collective(), _context.running_name())

    def _complete(self, what: str, done, collective: tuple | None, code: int) -> None:
        """``complete``, for an operation of ``collective`` of the call (``_context``'s
        ``running_collective``, named by ``code``, as it was launched), if any: the wait
        ends where a peer refused its value of it, returned without it, or waits in
        another collective of its number, and will never launch its part."""
        if collective is None:
            self.guard.wait(what, done)
        else:
            waiting = _stalls.NcclWait(collective, code)
            try:
                self.guard.wait(what, done, lambda: (
                    _context.refused_by(collective, since=True)
                    or _context.skipped_by(collective, code)), sleeping=waiting.sleeps,
                    number=collective[2])
            finally:
                waiting.end()
        self.xp.cuda.get_current_stream().wait_event(done)

    def pending(self, what: str, done, finish, verify=None) -> Handle:
        """An operation launched on the communication stream (the ``i...`` forms), as a
        Handle whose ``wait()`` checks ``verify``, waits as the blocking forms do, orders the
        rank's stream after it, and returns the result (its buffers live until completed,
        waited or not)."""
        collective, code = _context.running_collective(), _context.running_name()

        def wait():
            with self.scope():
                if verify is not None:
                    verify()
                if done is not None:
                    self._complete(what, done, collective, code)
                return finish()

        return Handle(wait)

    def ended(self, what: str, done, finish, verify=None, wait: bool = True):
        """The result of an operation launched as ``pending``'s, once it has completed; or
        (``wait=False``) ``pending``'s Handle of it."""
        if not wait:
            return self.pending(what, done, finish, verify)
        if verify is not None:
            verify()
        if done is not None:
            self.complete(what, done)
        return finish()

    def _live(self):
        return self.guard.live()

    def device_array(self, x, what: str):
        if not isinstance(x, self.xp.ndarray):
            raise TypeError(f"NCCL {what} takes device arrays ({self.xp.__name__}.ndarray), not "
                            f"{type(x).__name__}; copy host data with the device's to_device()")
        if x.dtype.hasobject:
            raise TypeError(f"NCCL {what}: arrays of dtype {x.dtype} cannot be sent")
        if x.flags.c_contiguous:
            return x
        return self.xp.ascontiguousarray(x).reshape(x.shape)  # (numpy's makes 0-d arrays 1-d)

    def synchronize(self) -> None:
        """Wait for every operation launched so far (handles never waited on included) and
        let go of their buffers: nothing launched in a call outlives it."""
        call = _context.whole_call()  # (a peer that refused a value launched one operation
        # fewer, one that skipped a collective, or failed, none: the last ones of this rank
        # never complete)
        refused = None
        if call is not None:
            outlived = _context.outlived_by(call[0])
            refused = lambda: _context.refused_by(call, since=True) or outlived()  # noqa: E731
        last = max(_context.current.nccl_names, default=0)  # (what a failed peer finished
        with self.device.scope():  # keeps the wait going: ``aborts``)
            self.guard.settle(self.comm_stream, refused, last)

    @property
    def poisoned(self) -> str | None:
        """Why this rank's process must not be reused (its communicator was aborted while a
        thread was blocked inside NCCL: ``_nccl_guard``), or None."""
        return self.guard.poisoned

    @property
    def aborted(self) -> bool:
        """Whether this rank's communicator was aborted (or closed): every rank's must then
        be renewed (the peers' fail at their next operation)."""
        return self.guard.comm is None

    def quiet(self) -> bool:
        """Whether nothing of this communicator may still run on the device (no operation
        in flight, none stranded by an abort), so that a device-wide wait would return."""
        return not self.guard._inflight and not self.guard.stranded

    # ------------------------------------------------------------ reductions
    def allreduce(self, x, op: str = "sum", *, weights: list | None = None, out=None):
        return reduction.allreduce(self, x, op, weights, out)

    def iallreduce(self, x, op: str = "sum", *, weights: list | None = None,
                   out=None) -> Handle:
        """``allreduce`` launched on the communication stream; ``wait()`` gives the result.
        Do not change ``x`` (nor read ``out``) before then."""
        return reduction.allreduce(self, x, op, weights, out, wait=False)

    def allreduce_many(self, packed: Packed, op: str, agree, wait: bool = True,
                       label: str | None = None):
        return reduction.allreduce_many(self, packed, op, agree, wait)

    def supports(self, dtype, op: str) -> bool:
        """Whether ``reduce``/``allreduce`` take ``dtype`` with ``op`` (the table is
        cupyx.distributed's): int8, uint8, int32, uint32, int64, uint64, float16, float32,
        float64 natively; complex64/128 as pairs of floats (sum and mean only);
        int16/uint16 through int32/uint32 and back (exact, wrapping as numpy does); bool as
        uint8 for max/min and as int64 for sum/prod (numpy counts Trues). Data movement
        (broadcast, allgather, send/recv) takes any fixed-size dtype, as bytes."""
        return types.can_reduce(self.dtypes, dtype, op)

    def reduce(self, x, op: str = "sum", root: int = 0, *, weights: list | None = None):
        """``x`` combined over every rank with ``op``, on rank ``root`` only (None
        elsewhere); a mean as ``allreduce``'s, by the rule of every back end."""
        return reduction.reduce(self, x, op, root, weights)

    def reduce_scatter(self, x, op: str = "sum", bounds=None, out=None):
        return reduction.reduce_scatter(self, x, op, bounds)

    def ireduce_scatter(self, x, op: str = "sum", bounds=None, out=None) -> Handle:
        """Non-blocking ``reduce_scatter`` (see ``iallreduce``)."""
        return reduction.reduce_scatter(self, x, op, bounds, wait=False)

    def scatter(self, parts, root: int, shape, dtype):
        """Rank ``root``'s ``parts[r]`` (host or device arrays) on each rank r's device:
        copied to the root's device, then one grouped send per rank (none for an empty
        part)."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        if self.rank == root:
            on_device = [self.xp.ascontiguousarray(p.astype(dtype, copy=False))
                         if self.device.is_device_array(p)
                         else self.device.to_device(np.ascontiguousarray(p, dtype),
                                                    self.xp.cuda.get_current_stream())
                         for p in parts]
            sends = [(on_device[r], r) for r in range(self.size)
                     if r != root and on_device[r].size]
            if sends:
                self.exchange(sends=sends)
            return on_device[root]
        if not int(np.prod(shape, dtype=np.int64)):
            return self.xp.empty(shape, dtype)
        return self.exchange(recvs=[(root, shape, dtype)])[0]

    def to_host(self, x) -> np.ndarray:
        return self.device.to_host(x, stream=self.device.current_stream())

    def gather(self, x, counts, root: int = 0, *, tail=(), dtype=None):
        """Every rank's rows ``x`` (``counts[r]`` rows of shape ``tail`` and ``dtype`` from
        rank r; None where it has none) joined along axis 0 in rank order, on rank ``root``
        only (None elsewhere): grouped sends to the root, received straight into place."""
        xp, nccl = self.xp, self.nccl
        dtype = np.dtype(x.dtype if dtype is None else dtype)
        counts = [int(c) for c in counts]
        with self.scope():
            if x is not None:
                x = self.device_array(x, "gather")
                if len(x) != counts[self.rank] or tuple(x.shape[1:]) != tuple(tail):
                    raise ValueError(f"NCCL gather: rank {self.rank} has {x.shape}, the plan "
                                     f"says {counts[self.rank]} rows of {tuple(tail)}")
            row = int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
            if self.rank != root:
                if counts[self.rank] and row:
                    raw = x.astype(dtype, copy=False).reshape(-1).view(xp.uint8)
                    done = self.launch("gather", lambda c, s: _grouped(
                        nccl, [(c.send, raw, root, s)]), (x, raw))
                    self.complete("gather", done)
                return None
            out = xp.empty((sum(counts),) + tuple(tail), dtype)
            starts = [sum(counts[:r]) for r in range(self.size + 1)]
            if counts[root]:
                out[starts[root]:starts[root + 1]] = x
            flat = out.reshape(-1).view(xp.uint8)
            parts = [(r, flat[starts[r] * row:starts[r + 1] * row])
                     for r, c in enumerate(counts) if r != root and c and row]
            if parts:
                done = self.launch("gather", lambda c, s: _grouped(
                    nccl, [(c.recv, part, r, s) for r, part in parts]), (x, out))
                self.complete("gather", done)
            return out

    # ------------------------------------------------------------ data movement
    def _start_broadcast(self, x, root, shape, dtype, out=None):
        if not 0 <= root < self.size:
            raise ValueError(f"root must be a rank, 0..{self.size - 1}; got {root}")
        xp = self.xp
        if self.rank == root:
            buf = self.device_array(x, "broadcast")
        elif x is not None:
            buf = xp.empty(x.shape, x.dtype)
        elif shape is not None and dtype is not None:
            buf = out if usable(out, shape, dtype, xp=xp) else xp.empty(shape, dtype)
        else:
            raise ValueError("NCCL broadcast needs the array's shape and dtype on every "
                             "rank: pass x (a buffer of the right shape) or shape= and "
                             "dtype=")
        raw = buf.reshape(-1).view(xp.uint8)
        if raw.size == 0:
            return None, lambda: buf
        u8 = self.nccl.NCCL_UINT8
        done = self.launch("broadcast", lambda c, s: c.broadcast(
            raw.data.ptr, raw.data.ptr, raw.size, u8, root, s), (x, buf))
        return done, lambda: buf

    def broadcast(self, x, root: int = 0, *, shape=None, dtype=None, out=None, wait=True):
        """Rank ``root``'s ``x`` on every rank. NCCL needs the receive buffer's size: the
        other ranks pass an array of the right shape and dtype as ``x`` (not modified) or
        ``shape`` and ``dtype``."""
        with self.scope():
            done, finish = self._start_broadcast(x, root, shape, dtype, out)
            return self.ended("broadcast", done, finish, wait=wait)

    def ibroadcast(self, x, root: int = 0, *, shape=None, dtype=None, out=None) -> Handle:
        """Non-blocking ``broadcast`` (see ``iallreduce``)."""
        return self.broadcast(x, root, shape=shape, dtype=dtype, out=out, wait=False)

    def _start_allgather(self, x, counts):
        xp, n = self.xp, self.size
        x = self.device_array(x, "allgather")
        if x.ndim == 0:
            x = x.reshape(1)
        tail = x.shape[1:]
        if counts is None:
            counts = self._exchange_sizes(x)
        counts = [int(c) for c in counts]
        if len(counts) != n or counts[self.rank] != len(x):
            raise ValueError(f"counts must give each of the {n} ranks' rows; got {counts} "
                             f"on rank {self.rank}, which has {len(x)}")
        rows = max(counts)
        send = x
        if len(x) < rows:
            send = xp.zeros((rows,) + tail, x.dtype)
            send[:len(x)] = x
        raw = send.reshape(-1).view(xp.uint8)
        gathered = xp.empty(n * raw.size, xp.uint8)
        done = None
        if raw.size:
            u8 = self.nccl.NCCL_UINT8
            done = self.launch("allgather", lambda c, s: c.allGather(
                raw.data.ptr, gathered.data.ptr, raw.size, u8, s), (x, send, gathered))

        def finish():
            parts = gathered.view(x.dtype).reshape((n, rows) + tail)
            if all(c == rows for c in counts):
                return parts.reshape((n * rows,) + tail)
            return xp.concatenate([parts[r, :counts[r]] for r in range(n)], axis=0)

        return done, finish

    def allgather(self, x, counts=None, out=None, wait=True):
        """Every rank's ``x`` joined along axis 0 in rank order (first dimensions may differ:
        each part is padded to the largest and trimmed; 0-d values are one row each).
        ``counts`` (every rank's number of rows) saves the exchange of sizes."""
        with self.scope():
            return self.ended("allgather", *self._start_allgather(x, counts), wait=wait)

    def iallgather(self, x, counts=None, out=None) -> Handle:
        """Non-blocking ``allgather`` (see ``iallreduce``; the sizes, when not given, are
        exchanged before it returns)."""
        return self.allgather(x, counts, out, wait=False)

    def _exchange_sizes(self, x) -> list:
        """Every rank's rows, checking that the other dimensions and the dtype agree."""
        head = np.full(11, -1, np.int64)
        head[0], head[1], head[2] = len(x), dtype_number(x.dtype), x.ndim
        head[3:3 + min(x.ndim - 1, 8)] = x.shape[1:9]
        mine = self.device.to_device(head, self.xp.cuda.get_current_stream())
        everyone = self.xp.empty(11 * self.size, self.xp.int64)
        i64 = self.nccl.NCCL_INT64
        done = self.launch("allgather (sizes)", lambda c, s: c.allGather(
            mine.data.ptr, everyone.data.ptr, 11, i64, s), (mine, everyone))
        self.complete("allgather (sizes)", done)
        heads = self.device.to_host(everyone, stream=self.xp.cuda.get_current_stream())
        heads = heads.reshape(self.size, 11)
        if len({tuple(h[1:]) for h in heads}) > 1:
            raise ValueError("allgather joins along axis 0, so the other dimensions and the "
                             "dtype must agree; got " + ", ".join(
                                 f"rank {r}: {len_tail(h)}" for r, h in enumerate(heads)))
        return [int(h[0]) for h in heads]

    def exchange(self, sends=(), recvs=()):
        """Point-to-point messages in one NCCL group: ``sends`` [(array, peer)], ``recvs``
        [(peer, shape, dtype)]; returns the received arrays. Two ranks that send to each
        other must do so in one exchange (a lone send waits for its receive)."""
        with self.scope():
            xp, nccl = self.xp, self.nccl
            for peer in [p for _, p in sends] + [p for p, _, _ in recvs]:
                if not 0 <= peer < self.size or peer == self.rank:
                    raise ValueError(f"peer {peer} is not another rank (0..{self.size - 1}; "
                                     f"this is rank {self.rank})")
            outgoing = [(self.device_array(x, "send").reshape(-1).view(xp.uint8), peer)
                        for x, peer in sends]
            received = [xp.empty(shape, dtype) for _, shape, dtype in recvs]
            incoming = [(buf.reshape(-1).view(xp.uint8), peer)
                        for buf, (peer, _, _) in zip(received, recvs)]
            done = self.launch("send/recv", lambda c, s: _grouped(
                nccl, [(c.send, raw, peer, s) for raw, peer in outgoing]
                + [(c.recv, raw, peer, s) for raw, peer in incoming]),
                (sends, outgoing, received))
            self.complete("send/recv", done)
            return received

    def alltoall(self, parts: list, specs: list) -> list:
        """Each ``parts[p]`` to rank p in one group of sends and receives (none of an empty
        part); what every rank sent this one, in rank order."""
        with self.scope():
            xp, me = self.xp, self.rank
            sends = [(parts[p], p) for p in range(self.size) if p != me and parts[p].size]
            recvs = [(r, tuple(shape), np.dtype(dtype)) for r, (shape, dtype)
                     in enumerate(specs) if r != me and int(np.prod(shape, dtype=np.int64))]
            received = iter(self.exchange(sends, recvs) if sends or recvs else ())
            return [parts[me].copy() if r == me else
                    next(received) if int(np.prod(shape, dtype=np.int64)) else
                    xp.empty(tuple(shape), np.dtype(dtype))
                    for r, (shape, dtype) in enumerate(specs)]

    def barrier(self) -> None:
        with self.scope():
            token = self.xp.zeros(1, self.xp.int32)
            i32, total = self.nccl.NCCL_INT32, self.ops["sum"]
            done = self.launch("barrier", lambda c, s: c.allReduce(
                token.data.ptr, token.data.ptr, 1, i32, total, s), (token,))
            self.complete("barrier", done)

    # ------------------------------------------------------------ teardown
    def abort(self, reason: str = "aborted") -> None:
        self.guard.abort(reason)

    def close(self) -> None:
        self.guard.close()


def _grouped(nccl, calls: list) -> None:
    """NCCL point-to-point calls ``[(method, raw device bytes, peer, stream)]`` in one group
    (the sends and receives of an exchange complete together)."""
    nccl.groupStart()
    try:
        for method, raw, peer, stream in calls:
            method(raw.data.ptr, raw.size, nccl.NCCL_UINT8, peer, stream)
    finally:
        nccl.groupEnd()
