"""What a simulated NCCL operation does once launched on its stream: post this rank's part to
its shared-memory segment, then finish once every rank it needs has posted (reading their
parts in place). See ``cupy.cuda.nccl`` for the communicator that launches them."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import _core, _float_minmax
from ._board import COUNT, DONE, DTYPE, GEN, KIND, NBYTES, OP, POSTED, ROOT
from ._errors import nccl_error, ncclInvalidArgument

# ncclDataType_t and ncclRedOp_t values (nccl.h; cupy.cuda.nccl's NCCL_* constants)
DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64,
          6: np.float16, 7: np.float32, 8: np.float64}
BFLOAT16 = 9
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
OPS = {SUM: np.add, PROD: np.multiply, MAX: np.maximum, MIN: np.minimum, AVG: np.add}
# NCCL's max and min of floats are fmaxf/fminf, fmax/fmin, __hmax/__hmin (src/device/
# reduce_kernel.h FuncMinMax, v2.30.7-1 lines 422-446; v2.28.9-1 lines 397-436; v2.19.3-1
# line 236; 2.18's FuncMax/FuncMin call CUDA's max/min, the same functions): PTX's max/min, a
# NaN loses to any number, two NaNs give the canonical NaN, +0.0 > -0.0 (``_float_minmax``).
# Every order of the ranks gives the same bits.
FLOAT_OPS: dict = {**OPS, MAX: _float_minmax.fmax, MIN: _float_minmax.fmin}
OP_NAMES = {SUM: "sum", PROD: "prod", MAX: "max", MIN: "min", AVG: "avg"}
KINDS = ["allReduce", "reduce", "broadcast", "reduceScatter", "allGather"]


class Work(_core.Op):
    """NCCL operations launched together (one, or a group's on one stream)."""

    def __init__(self, parts: list) -> None:
        self.parts = parts
        # A buffer that is not device memory of its GPU faults when the kernel runs, not in
        # the call (pointers are unchecked, see ``stalled``): such work runs only when
        # something waits for or queries its stream, so that calls in between succeed.
        self.eager = all(part.bad is None for part in parts)

    def progress(self) -> bool:
        return all([part.progress() for part in self.parts])

    def failure(self):
        for part in self.parts:
            comm = part.comm
            if comm._undefined is not None:
                return comm._undefined
            if comm._error is not None:
                return (f"it failed ({comm._error}). Poll the communicator's "
                        "check_async_error() and abort() it instead of waiting on the stream.")
            if comm._starved is not None:
                return comm._starved
            gone = [comm._gone[r] for r in part.peers() if r in comm._gone]
            if gone:
                return (f"{'; '.join(gone)}, and NCCL's transports within a node do not "
                        "notice it: the operation never completes, and "
                        "ncclCommGetAsyncError reports nothing (a peer's closed connection "
                        "is only logged, src/proxy.cc v2.30.7-1 line 1879). Learn of it some "
                        "other way (a timeout, a message of your own), then abort() this "
                        "communicator.")
        return None

    def describe(self) -> str:
        return " + ".join(part.describe() for part in self.parts)


def stalled(part) -> bool:
    """True while ``part`` cannot run: its communicator's ranks starve each other (it hangs),
    or one of its buffers is not device memory of its GPU (NCCL's kernel then faults: a
    sticky illegal address on the device, and the operation never completes)."""
    if part.bad is not None:
        _core.set_sticky(part.comm._device, 700)
        return True
    return part.comm._starved is not None


def dtype_of(datatype: int) -> np.dtype:
    if datatype == BFLOAT16:
        raise _core.not_modelled("BFLOAT16 (numpy has no bfloat16)")
    if datatype not in DTYPES:
        raise nccl_error(ncclInvalidArgument, f"unknown datatype {datatype}")
    return np.dtype(DTYPES[datatype])


class _Part:
    """One NCCL operation on one rank, a part of a ``Work``: ``progress`` runs its ``_step``
    until that says it is done, unless its communicator is closed (then it is done), failed
    or ``stalled`` (then it never is)."""

    comm: Any
    bad: str | None = None  # why a buffer is an illegal address (pointers are not checked)
    op_number = 0  # the rank's operation it is, set by the communicator when submitted
    posted = done = False

    def progress(self) -> bool:
        comm = self.comm
        if self.done or comm._closed:
            return True
        if comm._error is not None or comm._undefined is not None or stalled(self):
            return False
        self.done = self._step()
        return self.done

    def _step(self) -> bool:
        raise NotImplementedError


class Collective(_Part):
    """One collective on one rank: post this rank's part, then finish with every rank's."""

    algorithm: str  # NCCL's for it (``_nccl_rules.algorithm``), set by the communicator

    def __init__(self, comm, seq, kind, count, datatype, op, root, send, recv) -> None:
        self.comm, self.seq, self.kind, self.count = comm, seq, kind, count
        self.datatype, self.op, self.root, self.send, self.recv = datatype, op, root, send, recv

    def describe(self) -> str:
        return (f"NCCL {self.kind} #{self.seq} (count {self.count}) on rank {self.comm._rank} "
                f"of {self.comm._size}")

    def peers(self) -> list:
        """The ranks it needs (each of them, or a peer whose part is gone: -1)."""
        return [-1, *range(self.comm._size)]

    def _signature(self) -> tuple:
        return (KINDS.index(self.kind), self.count, self.datatype, self.op, self.root)

    def _step(self) -> bool:
        comm = self.comm
        if not self.posted and not self._post():
            return False
        board = comm._board
        slots = [board.slot(r) for r in range(comm._size)]
        if any(int(s[POSTED]) < self.seq for s in slots):
            comm._poll_peers()
            return False
        signatures = [tuple(int(v) for v in s[KIND:ROOT + 1]) for s in slots]
        if len(set(signatures)) > 1:
            listing = "; ".join(f"rank {r}: {describe_signature(sig)}"
                                for r, sig in enumerate(signatures))
            comm._undefined_behaviour(f"the ranks disagree on collective #{self.seq} "
                                      f"({listing})")
            return False
        try:
            self._finish(slots)
        except FileNotFoundError:  # a peer's part is gone: it aborted or was swept
            comm._peer_gone(-1, f"a peer's part of collective #{self.seq} is gone (it "
                                "aborted or destroyed the communicator)")
            return False
        board.slot(comm._rank)[DONE] = self.seq
        board.publish()
        return True

    def _post(self) -> bool:
        """Post this rank's part once every peer has read its last one; whether it did."""
        comm = self.comm
        board = comm._board
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
        board.publish()
        self.posted = True
        return True

    def _finish(self, slots) -> None:
        comm, dtype = self.comm, dtype_of(self.datatype)
        parts: list = [None] * comm._size
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
                self.recv[...] = reduce(self.op, parts, n)
        elif kind == "reduceScatter":
            me, c = comm._rank, self.count
            self.recv[...] = reduce(self.op, [p[me * c:(me + 1) * c] for p in parts], n)


def describe_signature(sig: tuple) -> str:
    kind, count, datatype, op, root = sig
    text = f"{KINDS[kind]} count={count} datatype={datatype}"
    if op >= 0:
        text += f" op={OP_NAMES.get(op, op)}"
    if root >= 0:
        text += f" root={root}"
    return text


def reduce(op: int, parts: list, n: int) -> np.ndarray:
    ufunc = (FLOAT_OPS if parts[0].dtype.kind == "f" else OPS)[op]
    with np.errstate(all="ignore"):
        result = parts[0].copy()
        for part in parts[1:]:
            ufunc(result, part, out=result)
        if op == AVG:
            if result.dtype.kind == "f":
                result /= result.dtype.type(n)
            elif result.dtype.kind == "u":
                result //= result.dtype.type(n)
            else:  # integer division truncating toward zero, as C does
                result[...] = np.sign(result) * (np.abs(result) // n)
    return result


class _Message(_Part):
    """The ``number``-th message between this rank and ``peer`` (``view``: its buffer),
    sent if ``outgoing``, else received; ``name``: its segment's."""

    outgoing: bool

    def __init__(self, comm, peer, number, datatype, view) -> None:
        self.comm, self.peer, self.number = comm, peer, number
        self.datatype, self.view = datatype, view
        src, dst = (comm._rank, peer) if self.outgoing else (peer, comm._rank)
        self.name = f"{comm._prefix}p{src}-{dst}-{number}"

    def peers(self) -> list:
        return [self.peer]


class Send(_Message):
    """A message to ``peer``: it completes once the peer has received it."""

    outgoing = True

    def describe(self) -> str:
        return (f"NCCL send #{self.number} from rank {self.comm._rank} to rank {self.peer} "
                "(a send completes only when its receive runs: call both inside "
                "groupStart()/groupEnd() when two ranks exchange)")

    def _step(self) -> bool:
        comm = self.comm
        pair = comm._board.pair(comm._rank, self.peer)
        if not self.posted:
            if comm._inject(self.op_number):
                return False
            comm._board.put_message(self.name, self.peer, self.number, self.datatype,
                                    self.view)
            comm._messages.append(self.name)
            pair[0] = self.number
            comm._board.publish()
            self.posted = True
        received = int(pair[1])
        if received == -self.number:
            comm._undefined_behaviour(f"rank {self.peer} expected a different count or "
                                      f"datatype for send #{self.number} from rank "
                                      f"{comm._rank}")
            return False
        if received < self.number:
            comm._poll_peers(among=[self.peer])
            return False
        if self.name in comm._messages:
            comm._messages.remove(self.name)
        return True


class Recv(_Message):
    """Receive the ``number``-th message from ``peer`` into ``view``."""

    outgoing = False

    def describe(self) -> str:
        return f"NCCL recv #{self.number} on rank {self.comm._rank} from rank {self.peer}"

    def _step(self) -> bool:
        comm = self.comm
        pair = comm._board.pair(self.peer, comm._rank)
        if int(pair[0]) < self.number:
            comm._poll_peers(among=[self.peer])
            return False
        count, datatype, raw = comm._board.take_message(self.name, self.peer, self.number)
        if (count, datatype) != (self.view.size, self.datatype):
            comm._undefined_behaviour(f"rank {self.peer} sent {count} elements of datatype "
                                      f"{datatype}; the recv of rank {comm._rank} expects "
                                      f"{self.view.size} of datatype {self.datatype}")
            pair[1] = -self.number
            comm._board.publish()
            return False
        self.view[...] = np.frombuffer(raw, dtype_of(datatype), count)
        pair[1] = self.number
        comm._board.publish()
        return True


