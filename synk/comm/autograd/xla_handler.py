"""synk's XLA FFI target on the CPU (``csrc/jax_ffi.cc``, built at install as
``synk.comm.autograd._jax_ffi``), which every ``synk.comm`` operation of a compiled function
calls: it calls the operation's Python function (``add``) with XLA's buffers, in place; what
that raises is kept (``callback_errors``), its text in XLA's error.

An allreduce the board can carry (``Allreduce``: a sum or product of one array of float32,
float64, int32 or int64) is posted here, in Python, with the bookkeeping of any collective
(``BEGIN``); the target waits for the peers' posts and combines them in rank order, as
``host_collectives`` does, then hands back (``END``), or, past the wait's budget or where the
headers differ, hands the collective to ``host_collectives.allreduce`` (``FINISH``). A small
``sendrecv`` between ranks with rings (``SendRecv``) is the same: Python holds the rings at
``BEGIN``, the target puts the message sent and takes the one received, or hands the
rest to Python (``FINISH``); either way ``END``/``FINISH`` gives the rings back, and after
a call that raised, ``ABANDON`` does (an interrupt may cut a hand-back short). Where the
target put and took both messages, ``END`` lends it the two lanes (``Lease``) until Python
next touches them (``shm_mesh``'s ``recall_in``, ``recall_out``, ``recall_all``): the same
sendrecv, and any other on those lanes in the same generation of the call, then runs in the
target alone, and Python is called only where it does not end there (``OWED``)."""
from __future__ import annotations

import ctypes
import importlib.util
import itertools
import math
import pickle
import threading
import time
import weakref
from typing import Any

import numpy as np

from ..._wire import ring as _ring
from ...errors import SynkError
from .. import context as _context, route as _route
from ..host import host_collectives as _host, shm_board as _board
from . import callback_errors as _callback_errors

TARGET = "synk_comm"
_MESSAGE = 4096  # the bytes of an error's text the target hands XLA (csrc/jax_ffi.cc)
_RUN = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p),
                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                        ctypes.POINTER(ctypes.c_int64))
BEGIN, END, FINISH, ABANDON, OWED = 0, 1, 2, 3, 4  # the target's calls (csrc/jax_ffi.cc's
# Stage; ABANDON follows a call that raised: what BEGIN holds is let go, where it still is;
# OWED, a leased sendrecv that sent its message and did not end)
_FUNCTIONS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # number -> fn
# (while its executable holds it)
_NUMBERS = itertools.count(1)
_LOADED: list = []  # the run function's address, once the target is registered
_SWAP: list = []  # the library's compare-and-swap of a lease's state (csrc's SynkSwap)


@_RUN
def _from_xla(number, stage, inputs, outputs, message, result):
    """The operation's function on its buffers' addresses, what it returns in ``result``
    (left at -1 where it raised)."""
    try:
        result[0] = _FUNCTIONS[number](stage, inputs, outputs)
    except BaseException as exc:
        _callback_errors.keep(exc)
        text = f"{type(exc).__name__}: {str(exc)[:_callback_errors.SAID]}".encode(errors="replace")
        text = text[:_MESSAGE - 1].decode(errors="ignore").encode() + b"\0"
        ctypes.memmove(message, text, len(text))


def add(fn, keep_with) -> dict:
    """The target's attributes for an operation running ``fn(stage, inputs, outputs)``
    (``Whole``, ``Allreduce``; the buffers' addresses: ``view`` makes arrays of them), kept
    as long as ``keep_with`` (the module's host callbacks: the executable's) holds it."""
    if not _LOADED:
        _register()
    number = next(_NUMBERS)
    _FUNCTIONS[number] = fn
    keep_with(fn)
    lease = ctypes.addressof(fn.descriptor) if isinstance(fn, SendRecv) else 0
    return {"index": np.int64(number), "run": np.int64(_LOADED[0]), "lease": np.int64(lease)}


