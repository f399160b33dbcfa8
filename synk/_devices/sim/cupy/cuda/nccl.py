"""Simulated ``cupy.cuda.nccl``: communicators between real processes, through shared memory.

An operation is queued on its stream like NCCL's kernels and runs in stream order: this rank
posts its part to its segment, and completes once every rank it needs has posted (reading
their parts in place). Ranks that disagree on an operation's kind, count, datatype, op or
root raise ``NcclError(ncclInvalidUsage)`` through ``check_async_error()`` on every rank (a
real GPU would hang or compute garbage); a peer that died or aborted gives
``ncclRemoteError``. Such an operation never completes until its communicator is aborted,
as on a GPU: waiting on its stream raises ``SimulatedHang`` at once, with the reason.
"""
from __future__ import annotations

import atexit
import os
import secrets
import signal
import threading
import time

import numpy as np

from ....._engine import shm as _shm
from ... import _core, _faults
from ..._board import (
    ABORTED,
    ATTACHED,
    COUNT,
    DESTROYED,
    DEVICE,
    DONE,
    DTYPE,
    GEN,
    KIND,
    NBYTES,
    OP,
    PID,
    POSTED,
    ROOT,
    START,
    STATE,
    Board,
    Scratch,
    proc_start,
)
from ..._core import LOCK
from ..._errors import (
    NcclError,
    SimulatedHang,
    nccl_error,
    ncclInvalidArgument,
    ncclInvalidUsage,
    ncclRemoteError,
    ncclSystemError,
)

available = True

NCCL_INT8 = NCCL_CHAR = 0
NCCL_UINT8 = 1
NCCL_INT32 = NCCL_INT = 2
NCCL_UINT32 = 3
NCCL_INT64 = 4
NCCL_UINT64 = 5
NCCL_FLOAT16 = NCCL_HALF = 6
NCCL_FLOAT32 = NCCL_FLOAT = 7
NCCL_FLOAT64 = NCCL_DOUBLE = 8
NCCL_BFLOAT16 = 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

_DTYPES = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32,
           NCCL_UINT32: np.uint32, NCCL_INT64: np.int64, NCCL_UINT64: np.uint64,
           NCCL_FLOAT16: np.float16, NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}
_OPS = {NCCL_SUM: np.add, NCCL_PROD: np.multiply, NCCL_MAX: np.maximum, NCCL_MIN: np.minimum,
        NCCL_AVG: np.add}
_OP_NAMES = {NCCL_SUM: "sum", NCCL_PROD: "prod", NCCL_MAX: "max", NCCL_MIN: "min",
             NCCL_AVG: "avg"}
_KINDS = ["allReduce", "reduce", "broadcast", "reduceScatter", "allGather"]
_VERSION = 22803  # what the simulator reports, unless SYNK_SIM_NCCL_VERSION says otherwise
MULTI_RANK_GPU_FROM = 23000  # NCCL 2.30: NCCL_MULTI_RANK_GPU_ENABLE=1 allows ranks to share a GPU
_ID_MAGIC = b"SYNKSIM1"
_ID_BYTES = 128
_prefix_override: list = []
_LIVE: set = set()  # communicators of this process not yet destroyed or aborted
_PENDING_NAMES: set = set()  # segment names this process would leave if it exited now
_tls = threading.local()


def get_version():
    """NCCL's version (``SYNK_SIM_NCCL_VERSION`` lets tests pretend another one)."""
    raw = os.environ.get("SYNK_SIM_NCCL_VERSION", "").strip()
    return int(raw) if raw else _VERSION


def get_build_version():
    return _VERSION


