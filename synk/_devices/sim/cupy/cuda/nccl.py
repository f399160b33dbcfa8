"""Simulated ``cupy.cuda.nccl``: communicators between real processes, through shared memory
(the board, ``_board``), or over TCP where the ranks share no ``/dev/shm`` (``_net``), that
follow the real library's rules by version (``_nccl_rules``) and report what a GPU would
hang on or compute wrong in the simulator's own errors::

    allReduce(...) --queued on its stream (_nccl_ops)--> this rank posts its part
        --> done once every rank it needs has posted (read in place on the board)
"""
from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import threading
import time

import numpy as np

from ..... import _settings
from ....._wire import shm as _shm
from ... import _core, _faults, _memory, _nccl_ops as ops, _nccl_rules as rules, _net
from ..._board import (
    ABORTED,
    ATTACHED,
    CONNECTED,
    DESTROYED,
    DEVICE,
    DONE,
    HOST,
    INIT,
    PASSED,
    PID,
    POSTED,
    REFUSED,
    START,
    STATE,
    Board,
    Scratch,
    SwitchToNetwork,
    proc_start,
)
from ..._core import LOCK
from ..._errors import (
    CUDARuntimeError,
    NcclError,
    SimulatedHang,
    SimulatorError,
    nccl_error,
    ncclInvalidArgument,
    ncclInvalidUsage,
    ncclRemoteError,
    ncclSystemError,
    ncclUnhandledCudaError,
)
from ..._netboard import NetBoard, NetScratch

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

_BUILD_VERSION = 22501  # what CuPy 14.2's wheels were built against (get_build_version())
_ID_MAGIC = b"SYNKSIM1"
_ID_BYTES = 128
_prefix_override: list = []
_LIVE: set = set()  # communicators of this process not yet destroyed or aborted
_PENDING_NAMES: set = set()  # segment names this process would leave if it exited now
_tls = threading.local()


def get_version():
    """NCCL's version: the installed NCCL wheel's (``SYNK_SIM_NCCL_VERSION`` lets tests
    pretend another one)."""
    return rules.version()


def get_build_version():
    return _BUILD_VERSION


def get_unique_id():
    """A fresh communicator id (128 bytes): it names the shared memory the ranks meet in,
    and carries the address of the root that ranks on other hosts call (``_net``): as
    ``ncclGetUniqueId``, it starts that root, listening on the interface NCCL would pick."""
    if _prefix_override:
        prefix = f"{_prefix_override[0]}nccl{secrets.token_hex(4)}-"
    else:
        prefix = f"{_shm.PREFIX}{os.getpid()}-{secrets.token_hex(8)}-nccl-"
    raw = _ID_MAGIC + prefix.encode()
    if len(raw) > _ID_BYTES - 16:
        raise ValueError(f"segment prefix {prefix!r} is too long for an NCCL unique id")
    tail, root = _net.new_id_tail(prefix)
    comm_id = raw + b"\0" * (_ID_BYTES - 16 - len(raw)) + tail
    if root is not None:
        root.start(comm_id)
    return comm_id


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
    """Launch the group's operations: connections they need first (blocking, see
    ``NcclCommunicator._connect``), then one piece of work per stream."""
    depth = getattr(_tls, "depth", 0)
    if depth == 0:
        raise nccl_error(ncclInvalidUsage, "groupEnd() without groupStart()")
    _tls.depth = depth - 1
    if _tls.depth:
        return
    group, _tls.group = _tls.group, []
    for comm in {id(item[1].comm): item[1].comm for item in group}.values():
        with comm._inside("ncclGroupEnd"):
            comm._connect([item[1] for item in group if item[1].comm is comm])
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
    _core.enqueue(state, ops.Work(parts))


_DEATH_FIRST_S = 0.5  # how long a peer's abort over the network waits for a death to report

class NcclConfig:
    """Configuration of a communicator (CuPy exposes only ``split_share``; the simulator
    accepts it and changes nothing)."""

    def __init__(self, split_share=0):
        self._split_share = int(split_share)

    @property
    def split_share(self):
        return self._split_share