def _register() -> None:
    import jax

    spec = importlib.util.find_spec(f"{__package__}._jax_ffi")
    if spec is None or spec.origin is None:
        raise SynkError(
            "synk.comm under jax.jit on the CPU runs through synk's compiled XLA handler, which "
            "was not built when synk was installed (the build needs a C++17 compiler, such as "
            "g++). Install one, then reinstall synk (pip install --force-reinstall --no-deps "
            "synk); or call synk.comm outside jax.jit")
    library = ctypes.CDLL(spec.origin)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.SynkComm), platform="cpu")
    swap = library.SynkSwap
    swap.argtypes, swap.restype = (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64), ctypes.c_int64
    _SWAP.append(swap)
    _LOADED.append(ctypes.cast(_from_xla, ctypes.c_void_p).value)


def spec(shape, dtype) -> tuple:
    """``view``'s description of an array: its shape, dtype, and its bytes' ctypes type."""
    dtype, shape = np.dtype(dtype), tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    return shape, dtype, (ctypes.c_char * nbytes) if nbytes else None


def view(address: int | None, spec: tuple, writable: bool) -> np.ndarray:
    """The array of ``spec`` (``spec()``) in XLA's buffer at ``address``."""
    shape, dtype, block = spec
    if block is None or not address:
        return np.empty(shape, dtype)
    array = np.frombuffer(block.from_address(address), dtype)
    if len(shape) != 1:
        array = array.reshape(shape)
    if not writable:
        array.flags.writeable = False
    return array


class Whole:
    """An operation run whole in Python: ``on_host(inputs, outputs)`` at ``BEGIN``."""

    __slots__ = ("on_host", "__weakref__")

    def __init__(self, on_host) -> None:
        self.on_host = on_host

    def __call__(self, stage: int, inputs, outputs) -> int:
        if stage == BEGIN:
            self.on_host(inputs, outputs)
        return 0


OPS = {"sum": 0, "prod": 1}  # csrc/jax_ffi.cc's kOp, kType
TYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2,
         np.dtype(np.int64): 3}
BOARD, LANE = 0, 1  # what a descriptor describes, its first word (csrc/jax_ffi.cc's Kind)
(_KIND, _WORD, _BASE, _RANK, _SIZE, _SLOTS, _LINE, _STEP, _HEAD, _HEAD_LEN, _BUDGET, _SEQ_BITS,
 _OP, _TYPE, _COUNT, _FIELDS) = range(16)  # a board's descriptor (csrc/jax_ffi.cc's Field)
(_LANE_AT, _DATA_AT, _CAPACITY, _TAIL, _NUMBER, _META_AT, _META_LEN, _BYTES, _LANE_BUDGET,
 _TAKEN, _OUT_AT, _OUT_HEAD, _OUT_SEEN, _SENT_NUMBER, _SENT, _WAKE, _IN_LEASE, _OUT_LEASE,
 _GENERATION, _OUT_LANE, _LANE_FIELDS) = range(1, 22)  # a sendrecv's (csrc's LaneField)
_FREE, _LENT, _BUSY = 0, 1, 2  # a lease's state (csrc/jax_ffi.cc's LeaseState)


class Lease:
    """A lane of a mesh, lent to the target between sendrecvs: its words (csrc/jax_ffi.cc's
    LeaseWord: state, generation, position, seen, messages) hold the lane's state meanwhile."""

    __slots__ = ("words", "at")

    def __init__(self) -> None:
        self.words = (ctypes.c_int64 * 5)()
        self.at = ctypes.addressof(self.words)

    def lend(self, generation: int, position: int, seen: int, messages: int) -> None:
        w = self.words
        w[1], w[2], w[3], w[4] = generation, position, seen, messages
        _SWAP[0](self.at, _FREE, _LENT)

    def take_back(self) -> tuple[int, int, int]:
        """(position, seen, messages), once no sendrecv holds the lane (one that does ends
        within its wait's budget)."""
        while _SWAP[0](self.at, _LENT, _FREE) == _BUSY:
            time.sleep(0)
        w = self.words
        return w[2], w[3], w[4]


_LEASES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # mesh -> {(side, peer):
# its Lease} (side 0: the lane from peer, 1: the lane to it)


def _leases(mesh, source: int, dest: int) -> tuple[Lease, Lease]:
    """The leases of ``mesh``'s lanes from ``source`` and to ``dest``."""
    table = _LEASES.get(mesh)
    if table is None:
        table = _LEASES[mesh] = {}
    return (table.get((0, source)) or table.setdefault((0, source), Lease()),
            table.get((1, dest)) or table.setdefault((1, dest), Lease()))


