"""The NCCL transport: collectives and messages between GPU ranks, on device arrays.

Through ``cupy.cuda.nccl`` (the binding shipped with CuPy; not ``pynccl``), on the rank's
own stream. Rank 0 makes the communicator's id (``make_id``, 128 bytes), the caller sends it
to the other ranks over synk's authenticated control channel, and every rank joins with
``NcclTransport.from_id``.

Bounded waits. No NCCL call is waited on with a blocking synchronisation: an operation is
launched, an event recorded after it, and the event polled in slices while checking
``check_async_error()`` and the caller's ``should_stop()`` ("give up?": a peer died, the
call was aborted, a deadline passed). On either, the communicator is aborted (so that no
rank stays inside a collective) and ``CollectiveError`` / ``CommAborted`` raised.

Communicator set-up cannot be cancelled through CuPy 14: its ``NcclConfig`` exposes only
``split_share``, so the non-blocking ``ncclCommInitRankConfig`` (``blocking=0``) with
``ncclCommGetAsyncError`` / ``ncclCommAbort`` is out of reach, and ``NCCL_COMM_BLOCKING=0``
makes CuPy raise a ``KeyError`` on ``ncclInProgress``. So init runs in a daemon thread
(CuPy releases the GIL inside it) and the caller gives up at its deadline with
``CommInitTimeout``; the stuck thread ends with the process, which synk then stops.

Dtypes and ops (the table is cupyx.distributed's): int8, uint8, int32, uint32, int64,
uint64, float16, float32, float64 natively; complex64/128 as pairs of floats (sum and mean
only); int16/uint16 through int32/uint32 and back (exact, wrapping as numpy does); bool as
uint8 for max/min and as int64 for sum/prod (numpy counts Trues). ``mean`` is a sum then a
division by the number of ranks (integers are averaged in float64, float16 in float32).
Data movement (broadcast, allgather, send/recv) takes any fixed-size dtype, as bytes.
"""
from __future__ import annotations

import threading
import time

import numpy as np

from .._devices.cuda_api import nccl_module
from ._mesh import CommAborted, CommError
from ._transport import Communicator, register

OPS = ("sum", "prod", "max", "min", "mean")
ID_BYTES = 128
_SLICE = 0.0005  # seconds between polls of an unfinished operation, after a short spin
_SPINS = 200


class CommInitError(CommError):
    """A rank could not join the communicator (set-up failed or was abandoned)."""


class CommInitTimeout(CommInitError, TimeoutError):
    """Communicator set-up did not finish by its deadline: a rank died or hung."""


