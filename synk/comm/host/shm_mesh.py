"""The one-host mesh (``Mesh``): every pair of ranks joined by an AF_UNIX socketpair and,
where it can be, a shared-memory ring, all of them by the board, and a progress thread.

::

    post   small: the peer's ring (``_wire.ring``), no system call, no thread hop
           large (``SHM_FROM``, or an eighth of the ring): a sender's segment
             (``shm_channel``), its reference on the ring or socket
           no room in the ring: the socket; what it does not take, the progress thread
    take   read by the waiting thread (polling first) or the progress thread -> mailboxes
    allreduce, barrier of ranks all on this host: the board (``shm_board``)
"""
from __future__ import annotations

import collections
import os
import pickle
import select
import threading
import time
from collections.abc import Callable

import numpy as np

from ..._wire import ring as _ring
from ..._wire.arrays import dtype_token
from ..._wire.waiting import Waiter
from ...errors import CommAborted, CommError, SynkError  # noqa: F401 (re-exported)
from .. import context as _context, stalls as _stalls
from .aborts import ABORT, LEFT
from .mailbox import (
    ANY,
    OBJECTS_REFUSED,
    OWN,
    P2P,
    WAIT_SLICE as _WAIT_SLICE,
    abort_note,
    bytes_of,
    ended_without,
    nothing,
)
from .matching import Matching
from .mesh_wire import HEADER, POSTED, Reader, Send, Sending, ring_post, unpack_record
from .shm_board import USABLE as _BOARD_USABLE, Board, other_size
from .shm_channel import SHM_FROM, Inbox, Outbox, Parcel, ring_shm_from

_RING_BYTES = 16 << 10  # arrays smaller than this try the ring first, in short
_RESUME_MS = 2  # how soon the progress thread reads again a socket a caller stopped reading