def _running(alone: bool = True):
    """The running call's context, where the target may wait for its peers itself: in the
    call's own group, with no non-blocking collective under way and (``alone``) on the
    share's thread, no other thread having called synk.comm in the call (a collective's
    number is drawn in the order of Python's calls); else None. (A message's rings are held
    for the target, as for any thread that reads or writes them: XLA runs a computation on
    a thread of its own at times, even from part of the way through.)"""
    c = _context.current
    if (c.active and c.size > 1 and not c.sliced and not c.lanes and _context.now() is c
            and not (alone and (c.threaded or threading.get_ident() != c.thread))):
        return c
    return None


def _address(memory: memoryview) -> int:
    return np.frombuffer(memory, np.uint8).ctypes.data


class _Poll:
    """The target's wait, as the thread's ``Waiter`` (``_wire.waiting``) sees it: its
    budget, and how it ended (a wait past its budget a miss; one that ended early, on
    another message, neither)."""

    __slots__ = ("waiter", "budget", "start")

    def __init__(self) -> None:
        self.waiter: Any = None
        self.budget = self.start = 0.0

    def begin(self, waiter) -> int:
        """The budget in nanoseconds, from now."""
        self.waiter, self.budget = waiter, waiter.outside()
        self.start = time.perf_counter()
        return int(self.budget * 1e9)

    def end(self, ended: bool) -> None:
        took = time.perf_counter() - self.start
        if ended or (self.budget and took >= self.budget):
            self.waiter.polled(took, ended)


class Allreduce(Whole):
    """An allreduce of one array of ``spec`` by ``op`` (of ``OPS``, its dtype of ``TYPES``)
    that the board carries where it can (``BEGIN`` returns its descriptor's address), else
    run whole (``on_host``)."""

    __slots__ = ("op", "spec", "kind", "posted", "board", "mapped", "descriptor", "poll")

    def __init__(self, on_host, op: str, spec: tuple) -> None:
        super().__init__(on_host)
        self.op, self.spec, self.kind = op, spec, f"allreduce {op}"
        self.posted: tuple = ()  # (context, tag, ticket, the number it ran outside)
        self.board, self.descriptor = None, (ctypes.c_int64 * _FIELDS)()
        self.mapped: memoryview | None = None  # the board's memory, while the target reads it
        self.poll = _Poll()

    def __call__(self, stage: int, inputs, outputs) -> int:
        if stage == BEGIN:
            board = self._board()
            if board is None:
                return super().__call__(stage, inputs, outputs)
            return self._begin(board, inputs, outputs)
        if not self.posted:  # (ABANDON after a hand-back that ended)
            return 0
        if stage != ABANDON:
            self.poll.end(stage == END)
        context, tag, ticket, outer = self.posted
        try:
            if stage == FINISH:
                self._reduce(context, tag, ticket, inputs, outputs)
            if stage != ABANDON:
                context.finished[()] = context.seq  # (``_context.numbered``'s)
        finally:
            context.number = outer
            self.posted, self.mapped = (), None
        return 0

    def _board(self):
        """The call's board, where this rank's allreduce may take it now: on the share's
        thread, in the call's own group, with nothing else under way."""
        c = _running()
        board = None if c is None else getattr(c.mesh, "board", None)
        if board is None or self.spec[2] is None or ctypes.sizeof(self.spec[2]) > board.slot:
            return None
        return board

    def _begin(self, board, inputs, outputs) -> int:
        """This rank's post, made as every collective's (``_context.numbered``'s numbers
        and row, ``host_collectives``' board): the descriptor's address, for the target."""
        c = _context.collective("allreduce")
        outer, c.number = c.number, c.seq + 1
        row = _context.own_row()
        if row is not None:
            row[_context.RUNNING] = c.seq + 1
        try:
            # (the mapping, held until the target hands back: a group torn down by another
            # thread, as the watchdog does on a death, lets go of its board meanwhile, and
            # the target's wait on it ends in Python, ``FINISH``, with the group's error)
            self.mapped = board._shm.buf
            tag = _context.next_tag(self.kind)
            ticket = board.post(tag, view(inputs[0], self.spec, False), True)
        except BaseException:
            c.number, self.mapped = outer, None
            raise
        self.posted = (c, tag, ticket, outer)
        if ticket is None:  # (messages, not the board: ``host_collectives.allreduce``)
            return self(FINISH, inputs, outputs)
        d = self.descriptor
        if board is not self.board:
            self._describe(board)
        d[_WORD], d[_HEAD_LEN] = ticket.word, len(ticket.head)
        d[_BUDGET] = self.poll.begin(board._waiter_of())
        return ctypes.addressof(d)

    def _reduce(self, context, tag, ticket, inputs, outputs) -> None:
        """The collective, taken over (or run by messages: no ``ticket``) in Python."""
        out = view(outputs[0], self.spec, True)
        got = _host.allreduce(context.mesh, context.rank, context.size, tag,
                              view(inputs[0], self.spec, False), self.op, None, out,
                              ticket)
        if got is not out:
            np.copyto(out, got)

    def _describe(self, board) -> None:
        d, shape, dtype = self.descriptor, self.spec[0], self.spec[1]
        assert self.mapped is not None  # (``_begin``'s: the board is open)
        d[_KIND], d[_BASE] = BOARD, _address(self.mapped)
        d[_RANK], d[_SIZE], d[_SLOTS] = board.rank, board.size, _board.SLOTS
        d[_LINE], d[_HEAD], d[_SEQ_BITS] = _board._LINE, _board._HEAD, _board._SEQ_BITS
        d[_STEP] = _board._HEAD + board.slot
        d[_OP], d[_TYPE], d[_COUNT] = OPS[self.op], TYPES[dtype], math.prod(shape)
        self.board = board