def get_unique_id():
    """A fresh communicator id (128 bytes): it names the shared memory the ranks meet in."""
    if _prefix_override:
        prefix = f"{_prefix_override[0]}nccl{secrets.token_hex(4)}-"
    else:
        prefix = f"{_shm.PREFIX}{os.getpid()}-{secrets.token_hex(8)}-nccl-"
    raw = _ID_MAGIC + prefix.encode()
    if len(raw) > _ID_BYTES - 16:
        raise ValueError(f"segment prefix {prefix!r} is too long for an NCCL unique id")
    return raw + b"\0" * (_ID_BYTES - 16 - len(raw)) + secrets.token_bytes(16)


def _prefix_of(commId: bytes) -> str:
    if not isinstance(commId, bytes):
        raise TypeError(f"commId must be bytes, not {type(commId).__name__}")
    if len(commId) != _ID_BYTES:
        raise ValueError(f"commId length {len(commId)} != {_ID_BYTES}.")
    if not commId.startswith(_ID_MAGIC):
        raise nccl_error(ncclInvalidArgument, "this unique id was not made by the simulator's "
                                              "get_unique_id()")
    return commId[len(_ID_MAGIC):_ID_BYTES - 16].rstrip(b"\0").decode()


def groupStart():
    _tls.depth = getattr(_tls, "depth", 0) + 1
    if _tls.depth == 1:
        _tls.group = []


def groupEnd():
    depth = getattr(_tls, "depth", 0)
    if depth == 0:
        raise nccl_error(ncclInvalidUsage, "groupEnd() without groupStart()")
    _tls.depth = depth - 1
    if _tls.depth:
        return
    group, _tls.group = _tls.group, []
    by_stream: dict = {}
    for item in group:
        by_stream.setdefault(id(item[0]), []).append(item)
    for items in by_stream.values():
        _launch(items[0][0], [part for _, part, _, _ in items],
                [a for _, _, reads, _ in items for a in reads],
                [a for _, _, _, writes in items for a in writes])


def _launch(state, parts: list, reads: list, writes: list) -> None:
    with LOCK:
        seq = _core.begin(state)
        _core.access(state, seq, reads, writes)
    _core.enqueue(state, _Work(parts))


