"""The host communicator: numpy arrays between a call's ranks, over the rank's mesh
(``shm_mesh`` on one host, ``mpi_mesh`` between hosts) and ``host_collectives``.

::

    collective       tag drawn here (``_tag``)  -> host_collectives -> mesh.post / mesh.take
    i-collective     queued on the ``_Lane``    -> the same, in start order -> ``wait()``
    send / recv      device arrays via the host -> mesh (wildcards, probes: ``matching``)
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import numpy as np

from ..._reduction import OPS
from ...errors import CommAborted
from .. import context as _context
from ..communicator import Communicator, Packed
from ..frame_marks import native_dtype
from ..handle import Handle
from ..status import Status
from . import host_collectives as _c, host_fused as _fused
from .mailbox import ANY, P2P
from .matching import Lone
from .shm_mesh import _WAIT_SLICE

_WRAPPED = "synk_device_array"  # field name that marks a device array sent through the host


class _Lane:
    """A rank's non-blocking collectives of one call, run in start order (the same on every
    rank) by one thread at a time (a thread each: 500 in flight on 4 ranks took over a
    minute), ending with the rank's share (``_context.settle``, ``leave``)."""

    def __init__(self, failed: Callable[[Exception], None]) -> None:
        """``failed(error)``: an operation raised ``error`` (see ``_run``)."""
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None  # while it runs the queue
        self._failed = failed

    def start(self, fn, *args) -> Handle:
        box: dict = {}
        done = threading.Event()
        with self._lock:
            self._queue.append((fn, args, box, done))
            if self._thread is None:  # (the thread ends when the queue is empty)
                context = _context.now()
                if self not in context.lanes:
                    context.lanes.append(self)
                    recall = getattr(context.mesh, "recall_all", None)
                    if recall is not None:  # (no lane is lent with these under way)
                        recall()
                self._thread = threading.Thread(target=self._run, name="synk-comm-op",
                                                daemon=True)
                self._thread.start()

        def finish():
            c = _context.current  # (the share's thread waits for this lane: ``Stall``)
            joins = c.joining is None and threading.get_ident() == c.thread
            if joins:
                c.joining = self
            try:
                while not done.wait(_WAIT_SLICE):  # in slices: an interrupt of the master
                    pass  # lands
            finally:
                if joins:
                    c.joining = None
            if "error" in box:
                raise box["error"]
            return box["result"]

        return Handle(finish)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    return
                fn, args, box, done = self._queue.popleft()
            try:
                box["result"] = fn(*args)
            except BaseException as exc:  # handed to wait(), and to the rank's other waits
                box["error"] = exc  # in the call: its later collectives may never be met
                if isinstance(exc, Exception):
                    self._failed(exc)
            finally:
                done.set()

    def running_here(self) -> bool:
        """Whether the calling thread is the lane's."""
        thread = self._thread
        return thread is not None and thread.ident == threading.get_ident()

    def busy(self) -> bool:
        """Whether operations are queued or running."""
        with self._lock:
            return self._thread is not None

    def finish(self, cancel: bool = False) -> None:
        """Return once the lane's thread has ended: after running what is queued, or
        (``cancel``) dropping it (the running operation ends by itself: its waits were
        ended, see ``Mailboxes.end_call``). Waits in slices, so that an interrupt of the
        master lands; a cancelled lane is given up after ``_CANCEL_S``."""
        with self._lock:
            thread = self._thread
            if cancel:
                for _, _, box, done in self._queue:
                    box["error"] = CommAborted("the share ended before this non-blocking "
                                               "operation started")
                    done.set()
                self._queue.clear()
        deadline = time.monotonic() + _CANCEL_S
        while thread is not None and thread.is_alive():
            thread.join(_WAIT_SLICE)
            if cancel and time.monotonic() > deadline:
                return


_CANCEL_S = 5.0  # the most a cancelled lane's running operation is waited for