class Mesh(Matching):
    """This rank's ends of the socketpairs to every other rank, and its progress thread,
    which sends and reads what the calling or waiting thread does not, so that two ranks
    sending to each other never deadlock and non-blocking sends progress. Beside a ring, the
    socket carries wake-ups, aborts, and what the ring has no room for."""

    def __init__(self, rank: int, size: int, socks: dict, spin_s: float = 0.0,
                 prefix: str | None = None, rings: dict[int, tuple[str, int] | None] | None
                 = None, board: str | None = None) -> None:
        super().__init__(rank, size)
        self.spin_s = spin_s
        self._outbox = Outbox(prefix, rank) if prefix else None  # (large messages' segments)
        self._inbox = Inbox()
        self._socks = socks  # peer rank -> socket
        self._peer_of = {s.fileno(): p for p, s in socks.items()}
        for s in socks.values():
            s.setblocking(False)
        self._cond = self._mail_lock = threading.Condition()  # the lock of the mailboxes
        self._gone: dict = {}  # peer -> why
        self._out: dict[int, collections.deque[Send]] = {p: collections.deque() for p in socks}
        self._readers = {p: Reader() for p in socks}
        self._send_locks = {p: threading.RLock() for p in socks}
        self._read_locks = {p: threading.Lock() for p in socks}  # one reader per socket
        # peer -> its ring (None: sockets only, e.g. a rank on another host), read by one
        # thread at a time (its lock), written under the peer's send lock
        self._rings: dict[int, _ring.Ring | None] = {
            p: None if not rings or (where := rings.get(p)) is None
            else _ring.attach(*where, _ring.mesh_ring_bytes(size)) for p in socks}
        self._ring_shm_from = ring_shm_from(size)
        self.board = Board(board, rank, size, self._waiter, self._check_waited) if (
            board and _BOARD_USABLE and all(self._rings.values())) else None  # (every peer
        # has a ring); where the collectives of all the call's ranks meet (``shm_board``)
        self._ring_locks = {p: threading.Lock() for p in socks}
        self._outside: set = set()  # peers whose ring a reader outside Python holds
        # peer -> the lease (xla_handler.Lease) of the lane from it, and of the lane to it,
        # lent to synk's XLA target between its sendrecvs: that lane's state is the lease's
        # until ``recall_in``/``recall_out`` (which every use of the lane in Python calls
        # first, under the lane's lock) takes it back; ``generation`` (a descriptor's must be
        # the lease's) changes at every ``recall_all``: a new call, its end, a group's method
        self._lent_in: dict = {}
        self._lent_out: dict = {}
        self._lend_lock = threading.Lock()
        self.generation = 0
        self._sent = dict.fromkeys(socks, 0)  # messages numbered so far, per peer
        self._next = dict.fromkeys(socks, 1)  # the number of the next message to deliver
        self._early: dict = {p: {} for p in socks}  # number -> (tag, item) that came early
        self._waiters = threading.local()  # each thread's Waiter
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="synk-comm", daemon=True)
        self._thread.start()

    # -- the caller's side ----------------------------------------------------------------
    def begin(self, call_id: int) -> None:
        """Start call ``call_id``: drop what is left of earlier calls, and free the segments
        of this rank's messages in them that were never received."""
        if self._outbox is not None:
            self._outbox.reclaim(call_id, _context.left_call)
        if self.board is not None:
            self.board.begin(call_id)
        self.recall_all()
        self._outside.clear()  # (one left by a call that failed as the reader gave it back)
        if not (self._mail or self._aborted):  # the usual case: nothing left over (a look
            self.call_id = call_id  # without the lock: a message of an earlier call that
            return  # lands meanwhile is dropped at the next begin)
        with self._cond:
            self._forget_before(call_id)  # (a segment is freed by its sender: Outbox.reclaim)

    def post(self, dest: int, tag: tuple, array: np.ndarray) -> Sending:
        """Queue ``array`` for ``dest``; the returned send's ``done`` is set once it is out."""
        data: memoryview | bytes | np.ndarray
        ring = self._rings.get(dest)
        if (ring is not None and type(array) is np.ndarray and array.nbytes < _RING_BYTES
                and array.flags.c_contiguous and not self._gone):
            dtype = array.dtype
            if dtype.fields is None and not dtype.hasobject:  # (the usual case, in short)
                meta = pickle.dumps((tag, dtype.str, array.shape), pickle.HIGHEST_PROTOCOL)
                try:
                    data = array.data.cast("B")  # (memoryview(array))
                except (TypeError, ValueError):  # a dtype with no buffer format
                    data = bytes_of(array)
                with self._send_locks[dest]:
                    self.recall_out(dest)
                    if not self._out[dest]:
                        number = self._sent[dest] + 1
                        if ring_post(ring, number, meta, data):
                            self._sent[dest] = number
                            if ring.out.reader_sleeping():
                                self._queue(dest, Send([HEADER.pack(0, 0, 0)]))
                            return POSTED
        if dest not in self._socks:
            self.check_peer(dest, sending=True)
        array = np.asarray(array, order="C")  # (ascontiguousarray would make 0-d 1-d)
        if array.dtype.hasobject:
            raise TypeError(OBJECTS_REFUSED)
        if dest in self._gone:
            raise CommError(f"rank {dest} is gone ({self._gone[dest]})")
        if self._outbox is not None and array.nbytes >= self._shm_from(dest):
            ref = self._outbox.put(dest, bytes_of(array), tag[0])
            return self._send(dest, (tag, dtype_token(array.dtype), array.shape, ref), b"")
        return self._send(dest, (tag, dtype_token(array.dtype), array.shape), bytes_of(array))

    def post_filled(self, dest: int, tag: tuple, shape: tuple, dtype: np.dtype, fill):
        """``post`` of an array of ``shape`` and ``dtype`` that ``fill(view)`` writes straight
        into the segment a large message takes. ``(send, view)`` (read the view only before
        the next message to ``dest``); None where it would take none: post an array."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self._outbox is None or nbytes < self._shm_from(dest) or dest not in self._socks \
                or self._gone:
            return None
        ref, view = self._outbox.put_filled(dest, nbytes, dtype, shape, tag[0], fill)
        return self._send(dest, (tag, dtype_token(dtype), shape, ref), b""), view

    def _shm_from(self, dest: int) -> int:  # (the least bytes to ``dest`` that take a segment)
        return SHM_FROM if self._rings.get(dest) is None else self._ring_shm_from

    def _send(self, dest: int, fields: tuple, data) -> Sending:
        """Send a message, its meta ``fields`` pickled then ``data``, by ring or socket."""
        meta = pickle.dumps(fields, pickle.HIGHEST_PROTOCOL)
        with self._send_locks[dest]:
            self.recall_out(dest)
            number = self._sent[dest] = self._sent[dest] + 1
            ring = self._rings[dest]
            if ring is not None and not self._out[dest] and ring_post(ring, number, meta, data):
                if ring.out.reader_sleeping():
                    self._queue(dest, Send([HEADER.pack(0, 0, 0)]))
                return POSTED
            send = Send([HEADER.pack(len(meta), len(data), number), meta, data])
            self._queue(dest, send)
        return send

    def _queue(self, dest: int, send: Send) -> None:
        """Write ``send`` on the socket (the caller holds the send lock), leaving what the
        socket does not take now to the progress thread."""
        queue = self._out[dest]
        if not queue:  # nothing ahead of it: write what the socket takes now
            self._push(dest, send)
        if send.done.is_set():
            return
        queue.append(send)
        self._wake()  # the progress thread writes the rest

    def wait_sent(self, send: Sending) -> None:
        while not send.done.wait(_WAIT_SLICE):
            pass
        if send.error is not None:
            raise send.error

    def take(self, source: int, tag: tuple) -> np.ndarray:
        """The next message from ``source`` with ``tag``, waiting for it."""
        return self._copy_of(source, tag, self._take(source, tag))

    def take_view(self, source: int, tag: tuple):
        """``take``, a large message not copied: the array (maybe a view of the sender's
        shared memory) and a function to call once done with it."""
        return self._view_of(source, tag, self._take(source, tag))

    def _view_of(self, source: int, tag: tuple, item):
        """A message taken, and a function to call once done with it: a large message is a
        view of its sender's shared memory, which that hands back."""
        if not isinstance(item, Parcel):
            return item, nothing
        try:
            view = self._inbox.view(item)
        except FileNotFoundError:
            raise CommError(f"rank {source} is gone (its message's shared memory was "
                            f"removed); rank {self.rank} was receiving it") from None
        return view, lambda: self._release(source, item, tag[0])

    def _copy_of(self, source: int, tag: tuple, item) -> np.ndarray:
        """A message taken, as an array of this rank's own."""
        if not isinstance(item, Parcel):  # (a small one: its own already)
            return item
        view, done = self._view_of(source, tag, item)
        if done is nothing:
            return view
        try:
            return view.copy()
        finally:
            done()

    def _waiter(self) -> Waiter:
        waiter = getattr(self._waiters, "waiter", None)
        if waiter is None:
            waiter = self._waiters.waiter = Waiter(self.spin_s)
        return waiter

    def _mailed(self, key: tuple, tag: tuple, source: int):
        """The message waited for if it is in, else None; raises when it will not come (a
        gone rank's ring read first: what it posted before it went is there)."""
        if key not in self._mail and not self._aborted.about(tag[0]) and not self._gone:
            return None  # (a look without the lock; the usual case while waiting)
        if source in self._gone and self._rings.get(source) is not None:
            item = self._drain_ring(source, key, block=True)
            if item is not None:
                return item
        with self._cond:
            item = self._pop(key)
            if item is not None:
                return item
            self._raise_if_ended(source, tag)
        return None

    def _raise_if_ended(self, source: int, tag: tuple) -> None:
        """Raise where ``source``'s part of ``tag`` will not come (holding the lock)."""
        self._raise_if_aborted(source, tag)
        if source in self._gone:
            raise CommError(f"rank {source} is gone ({self._gone[source]}); "
                            f"rank {self.rank} was waiting for its message")

    def _check_waited(self, source: int, tag: tuple) -> bool:
        """Raise where ``source``'s post on the board will not come: as ``_raise_if_ended``,
        or it took messages for this collective (its array does not fit a slot). True where
        its function or share is over (``_returned``, ``_context.share_ended``): a post it
        made is on the board by then."""
        if self._rings.get(source) is not None:
            self._drain_ring(source, None)
        with self._cond:
            self._raise_if_ended(source, tag)
            n = len(tag)
            for src, other in self._mail:  # (the collective's own messages: its tag, or
                if src == source and other[:n] == tag and (  # its tag and a part's number,
                        len(other) == n or type(other[n]) is not tuple):  # not a group's)
                    raise other_size(source, tag, self.rank)
            self._raise_if_crossed(source, tag)
            returned = self._returned(source, tag)
        if not (returned or _context.share_ended(source, tag[0])):
            return False
        if self._rings.get(source) is not None:  # (an abort it sent before, on its socket,
            self._drain_ring(source, None, block=True)  # is read before this rank says it
        with self._read_locks[source]:  # returned without posting)
            self._read(source)
        with self._cond:
            self._raise_if_ended(source, tag)
        return True

    def _drain_ring(self, source: int, key: tuple | None, block: bool = False):
        """Deliver what ``source``'s ring holds (unless another thread is at it, or with
        ``block``, once it is done), up to the message with ``key`` if it is among them:
        that one is returned (not put in the mailbox), else None. (What follows it stays in
        the ring, where synk's XLA target takes its messages: ``held_inbox``.)"""
        lock = self._ring_locks[source]
        if not lock.acquire(blocking=block):
            return None
        try:
            self.recall_in(source)
            if source in self._outside:  # (held for a reader outside Python: what it
                return None  # does not take, the thread that holds it drains)
            ring = self._rings[source]
            assert ring is not None  # (called for a peer with a ring only)
            inbox = ring.inbox
            found = None
            while (found is None or key is None) and (record := inbox.get()) is not None:
                found = self._deliver(source, *unpack_record(record[1]), want=key)
            return found
        finally:
            lock.release()

    def _take(self, source: int, tag: tuple):
        if source not in self._socks:
            self.check_peer(source, sending=False)
        key = (source, tag)
        ring = self._rings[source]
        item = self._mailed(key, tag, source)
        if item is not None:
            return item
        if ring is not None:
            item = self._drain_ring(source, key)
            if item is not None:
                return item
        return self._wait_for(source, tag, key, ring)

    def _wait_for(self, source: int, tag: tuple, key: tuple, ring):
        waiter = self._waiter()
        mail, noted = self._mail, self._noted
        lock, sock = self._read_locks[source], self._socks[source]
        held = False  # once this thread has the socket, it reads it until the message is in
        start = time.perf_counter()
        if ring is not None:
            inbox = ring.inbox

            def ready() -> bool:
                return inbox.pending() or key in mail or noted(source, tag)
        else:
            def ready() -> bool:
                return key in mail or bool(select.select([sock], [], [], 0)[0])
        stall = None
        try:
            while True:
                item = self._mailed(key, tag, source)
                if item is not None:
                    return item
                if ring is not None:
                    item = self._drain_ring(source, key)
                    if item is not None:
                        return item
                    if inbox.pending():
                        continue  # (another thread is reading it)
                if waiter.poll(ready):
                    if ring is None and key not in mail and lock.acquire(blocking=False):
                        try:
                            self._read(source)
                        finally:
                            lock.release()
                    continue
                if self._ended_before_sleep(source, tag, ring):
                    return self._from_ended(source, tag, key, held)
                stall = stall or _stalls.stall(tag, message=tag[1] == P2P)
                if stall is not None and (why := stall.check(source)) is not None:
                    raise ValueError(why)
                if not held:
                    held = lock.acquire(blocking=False)
                self._sleep(source, key, ring, held, waiter, start)
        finally:
            if stall is not None:
                stall.end()
            if held:
                lock.release()  # the progress thread takes the socket back within _RESUME_MS

    def _ended_before_sleep(self, source: int, tag: tuple, ring) -> bool:
        """Whether ``source`` returned from its function (or its share ended), before a
        wait for ``tag`` sleeps; raises where it posted on the board or crossed."""
        if self.board is not None:
            self.board.check_sends(source, tag)
        with self._cond:
            self._raise_if_crossed(source, tag)
            returned = self._returned(source, tag)
        return returned or (ring is not None and _context.share_ended(source, tag[0]))

    def _sleep(self, source: int, key: tuple, ring, held: bool, waiter: Waiter,
               start: float) -> None:
        """One slice of a wait for ``key`` from ``source`` (none where its ring has some)."""
        if ring is not None:
            ring.inbox.set_sleeping(True)
        try:
            if ring is not None and ring.inbox.pending():
                return
            if held:  # sleep on the socket: a message, a wake-up or its end
                if select.select([self._socks[source]], [], [], _WAIT_SLICE)[0]:
                    self._read(source)
                    waiter.slept(time.perf_counter() - start)
            else:  # the progress thread reads it, and notifies
                with self._cond:
                    if key not in self._mail:
                        self._cond.wait(_WAIT_SLICE)
        finally:
            if ring is not None:
                ring.inbox.set_sleeping(False)

    def _returned(self, source: int, tag: tuple) -> bool:
        if super()._returned(source, tag):
            return True
        kind = tag[1] if len(tag) > 1 else None  # (or posted such an exchange on the board)
        return (self.board is not None and type(kind) is str and not kind.startswith(OWN)
                and self.board.posted_own(source, tag[0]))

    def _from_ended(self, source: int, tag: tuple, key: tuple, held: bool):
        """The message with ``key`` from ``source``, whose function returned: what it sent
        is in its ring or socket by then (``share_ended``), else it never comes (``held``:
        this thread holds the socket's read lock)."""
        if self._rings.get(source) is not None:
            item = self._drain_ring(source, key, block=True)
            if item is not None:
                return item
        if not held:
            self._read_locks[source].acquire()
        try:
            self._read(source)
        finally:
            if not held:
                self._read_locks[source].release()
        with self._cond:
            item = self._pop(key)
            if item is not None:
                return item
            self._raise_if_ended(source, tag)
            self._raise_if_crossed(source, tag)
        raise ended_without(self.rank, tag, source)

    def _senders_ended(self, source: int, call_id: int) -> bool:
        peers = list(self._socks) if source == ANY else [source]
        if not all(self._rings.get(p) is not None and _context.share_ended(p, call_id)
                   for p in peers):
            return False
        for peer in peers:  # (what they sent is in their rings or the sockets by now)
            self._drain_ring(peer, None, block=True)
            with self._read_locks[peer]:
                self._read(peer)
        return True

    def flush(self) -> None:
        """Wait until what this rank sent is out of its queues, in its peers' sockets (a
        gone peer's sends end with their error)."""
        for peer, queue in self._out.items():
            with self._send_locks[peer]:
                last = queue[-1] if queue else None
            if last is not None:
                while not last.done.wait(_WAIT_SLICE) and not self._stopping:
                    pass

    def stop_reason(self, number: int = 0) -> str | None:
        """Why a wait of the running call (in its collective ``number``; 0, any) should
        end (a rank of it failed, or a peer is gone), or None: for waits outside this mesh
        (NCCL's)."""
        with self._cond:
            return self._running_call_aborted(number) or self.gone_reason()

    def gone_reason(self) -> str | None:
        """Why a wait outside any call (a communicator's set-up) should end: a gone peer."""
        with self._cond:  # (re-entrant: a Condition's lock)
            return self._gone_why(ANY)

    def abort(self, call_id: int, why: str, left: bool = False,
              finished: dict | None = None) -> None:
        """Tell every peer that this rank failed in call ``call_id`` (``left``: that it had
        no rows and its function failed before its first collective; ``finished``: the
        collectives of the call it finished; see ``aborts``)."""
        note = abort_note(why)
        meta = pickle.dumps(((call_id, LEFT if left else ABORT, finished or {}), note.dtype.str,
                             note.shape))
        for peer in self._socks:  # on the sockets, out of order: the peers may be waiting
            if peer in self._gone:  # for another rank's message, not reading this ring
                continue
            with self._send_locks[peer]:
                self._queue(peer, Send([HEADER.pack(len(meta), note.nbytes, 0), meta,
                                         note]))

    def stop(self) -> None:
        if self._thread is None:
            return
        self.recall_all()
        self._stopping = True
        self._wake()
        self._thread.join(timeout=5)
        self._thread = None
        for s in self._socks.values():
            s.close()
        for ring in self._rings.values():
            if ring is not None:
                ring.close()
        self._inbox.close()
        if self._outbox is not None:
            self._outbox.destroy()
        if self.board is not None:
            self.board.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- Matching's hooks (wildcard receives, probes) -------------------------------------
    def _opened(self, key: tuple, item):
        return self._copy_of(key[0], key[1], item)

    def _progress_all(self) -> None:
        for peer, ring in self._rings.items():
            if ring is not None:
                self._drain_ring(peer, None)

    def _napper(self) -> Callable[[int], None]:
        waiter = self._waiter()
        inboxes = [ring.inbox for ring in self._rings.values() if ring is not None]
        polled = False

        def nap(seen: int) -> None:
            nonlocal polled

            def ready() -> bool:
                return self._arrivals != seen or any(inbox.pending() for inbox in inboxes)

            if not polled:  # (once a wait: polling pays only for a message that is close)
                polled = True
                if waiter.poll(ready):
                    return
            for inbox in inboxes:  # so that their senders send a wake-up
                inbox.set_sleeping(True)
            try:
                with self._cond:  # (the progress thread notifies under it)
                    if not ready():
                        self._cond.wait(_WAIT_SLICE)
            finally:
                for inbox in inboxes:
                    inbox.set_sleeping(False)

        return nap

    def _gone_why(self, source: int) -> str | None:
        gone = self._gone
        if not gone or (source != ANY and source not in gone):
            return None
        peer = source if source != ANY else next(iter(gone))
        return f"rank {peer} is gone ({gone[peer]})"

    # -- the progress thread --------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:
            pass

    def _deliver(self, source: int, number, tag, item, want=None):
        """A message from ``source`` arrived (by its ring or its socket): put it in its
        mailbox once every message numbered before it is in. Number 0: out of band (an
        abort); None: a wake-up. Returns the message instead when its key is ``want`` and
        it is next in order (the caller is waiting for it)."""
        if number:
            self.recall_in(source)
        elif number == 0:  # (an abort: the lanes come back to Python, which refuses to lend
            self.recall_all()  # them in an aborted call)
        with self._cond:
            if number is None:
                self._cond.notify_all()
                return None
            if number:
                if number != self._next[source]:
                    self._early[source][number] = (tag, item)
                    return None
                early = self._early[source]
                self._next[source] = number + 1
                if not early and want is not None and want[1] == tag and (
                        want not in self._mail and tag[0] >= self.call_id):
                    if isinstance(item, Parcel) and item.ref.retired:
                        self._inbox.forget(item.ref.retired)
                    return item  # the usual case: no mailbox, nobody to notify
                self._accept(source, tag, item)
                self._accept_early(source)
            else:
                self._accept(source, tag, item)
            self._cond.notify_all()
        return None

    def _accept_early(self, source: int) -> None:
        """Accept those of ``source``'s messages that came early and are next now (the
        caller holds the mailboxes' lock)."""
        early = self._early[source]
        while early:
            got = early.pop(self._next[source], None)
            if got is None:
                break
            self._next[source] += 1
            self._accept(source, *got)

    # -- a message taken outside Python (synk's XLA target: comm/autograd/xla_handler.py) --
    def held_inbox(self, source: int, tag: tuple):
        """(the ring's memory, its inbox lane, its tail, the next message's number) of
        ``source``'s ring, held for a reader outside Python (no other thread drains it)
        that takes the next record where it is the message of ``tag``, then gives it back
        (``given_back``); None where it may not: no ring, a checked lane, a gone rank or an
        abort, another thread at the ring, a message of ``tag`` (or a later one) already in."""
        ring, lock = self._rings.get(source), self._ring_locks[source]
        if (ring is None or ring.inbox.checked or self._gone or self._aborted.about(tag[0])
                or not lock.acquire(blocking=False)):
            return None
        try:
            self.recall_in(source)
            if self._early[source] or (source, tag) in self._mail:
                return None
            self._outside.add(source)
            return ring._shm.buf, ring.inbox, ring.inbox._tail, self._next[source]
        finally:
            lock.release()

    def given_back(self, source: int, tail: int | None, number: int, lease=None) -> None:
        """``held_inbox``'s ring given back; where its reader took message ``number`` from
        it (``tail``: where the records it left start), that message counted, and the lane
        lent to ``lease``, if any. Safe to call again (to finish a hand-back an interrupt cut
        short: ``_outside``, cleared last, says it was not)."""
        if source not in self._outside:
            return
        if tail is not None:
            self._took_in(source, tail, number + 1)
            if lease is not None:
                lease.lend(self.generation, tail, 0, self._next[source])
                self._lent_in[source] = lease
        self._outside.discard(source)

    def _took_in(self, source: int, tail: int, following: int) -> None:
        """The lane from ``source`` read up to ``tail`` outside Python, up to the message
        numbered ``following``."""
        ring = self._rings[source]
        assert ring is not None  # (``held_inbox``'s)
        ring.inbox._tail = tail
        with self._cond:
            if self._next[source] < following:
                self._next[source] = following
                if self._early[source]:  # (they come in order now)
                    self._accept_early(source)
                    self._cond.notify_all()

    def recall_in(self, source: int) -> None:
        """The lane from ``source`` back from its lease, if lent (the caller holds its
        ring lock, or uses no more of it than its message numbers)."""
        if source in self._lent_in:
            with self._lend_lock:
                lease = self._lent_in.pop(source, None)
                if lease is not None:
                    tail, _, following = lease.take_back()
                    self._took_in(source, tail, following)

    def recall_out(self, dest: int, wake: bool = False) -> None:
        """The lane to ``dest`` back from its lease, if lent (the caller holds its send
        lock, or the lease's holder owes it: ``wake``, its reader is woken)."""
        if dest in self._lent_out:
            with self._lend_lock:
                lease = self._lent_out.pop(dest, None)
                if lease is not None:
                    ring = self._rings[dest]
                    assert ring is not None  # (``held_outbox``'s)
                    ring.out._head, ring.out._seen, self._sent[dest] = lease.take_back()
        if wake:
            with self._send_locks[dest]:
                self._queue(dest, Send([HEADER.pack(0, 0, 0)]))

    def recall_all(self) -> None:
        """Every lane lent back, and a new generation: a descriptor of the last one is
        lent none again."""
        self.generation += 1
        for source in list(self._lent_in):
            self.recall_in(source)
        for dest in list(self._lent_out):
            self.recall_out(dest)

    def held_outbox(self, dest: int, nbytes: int):
        """(the ring's memory, its out lane, its head and the tail it last saw, the next
        message's number) of the ring to ``dest``, its send lock held, for a writer outside
        Python that puts one message of ``nbytes`` in it (``sent_outside``); None where
        ``post`` would not put it in the ring (no ring, a checked lane, a gone rank, a
        large message, messages queued on the socket) or another thread is sending."""
        ring, lock = self._rings.get(dest), self._send_locks[dest]
        if (ring is None or ring.out.checked or self._gone or nbytes >= _RING_BYTES
                or not lock.acquire(blocking=False)):
            return None
        self.recall_out(dest)
        if self._out[dest]:
            lock.release()
            return None
        out = ring.out
        return ring._shm.buf, out, out._head, out._seen, self._sent[dest] + 1

    def sent_outside(self, dest: int, put: tuple | None, lease=None) -> None:
        """``held_outbox``'s ring given back, its send lock let go; where the writer put its
        message in it (``put``: the lane's head and the tail it saw, the message's number,
        whether the reader sleeps), that message counted, and the lane lent to ``lease``, if
        any. Safe to call again (to finish a hand-back an interrupt cut short: the lock, let
        go last, says it was not)."""
        lock = self._send_locks[dest]
        if not lock._is_owned():  # type: ignore[attr-defined]
            return
        if put is not None:
            ring = self._rings[dest]
            assert ring is not None  # (``held_outbox``'s)
            head, seen, number, wake = put
            ring.out._head, ring.out._seen, self._sent[dest] = head, seen, number
            if wake:
                self._queue(dest, Send([HEADER.pack(0, 0, 0)]))
            if lease is not None:
                lease.lend(self.generation, head, seen, number)
                self._lent_out[dest] = lease
        lock.release()

    def _accept(self, source: int, tag: tuple, item) -> None:
        if isinstance(item, Parcel) and item.ref.retired:
            self._inbox.forget(item.ref.retired)
        # (a message of a call that is over is dropped; its sender frees its segment, if
        # any: Outbox.reclaim; freed here too, it could be freed again once reused)
        self._file(source, tag, item)

    def _release(self, source: int, parcel: Parcel, call_id: int) -> None:
        """Hand ``source`` its segment back (a message of call ``call_id``)."""
        if call_id < self.call_id:
            return  # read past its call (a handle never waited for): its sender freed it
        try:
            self._inbox.done(parcel)
        except FileNotFoundError:
            pass  # it is gone, and its segments with it

    def _read(self, peer: int) -> None:
        """Read what ``peer`` has sent (the caller holds its read lock)."""
        try:
            alive = self._readers[peer].feed(
                self._socks[peer], lambda number, tag, arr: self._deliver(peer, number, tag, arr))
        except OSError as err:
            self._lose(peer, f"connection error: {err}")
            return
        if not alive:
            self._lose(peer, "it closed its connection")

    def _push(self, peer: int, send: Send) -> bool:
        """Write as much of ``send`` as the socket takes (the caller holds the peer's send
        lock); True when all of it is out."""
        sock = self._socks[peer]
        while send.chunks:
            chunk = send.chunks[0]
            try:
                n = sock.send(chunk)
            except BlockingIOError:
                return False
            except OSError as err:
                send.error = CommError(f"rank {peer} is gone (connection error: {err})")
                send.done.set()
                self._lose(peer, f"connection error: {err}")
                return True
            if n < len(chunk):
                send.chunks[0] = chunk[n:]
                return False
            send.chunks.popleft()
        send.done.set()
        return True

    def _lose(self, peer: int, why: str) -> None:
        with self._send_locks[peer], self._cond:
            self._gone.setdefault(peer, why)
            for send in self._out[peer]:
                send.error = CommError(f"rank {peer} is gone ({why})")
                send.done.set()
            self._out[peer].clear()
            self._cond.notify_all()
        self.recall_all()  # (no lane is lent with a rank gone: ``held_inbox``)

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug here must end the waits, not hang them
            why = f"this rank's synk.comm progress thread failed: {type(exc).__name__}: {exc}"
            for peer in self._socks:
                self._lose(peer, why)

    def _serve(self) -> None:
        while not self._stopping:
            poller = select.poll()
            skipping = False
            for peer, sock in self._socks.items():
                if peer in self._gone:
                    continue
                reading = not self._read_locks[peer].locked()  # else a waiting caller reads
                skipping = skipping or not reading
                mask = ((select.POLLIN if reading else 0)
                        | (select.POLLOUT if self._out[peer] else 0))
                if mask:
                    poller.register(sock.fileno(), mask)
            poller.register(self._wake_r, select.POLLIN)
            # A caller that was reading a socket does not wake this thread when it stops
            # (that would cost every message a wake-up); the socket is taken back within
            # _RESUME_MS instead.
            for fd, events in poller.poll(_RESUME_MS if skipping else None):
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                peer = self._peer_of[fd]
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    lock = self._read_locks[peer]
                    if lock.acquire(blocking=False):
                        try:
                            self._read(peer)
                        finally:
                            lock.release()
                if events & select.POLLOUT and peer not in self._gone:
                    self._write(peer)

    def _write(self, peer: int) -> None:
        with self._send_locks[peer]:
            queue = self._out[peer]
            while queue and self._push(peer, queue[0]):
                queue.popleft()