class _Work(_core.Op):
    """NCCL operations launched together (one, or a group's on one stream)."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def progress(self) -> bool:
        return all([part.progress() for part in self.parts])

    def failure(self):
        for part in self.parts:
            error = part.comm._error
            if error is not None:
                return str(error)
        return None

    def describe(self) -> str:
        return " + ".join(part.describe() for part in self.parts)


class NcclCommunicator:
    """A simulated communicator for one device, in one process of ``ndev``."""

    def __init__(self, ndev, commId, rank, config=None):
        if config is not None:
            raise _core.not_modelled("NcclConfig")
        prefix = _prefix_of(commId)
        if not 0 <= rank < ndev:
            raise nccl_error(ncclInvalidArgument, f"rank {rank} of a {ndev}-rank communicator")
        self._rank, self._size, self._prefix = int(rank), int(ndev), prefix
        self._device = _core.check_device(_core.current_device())
        self._error: NcclError | None = None
        self._closed = ""  # "aborted" / "destroyed"
        self._seq = 0  # collectives launched
        self._ops = 0  # NCCL operations launched (numbering for fault injection)
        self._sent: dict = {}  # peer -> messages launched to it
        self._received: dict = {}  # peer -> receives launched from it
        self._messages: list = []  # segments of messages sent, not known to be received
        self._peers = _shm.Attachments()
        self._last_liveness = 0.0
        self._scratch = Scratch(prefix, self._rank)
        if _faults.find("kill_init", self._rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if _faults.find("hang_init", self._rank):
            while True:  # a rank stuck inside ncclCommInitRank
                time.sleep(3600)
        deadline = time.monotonic() + _core.hang_timeout()
        self._board = None
        _PENDING_NAMES.add(prefix + "board")
        try:
            self._board = Board(prefix, self._size, deadline)
            self._join(deadline)
        except BaseException:
            _shm.unlink(prefix + "board")
            _PENDING_NAMES.discard(prefix + "board")
            if self._board is not None:
                self._board.close()
            raise
        _PENDING_NAMES.discard(prefix + "board")
        _LIVE.add(self)

    def _join(self, deadline: float) -> None:
        mine = self._board.slot(self._rank)
        pid = os.getpid()
        if mine[STATE] != 0 and mine[PID] != pid:
            raise nccl_error(ncclInvalidUsage, f"rank {self._rank} joined this communicator "
                                               f"twice (processes {int(mine[PID])} and {pid})")
        physical = _core.visible()[self._device]  # the GPU, whatever CUDA_VISIBLE_DEVICES says
        mine[PID], mine[START], mine[DEVICE] = pid, proc_start(pid) or 0, physical
        mine[STATE] = ATTACHED
        while True:
            states = [int(self._board.slot(r)[STATE]) for r in range(self._size)]
            if all(s != 0 for s in states):
                break
            if time.monotonic() > deadline:
                missing = [r for r, s in enumerate(states) if s == 0]
                raise SimulatedHang(f"NcclCommunicator() would hang forever on a GPU: ranks "
                                    f"{missing} of {self._size} never joined the communicator "
                                    f"(after {_core.hang_timeout():g} s, SYNK_SIM_HANG_TIMEOUT)")
            time.sleep(0.002)
        self._board.unlink()  # everyone has it mapped
        self._check_gpus_distinct()

    def _check_gpus_distinct(self) -> None:
        """NCCL's rule: ranks of one communicator on the same GPU are refused
        (``ncclInvalidUsage``), unless NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1."""
        seen: dict = {}
        for r in range(self._size):
            device = int(self._board.slot(r)[DEVICE])
            if device not in seen:
                seen[device] = r
                continue
            if get_version() >= MULTI_RANK_GPU_FROM:
                if os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE", "0").strip() == "1":
                    return
                raise nccl_error(ncclInvalidUsage, "Multiple Ranks are using the same "
                                 "GPU/Partition. Set NCCL_MULTI_RANK_GPU_ENABLE=1 to enable this "
                                 "configuration.")
            raise nccl_error(ncclInvalidUsage, f"Duplicate GPU detected : rank {seen[device]} "
                             f"and rank {r} both on CUDA device {device}")

    # ------------------------------------------------------------ queries
    @property
    def comm(self):
        return id(self)

    def rank_id(self):
        self._check_open()
        return self._rank

    def size(self):
        self._check_open()
        return self._size

    def device_id(self):
        self._check_open()
        return self._device

    def check_async_error(self):
        """Raise the error of an operation that failed asynchronously, if any."""
        if self._closed:
            return
        for state in _core.all_states():
            if state.device == self._device and state.pending:
                _core.progress(state)
        self._poll_peers(force=True)
        if self._error is not None:
            error = NcclError(self._error.status)  # a new one each time, as CuPy raises
            error.args = self._error.args
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise nccl_error(ncclInvalidArgument, f"the communicator was {self._closed}")

    # ------------------------------------------------------------ teardown
    def abort(self):
        """Abort the communicator: its unfinished operations end (their results undefined),
        and the other ranks' operations with it fail with ncclRemoteError."""
        if not self._closed and self._board is not None and self._board.words is not None:
            for r in range(self._size):  # what ranks that were killed left behind
                slot = self._board.slot(r)
                if r != self._rank and proc_start(int(slot[PID])) != int(slot[START]):
                    _shm.sweep(f"{self._prefix}r{r}-")
                    _shm.sweep(f"{self._prefix}p{r}-")
        self._close("aborted", ABORTED)

    def destroy(self):
        self._close("destroyed", DESTROYED)

    def _close(self, how: str, state: int) -> None:
        with LOCK:
            if self._closed:
                return
            self._closed = how
            _LIVE.discard(self)
        try:
            if self._board is not None and self._board.words is not None:
                self._let_peers_read()
        finally:  # even when interrupted while waiting (synk's watchdog, Ctrl-C)
            if self._board is not None and self._board.words is not None:
                self._board.slot(self._rank)[STATE] = state
                self._board.close()
            self._scratch.destroy()
            for name in self._messages:
                _shm.unlink(name)
            self._messages.clear()
            self._peers.release_all()

    def _let_peers_read(self, patience: float = 2.0) -> None:
        """Before this rank's part goes: let live peers that joined the last collective it
        posted finish reading it (on a GPU, data already sent is delivered even if the
        sender then aborts)."""
        board, deadline = self._board, time.monotonic() + patience
        posted = int(board.slot(self._rank)[POSTED])
        while posted and time.monotonic() < deadline:
            waiting = False
            for r in range(self._size):
                slot = board.slot(r)
                if (r != self._rank and int(slot[STATE]) == ATTACHED and int(slot[DONE]) < posted
                        and int(slot[POSTED]) >= posted
                        and proc_start(int(slot[PID])) == int(slot[START])):
                    waiting = True
            if not waiting:
                return
            time.sleep(0.001)

    # ------------------------------------------------------------ operations
    def _buffer(self, ptr: int, count: int, datatype: int, what: str) -> tuple:
        dtype = _dtype(datatype)
        nbytes = int(count) * dtype.itemsize
        try:
            alloc, offset = _core.resolve(int(ptr), nbytes)
        except Exception as err:
            raise nccl_error(ncclInvalidArgument, f"{what}: {err}") from None
        if alloc.device != self._device:
            raise nccl_error(ncclInvalidArgument, f"{what} is on device {alloc.device}; this "
                                                  f"communicator's device is {self._device}")
        return alloc, alloc.buf[offset:offset + nbytes].view(dtype)

    def _stream(self, stream: int):
        state = _core.state_of_ptr(int(stream), self._device)
        if state.device != self._device:
            raise nccl_error(ncclInvalidArgument, f"the stream is on device {state.device}; this "
                                                  f"communicator's device is {self._device}")
        return state

    def _submit(self, part, stream: int, reads: list, writes: list) -> None:
        self._check_open()
        state = self._stream(stream)
        self._ops += 1
        part.op_number = self._ops
        if getattr(_tls, "depth", 0):
            _tls.group.append((state, part, reads, writes))
        else:
            _launch(state, [part], reads, writes)

    def _collective(self, kind: str, send, recv, count, datatype, op, root, stream,
                    send_count=None, recv_count=None) -> None:
        self._check_open()
        if op is not None and op not in _OPS:
            raise nccl_error(ncclInvalidArgument, f"unknown reduction op {op}")
        if root is not None and not 0 <= root < self._size:
            raise nccl_error(ncclInvalidArgument,
                             f"root {root} of a {self._size}-rank communicator")
        reads, writes = [], []
        send_view = recv_view = None
        if send is not None:
            alloc, send_view = self._buffer(send, send_count if send_count is not None else count,
                                            datatype, "sendbuf")
            reads.append(alloc)
        if recv is not None:
            alloc, recv_view = self._buffer(recv, recv_count if recv_count is not None else count,
                                            datatype, "recvbuf")
            writes.append(alloc)
        self._seq += 1
        part = _Collective(self, self._seq, kind, int(count), int(datatype),
                           -1 if op is None else int(op), -1 if root is None else int(root),
                           send_view, recv_view)
        self._submit(part, stream, reads, writes)

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._collective("allReduce", sendbuf, recvbuf, count, datatype, op, None, stream)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        mine = self._rank == root
        self._collective("reduce", sendbuf, recvbuf if mine else None, count, datatype, op,
                         root, stream)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        mine = self._rank == root
        self._collective("broadcast", sendbuff if mine else None, recvbuff, count, datatype,
                         None, root, stream)

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._collective("reduceScatter", sendbuf, recvbuf, recvcount, datatype, op, None,
                         stream, send_count=int(recvcount) * self._size)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._collective("allGather", sendbuf, recvbuf, count, datatype, None, None, stream,
                         recv_count=int(count) * self._size)

    def _peer(self, peer) -> int:
        if not 0 <= peer < self._size or peer == self._rank:
            raise nccl_error(ncclInvalidArgument, f"peer {peer} (this is rank {self._rank} of "
                                                  f"{self._size})")
        return int(peer)

    def send(self, sendbuf, count, datatype, peer, stream):
        self._check_open()
        peer = self._peer(peer)
        alloc, view = self._buffer(sendbuf, count, datatype, "sendbuf")
        number = self._sent[peer] = self._sent.get(peer, 0) + 1
        self._submit(_Send(self, peer, number, int(datatype), view), stream, [alloc], [])

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._check_open()
        peer = self._peer(peer)
        alloc, view = self._buffer(recvbuf, count, datatype, "recvbuf")
        number = self._received[peer] = self._received.get(peer, 0) + 1
        self._submit(_Recv(self, peer, number, int(datatype), view), stream, [], [alloc])

    # ------------------------------------------------------------ progress helpers
    def _fail(self, status: int, detail: str) -> None:
        if self._error is None:
            self._error = nccl_error(status, f"rank {self._rank}: {detail}")

    def _poll_peers(self, force: bool = False, among=None) -> None:
        """Note a peer that died or aborted (checked at most every 50 ms)."""
        now = time.monotonic()
        if self._error is not None or self._closed or self._board is None:
            return
        if not force and now - self._last_liveness < 0.05:
            return
        self._last_liveness = now
        found = []  # a death first: it is the cause when the survivors abort after it
        for r in range(self._size) if among is None else among:
            if r == self._rank:
                continue
            slot = self._board.slot(r)
            state = int(slot[STATE])
            if proc_start(int(slot[PID])) != int(slot[START]) and state == ATTACHED:
                found.append((0, f"rank {r} (process {int(slot[PID])}) died"))
            elif state == ABORTED:
                found.append((1, f"rank {r} aborted the communicator"))
            elif state == DESTROYED and among is not None:
                found.append((1, f"rank {r} destroyed the communicator"))
            elif proc_start(int(slot[PID])) != int(slot[START]):
                found.append((0, f"rank {r} (process {int(slot[PID])}) died"))
        if found:
            self._fail(ncclRemoteError, min(found)[1])

    def _inject(self, number: int) -> bool:
        """Faults set for this operation; True if it must never complete."""
        if _faults.find("kill", self._rank, number):
            os.kill(os.getpid(), signal.SIGKILL)
        fault = _faults.find("async_error", self._rank, number)
        if fault:
            self._fail(fault.get("code", ncclSystemError), "injected by SYNK_SIM_FAULTS")
            return True
        return False

    def _peer_view(self, r: int, nbytes: int) -> np.ndarray:
        slot = self._board.slot(r)
        name = self._scratch.prefix + f"r{r}-{int(slot[GEN])}"
        return self._peers.array(name, nbytes, np.uint8)


