"""The shared-memory meeting place of one simulated NCCL communicator."""
from __future__ import annotations

import time
from multiprocessing import shared_memory

import numpy as np

from ..._wire import shm as _shm
from ._errors import SimulatedHang, nccl_error, ncclInvalidUsage

MAGIC = 0x53594E4B4E43434C  # "SYNKNCCL": written last by the creator
HEADER = 8  # int64 fields: [0] magic, [1] ranks, [2] the ranks meet over TCP instead
NETWORK = 2
SLOT = 16  # int64 fields per rank, indexed by the names below
(STATE, PID, START, POSTED, DONE, KIND, COUNT, DTYPE, OP, ROOT, GEN, NBYTES, DEVICE, INIT,
 CONNECTED, HOST) = range(16)
EMPTY, ATTACHED, ABORTED, DESTROYED = 0, 1, 2, 3  # STATE
JOINING, PASSED, REFUSED = 0, 1, 2  # INIT: NCCL's checks at set-up
PAIR = 3  # int64 fields per ordered pair: [sent, received, reached its first send/receive]


def proc_start(pid: int) -> int | None:
    """The start time of live process ``pid`` (None if it is gone or a zombie), so that a
    recycled pid is not taken for the process that died."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


class SwitchToNetwork(Exception):
    """A rank that shares no /dev/shm with the others called the communicator's root: every
    rank meets over TCP instead (see ``_net``)."""


class Words:
    """A board's words, the communicator's rendezvous: one slot of int64 fields per rank
    and, per ordered pair of ranks, the messages sent and received and whether the first
    rank has reached its first send/receive with the second; ``Board`` maps them in shared
    memory and ``_netboard.NetBoard`` keeps a copy."""

    nranks: int
    words: np.ndarray | None  # None once the board is closed

    def slot(self, rank: int) -> np.ndarray:
        assert self.words is not None, "the board is closed"
        start = HEADER + SLOT * rank
        return self.words[start:start + SLOT]

    def pair(self, src: int, dst: int) -> np.ndarray:
        """[messages sent from src to dst, of them received, src reached its first
        send/receive with dst]."""
        assert self.words is not None, "the board is closed"
        start = HEADER + SLOT * self.nranks + PAIR * (src * self.nranks + dst)
        return self.words[start:start + PAIR]


class Board(Words):
    """This process's mapping of a communicator's board in shared memory. Its methods (the words:
    ``slot``, ``pair``; ``publish`` after writing this rank's words; ``alive``; a collective's
    parts; the messages) are the communicator's only way to its peers, and
    ``_netboard.NetBoard`` has them too. Segments, named from the unique id's prefix
    (``synk-<pid>-<token>-``): ``<prefix>board``, ``<prefix>r<rank>-<gen>`` (a rank's part of the
    collective under way), ``<prefix>p<src>-<dst>-<n>`` (a message); owner-only, so that synk's
    sweeps reclaim a killed process's; the board is unlinked once every rank has mapped it."""

    network = False

    def __init__(self, prefix: str, nranks: int, deadline: float) -> None:
        self.prefix, self.nranks = prefix, nranks
        self.name = prefix + "board"
        size = 8 * (HEADER + SLOT * nranks + PAIR * nranks * nranks)
        self.shm: shared_memory.SharedMemory | None = self._create_or_attach(size, deadline)
        self.words = np.ndarray(size // 8, np.int64, buffer=self.shm.buf)
        self._peers = _shm.Attachments()

    def _create_or_attach(self, size: int, deadline: float) -> shared_memory.SharedMemory:
        shm: shared_memory.SharedMemory | None
        try:
            shm = _shm._open(self.name, True, size)
        except FileExistsError:
            pass
        else:
            words = np.ndarray(2, np.int64, buffer=shm.buf)
            words[1] = self.nranks
            words[0] = MAGIC
            return shm
        while True:  # another rank created it: wait until it is ready
            try:
                shm = _shm.attach(self.name)
            except (FileNotFoundError, ValueError, OSError):
                shm = None
            if shm is not None and shm.size >= 16:
                head = np.ndarray(2, np.int64, buffer=shm.buf)
                if head[0] == MAGIC:
                    if head[1] != self.nranks or shm.size < size:
                        theirs, got = int(head[1]), shm.size
                        _shm.release(shm)
                        raise nccl_error(ncclInvalidUsage, (
                            f"this rank was told the communicator has {self.nranks} ranks, "
                            f"another rank {theirs}") if theirs != self.nranks else (
                            f"another rank made the communicator's board of {got} bytes, "
                            f"this rank expects {size}: the ranks run different versions "
                            "of the simulator"))
                    return shm
            if shm is not None:
                _shm.release(shm)
            if time.monotonic() > deadline:
                raise SimulatedHang("NcclCommunicator() would hang forever on a GPU: the "
                                    "communicator's rendezvous was never completed")
            time.sleep(0.002)

    def publish(self) -> None:
        """This rank's words are seen by the others as soon as they are written."""

    def alive(self, rank: int) -> bool:
        """Whether ``rank``'s process still runs (a recycled pid is not taken for it)."""
        slot = self.slot(rank)
        return proc_start(int(slot[PID])) == int(slot[START])

    def mark_network(self) -> None:
        """Tell the ranks waiting here to meet over TCP (the root heard from a rank that
        cannot map this board)."""
        assert self.words is not None, "the board is closed"
        self.words[NETWORK] = 1

    def check_switch(self) -> None:
        if self.words is not None and self.words[NETWORK]:
            raise SwitchToNetwork()

    def peer_part(self, rank: int, generation: int, nbytes: int) -> np.ndarray:
        """Rank ``rank``'s part of the collective under way (FileNotFoundError if gone)."""
        return self._peers.array(f"{self.prefix}r{rank}-{generation}", nbytes, np.uint8)

    def put_message(self, name: str, peer: int, number: int, datatype: int,
                    data: np.ndarray) -> None:
        """Leave message ``number`` for ``peer`` in segment ``name``."""
        raw = data.reshape(-1).view(np.uint8)
        shm = _shm._open(name, True, 64 + raw.nbytes)
        head = np.ndarray(4, np.int64, buffer=shm.buf)
        head[0], head[1], head[2] = data.size, datatype, 0
        np.ndarray(raw.nbytes, np.uint8, buffer=shm.buf, offset=64)[...] = raw
        _shm.release(shm)

    def take_message(self, name: str, peer: int, number: int) -> tuple:
        """(count, datatype, bytes) of the message in segment ``name``, which goes."""
        shm = _shm.attach(name)
        try:
            buf = shm.buf
            assert buf is not None  # (just attached)
            head = np.ndarray(4, np.int64, buffer=buf)
            count, datatype = int(head[0]), int(head[1])
            data = bytes(buf[64:])
        finally:
            _shm.release(shm)
            _shm.unlink(name)
        return count, datatype, data

    def sweep_dead(self) -> None:
        """Remove what ranks that were killed left behind."""
        for r in range(self.nranks):
            if not self.alive(r):
                _shm.sweep(f"{self.prefix}r{r}-")
                _shm.sweep(f"{self.prefix}p{r}-")

    def unlink(self) -> None:
        _shm.unlink(self.name)

    def close(self) -> None:
        self.words = None
        self._peers.release_all()
        if self.shm is not None:
            _shm.release(self.shm)
            self.shm = None


class Scratch:
    """This rank's segment holding its contribution to the collective under way; regrown
    under a new generation number when too small."""

    def __init__(self, prefix: str, rank: int) -> None:
        self.prefix, self.rank = prefix, rank
        self.gen = 0
        self.shm: shared_memory.SharedMemory | None = None

    def ensure(self, nbytes: int) -> np.ndarray:
        if self.shm is None or self.shm.size < nbytes:
            self.destroy()
            self.gen += 1
            self.shm = _shm._open(f"{self.prefix}r{self.rank}-{self.gen}", True,
                                  max(nbytes, 4096))
        return np.ndarray(nbytes, np.uint8, buffer=self.shm.buf)

    def destroy(self) -> None:
        if self.shm is not None:
            _shm.destroy(self.shm)
            self.shm = None