class NcclCommunicator:
    """A simulated communicator for one device, in one process of ``ndev``; its operations are
    queued on their stream like NCCL's kernels (``_nccl_ops``). A peer that died is
    ncclRemoteError, as is one that aborted or destroyed it over the network; one on the same
    host that did goes unnoticed (``_peer_gone``): what needs it never completes until the
    communicator is aborted, and waiting on it raises ``SimulatedHang`` at once, with the reason."""

    def __init__(self, ndev, commId, rank, config=None):
        if config is not None and not isinstance(config, NcclConfig):
            raise TypeError(f"config must be an NcclConfig, not {type(config).__name__}")
        prefix = _prefix_of(commId)
        if not 0 <= rank < ndev:
            raise nccl_error(ncclInvalidArgument, f"rank {rank} of a {ndev}-rank communicator")
        self._rank, self._size, self._prefix = int(rank), int(ndev), prefix
        self._device = _core.check_device(_core.current_device())
        _core.check_sticky(self._device)
        self._params = rules.params()  # NCCL reads its variables once per process
        self._error: NcclError | None = None
        # a bug whose outcome NCCL leaves undefined (a hang, or wrong numbers), with no status
        # of NCCL's: check_async_error() raises SimulatorError saying so
        self._undefined: str | None = None
        self._gone: dict = {}  # peer -> why it never takes part again, unnoticed by NCCL
        self._closed = ""  # "aborted" / "destroyed"
        self._starved: str | None = None  # why every operation would hang
        self._seq = 0  # collectives launched
        self._ops = 0  # NCCL operations launched (numbering for fault injection)
        self._sent: dict = {}  # peer -> messages launched to it
        # collective -> the bytes this rank gave it (count times the datatype's size): what
        # a GPU's NCCL would move for it (a count, not a rule: tests read it)
        self.bytes_given: dict[str, int] = {}
        self._received: dict = {}  # peer -> receives launched from it
        self._connected: set = set()  # algorithms and peers connected so far
        self._nvls = self._one_gpu_per_host = False  # (set in _join)
        self._messages: list = []  # segments of messages sent, not known to be received
        self._threads: dict = {}  # thread ident -> the NCCL call it is inside
        self._last_liveness = 0.0
        self._aborts_seen: dict = {}  # peer -> when its abort was first seen (network)
        self._scratch = Scratch(prefix, self._rank)
        if _faults.find("kill_init", self._rank):
            os.kill(os.getpid(), signal.SIGKILL)
        if _faults.find("hang_init", self._rank):
            while True:  # a rank stuck inside ncclCommInitRank
                time.sleep(3600)
        deadline = time.monotonic() + _settings.sim_hang_timeout()
        self._board = None
        _PENDING_NAMES.add(prefix + "board")
        try:
            if _net.on_this_board(commId, self._params):
                try:
                    self._board = Board(prefix, self._size, deadline)
                    self._join(deadline)
                except SwitchToNetwork:  # a rank elsewhere called the root: meet over TCP
                    self._board.close()  # (the root removes it)
                    self._board = None
                    self._join_network(commId, deadline)
                else:
                    if self._rank == 0:
                        _net.shm_met(commId, prefix)
            else:
                self._join_network(commId, deadline)
        except BaseException:
            if self._board is None or not self._board.network:
                _shm.unlink(prefix + "board")
            _PENDING_NAMES.discard(prefix + "board")
            _net.give_up(prefix)
            if self._board is not None:
                self._board.slot(self._rank)[STATE] = DESTROYED
                self._board.close()
            self._scratch.destroy()
            raise
        _PENDING_NAMES.discard(prefix + "board")
        _LIVE.add(self)

    def _join_network(self, commId: bytes, deadline: float) -> None:
        """Join over TCP (``_net``): call the root, connect to every peer, then join on a
        board kept in step over those connections."""
        peers = _net.mesh(commId, self._size, self._rank, deadline)
        self._board = NetBoard(self._prefix, self._size, self._rank, peers)
        self._scratch = NetScratch(self._board)
        self._join(deadline)

    @staticmethod
    def initAll(devices):
        """Communicators for several devices of this process (``ncclCommInitAll``): an int
        (the first n devices) or a list of devices; rank i on the i-th."""
        if isinstance(devices, list):
            devlist = devices
        elif isinstance(devices, int):
            devlist = list(range(devices))
        else:
            raise ValueError('"devices" should be an int or a list of int.')
        uid, comms, errors = get_unique_id(), [None] * len(devlist), []

        def join(i, device):
            try:
                _core.set_device(device)
                comms[i] = NcclCommunicator(len(devlist), uid, i)
            except BaseException as err:  # raised below, in the caller's thread
                errors.append(err)

        threads = [threading.Thread(target=join, args=(i, d), daemon=True)
                   for i, d in enumerate(devlist)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            for comm in comms:
                if comm is not None:
                    comm.destroy()
            raise errors[0]
        return comms

    def _join(self, deadline: float) -> None:
        board, me = self._board, self._rank
        mine = board.slot(me)
        pid = os.getpid()
        if mine[STATE] != 0 and mine[PID] != pid:
            raise nccl_error(ncclInvalidUsage, f"rank {me} joined this communicator twice "
                                               f"(processes {int(mine[PID])} and {pid})")
        physical = _core.visible()[self._device]  # the GPU, whatever CUDA_VISIBLE_DEVICES says
        mine[PID], mine[START], mine[DEVICE] = pid, proc_start(pid) or 0, physical
        mine[HOST] = rules.host_hash()
        mine[STATE] = ATTACHED
        board.publish()
        self._await(lambda: all(int(board.slot(r)[STATE]) != 0 for r in range(self._size)),
                    deadline, lambda: "ranks " + str(
                        [r for r in range(self._size) if int(board.slot(r)[STATE]) == 0])
                    + " never joined the communicator", board.check_switch)
        board.unlink()  # everyone has it mapped
        devices = [(int(board.slot(r)[HOST]), int(board.slot(r)[DEVICE]))
                   for r in range(self._size)]  # a GPU is a device of a host
        params = self._params
        refused = rules.shared_gpu_refusal(get_version(), me, devices,
                                           params["NCCL_MULTI_RANK_GPU_ENABLE"],
                                           params["NCCL_NVLS_ENABLE"])
        if refused is None:
            refused = rules.nvls_refusal(get_version(), devices, params["NCCL_NVLS_ENABLE"])
        if refused is not None:
            mine[INIT] = REFUSED
            board.publish()
            raise nccl_error(ncclInvalidUsage, refused)
        mine[INIT] = PASSED
        board.publish()
        self._await(lambda: all(int(board.slot(r)[INIT]) == PASSED for r in range(self._size)),
                    deadline, lambda: "ranks " + str(
                        [r for r in range(self._size) if int(board.slot(r)[INIT]) != PASSED])
                    + " failed their set-up (NCCL refused them) or never finished it, and the "
                      "others wait for them in the next bootstrap step")
        self._starved = rules.starved(devices, params["NCCL_MAX_CTAS"])
        self._nvls = rules.nvls_on(get_version(), devices, params["NCCL_NVLS_ENABLE"])
        hosts = [h for h, _ in devices]
        self._one_gpu_per_host = len(set(hosts)) == len(hosts)
        if (not params["NCCL_RUNTIME_CONNECT"]
                or get_version() < rules.RUNTIME_CONNECT_FROM):
            self._connected.update(rules.ALGORITHMS)  # every algorithm connected at set-up

    def _await(self, done, deadline: float, missing, check=None) -> None:
        while not done():
            if check is not None:
                check()
            if time.monotonic() > deadline:
                raise SimulatedHang(f"NcclCommunicator() would hang forever on a GPU: "
                                    f"{missing()} (after {_settings.sim_hang_timeout():g} s, "
                                    "SYNK_SIM_HANG_TIMEOUT)")
            time.sleep(0.002)

    # ------------------------------------------------------------ calls and threads
    @contextlib.contextmanager
    def _inside(self, call: str):
        """``with``: this thread is inside NCCL's ``call`` on this communicator (which must be
        open): ``_threads`` says so while it runs (the outermost call, when nested)."""
        if self._closed:
            raise nccl_error(ncclInvalidArgument, f"{call}: the communicator was "
                                                  f"{self._closed} (its handle is NULL)")
        me = threading.get_ident()
        outer = self._threads.get(me)
        self._threads[me] = call if outer is None else outer
        try:
            yield
        finally:
            if outer is None:
                self._threads.pop(me, None)
            else:
                self._threads[me] = outer

    def _connect(self, parts: list) -> None:
        """Connect what ``parts`` need for the first time (an algorithm, a peer), as NCCL
        >= 2.22 does inside the call: this thread blocks until the peers connect it too.
        Nothing reliably ends the wait: an abort from another thread leaves it blocked
        (NCCL: "might hang forever"); the simulator ends it with ``SimulatedHang`` after its
        hang timeout, where a GPU may never end it."""
        needs = []
        for part in parts:
            if isinstance(part, ops.Collective):
                need = part.algorithm
            elif part.peer != self._rank:
                need = part.peer
            else:
                continue
            if need not in self._connected and need not in needs:
                needs.append(need)
        if not needs:
            return
        board, me = self._board, self._rank
        for need in needs:
            if isinstance(need, str):
                board.slot(me)[CONNECTED] |= 1 << rules.ALGORITHMS.index(need)
            else:
                board.pair(me, need)[2] = 1
        board.publish()

        def arrived(need) -> bool:
            if isinstance(need, str):
                bit = 1 << rules.ALGORITHMS.index(need)
                return all(int(board.slot(r)[CONNECTED]) & bit for r in range(self._size))
            return bool(board.pair(need, me)[2])

        me_thread = threading.get_ident()
        outer = self._threads.get(me_thread)
        self._threads[me_thread] = "connect"
        try:
            deadline = time.monotonic() + _settings.sim_hang_timeout()
            while True:
                with LOCK:  # (abort() marks the communicator closed under it, then unmaps)
                    if not self._closed and all(arrived(n) for n in needs):
                        break
                if time.monotonic() > deadline:
                    with LOCK:
                        late = needs if self._closed else [n for n in needs if not arrived(n)]
                    aborted = (f" The communicator was {self._closed} from another thread "
                               "meanwhile, which does not free a blocking communicator's "
                               "caller: 'the thread can possibly get stuck inside NCCL calls "
                               "... NCCL communicators might hang forever' (NCCL's "
                               "usage/communicators.rst, Fault Tolerance)."
                               if self._closed else "")
                    raise SimulatedHang(
                        f"rank {me} would block forever inside NCCL (in C, no timeout): its "
                        f"first use of {_describe_needs(late)} connects on first use (NCCL >= "
                        "2.22, NCCL_RUNTIME_CONNECT=1) and waits until every peer connects it "
                        "too; a peer that raised, died or never calls it leaves this thread "
                        "stuck. Set NCCL_RUNTIME_CONNECT=0 to connect every algorithm in "
                        f"ncclCommInitRank.{aborted} (waited {_settings.sim_hang_timeout():g} s, "
                        "SYNK_SIM_HANG_TIMEOUT)")
                time.sleep(0.002)
        finally:
            self._threads[me_thread] = outer
        self._connected.update(needs)

    # ------------------------------------------------------------ queries
    @property
    def comm(self):
        return 0 if self._closed else id(self)

    def rank_id(self):
        with self._inside("ncclCommUserRank"):
            return self._rank

    def size(self):
        with self._inside("ncclCommCount"):
            return self._size

    def device_id(self):
        with self._inside("ncclCommCuDevice"):
            return self._device

    def check_async_error(self):
        """Raise the error of an operation that failed asynchronously, if any; ncclInvalidArgument
        after ``abort()`` or ``destroy()`` (a NULL communicator in CuPy); for ranks that disagree
        the simulator's own ``SimulatorError`` (``_undefined_behaviour``), never an ``NcclError`` a
        program could take for NCCL's. A peer on this host that aborted goes unnoticed, as in NCCL
        (``_poll_peers``)."""
        with self._inside("ncclCommGetAsyncError"):
            for state in _core.all_states():
                if state.device == self._device and state.pending:
                    _core.progress(state)
            self._poll_peers(force=True)
            if self._undefined is not None:
                raise SimulatorError(self._undefined)
            if self._error is not None:
                error = NcclError(self._error.status)  # a new one each time, as CuPy raises
                error.args = self._error.args
                raise error

    # ------------------------------------------------------------ teardown
    def abort(self):
        """Abort the communicator (``ncclCommAbort``): its unfinished operations end (their
        results undefined) and the other ranks' fail with ncclRemoteError. A thread of this
        process blocked inside it connecting stays blocked (NCCL: a blocking communicator's
        caller "might hang forever"). It frees the communicator: a thread inside any other
        call of it would use freed memory."""
        if not self._closed and self._board is not None and self._board.words is not None:
            self._board.sweep_dead()  # what ranks that were killed left behind
        self._close("aborted", ABORTED)

    def destroy(self):
        self._close("destroyed", DESTROYED)

    def _close(self, how: str, state: int) -> None:
        with LOCK:
            if self._closed:
                return
            self._closed = how
            _LIVE.discard(self)
        me = threading.get_ident()
        blocked = {t for t, what in list(self._threads.items()) if what == "connect"}
        inside = {t: what for t, what in list(self._threads.items())
                  if t != me and t not in blocked}  # (a blocked caller stays blocked: above)
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
        if inside:
            calls = ", ".join(sorted(set(inside.values())))
            raise SimulatorError(
                f"the communicator was {how} (ncclComm{'Abort' if how == 'aborted' else 'Destroy'}"
                f", which frees it) while another thread was inside {calls} on it: on a GPU "
                "that thread would use freed memory. Let NCCL calls on a communicator finish "
                "(a lock) before freeing it; only a thread blocked while connecting may be "
                "freed by an abort.")

    def _let_peers_read(self) -> None:
        """Before this rank's part goes: let live peers that joined the last collective it
        posted finish reading it, for up to 2 s (on a GPU, data already sent is delivered
        even if the sender then aborts)."""
        board, deadline = self._board, time.monotonic() + 2.0
        posted = int(board.slot(self._rank)[POSTED])
        while posted and time.monotonic() < deadline:
            if not any(r != self._rank and int((slot := board.slot(r))[STATE]) == ATTACHED
                       and int(slot[DONE]) < posted <= int(slot[POSTED]) and board.alive(r)
                       for r in range(self._size)):
                return
            time.sleep(0.001)

    # ------------------------------------------------------------ operations
    def _buffer(self, ptr: int, count: int, datatype: int, what: str) -> tuple:
        """(its allocation or None, a numpy view of it, why it is an illegal address or None).
        NCCL checks pointers only with NCCL_CHECK_POINTERS=1; otherwise a bad one faults in
        its kernel."""
        dtype = ops.dtype_of(datatype)
        nbytes = int(count) * dtype.itemsize
        if nbytes == 0:
            return None, np.empty(0, dtype), None
        try:
            alloc, offset = _memory.resolve(int(ptr), nbytes)
            if alloc.device != self._device:
                raise ValueError(f"it is memory of device {alloc.device}; this communicator's "
                                 f"device is {self._device}")
        except (CUDARuntimeError, ValueError) as err:
            if self._params["NCCL_CHECK_POINTERS"] == 1:
                raise nccl_error(ncclInvalidArgument, f"{what}: {err}") from None
            return None, None, f"{what} at {int(ptr):#x}: {err}"
        return alloc, alloc.buf[offset:offset + nbytes].view(dtype), None

    def _stream(self, stream: int):
        state = _core.state_of_ptr(int(stream), self._device)
        if state.device != self._device:
            raise nccl_error(ncclInvalidArgument, f"the stream is on device {state.device}; this "
                                                  f"communicator's device is {self._device}")
        if _core.sticky(self._device):
            raise nccl_error(ncclUnhandledCudaError, f"device {self._device} has a sticky CUDA "
                                                     f"error ({_core.sticky(self._device)})")
        return state

    def _submit(self, part, stream: int, reads: list, writes: list) -> None:
        """Launch ``part`` on ``stream`` (in a group: at its end), reading and writing the
        allocations ``reads`` and ``writes`` (None: none)."""
        reads, writes = [a for a in reads if a is not None], [a for a in writes if a is not None]
        state = self._stream(stream)
        self._ops += 1
        part.op_number = self._ops
        if getattr(_tls, "depth", 0):
            _tls.group.append((state, part, reads, writes))
        else:
            self._connect([part])
            _launch(state, [part], reads, writes)

    def _collective(self, call: str, kind: str, send, recv, count, datatype, op, root,
                    stream, send_count=None, recv_count=None) -> None:
        with self._inside(call):
            if op is not None and op not in ops.OPS:
                raise nccl_error(ncclInvalidArgument, f"{call}: invalid reduction operation "
                                                      f"{op}")
            if root is not None and not 0 <= root < self._size:
                raise nccl_error(ncclInvalidArgument, f"{call}: invalid root {root} (root "
                                 f"should be in the 0..{self._size} range)")
            itemsize = ops.dtype_of(datatype).itemsize
            if int(count) == 0:
                return  # "Empty collectives can be discarded" (src/enqueue.cc)
            send_count = count if send_count is None else send_count
            read, send_view, bad = (None, None, None) if send is None else self._buffer(
                send, send_count, datatype, "sendbuf")
            written, recv_view, why = (None, None, None) if recv is None else self._buffer(
                recv, count if recv_count is None else recv_count, datatype, "recvbuf")
            self._seq += 1
            self.bytes_given[kind] = self.bytes_given.get(kind, 0) + int(send_count) * itemsize
            part = ops.Collective(self, self._seq, kind, int(count), int(datatype),
                                  -1 if op is None else int(op),
                                  -1 if root is None else int(root), send_view, recv_view)
            part.bad = bad or why
            part.algorithm = rules.algorithm(kind, int(count) * itemsize, self._nvls,
                                             self._one_gpu_per_host)
            self._submit(part, stream, [read], [written])

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self._collective("ncclAllReduce", "allReduce", sendbuf, recvbuf, count, datatype, op,
                         None, stream)

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        mine = self._rank == root
        self._collective("ncclReduce", "reduce", sendbuf, recvbuf if mine else None, count,
                         datatype, op, root, stream)

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        mine = self._rank == root
        self._collective("ncclBroadcast", "broadcast", sendbuff if mine else None, recvbuff,
                         count, datatype, None, root, stream)

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._collective("ncclReduceScatter", "reduceScatter", sendbuf, recvbuf, recvcount,
                         datatype, op, None, stream, send_count=int(recvcount) * self._size)

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._collective("ncclAllGather", "allGather", sendbuf, recvbuf, count, datatype, None,
                         None, stream, recv_count=int(count) * self._size)

    def send(self, sendbuf, count, datatype, peer, stream):
        self._p2p("ncclSend", ops.Send, sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf, count, datatype, peer, stream):
        self._p2p("ncclRecv", ops.Recv, recvbuf, count, datatype, peer, stream)

    def _p2p(self, call: str, kind, buf, count, datatype, peer, stream) -> None:
        sending = kind is ops.Send
        with self._inside(call):
            if not 0 <= peer < self._size:
                raise nccl_error(ncclInvalidArgument, f"{call}: peer {peer} of a "
                                                      f"{self._size}-rank communicator")
            peer = int(peer)
            alloc, view, bad = self._buffer(buf, count, datatype,
                                            "sendbuf" if sending else "recvbuf")
            numbers = self._sent if sending else self._received
            number = numbers[peer] = numbers.get(peer, 0) + 1
            part = kind(self, peer, number, int(datatype), view)
            part.bad = bad
            self._submit(part, stream, [alloc if sending else None], [None if sending else alloc])

    # ------------------------------------------------------------ progress helpers
    def _fail(self, status: int, detail: str) -> None:
        if self._error is None:
            self._error = nccl_error(status, f"rank {self._rank}: {detail}")

    def _undefined_behaviour(self, detail: str) -> None:
        """Ranks that disagree on an operation (its kind, count, datatype, op, root; a send's count
        or datatype): NCCL compares nothing and returns no status, "undefined behavior, including
        hangs, crashes, or data corruption" (docs/userguide/source/usage/collectives.rst v2.30.7-1
        lines 5-6; a send and its recv "with the same count and data type", usage/p2p.rst lines
        12-14)."""
        if self._undefined is None:
            self._undefined = (f"rank {self._rank}: {detail}. NCCL does not check that the ranks "
                               "agree and gives no status for it: on a GPU this would hang or "
                               "give wrong numbers (undefined behaviour), so the simulator "
                               "reports it as its own error, not as an NcclError")

    def _peer_gone(self, r: int, why: str) -> None:
        """Peer ``r`` aborted or destroyed the communicator: over the network its connections close
        (ncclRemoteError, src/misc/socket.cc v2.30.7-1 line 60); within a node nothing notices, as
        ncclCommGetAsyncError reads the communicator's and its proxy's results only (src/init.cc
        line 3453) and the proxy only logs a closed connection (src/proxy.cc line 1879): the
        operations that need it never complete."""
        if self._board.network:
            self._fail(ncclRemoteError, why)
        else:
            self._gone.setdefault(r, why)

    def _poll_peers(self, force: bool = False, among=None) -> None:
        """Note a peer that died, aborted or destroyed the communicator (checked at most
        every 50 ms)."""
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
            alive = self._board.alive(r)
            if state in (ABORTED, DESTROYED) and not self._board.network:
                how = "aborted" if state == ABORTED else "destroyed"
                self._peer_gone(r, f"rank {r} {how} the communicator")
                continue
            if state == ABORTED:
                # (over the network a death reaches this rank on its own connection, which
                # the abort it caused may overtake: an abort is reported once it has been
                # seen for _DEATH_FIRST_S with no death, so that the death is the cause)
                seen = self._aborts_seen.setdefault(r, now)
                if now - seen >= _DEATH_FIRST_S:
                    found.append((1, f"rank {r} aborted the communicator"))
            elif state == DESTROYED and among is not None:
                found.append((1, f"rank {r} destroyed the communicator"))
            elif not alive:
                found.append((0, f"rank {r} (process {int(slot[PID])}) died"))
        if found:
            self._fail(ncclRemoteError, min(found)[1])

    def _inject(self, number: int) -> bool:
        """Faults set for this operation; True if it must never complete."""
        if _faults.find("kill", self._rank, number):
            os.kill(os.getpid(), signal.SIGKILL)
        fault = _faults.find("cuda_error", self._rank, number)
        if fault:  # NCCL's kernel faults: the device's context is corrupted
            _core.set_sticky(self._device, fault.get("code", 700))
            return True
        fault = _faults.find("async_error", self._rank, number)
        if fault:
            self._fail(fault.get("code", ncclSystemError), "injected by SYNK_SIM_FAULTS")
            return True
        return False

    def _peer_view(self, r: int, nbytes: int) -> np.ndarray:
        return self._board.peer_part(r, int(self._board.slot(r)[ops.GEN]), nbytes)


def _describe_needs(needs: list) -> str:
    return ", ".join(f"{n} on this communicator" if isinstance(n, str)
                     else f"send/recv with rank {n}" for n in needs)


@atexit.register
def _leave() -> None:
    """At exit: what this process's unfinished communicators would otherwise leave."""
    for comm in list(_LIVE):
        comm._threads.clear()
        comm._close("destroyed", DESTROYED)
    for name in list(_PENDING_NAMES):
        _shm.unlink(name)


__all__ = ["NcclCommunicator", "NcclConfig", "NcclError", "get_unique_id", "get_version",
           "get_build_version", "groupStart", "groupEnd", "available",
           *[n for n in dir() if n.startswith("NCCL_")]]