def _dtype(datatype: int) -> np.dtype:
    if datatype == NCCL_BFLOAT16:
        raise _core.not_modelled("NCCL_BFLOAT16 (numpy has no bfloat16)")
    if datatype not in _DTYPES:
        raise nccl_error(ncclInvalidArgument, f"unknown datatype {datatype}")
    return np.dtype(_DTYPES[datatype])


class _Collective:
    """One collective on one rank: post this rank's part, then finish with every rank's."""

    def __init__(self, comm, seq, kind, count, datatype, op, root, send, recv) -> None:
        self.comm, self.seq, self.kind, self.count = comm, seq, kind, count
        self.datatype, self.op, self.root, self.send, self.recv = datatype, op, root, send, recv
        self.posted = self.done = False
        self.op_number = 0

    def describe(self) -> str:
        return (f"NCCL {self.kind} #{self.seq} (count {self.count}) on rank {self.comm._rank} "
                f"of {self.comm._size}")

    def _signature(self) -> tuple:
        return (_KINDS.index(self.kind), self.count, self.datatype, self.op, self.root)

    def progress(self) -> bool:
        comm = self.comm
        if self.done or comm._closed:
            return True
        if comm._error is not None:
            return False
        board = comm._board
        if not self.posted:
            if comm._inject(self.op_number):
                return False
            peers = [board.slot(r) for r in range(comm._size)]
            if any(int(s[DONE]) < self.seq - 1 for s in peers):  # still reading my last part
                comm._poll_peers()
                return False
            mine = board.slot(comm._rank)
            if self.send is not None and (self.kind != "broadcast" or comm._rank == self.root):
                data = self.send.reshape(-1).view(np.uint8)
                comm._scratch.ensure(data.nbytes)[...] = data
                mine[NBYTES] = data.nbytes
            else:
                mine[NBYTES] = 0
            mine[GEN] = comm._scratch.gen
            mine[KIND], mine[COUNT], mine[DTYPE], mine[OP], mine[ROOT] = self._signature()
            mine[POSTED] = self.seq
            self.posted = True
        slots = [board.slot(r) for r in range(comm._size)]
        if any(int(s[POSTED]) < self.seq for s in slots):
            comm._poll_peers()
            return False
        signatures = [tuple(int(v) for v in s[KIND:ROOT + 1]) for s in slots]
        if len(set(signatures)) > 1:
            listing = "; ".join(f"rank {r}: {_describe_signature(sig)}"
                                for r, sig in enumerate(signatures))
            comm._fail(ncclInvalidUsage,
                       f"the ranks disagree on collective #{self.seq} ({listing}); "
                                         "on a GPU this would hang or give wrong numbers")
            return False
        try:
            self._finish(slots)
        except FileNotFoundError:  # a peer's part is gone: it aborted or was swept
            comm._fail(ncclRemoteError, f"a peer's part of collective #{self.seq} is gone")
            return False
        board.slot(comm._rank)[DONE] = self.seq
        self.done = True
        return True

    def _finish(self, slots) -> None:
        comm, dtype = self.comm, _dtype(self.datatype)
        parts = [None] * comm._size
        for r, slot in enumerate(slots):
            nbytes = int(slot[NBYTES])
            if nbytes:
                raw = (self.send.reshape(-1).view(np.uint8) if r == comm._rank
                       else comm._peer_view(r, nbytes))
                parts[r] = raw.view(dtype)
        kind, n = self.kind, comm._size
        if kind == "broadcast":
            self.recv[...] = parts[self.root]
        elif kind == "allGather":
            for r in range(n):
                self.recv[r * self.count:(r + 1) * self.count] = parts[r]
        elif kind in ("allReduce", "reduce"):
            if self.recv is not None:
                self.recv[...] = _reduce(self.op, parts, n)
        elif kind == "reduceScatter":
            me, c = comm._rank, self.count
            self.recv[...] = _reduce(self.op, [p[me * c:(me + 1) * c] for p in parts], n)