class HostCommunicator(Communicator):
    """One rank's end of a call's host communication (``mesh``: None for a group of one)."""

    xp = np

    def __init__(self, mesh, rank: int, size: int, device=None) -> None:
        self.mesh, self.rank, self.size, self.device = mesh, int(rank), int(size), device
        self.host = self
        self._call_id = _context.current.call_id  # (a communicator is one call's)
        self._lane = _Lane(self._lane_failed)
        self._lone: Lone | None = None
        # receives from one rank with one tag match its messages in the order they were
        # posted (MPI's rule), whatever order they are waited in (``_nth``)
        self._receives = threading.Condition()
        self._posted: dict = {}  # (rank, key) -> receives posted
        self._taken: dict = {}  # (rank, key) -> messages taken from the mesh
        self._early: dict = {}  # (rank, key) -> {number: message its receive waits for}
        self._taking: set = set()  # (rank, key) a thread is taking from the mesh

    # drawn in the calling thread from the running call, so that every rank's n-th
    # collective matches the others' n-th
    _tag = staticmethod(_context.next_tag)

    def supports(self, dtype, op: str) -> bool:
        return op in OPS and np.dtype(dtype).kind in _c.NUMBERS

    # ------------------------------------------------------------ reductions
    def allreduce(self, x, op: str = "sum", *, weights: list | None = None, out=None):
        return _c.allreduce(self.mesh, self.rank, self.size, self._tag(f"allreduce {op}"), x,
                            op, weights, out)

    def iallreduce(self, x, op: str = "sum", *, weights: list | None = None,
                   out=None) -> Handle:
        return self._ticketed(_c.allreduce, f"allreduce {op}", x, op, weights, out)

    def _ticketed(self, fn, kind: str, x, *args) -> Handle:
        """``fn`` (``host_collectives``' allreduce or reduce_scatter) of ``x`` on the lane,
        its tag drawn and its board post made now, in the ranks' order."""
        tag, x = self._tag(kind), np.asarray(x)
        ticket = None if self.size == 1 else _c.allreduce_post(self.mesh, self.size, tag, x)
        return self._lane.start(fn, self.mesh, self.rank, self.size, tag, x, *args, ticket)

    def _run(self, wait: bool, fn, kind: str, *args):
        """``fn`` (of ``host_collectives``) under the next tag of ``kind``: now, or (not
        ``wait``) on the lane, the tag drawn now."""
        tag = self._tag(kind)
        if wait:
            return fn(self.mesh, self.rank, self.size, tag, *args)
        return self._lane.start(fn, self.mesh, self.rank, self.size, tag, *args)

    def allreduce_many(self, packed: Packed, op: str, agree, wait: bool = True,
                       label: str | None = None):
        """Small in all: every rank's head and buffers in one message to every other rank,
        combined in rank order; else the heads first, then each buffer's allreduce."""
        tag = self._tag(f"allreduce {op if label is None else label}")
        if not wait:
            ticket = None if self.size == 1 else _fused.many_post(self.mesh, self.size, tag,
                                                                   packed)
            return self._lane.start(_fused.allreduce_many, self.mesh, self.rank, self.size, tag,
                                    packed, op, agree, ticket)
        return _fused.allreduce_many(self.mesh, self.rank, self.size, tag, packed, op, agree)

    def reduce(self, x, op: str = "sum", root: int = 0, *, weights: list | None = None):
        return self._run(True, _c.reduce, f"reduce {op} {root}", x, op, root, weights)

    def ireduce(self, x, op: str = "sum", root: int = 0, *,
                weights: list | None = None) -> Handle:
        return self._run(False, _c.reduce, f"reduce {op} {root}", x, op, root, weights)

    def igather(self, x, counts: list, root: int = 0, *, tail=(), dtype=None) -> Handle:
        dtype = np.asarray(x).dtype if dtype is None else dtype
        return self._run(False, _c.gather, f"gather {root}", x, counts, root, tail, dtype)

    def iscatter(self, parts, root: int, shape, dtype) -> Handle:
        return self._run(False, _c.scatter, f"scatter {root}", parts, root)

    def gather(self, x, counts: list, root: int = 0, *, tail=(), dtype=None):
        dtype = np.asarray(x).dtype if dtype is None else dtype
        return self._run(True, _c.gather, f"gather {root}", x, counts, root, tail, dtype)

    def scatter(self, parts, root: int, shape, dtype):
        return self._run(True, _c.scatter, f"scatter {root}", parts, root)

    def to_host(self, x) -> np.ndarray:
        return np.asarray(x)

    def reduce_scatter(self, x, op: str = "sum", bounds=None, out=None):
        return self._run(True, _c.reduce_scatter, f"reduce_scatter {op}", x, op, bounds, out)

    def ireduce_scatter(self, x, op: str = "sum", bounds=None, out=None) -> Handle:
        return self._ticketed(_c.reduce_scatter, f"reduce_scatter {op}", x, op, bounds, out)

    def alltoall(self, parts: list, specs: list) -> list:
        return self._run(True, _c.alltoall, "alltoall", parts, specs)

    def ialltoall(self, parts: list, specs: list) -> Handle:
        return self._run(False, _c.alltoall, "alltoall", parts, specs)

    # ------------------------------------------------------------ data movement
    def broadcast(self, x, root: int = 0, *, shape=None, dtype=None, out=None):
        return self._run(True, _c.broadcast, f"broadcast {root}", x, root, out)

    def ibroadcast(self, x, root: int = 0, *, shape=None, dtype=None, out=None) -> Handle:
        return self._run(False, _c.broadcast, f"broadcast {root}", x, root, out)

    def allgather(self, x, counts=None, out=None):
        return self._run(True, _c.allgather, "allgather", x, out)

    def iallgather(self, x, counts=None, out=None) -> Handle:
        return self._run(False, _c.allgather, "allgather", x, out)

    def allgather_heads(self, head: np.ndarray) -> list:
        """Every rank's ``head`` (a small array of one dtype and shape on every rank)."""
        return self.start_heads(head)()

    def start_heads(self, head: np.ndarray) -> Heads:
        """``allgather_heads`` in two halves: ``head`` is posted to every other rank now,
        and the ``Heads`` returned gives every rank's, in rank order, waiting for them (a
        device communicator reads them while its own operation runs)."""
        if self.size == 1:
            return Heads(self, None, head, [])
        tag = self._tag("heads")
        return Heads(self, tag, head, _c.post_all(self.mesh, self.rank, self.size, tag, head))

    def allgather_objects(self, obj, kind: str) -> list:
        """Every rank's ``obj`` (small, picklable), in rank order."""
        return _c.allgather_objects(self.mesh, self.rank, self.size, self._tag(kind), obj,
                                    kind)

    def barrier(self) -> None:
        tag = _context.next_tag("barrier")
        if self.size > 1:
            _c.barrier(self.mesh, self.rank, self.size, tag)

    def ibarrier(self) -> Handle:
        tag = _context.next_tag("barrier")
        if self.size == 1:
            return Handle.done(None)
        ticket = _c.board_post(self.mesh, tag, None, True)  # (now, in the ranks' order)
        return self._lane.start(_c.barrier, self.mesh, self.rank, self.size, tag, ticket)

    # ------------------------------------------------------------ messages
    def message_tag(self, what: str, peer, tag, wild: bool = False) -> tuple:
        """The tag of a message to or from ``peer`` with the user's ``tag`` (with ``wild``,
        a receive's: ``peer`` or ``tag`` may be ``ANY``, and the tag is a pattern)."""
        if not (wild and _is_any(peer)) and (
                not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size):
            anyone = " or ANY_SOURCE" if wild else ""
            raise ValueError(f"synk.comm.{what}: rank {peer!r} is not a rank of this call "
                             f"(ranks 0..{self.size - 1}{anyone}; this is rank {self.rank})")
        if not wild and _is_any(tag):
            raise ValueError(f"synk.comm.{what}: tag {tag!r} is ANY_TAG, which receives and "
                             "probes take (it matches any tag); give a message a tag of its own")
        c = _context.now()
        return (c.call_id, P2P, tag, c.scope) if c.scope else (c.call_id, P2P, tag)

    @staticmethod
    def _user_tag(key: tuple):
        """The user's tag in a tag of ``_key``."""
        return key[2]

    def _mailboxes(self):
        """The mesh, or the mailboxes of a call of one rank (its messages to itself)."""
        if self.mesh is not None:
            return self.mesh
        if self._lone is None:
            self._lone = Lone(_context.now().call_id)
        return self._lone

    def isend(self, x, peer: int, tag: int = 0) -> Handle:
        # a device array is copied to the host and marked, and the receiver copies it back to
        # its device (``_arrived``); sends are buffered, as MPI's: two ranks that send to each
        # other first never deadlock (unlike NCCL's sends)
        key = self.message_tag("isend", peer, tag)
        device = self.device
        if device is not None and not device.is_host and device.is_device_array(x):
            host = np.asarray(device.to_host(x, stream=device.current_stream()), order="C")
            x = host.view(np.dtype([(_WRAPPED, host.dtype)]))
        if peer == self.rank:  # buffered: a copy, in this rank's own mailbox
            self._mailboxes().post_own(key, x)
            return Handle.done(None)
        mesh = self.mesh
        sent = mesh.post(peer, key, x)
        return Handle(lambda: mesh.wait_sent(sent))

    def _lane_failed(self, error: Exception) -> None:
        """A non-blocking operation of this rank failed: every wait of this rank in the
        call raises its error again (``Mailboxes.failed_here``)."""
        mesh = self.mesh
        if mesh is not None:
            mesh.failed_here(self._call_id, error)

    def irecv(self, peer: int = ANY, tag=ANY, status: Status | None = None) -> Handle:
        key = self.message_tag("irecv", peer, tag, wild=True)
        device = self.device
        # a rank and a tag (the usual case): a wait on that rank alone (``take``); a wildcard
        # (``ANY``), like a probe and a message to this rank itself, goes through the mesh's
        # ``matching`` part
        if not _is_any(peer) and not _is_any(tag):
            with self._receives:
                n = self._posted.get((peer, key), 0)
                self._posted[(peer, key)] = n + 1
            if peer != self.rank:
                mesh = self.mesh
                recall = getattr(mesh, "recall_in", None)
                if recall is not None:  # (its message is this receive's, not a lessee's)
                    recall(peer)

                def take():
                    return mesh.take(peer, key)
            else:  # (its own mailbox: what this rank sent itself)
                def take():
                    return self._matched("recv", peer, key, True)[1]
            if status is None:
                return Handle(lambda: _arrived(device, self._nth(peer, key, n, take)))
            return Handle(lambda: _arrived(device, _described(status, peer, tag,
                                                              self._nth(peer, key, n, take))))
        return Handle(lambda: self._matched("recv", peer, key, True, status=status)[1])

    def held_inbox(self, peer: int, tag: tuple):
        """The mesh's ``held_inbox`` for a receive made outside Python of the message from
        ``peer`` with ``tag`` (a ``message_tag``), where that is the next this rank takes
        (every receive of it posted has its message); else None."""
        held, pk = getattr(self.mesh, "held_inbox", None), (peer, tag)
        if (held is None or self._posted.get(pk, 0) != self._taken.get(pk, 0)
                or pk in self._taking):
            return None
        return held(peer, tag)

    def _nth(self, peer: int, key: tuple, n: int, take: Callable):
        """The ``n``-th message from ``peer`` with ``key`` (numbered from 0 as they arrive;
        ``take()`` gives the next), for the ``n``-th receive posted for them: messages taken
        for later receives (waited for first) are kept for them. One thread at a time takes
        them."""
        pk = (peer, key)
        while True:
            with self._receives:
                while True:
                    early = self._early.get(pk)
                    if early and n in early:
                        message = early.pop(n)
                        if not early:
                            del self._early[pk]
                        return message
                    if pk not in self._taking:
                        self._taking.add(pk)
                        break
                    self._receives.wait(_WAIT_SLICE)
            try:
                message = take()
            finally:
                with self._receives:
                    self._taking.discard(pk)
                    self._receives.notify_all()
            with self._receives:
                number = self._taken.get(pk, 0)
                self._taken[pk] = number + 1
                if number == n:
                    return message
                self._early.setdefault(pk, {})[number] = message

    def probe(self, peer: int = ANY, tag=ANY) -> Status:
        key = self.message_tag("probe", peer, tag, wild=True)
        return self._matched("probe", peer, key, False)[0]

    def iprobe(self, peer: int = ANY, tag=ANY) -> Status | None:
        got = self._matched("iprobe", peer, self.message_tag("iprobe", peer, tag, wild=True), False,
                            block=False)
        return None if got is None else got[0]

    def _matched(self, what: str, peer, pattern: tuple, take: bool, block: bool = True,
                 status: Status | None = None):
        """(Status, array) of the first message that matches (the array None unless
        ``take``), waiting for one unless ``block`` is False (then None if none is in)."""
        got = self._mailboxes().match(peer, pattern, take, block)
        if got is None:
            if not block:
                return None
            raise ValueError(_never(what, self.rank, peer, self._user_tag(pattern)))
        (source, key), item = got
        status = status or Status()
        _described(status, source, self._user_tag(key), item)
        return status, (_arrived(self.device, item) if take else None)

    def abort(self, reason: str = "aborted") -> None:
        if self.mesh is not None:
            self.mesh.abort(_context.now().call_id, reason)