class CollectiveError(CommError):
    """An NCCL operation failed (``status``: NCCL's result code); the communicator was
    aborted, so no rank waits inside it."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self):
        return type(self), (str(self), self.status)


def tables(nccl) -> tuple[dict, dict]:
    """(numpy dtype char -> NCCL datatype, op name -> NCCL op), as cupyx.distributed keeps
    them; complex types count two elements per value."""
    dtypes = {"b": nccl.NCCL_INT8, "B": nccl.NCCL_UINT8, "i": nccl.NCCL_INT32,
              "I": nccl.NCCL_UINT32, "l": nccl.NCCL_INT64, "L": nccl.NCCL_UINT64,
              "q": nccl.NCCL_INT64, "Q": nccl.NCCL_UINT64, "e": nccl.NCCL_FLOAT16,
              "f": nccl.NCCL_FLOAT32, "d": nccl.NCCL_FLOAT64, "F": nccl.NCCL_FLOAT32,
              "D": nccl.NCCL_FLOAT64}
    ops = {"sum": nccl.NCCL_SUM, "prod": nccl.NCCL_PROD, "max": nccl.NCCL_MAX,
           "min": nccl.NCCL_MIN}
    return dtypes, ops


def make_id(xp) -> bytes:
    """A fresh communicator id (``get_unique_id()``: 128 bytes in CuPy >= 14; older CuPy
    gave a tuple of 128 signed chars, converted here)."""
    uid = nccl_module(xp).get_unique_id()
    if not isinstance(uid, bytes):
        uid = bytes(b & 0xFF for b in uid)
    return check_id(uid)


MULTI_RANK_GPU_FROM = 23000  # NCCL 2.30: several ranks of a communicator may share a GPU


def multi_rank_env(xp) -> dict | None:
    """The environment NCCL needs to take several ranks on one GPU, or None when this
    NCCL cannot (before 2.30). NCCL_MULTI_RANK_GPU_ENABLE=1 lifts its refusal ("Multiple
    Ranks are using the same GPU/Partition"); NVLink SHARP does not work with several
    ranks on one device, so it is kept off (NCCL_NVLS_ENABLE=0)."""
    try:
        version = int(nccl_module(xp).get_version())
    except Exception:  # no NCCL runtime
        return None
    if version < MULTI_RANK_GPU_FROM:
        return None
    return {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"}


def check_id(comm_id) -> bytes:
    if not isinstance(comm_id, bytes) or len(comm_id) != ID_BYTES:
        raise ValueError(f"an NCCL unique id is {ID_BYTES} bytes, got {type(comm_id).__name__} "
                         f"of length {len(comm_id) if hasattr(comm_id, '__len__') else '?'}")
    return comm_id


def split_bounds(n_rows: int, n_ranks: int) -> list:
    """Start of each rank's rows and the end (as synk splits rows: differing by one)."""
    base, extra = divmod(n_rows, n_ranks)
    bounds = [0]
    for r in range(n_ranks):
        bounds.append(bounds[-1] + base + (r < extra))
    return bounds


def check_op(op) -> str:
    name = op.lower() if isinstance(op, str) else op
    name = "mean" if name == "avg" else name
    if name not in OPS:
        raise ValueError(f"unknown op {op!r} for the NCCL transport: use one of {list(OPS)}")
    return name


@register("nccl")
class NcclTransport(Communicator):
    """One GPU rank's NCCL communicator, on its device's stream."""

    combines_on_device = True  # synk combines functions' outputs with it, on the devices

    def __init__(self, device, comm, size: int, rank: int, should_stop=None) -> None:
        self.device, self.xp = device, device.xp
        self.stream = device.stream
        self.nccl = nccl_module(device.xp)
        self._comm, self.size, self.rank = comm, int(size), int(rank)
        self._should_stop = should_stop
        self._dtypes, self._ops = tables(self.nccl)
        with self.xp.cuda.Device(device.device_id):
            self.comm_stream = self.xp.cuda.Stream(non_blocking=True)
        self._broken: str | None = None

    @classmethod
    def from_id(cls, device, comm_id: bytes, size: int, rank: int, *, deadline: float,
                should_stop=None) -> NcclTransport:
        """Join the communicator ``comm_id`` as ``rank`` of ``size``; by ``deadline`` (a
        ``time.monotonic()`` value) or raise ``CommInitTimeout``."""
        check_id(comm_id)
        if device.stream is None:
            raise RuntimeError(f"{device!r} is not bound: call bind() before making its "
                               "communicator")
        box: dict = {}
        xp, nccl = device.xp, nccl_module(device.xp)

        def init():
            try:
                xp.cuda.Device(device.device_id).use()  # a new thread starts on device 0
                box["comm"] = nccl.NcclCommunicator(size, comm_id, rank)
            except BaseException as err:  # handed to the caller
                box["error"] = err

        thread = threading.Thread(target=init, name=f"synk-nccl-init-r{rank}", daemon=True)
        thread.start()
        while True:
            thread.join(0.01)
            if not thread.is_alive():
                break
            why = should_stop() if should_stop is not None else None
            if why:
                raise CommInitError(f"NCCL set-up of rank {rank} of {size} abandoned: {why}")
            if time.monotonic() >= deadline:
                raise CommInitTimeout(
                    f"NCCL set-up of rank {rank} of {size} did not finish by its deadline: "
                    "a rank died or hung while joining (the set-up call cannot be cancelled "
                    "through CuPy; it stays in a background thread until the process ends)")
        if "error" in box:
            err = box["error"]
            raise CommInitError(f"NCCL set-up of rank {rank} of {size} failed: "
                                f"{type(err).__name__}: {err}") from err
        return cls(device, box["comm"], size, rank, should_stop)

    # ------------------------------------------------------------ streams and waiting
    def _begin(self) -> int:
        """The stream NCCL operations run on (``comm_stream``), ordered after the work
        launched so far on the rank's stream; its handle. One stream for all of them keeps
        every rank's operations in the order they were called."""
        ready = self.xp.cuda.Event(disable_timing=True)
        ready.record(self.stream)
        self.comm_stream.wait_event(ready)
        return self.comm_stream.ptr

    def _launched(self):
        """An event after the operations launched on the communication stream so far."""
        done = self.xp.cuda.Event(disable_timing=True)
        done.record(self.comm_stream)
        return done

    def _wait(self, what: str, done=None) -> None:
        """Until ``done`` (default: everything launched so far) has happened, in slices,
        giving up (and aborting) on an NCCL error or when ``should_stop`` says so; then the
        rank's stream is ordered after it."""
        done = self._launched() if done is None else done
        spins = 0
        while not done.done:
            try:
                self._comm.check_async_error()
            except self.nccl.NcclError as err:
                self.abort(f"{what} failed: {err}")
                raise CollectiveError(f"NCCL {what} on rank {self.rank} of {self.size} failed: "
                                      f"{err}; the communicator was aborted",
                                      getattr(err, "status", None)) from err
            except AttributeError:  # aborted meanwhile (by another thread): _comm is None
                raise CommError(f"NCCL {what} on rank {self.rank}: the communicator is "
                                f"{self._broken or 'closed'}") from None
            why = self._should_stop() if self._should_stop is not None else None
            if why:
                self.abort(why)
                raise CommAborted(f"NCCL {what} on rank {self.rank} given up: {why}")
            spins += 1
            time.sleep(0 if spins < _SPINS else _SLICE)
        self.stream.wait_event(done)

    def _pending(self, what: str, finish) -> Pending:
        """A non-blocking operation just launched; ``finish()`` makes its result."""
        return Pending(self, what, self._launched(), finish)

    def _live(self):
        if self._comm is None:
            raise CommError(f"the NCCL communicator of rank {self.rank} is "
                            f"{self._broken or 'closed'}")
        return self._comm

    def _device_array(self, x, what: str):
        if not isinstance(x, self.xp.ndarray):
            raise TypeError(f"NCCL {what} takes device arrays ({self.xp.__name__}.ndarray), not "
                            f"{type(x).__name__}; copy host data with the device's to_device()")
        if x.dtype.hasobject:
            raise TypeError(f"NCCL {what}: arrays of dtype {x.dtype} cannot be sent")
        if x.flags.c_contiguous:
            return x
        return self.xp.ascontiguousarray(x).reshape(x.shape)  # (numpy's makes 0-d arrays 1-d)

    def _scope(self):
        """The rank's device and stream, current in the calling thread."""
        return _Scope(self.xp, self.device.device_id, self.stream)

    # ------------------------------------------------------------ reductions
    def _native(self, x, op: str):
        """(array NCCL can reduce, its datatype, element count, back to x's dtype)."""
        xp, char = self.xp, x.dtype.char
        if char in "FD":
            if op != "sum":
                raise TypeError(f"NCCL reduces complex arrays by sum (and mean) only, not "
                                f"{op!r}")
            real = np.float32 if char == "F" else np.float64
            return x.view(real), self._dtypes[char], 2 * x.size, lambda r: r.view(x.dtype)
        if char in self._dtypes:
            return x, self._dtypes[char], x.size, lambda r: r
        if char in "hH":
            wide = xp.int32 if char == "h" else xp.uint32
            return (x.astype(wide), self._dtypes[np.dtype(wide).char], x.size,
                    lambda r: r.astype(x.dtype))
        if char == "?":
            if op in ("max", "min"):
                return (x.astype(xp.uint8), self._dtypes["B"], x.size,
                        lambda r: r.astype(xp.bool_))
            return x.astype(xp.int64), self._dtypes["l"], x.size, lambda r: r
        raise TypeError(f"NCCL has no datatype for {x.dtype}: cast to float32/float64 or an "
                        "int32/int64 type first")

    def _start_allreduce(self, x, op: str):
        """Launch an allreduce of ``x``; (what to wait for, what makes the result)."""
        op = check_op(op)
        x = self._device_array(x, "allreduce")
        if x.size == 0:
            return None, x.copy
        mean = op == "mean"
        work = _mean_input(self.xp, x) if mean else x
        work, datatype, count, back = self._native(work, "sum" if mean else op)
        recv = self.xp.empty_like(work)
        self._live().allReduce(work.data.ptr, recv.data.ptr, count, datatype,
                               self._ops["sum" if mean else op], self._begin())
        if not mean:
            return self._launched(), lambda: back(recv)
        dtype = _mean_dtype(x.dtype)
        return self._launched(), lambda: (back(recv) / self.size).astype(dtype)

    def allreduce(self, x, op: str = "sum"):
        with self._scope():
            done, finish = self._start_allreduce(x, op)
            if done is not None:
                self._wait("allreduce", done)
            return finish()

    def iallreduce(self, x, op: str = "sum") -> Pending:
        """``allreduce`` launched on the communication stream; ``wait()`` gives the result.
        Do not change ``x`` before then."""
        with self._scope():
            done, finish = self._start_allreduce(x, op)
            return Pending(self, "allreduce", done, finish)

    def can_reduce(self, dtype, op: str) -> bool:
        """Whether ``reduce``/``allreduce`` take ``dtype`` with ``op`` (see ``_native``)."""
        char = np.dtype(dtype).char
        if char in "FD":
            return op in ("sum", "mean")
        return char in self._dtypes or char in "hH?"

    def reduce(self, x, op: str = "sum", root: int = 0):
        """``x`` combined over every rank with ``op`` (sum, prod, max, min), on rank
        ``root`` only (None elsewhere)."""
        op = check_op(op)
        if op == "mean":
            raise ValueError("NCCL reduce: use 'sum' and divide (mean is not an NCCL op)")
        if not 0 <= root < self.size:
            raise ValueError(f"root must be a rank, 0..{self.size - 1}; got {root}")
        with self._scope():
            x = self._device_array(x, "reduce")
            work, datatype, count, back = self._native(x, op)
            mine = self.rank == root
            recv = self.xp.empty_like(work) if mine else work
            if count:
                self._live().reduce(work.data.ptr, recv.data.ptr, count, datatype,
                                    self._ops[op], root, self._begin())
                self._wait("reduce")
            return back(recv) if mine else None

    def gather(self, x, counts, root: int = 0, *, tail=(), dtype=None):
        """Every rank's rows ``x`` (``counts[r]`` rows of shape ``tail`` and ``dtype`` from
        rank r; None where it has none) joined along axis 0 in rank order, on rank ``root``
        only (None elsewhere): grouped sends to the root, received straight into place."""
        xp, nccl = self.xp, self.nccl
        dtype = np.dtype(x.dtype if dtype is None else dtype)
        counts = [int(c) for c in counts]
        with self._scope():
            comm = self._live()
            if x is not None:
                x = self._device_array(x, "gather")
                if len(x) != counts[self.rank] or tuple(x.shape[1:]) != tuple(tail):
                    raise ValueError(f"NCCL gather: rank {self.rank} has {x.shape}, the plan "
                                     f"says {counts[self.rank]} rows of {tuple(tail)}")
            row = int(np.prod(tail, dtype=np.int64)) * dtype.itemsize
            if self.rank != root:
                if counts[self.rank] and row:
                    raw = x.astype(dtype, copy=False).reshape(-1).view(xp.uint8)
                    stream = self._begin()
                    nccl.groupStart()
                    try:
                        comm.send(raw.data.ptr, raw.size, nccl.NCCL_UINT8, root, stream)
                    finally:
                        nccl.groupEnd()
                    self._wait("gather")
                return None
            out = xp.empty((sum(counts),) + tuple(tail), dtype)
            starts = [sum(counts[:r]) for r in range(self.size + 1)]
            if counts[root]:
                out[starts[root]:starts[root + 1]] = x
            flat = out.reshape(-1).view(xp.uint8)
            parts = [(r, flat[starts[r] * row:starts[r + 1] * row])
                     for r, c in enumerate(counts) if r != root and c and row]
            stream = self._begin()
            nccl.groupStart()
            try:
                for r, part in parts:
                    comm.recv(part.data.ptr, part.size, nccl.NCCL_UINT8, r, stream)
            finally:
                nccl.groupEnd()
            self._wait("gather")
            return out

    def _start_reduce_scatter(self, x, op: str):
        op = check_op(op)
        x = self._device_array(x, "reduce_scatter")
        if x.ndim == 0:
            raise ValueError("reduce_scatter splits along axis 0, so x needs at least 1 "
                             "dimension")
        xp, n = self.xp, self.size
        work = _mean_input(xp, x) if op == "mean" else x
        bounds = split_bounds(len(x), n)
        rows = max(bounds[r + 1] - bounds[r] for r in range(n))
        if rows * n != len(x):  # uneven shares: pad each to the largest
            padded = xp.zeros((rows * n,) + x.shape[1:], work.dtype)
            for r in range(n):
                lo, hi = bounds[r], bounds[r + 1]
                padded[r * rows:r * rows + hi - lo] = work[lo:hi]
            work = padded
        sendable, datatype, count, back = self._native(work, "sum" if op == "mean" else op)
        per_rank = count // n
        recv = xp.empty(per_rank, sendable.dtype)
        self._live().reduceScatter(sendable.data.ptr, recv.data.ptr, per_rank, datatype,
                                   self._ops["sum" if op == "mean" else op], self._begin())

        def finish():
            mine = bounds[self.rank + 1] - bounds[self.rank]
            result = back(recv).reshape((rows,) + x.shape[1:])[:mine]
            if op == "mean":
                result = (result / n).astype(_mean_dtype(x.dtype))
            return result

        return self._launched(), finish

    def reduce_scatter(self, x, op: str = "sum"):
        with self._scope():
            done, finish = self._start_reduce_scatter(x, op)
            self._wait("reduce_scatter", done)
            return finish()

    def ireduce_scatter(self, x, op: str = "sum") -> Pending:
        """Non-blocking ``reduce_scatter`` (see ``iallreduce``)."""
        with self._scope():
            return Pending(self, "reduce_scatter", *self._start_reduce_scatter(x, op))

    # ------------------------------------------------------------ data movement
    def _start_broadcast(self, x, root, shape, dtype):
        if not 0 <= root < self.size:
            raise ValueError(f"root must be a rank, 0..{self.size - 1}; got {root}")
        xp = self.xp
        if self.rank == root:
            buf = self._device_array(x, "broadcast")
        elif x is not None:
            buf = xp.empty(x.shape, x.dtype)
        elif shape is not None and dtype is not None:
            buf = xp.empty(shape, dtype)
        else:
            raise ValueError("NCCL broadcast needs the array's shape and dtype on every "
                             "rank: pass x (a buffer of the right shape) or shape= and "
                             "dtype=")
        raw = buf.reshape(-1).view(xp.uint8)
        self._live().broadcast(raw.data.ptr, raw.data.ptr, raw.size, self.nccl.NCCL_UINT8,
                               root, self._begin())
        return self._launched(), lambda: buf

    def broadcast(self, x, root: int = 0, *, shape=None, dtype=None):
        """Rank ``root``'s ``x`` on every rank. NCCL needs the receive buffer's size: the
        other ranks pass an array of the right shape and dtype as ``x`` (not modified) or
        ``shape`` and ``dtype``."""
        with self._scope():
            done, finish = self._start_broadcast(x, root, shape, dtype)
            self._wait("broadcast", done)
            return finish()

    def ibroadcast(self, x, root: int = 0, *, shape=None, dtype=None) -> Pending:
        """Non-blocking ``broadcast`` (see ``iallreduce``)."""
        with self._scope():
            return Pending(self, "broadcast", *self._start_broadcast(x, root, shape, dtype))

    def _start_allgather(self, x, counts):
        xp, n = self.xp, self.size
        x = self._device_array(x, "allgather")
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
        self._live().allGather(raw.data.ptr, gathered.data.ptr, raw.size,
                               self.nccl.NCCL_UINT8, self._begin())

        def finish():
            parts = gathered.view(x.dtype).reshape((n, rows) + tail)
            if all(c == rows for c in counts):
                return parts.reshape((n * rows,) + tail)
            return xp.concatenate([parts[r, :counts[r]] for r in range(n)], axis=0)

        return self._launched(), finish

    def allgather(self, x, counts=None):
        """Every rank's ``x`` joined along axis 0 in rank order (first dimensions may differ:
        each part is padded to the largest and trimmed; 0-d values are one row each).
        ``counts`` (every rank's number of rows) saves the exchange of sizes."""
        with self._scope():
            done, finish = self._start_allgather(x, counts)
            self._wait("allgather", done)
            return finish()

    def iallgather(self, x, counts=None) -> Pending:
        """Non-blocking ``allgather`` (see ``iallreduce``; the sizes, when not given, are
        exchanged before it returns)."""
        with self._scope():
            return Pending(self, "allgather", *self._start_allgather(x, counts))

    def _exchange_sizes(self, x) -> list:
        """Every rank's rows, checking that the other dimensions and the dtype agree."""
        head = np.full(11, -1, np.int64)
        head[0], head[1], head[2] = len(x), x.dtype.num, x.ndim
        head[3:3 + min(x.ndim - 1, 8)] = x.shape[1:9]
        mine = self.device.to_device(head)
        everyone = self.xp.empty(11 * self.size, self.xp.int64)
        self._live().allGather(mine.data.ptr, everyone.data.ptr, 11, self.nccl.NCCL_INT64,
                               self._begin())
        self._wait("allgather (sizes)")
        heads = self.device.to_host(everyone).reshape(self.size, 11)
        if len({tuple(h[1:]) for h in heads}) > 1:
            raise ValueError("allgather joins along axis 0, so the other dimensions and the "
                             "dtype must agree; got " + ", ".join(
                                 f"rank {r}: {len_tail(h)}" for r, h in enumerate(heads)))
        return [int(h[0]) for h in heads]

    def exchange(self, sends=(), recvs=()):
        """Point-to-point messages in one NCCL group: ``sends`` [(array, peer)], ``recvs``
        [(peer, shape, dtype)]; returns the received arrays. Two ranks that send to each
        other must do so in one exchange (a lone send waits for its receive)."""
        with self._scope():
            xp, comm, uint8 = self.xp, self._live(), self.nccl.NCCL_UINT8
            for peer in [p for _, p in sends] + [p for p, _, _ in recvs]:
                if not 0 <= peer < self.size or peer == self.rank:
                    raise ValueError(f"peer {peer} is not another rank (0..{self.size - 1}; "
                                     f"this is rank {self.rank})")
            outgoing = [(self._device_array(x, "send").reshape(-1).view(xp.uint8), peer)
                        for x, peer in sends]
            received = [xp.empty(shape, dtype) for _, shape, dtype in recvs]
            incoming = [(buf.reshape(-1).view(xp.uint8), peer)
                        for buf, (peer, _, _) in zip(received, recvs)]
            stream = self._begin()  # after every buffer is made: nothing of theirs races
            self.nccl.groupStart()
            try:
                for raw, peer in outgoing:
                    comm.send(raw.data.ptr, raw.size, uint8, peer, stream)
                for raw, peer in incoming:
                    comm.recv(raw.data.ptr, raw.size, uint8, peer, stream)
            finally:
                self.nccl.groupEnd()
            self._wait("send/recv")
            return received

    def send(self, x, peer: int) -> None:
        """Send ``x`` to ``peer``; returns once ``peer`` has received it."""
        self.exchange(sends=[(x, peer)])

    def recv(self, peer: int, shape, dtype):
        return self.exchange(recvs=[(peer, shape, dtype)])[0]

    def barrier(self) -> None:
        with self._scope():
            token = self.xp.zeros(1, self.xp.int32)
            self._live().allReduce(token.data.ptr, token.data.ptr, 1, self.nccl.NCCL_INT32,
                                   self._ops["sum"], self._begin())
            self._wait("barrier")

    # ------------------------------------------------------------ teardown
    def abort(self, reason: str = "aborted") -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            self._broken = f"aborted ({reason})"
            comm.abort()

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            self._broken = "closed"
            comm.destroy()


class Pending:
    """An NCCL operation launched on the communication stream (the ``i...`` forms).

    ``wait()`` waits for the event recorded after it, in slices, as the blocking forms do
    (an NCCL error or a failed peer raises; nothing hangs), orders the rank's stream after
    it, and returns the result; the same result on every call. Meanwhile the rank's stream
    may compute: that is the overlap."""

    def __init__(self, transport, what: str, done, finish) -> None:
        self._transport, self._what, self._done, self._finish = transport, what, done, finish
        self._result, self._finished = None, False

    def wait(self):
        if not self._finished:
            transport = self._transport
            with transport._scope():
                if self._done is not None:
                    transport._wait(self._what, self._done)
                self._result = self._finish()
            self._finished = True
            self._transport = self._finish = None
        return self._result


class _Scope:
    """``with``: a device and a stream current in this thread, restored after."""

    __slots__ = ("_device", "_stream")

    def __init__(self, xp, device_id: int, stream) -> None:
        self._device, self._stream = xp.cuda.Device(device_id), stream

    def __enter__(self):
        self._device.__enter__()
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        self._stream.__exit__(*exc)
        self._device.__exit__(*exc)


def _mean_input(xp, x):
    if x.dtype.kind in "fc":
        return x.astype(xp.float32) if x.dtype == np.float16 else x
    return x.astype(xp.float64)


def _mean_dtype(dtype) -> np.dtype:
    return dtype if dtype.kind in "fc" else np.dtype(np.float64)


def len_tail(head) -> str:
    """A size header as words: "3 rows of (4,) float32"."""
    ndim = int(head[2])
    tail = tuple(int(d) for d in head[3:3 + max(ndim - 1, 0)])
    names = {np.dtype(c).num: np.dtype(c).name for c in "?bBhHiIlLqQefdgFD"}
    return f"{int(head[0])} rows of {tail} {names.get(int(head[1]), f'dtype #{int(head[1])}')}"