def _describe_signature(sig: tuple) -> str:
    kind, count, datatype, op, root = sig
    text = f"{_KINDS[kind]} count={count} datatype={datatype}"
    if op >= 0:
        text += f" op={_OP_NAMES.get(op, op)}"
    if root >= 0:
        text += f" root={root}"
    return text


def _reduce(op: int, parts: list, n: int) -> np.ndarray:
    with np.errstate(all="ignore"):
        result = parts[0].copy()
        for part in parts[1:]:
            _OPS[op](result, part, out=result)
        if op == NCCL_AVG:
            if result.dtype.kind == "f":
                result /= result.dtype.type(n)
            elif result.dtype.kind == "u":
                result //= result.dtype.type(n)
            else:  # integer division truncating toward zero, as C does
                result[...] = np.sign(result) * (np.abs(result) // n)
    return result


class _Send:
    """A message to ``peer``: it completes once the peer has received it."""

    def __init__(self, comm, peer, number, datatype, view) -> None:
        self.comm, self.peer, self.number = comm, peer, number
        self.datatype, self.view = datatype, view
        self.posted = self.done = False
        self.name = f"{comm._prefix}p{comm._rank}-{peer}-{number}"

    def describe(self) -> str:
        return (f"NCCL send #{self.number} from rank {self.comm._rank} to rank {self.peer} "
                "(a send completes only when its receive runs: call both inside "
                "groupStart()/groupEnd() when two ranks exchange)")

    def progress(self) -> bool:
        comm = self.comm
        if self.done or comm._closed:
            return True
        if comm._error is not None:
            return False
        pair = comm._board.pair(comm._rank, self.peer)
        if not self.posted:
            if comm._inject(self.op_number):
                return False
            data = self.view.reshape(-1).view(np.uint8)
            shm = _shm._open(self.name, True, 64 + data.nbytes)
            head = np.ndarray(4, np.int64, buffer=shm.buf)
            head[0], head[1], head[2] = self.view.size, self.datatype, 0
            np.ndarray(data.nbytes, np.uint8, buffer=shm.buf, offset=64)[...] = data
            _shm.release(shm)
            comm._messages.append(self.name)
            pair[0] = self.number
            self.posted = True
        received = int(pair[1])
        if received == -self.number:
            comm._fail(ncclInvalidUsage, f"rank {self.peer} expected a different count or "
                                         f"datatype for send #{self.number} from this rank")
            return False
        if received < self.number:
            comm._poll_peers(among=[self.peer])
            return False
        if self.name in comm._messages:
            comm._messages.remove(self.name)
        self.done = True
        return True


class _Recv:
    """Receive the ``number``-th message from ``peer`` into ``view``."""

    def __init__(self, comm, peer, number, datatype, view) -> None:
        self.comm, self.peer, self.number = comm, peer, number
        self.datatype, self.view = datatype, view
        self.done = False
        self.name = f"{comm._prefix}p{peer}-{comm._rank}-{number}"

    def describe(self) -> str:
        return f"NCCL recv #{self.number} on rank {self.comm._rank} from rank {self.peer}"

    def progress(self) -> bool:
        comm = self.comm
        if self.done or comm._closed:
            return True
        if comm._error is not None:
            return False
        pair = comm._board.pair(self.peer, comm._rank)
        if int(pair[0]) < self.number:
            comm._poll_peers(among=[self.peer])
            return False
        shm = _shm.attach(self.name)
        try:
            head = np.ndarray(4, np.int64, buffer=shm.buf)
            count, datatype = int(head[0]), int(head[1])
            if (count, datatype) != (self.view.size, self.datatype):
                comm._fail(ncclInvalidUsage, f"rank {self.peer} sent {count} elements of datatype "
                                             f"{datatype}; this recv expects {self.view.size} of "
                                             f"datatype {self.datatype}")
                pair[1] = -self.number
                return False
            src = np.ndarray(count, _dtype(datatype), buffer=shm.buf, offset=64)
            self.view[...] = src
        finally:
            _shm.release(shm)
            _shm.unlink(self.name)
        pair[1] = self.number
        self.done = True
        return True


@atexit.register
def _leave() -> None:
    """At exit: what this process's unfinished communicators would otherwise leave."""
    for comm in list(_LIVE):
        comm._close("destroyed", DESTROYED)
    for name in list(_PENDING_NAMES):
        _shm.unlink(name)


__all__ = ["NcclCommunicator", "NcclError", "get_unique_id", "get_version",
           "get_build_version", "groupStart", "groupEnd", "available",
           *[n for n in dir() if n.startswith("NCCL_")]]