class Heads:
    """The second half of ``start_heads``: called, every rank's head, in rank order."""

    __slots__ = ("comm", "tag", "head", "sends")

    def __init__(self, comm: HostCommunicator, tag: tuple | None, head: np.ndarray,
                 sends: list) -> None:
        self.comm, self.tag, self.head, self.sends = comm, tag, head, sends

    def __call__(self) -> list:
        if self.tag is None:
            return [self.head]
        c = self.comm
        return _c.take_all(c.mesh, c.rank, c.size, self.tag, self.head, self.sends)

    def named(self, error: ValueError, mine) -> ValueError:
        """``host_collectives.named`` of the ranks whose heads disagree: every rank's
        ``mine`` exchanged under the heads' tag."""
        if self.tag is None:
            return error
        c = self.comm
        return _c.named(c.mesh, c.rank, c.size, self.tag, error, mine)


def _is_any(value) -> bool:
    return isinstance(value, (int, np.integer)) and value == ANY


def _described(status: Status, source: int, tag, item):
    """``item`` (a message's array, or what stands for it), described in ``status``."""
    dtype = np.dtype(item.dtype)
    if dtype.names == (_WRAPPED,):
        dtype = dtype[_WRAPPED]
    dtype = native_dtype(dtype)  # (a framework's array: its native one)
    status.source, status.tag, status.shape, status.dtype = (
        int(source), tag, tuple(item.shape), dtype)
    return item


def _never(what: str, rank: int, source, tag) -> str:
    """What a receive from this rank itself says when there is nothing to receive."""
    whom = "itself" if source == rank else "any rank, and it is the only one here"
    which = "any tag" if _is_any(tag) else f"tag {tag!r}"
    return (f"synk.comm.{what}: rank {rank} waits for a message from {whom}, with {which}, "
            "but it has sent itself none (or received them all): no other rank can send it, "
            "so the wait would never end; send it first, with synk.comm.send(x, "
            "synk.comm.rank(), tag)")


def _arrived(device, array: np.ndarray):
    """A received array: a device array sent through the host back on this rank's device."""
    if array.dtype.names != (_WRAPPED,):
        return array
    host = array.view(array.dtype[_WRAPPED])
    if device is None or device.is_host:
        return host  # a CPU rank of a mixed group keeps it on the host
    return device.to_device(host, device.current_stream())
