"""synk's XLA FFI target on the CPU (``csrc/jax_ffi.cc``, built at install as
``synk.comm.autograd._jax_ffi``), which every ``synk.comm`` operation of a compiled function
calls: it calls the operation's Python function (``add``) with XLA's buffers, in place; what
that raises is kept (``callback_errors``), its text in XLA's error.

An allreduce the board can carry (``Allreduce``: a sum or product of one array of float32,
float64, int32 or int64) is posted here, in Python, with the bookkeeping of any collective
(``BEGIN``); the target waits for the peers' posts and combines them in rank order, as
``host_collectives`` does, then hands back (``END``), or, past the wait's budget or where the
headers differ, hands the collective to ``host_collectives.allreduce`` (``FINISH``)."""
from __future__ import annotations

import ctypes
import importlib.util
import itertools
import math
import threading
import weakref

import numpy as np

from ...errors import SynkError
from .. import context as _context
from ..host import host_collectives as _host, shm_board as _board
from . import callback_errors as _callback_errors

TARGET = "synk_comm"
_MESSAGE = 4096  # the bytes of an error's text the target hands XLA (csrc/jax_ffi.cc)
_RUN = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(ctypes.c_void_p),
                        ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                        ctypes.POINTER(ctypes.c_int64))
BEGIN, END, FINISH = 0, 1, 2  # the target's calls (csrc/jax_ffi.cc's Stage)
_FUNCTIONS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # number -> fn
# (while its executable holds it)
_NUMBERS = itertools.count(1)
_LOADED: list = []  # the run function's address, once the target is registered


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
    return {"index": np.int64(number), "run": np.int64(_LOADED[0])}


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
        self.on_host(inputs, outputs)
        return 0


OPS = {"sum": 0, "prod": 1}  # csrc/jax_ffi.cc's kOp, kType
TYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2,
         np.dtype(np.int64): 3}
(_WORD, _BASE, _RANK, _SIZE, _SLOTS, _LINE, _STEP, _HEAD, _HEAD_LEN, _BUDGET, _SEQ_BITS,
 _OP, _TYPE, _COUNT, _FIELDS) = range(15)  # a board's descriptor (csrc/jax_ffi.cc's Field)


class Allreduce(Whole):
    """An allreduce of one array of ``spec`` by ``op`` (of ``OPS``, its dtype of ``TYPES``)
    that the board carries where it can (``BEGIN`` returns its descriptor's address), else
    run whole (``on_host``)."""

    __slots__ = ("op", "spec", "kind", "posted", "board", "mapped", "descriptor")

    def __init__(self, on_host, op: str, spec: tuple) -> None:
        super().__init__(on_host)
        self.op, self.spec, self.kind = op, spec, f"allreduce {op}"
        self.posted: tuple = ()  # (context, tag, ticket, the number it ran outside)
        self.board, self.descriptor = None, (ctypes.c_int64 * _FIELDS)()
        self.mapped: memoryview | None = None  # the board's memory, while the target reads it

    def __call__(self, stage: int, inputs, outputs) -> int:
        if stage == BEGIN:
            board = self._board()
            if board is None:
                return super().__call__(stage, inputs, outputs)
            return self._begin(board, inputs, outputs)
        context, tag, ticket, outer = self.posted
        self.posted, self.mapped = (), None
        try:
            if stage == FINISH:
                self._reduce(context, tag, ticket, inputs, outputs)
            context.finished[()] = context.seq  # (``_context.numbered``'s, once it returned)
        finally:
            context.number = outer
        return 0

    def _board(self):
        """The call's board, where this rank's allreduce may take it now: on the share's
        thread, in the call's own group, with nothing else under way."""
        c = _context.current
        if not (c.active and c.size > 1 and not c.sliced and not c.lanes and not c.threaded
                and _context.now() is c and threading.get_ident() == c.thread):
            return None
        board = getattr(c.mesh, "board", None)
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
        waiter = board._waiter_of()
        d[_BUDGET] = int(waiter.budget * 1e9) if waiter.polling else 0
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
        d[_BASE] = np.frombuffer(self.mapped, np.uint8).ctypes.data
        d[_RANK], d[_SIZE], d[_SLOTS] = board.rank, board.size, _board.SLOTS
        d[_LINE], d[_HEAD], d[_SEQ_BITS] = _board._LINE, _board._HEAD, _board._SEQ_BITS
        d[_STEP] = _board._HEAD + board.slot
        d[_OP], d[_TYPE], d[_COUNT] = OPS[self.op], TYPES[dtype], math.prod(shape)
        self.board = board