class SendRecv(Whole):
    """A ``sendrecv`` of one array of ``spec`` (``params``: dest, source, tag) whose
    message the target takes from the source's ring, where it is the ring's next record
    (``HostCommunicator.held_inbox``), and whose own it puts in the destination's, where
    ``post`` would (``held_outbox``; else Python posts it at ``BEGIN``): ``BEGIN`` returns
    the descriptor's address. Past the wait's budget, or where the record is another's,
    ``FINISH`` receives it in Python (``deliver(message, outputs)`` writes it into XLA's
    output buffer); where the target may not wait, the operation runs whole (``on_host``)."""

    __slots__ = ("spec", "params", "deliver", "posted", "mapped", "comm", "tag",
                 "described", "out", "out_at", "meta", "descriptor", "poll", "leases")

    def __init__(self, on_host, spec: tuple, params: dict, deliver) -> None:
        super().__init__(on_host)
        self.spec, self.params, self.deliver = spec, params, deliver
        self.posted: tuple = ()  # (the communicator, Python's send or None)
        self.mapped: tuple = ()  # the rings' memory, while the target reads and writes it
        self.comm = self.tag = None  # the call's communicator, and the messages' tag in it
        self.described: tuple = ()  # (lane, tag) the descriptor describes
        self.out, self.out_at = None, 0  # the lane to the destination, and its address
        self.meta = ctypes.create_string_buffer(0)
        self.descriptor = (ctypes.c_int64 * _LANE_FIELDS)()
        self.poll = _Poll()
        self.leases: tuple = ()  # (from the source, to the destination), while described

    def __call__(self, stage: int, inputs, outputs) -> int:
        p = self.params
        if stage == BEGIN:
            c = _running(alone=False)
            if c is None or self.spec[2] is None or c.rank in (p["dest"], p["source"]):
                return super().__call__(stage, inputs, outputs)
            return self._begin(c.host or _route.host("sendrecv"), inputs, outputs)
        if stage == OWED:
            return self._owed(outputs)
        if not self.posted:  # (ABANDON after a hand-back that ended)
            return 0
        if stage != ABANDON:
            self.poll.end(stage == END)
        (comm, sent), d, mesh = self.posted, self.descriptor, self.posted[0].mesh
        lend = stage == END and d[_OUT_AT] and d[_SENT] and d[_TAKEN] and d[_IN_LEASE]
        mesh.sent_outside(p["dest"], (d[_OUT_HEAD], d[_OUT_SEEN], d[_SENT_NUMBER], d[_WAKE])
                          if d[_OUT_AT] and d[_SENT] else None,  # (a no-op where not held)
                          self.leases[1] if lend else None)
        mesh.given_back(p["source"], d[_TAIL] if d[_TAKEN] else None, d[_NUMBER],
                        self.leases[0] if lend else None)
        self.posted, self.mapped = (), ()
        if stage == FINISH:
            if d[_OUT_AT] and not d[_SENT]:  # (no room in the ring: Python's post)
                sent = mesh.post(p["dest"], self.tag, view(inputs[0], self.spec, False))
            self.deliver(comm.irecv(p["source"], p["tag"]).wait(), outputs)
        if sent is not None and stage != ABANDON:
            mesh.wait_sent(sent)
        return 0

    def _owed(self, outputs) -> int:
        """A leased sendrecv that sent its message: the lanes taken back, the reader woken,
        and the message received in Python where the target did not take it."""
        p, d, comm = self.params, self.descriptor, self.comm
        assert comm is not None  # (its generation's: ``_begin`` described it)
        comm.mesh.recall_in(p["source"])
        comm.mesh.recall_out(p["dest"], wake=bool(d[_WAKE]))
        if not d[_TAKEN]:
            self.deliver(comm.irecv(p["source"], p["tag"]).wait(), outputs)
        return 0

    def _begin(self, comm, inputs, outputs) -> int:
        """The descriptor's address where the target may take the message received (and
        put the one sent); else the operation, in Python."""
        p = self.params
        if comm is not self.comm:  # (the messages' tag: made again for another call's)
            self.tag = comm.message_tag("sendrecv", p["dest"], p["tag"])
            comm.message_tag("sendrecv", p["source"], p["tag"])
            self.comm = comm
        mesh = comm.mesh
        held = comm.held_inbox(p["source"], self.tag)
        if held is None:
            sent = mesh.post(p["dest"], self.tag, view(inputs[0], self.spec, False))
            self.deliver(comm.irecv(p["source"], p["tag"]).wait(), outputs)
            mesh.wait_sent(sent)
            return 0
        self.posted, self.mapped = (comm, None), (held[0],)
        d = self.descriptor
        d[_TAIL], d[_NUMBER], d[_TAKEN], d[_SENT], d[_OUT_AT] = held[2], held[3], 0, 0, 0
        d[_IN_LEASE] = 0  # (until the lanes are described for this mesh, below)
        if self.described != (held[1], self.tag):  # (identity: the tuple holds the lane)
            self._describe(held[0], held[1])
        out = mesh.held_outbox(p["dest"], d[_BYTES])
        if out is None:
            self.posted = (comm, mesh.post(p["dest"], self.tag, view(inputs[0], self.spec,
                                                                      False)))
        else:
            memory, lane, d[_OUT_HEAD], d[_OUT_SEEN], d[_SENT_NUMBER] = out
            self.mapped += (memory,)
            if lane is not self.out:  # (the lane's address: made again for another lane)
                self.out, self.out_at = lane, _address(memory) + lane.at
            d[_OUT_AT] = d[_OUT_LANE] = self.out_at
            self.leases = _leases(mesh, p["source"], p["dest"])
            d[_IN_LEASE], d[_OUT_LEASE] = self.leases[0].at, self.leases[1].at
            d[_GENERATION] = mesh.generation
        d[_LANE_BUDGET] = self.poll.begin(mesh._waiter())
        return ctypes.addressof(d)

    def _describe(self, memory: memoryview, lane) -> None:
        """The descriptor of ``lane`` and of the messages' record meta (as
        ``mesh_wire.ring_post`` makes it): made again for another lane or tag."""
        shape, dtype, block = self.spec
        self.meta = ctypes.create_string_buffer(
            pickle.dumps((self.tag, dtype.str, shape), pickle.HIGHEST_PROTOCOL))
        d = self.descriptor
        d[_KIND], d[_LANE_AT] = LANE, _address(memory) + lane.at
        d[_DATA_AT], d[_CAPACITY] = _ring._DATA_AT, lane.capacity
        d[_META_AT], d[_META_LEN] = ctypes.addressof(self.meta), len(self.meta) - 1
        d[_BYTES] = ctypes.sizeof(block)  # (every ring of a mesh has one capacity)
        self.described = (lane, self.tag)
