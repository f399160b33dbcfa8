"""The many-host mesh of ``synk.comm``: MPI point-to-point messages behind the one-host
mesh's interface, so that ``host_collectives`` run on it unchanged.

::

    post   META: header, pickled (tag, dtype, shape), the bytes when small (INLINE)
           DATA: the bytes, when large (after its META, under the same lock)
    take   polls MPI (Backoff) -> _progress: receives, answers asks (_ASK) -> mailboxes
"""
from __future__ import annotations

import collections
import contextlib
import os
import pickle
import struct
import threading
import time

import numpy as np

from ..._wire.arrays import dtype_token
from ...errors import CommError
from .. import context as _context, stalls as _stalls
from .aborts import ABORT, LEFT
from .mailbox import ANY, OBJECTS_REFUSED, OWN, P2P, abort_note, bytes_of, ended_without, nothing
from .matching import Matching

_HEADER = struct.Struct("<QQ")  # meta length, bytes that follow inline
_META, _DATA, _ASK = 1, 2, 3  # MPI tags on synk's own communicator
INLINE = 64 << 10  # a message this small travels with its meta: one MPI message
PLACE = "place"  # the kind of a rank's answer to an ``_ASK`` (a note, as ABORT's)
ASK_AFTER_S = 0.2  # a wait for one rank this long asks it where it is (see ``_place``)
ASK_EVERY_S = 1.0  # and again this often while it lasts
_FIELDS = _context.FIELDS  # (an answer: the rank's row first)


@contextlib.contextmanager
def mpi_errors(MPI):
    """MPI's errors (returned, not fatal, on synk's communicator) as ``CommError``."""
    try:
        yield
    except MPI.Exception as err:
        raise CommError(f"MPI failed under synk.comm: {err.Get_error_string()} (MPI error "
                        f"class {err.Get_error_class()}); a peer rank or its host is "
                        "probably gone") from err


class Backoff:
    """How a rank waits on MPI between polls: spins for ``spin_s``, yields its core for
    ``YIELD_S`` (each step of an MPI transfer needs a poll on both sides), then sleeps,
    doubling from 20 us to 1 ms. ``os.sched_yield``, since ``time.sleep(0)`` sleeps the
    timer slack (50 us) on Linux, delaying the ``Reduce`` after ``arrive`` on one rank."""

    YIELD_S = 2e-3

    def __init__(self, spin_s: float = 0.0) -> None:
        now = time.perf_counter()
        self._spin_until = now + spin_s
        self._yield_until = self._spin_until + self.YIELD_S
        self._pause = 20e-6

    def wait(self) -> None:
        now = time.perf_counter()
        if now < self._spin_until:
            return
        if now < self._yield_until:
            os.sched_yield()
            return
        time.sleep(self._pause)
        self._pause = min(self._pause * 2, 1e-3)


class _Send:
    """A message on its way out: its MPI requests, the buffers they read, and where it goes
    (``dest``, ``tag``: what a wait for it checks, ``wait_sent``)."""

    __slots__ = ("requests", "buffers", "dest", "tag")

    def __init__(self, requests: list, buffers: tuple, dest: int = -1, tag: tuple = ()) -> None:
        self.requests, self.buffers = requests, buffers
        self.dest, self.tag = dest, tag


class _Arriving:
    """A large message whose META has arrived and whose DATA is being received."""

    __slots__ = ("request", "array", "tag")

    def __init__(self, request, array: np.ndarray, tag: tuple) -> None:
        self.request, self.array, self.tag = request, array, tag


class MpiMesh(Matching):
    """This rank's end of synk.comm over an MPI communicator of the group's ranks, with the
    one-host mesh's interface. Messages go to per-(source, tag) mailboxes, so synk's tuple
    tags need no MPI tag. No progress thread (a blocking MPI call busy-polls a core): a
    waiting rank polls with a ``Backoff`` (as ``mpi4py.futures`` does; spinning only when
    every rank has a core) and receives whatever has arrived, so two ranks sending each
    other large messages never deadlock."""

    def __init__(self, comm, rank: int, size: int, spin_s: float = 0.0) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        super().__init__(rank, size)
        self.comm, self.spin_s = comm, spin_s
        # this rank's MPI calls and the mailboxes: one lock serialises the MPI calls
        # (MPI_THREAD_MULTIPLE is not required of the MPI library)
        self._lock = threading.RLock()
        self._mail_lock = threading.Condition(self._lock)
        self._arriving: dict = {p: collections.deque() for p in range(size)}  # in order
        self._out: list[_Send] = []  # sends not known to be done (their buffers kept)
        self._status = MPI.Status()
        self._stopped = False
        self._asked: dict = {}  # (rank, call id) -> when a wait for it began, when last asked
        self._places: dict = {}  # rank -> (call id, its latest answer: see ``_answer_asks``)
        self._answered_at: dict = {}  # rank -> when its latest answer came

    # -- the caller's side ----------------------------------------------------------------
    def begin(self, call_id: int) -> None:
        """Start call ``call_id``: drop what is left of earlier calls. (What of them is
        still in MPI is dropped as it is received, at this call's first look: no call into
        MPI here, on every call's path, for a function that may use no synk.comm.)"""
        if self._asked:
            self._asked.clear()
        if not (self._mail or self._aborted):  # the usual case: nothing left over
            self.call_id = call_id
            return
        with self._lock:
            self._forget_before(call_id)

    def post(self, dest: int, tag: tuple, array: np.ndarray) -> _Send:
        """Start sending ``array`` to ``dest``; ``wait_sent`` finishes it. A large one's META
        and DATA are posted under one lock, so that they stay paired (MPI keeps the order of
        messages between two ranks)."""
        self.check_peer(dest, sending=True)
        array = np.asarray(array, order="C")
        if array.dtype.hasobject:
            raise TypeError(OBJECTS_REFUSED)
        if self._stopped:
            raise CommError("this rank's synk.comm is closed")
        meta = pickle.dumps((tag, dtype_token(array.dtype), array.shape),
                            pickle.HIGHEST_PROTOCOL)
        data = bytes_of(array)
        byte = self._MPI.BYTE
        with self._lock, mpi_errors(self._MPI):
            if array.nbytes <= INLINE:
                buf = b"".join((_HEADER.pack(len(meta), array.nbytes), meta, data.data))
                send = _Send([self.comm.Isend([buf, byte], dest, _META)], (buf,), dest, tag)
            else:
                head = _HEADER.pack(len(meta), 0) + meta
                send = _Send([self.comm.Isend([head, byte], dest, _META),
                              self.comm.Isend([data, byte], dest, _DATA)], (head, array),
                             dest, tag)
            self._out.append(send)
        return send

    def wait_sent(self, send: _Send) -> None:
        """Wait until ``send`` is out (a large one only once its receiver takes it), or
        ``CommAborted`` where a rank of its call failed or the receiver left; the send then
        stays with MPI, its buffers kept, until it goes or synk.comm stops."""
        backoff = Backoff(self.spin_s)
        while True:
            with self._lock, mpi_errors(self._MPI):
                if self._MPI.Request.Testall(send.requests):
                    return
                if self._progress():
                    continue
                if send.tag:
                    self._raise_if_aborted(send.dest, send.tag)
                if self._stopped:
                    raise CommError("this rank's synk.comm is closed")
            backoff.wait()

    def take_view(self, source: int, tag: tuple):
        """As ``take`` (the array is this rank's own), with a no-op to call when done."""
        return self.take(source, tag), nothing

    def take(self, source: int, tag: tuple) -> np.ndarray:
        """The next message from ``source`` with ``tag``, waiting for it."""
        self.check_peer(source, sending=False)
        key = (source, tag)
        backoff = Backoff(self.spin_s)
        stall = None  # (once the wait makes no progress)
        try:
            while True:
                with self._lock, mpi_errors(self._MPI):
                    item = self._pop(key)
                    if item is not None:
                        return item
                    self._raise_if_aborted(source, tag)
                    if self._stopped:
                        raise CommError("this rank's synk.comm is closed")
                    if self._progress():
                        continue
                    self._raise_if_crossed(source, tag)
                    error = self._never_coming(source, tag)
                    if error is not None:
                        raise error
                    stall = stall or _stalls.stall(tag, message=tag[1] == P2P)
                    if stall is not None and (why := stall.check(
                            source, self._answered_row(source, tag[0]))) is not None:
                        raise ValueError(why)
                backoff.wait()
        finally:
            if stall is not None:
                stall.end()

    def progress(self) -> None:
        """Let MPI move what it holds, from a rank that waits outside MPI. Open MPI moves
        bytes only inside MPI calls, and a send it reported done may still hold a packet the
        receiver needs (ob1's FIN after an RDMA put: ``mca_pml_ob1_send_fin``): a rank gone
        idle after one left its peer waiting for good. Also takes
        what has come (dropped when the next call begins) and answers the peers' asks.
        Skipped while another thread holds the lock (it is in MPI) or once stopped."""
        if self._stopped or not self._lock.acquire(blocking=False):
            return
        try:
            if not self._MPI.Is_finalized():
                self.comm.Iprobe(self._MPI.ANY_SOURCE, self._MPI.ANY_TAG)
                self._progress()
        except self._MPI.Exception:
            pass
        finally:
            self._lock.release()

    def _progress_all(self) -> None:
        with self._lock, mpi_errors(self._MPI):
            self._progress()

    def _napper(self):
        backoff = Backoff(self.spin_s)
        return lambda seen: backoff.wait()

    def _gone_why(self, source: int) -> str | None:
        return "this rank's synk.comm is closed" if self._stopped else None

    def _senders_ended(self, source: int, call_id: int) -> bool:
        with self._lock, mpi_errors(self._MPI):
            peers = [r for r in range(self.size) if r != self.rank] if source == ANY \
                else [source]
            places = [self._place(peer, call_id) for peer in peers]
            return all(place is not None and place[0] for place in places)

    def _never_coming(self, source: int, tag: tuple) -> ValueError | None:
        """Why the message of ``tag`` from ``source`` will never come, as ``source`` answers
        where it is (``_place``): its function returned without sending it, or it refused
        its value of that collective and went on; else None (holding the lock, with no
        message of ``source`` left to deliver: what it sent before its answer is in)."""
        kind = tag[1] if len(tag) > 1 else None
        if type(kind) is not str or kind.startswith(OWN):  # (synk's own exchanges after
            return None  # the function: every rank takes part)
        place = self._place(source, tag[0])
        if place is None:
            return None
        returned, refused, refused_in, _ = place
        if kind != P2P:
            why = _context.refused_there(tag, self.rank, source, refused, refused_in)
            if why is not None:
                return ValueError(why)
        return ended_without(self.rank, tag, source) if returned else None

    def _answered_row(self, source: int, call_id: int) -> tuple:
        """``source``'s row in call ``call_id`` as it answered since it was last asked
        (``_place``), or () where it has not answered since."""
        with self._lock:
            place = self._place(source, call_id)
            asked = self._asked[(source, call_id)][1]
            if place is None or not asked or self._answered_at.get(source, 0.0) < asked:
                return ()
            return place[3]

    def _place(self, rank: int, call_id: int) -> tuple | None:
        """``rank``'s latest answer about call ``call_id`` (``_context.place_in``'s), or None;
        asks it (again) once this wait has lasted ``ASK_AFTER_S`` (and its last ask
        ``ASK_EVERY_S``), since a rank on another host has no row here. Holding the lock. MPI
        keeps one rank's order, so once its answer is in, what it sent before is too
        (``_never_coming``; the answer's row is judged as on one host)."""
        now = time.monotonic()
        began, asked = self._asked.setdefault((rank, call_id), (now, 0.0))
        if now - began >= ASK_AFTER_S and now - asked >= ASK_EVERY_S:
            self._asked[(rank, call_id)] = (began, now)
            ask = np.array([call_id], np.int64)
            self._out.append(_Send([self.comm.Isend([ask, self._MPI.BYTE], rank, _ASK)],
                                   (ask,)))
        got = self._places.get(rank)
        return got[1] if got is not None and got[0] == call_id else None

    def _answer_asks(self) -> None:
        """Answer the ranks that asked where this rank is in a call (``_place``), holding
        the lock; a call it has not started yet gets no answer (they ask again)."""
        MPI, status = self._MPI, self._status
        while True:
            message = self.comm.Improbe(MPI.ANY_SOURCE, _ASK, status)
            if message is None:
                return
            source = status.Get_source()
            ask = np.empty(1, np.int64)
            message.Recv([ask, MPI.BYTE])
            call_id = int(ask[0])
            place = _context.place_in(call_id)
            if place is not None and not self._stopped:
                returned, refused, refused_in, row = place
                self.post(source, (call_id, PLACE), np.array(
                    [*row, returned, len(refused), *refused, *refused_in], np.int64))

    def stop_reason(self, number: int = 0) -> str | None:
        """Why a wait of the running call (in its collective ``number``; 0, any) should
        end (a rank of it failed), or None."""
        with self._lock:
            return self._running_call_aborted(number)

    def gone_reason(self) -> str | None:
        """Why a wait outside any call (a communicator's set-up) should end: None here (a
        lost peer ends the MPI job)."""
        return None

    def abort(self, call_id: int, why: str, left: bool = False,
              finished: dict | None = None) -> None:
        """Tell every peer that this rank failed in call ``call_id`` (``left``,
        ``finished``: see ``Mesh.abort``)."""
        note = abort_note(why)
        for peer in range(self.size):
            if peer != self.rank:
                try:
                    self.post(peer, (call_id, LEFT if left else ABORT, finished or {}), note)
                except CommError:
                    pass

    def stop(self, grace: float = 1.0) -> None:
        """Receive what is still arriving and let this rank's sends finish (for up to
        ``grace`` seconds, so that no MPI request outlives the group), then refuse more."""
        if self._stopped:
            return
        end = time.monotonic() + grace
        while time.monotonic() < end:
            with self._lock, contextlib.suppress(self._MPI.Exception):
                self._progress()
            with self._lock:
                busy = self._out or any(self._arriving.values())
            if not busy:
                break
            time.sleep(1e-3)
        with self._lock:
            self._stopped = True
            self._mail.clear()

    # -- receiving, with the lock held ----------------------------------------------------
    def _progress(self) -> bool:
        """Receive what has arrived and retire finished sends; True if a message came."""
        MPI, got = self._MPI, False
        self._answer_asks()
        if self._out:
            self._out = [s for s in self._out if not MPI.Request.Testall(s.requests)]
        for source, queue in self._arriving.items():
            got = self._drain(source, queue) or got
        status = self._status
        while True:
            message = self.comm.Improbe(MPI.ANY_SOURCE, _META, status)
            if message is None:
                return got
            source = status.Get_source()
            buf = bytearray(status.Get_count(MPI.BYTE))
            message.Recv([buf, MPI.BYTE])
            meta_len, inline = _HEADER.unpack_from(buf)
            tag, dtype, shape = pickle.loads(buf[_HEADER.size:_HEADER.size + meta_len])
            array = np.empty(shape, dtype)
            queue = self._arriving[source]
            start = _HEADER.size + meta_len
            if len(buf) > start or array.nbytes == 0:
                bytes_of(array)[:] = np.frombuffer(buf, np.uint8, inline, start)
                queue.append((tag, array))
            else:
                request = self.comm.Irecv([bytes_of(array), MPI.BYTE], source, _DATA)
                queue.append(_Arriving(request, array, tag))
            self._drain(source, queue)
            got = True

    def _drain(self, source: int, queue) -> bool:
        """Deliver ``source``'s messages that are complete, in the order they came."""
        got = False
        while queue and (not isinstance(queue[0], _Arriving) or queue[0].request.Test()):
            item = queue.popleft()
            if isinstance(item, _Arriving):
                item = (item.tag, item.array)
            self._deliver(source, *item)
            got = True
        return got

    def _deliver(self, source: int, tag: tuple, array: np.ndarray) -> None:
        if len(tag) == 2 and tag[1] == PLACE:  # (an answer to ``_place``)
            words = array.tolist()
            row, (returned, n), rest = words[:_FIELDS], words[_FIELDS:_FIELDS + 2], \
                words[_FIELDS + 2:]
            self._places[source] = (tag[0], (bool(returned), tuple(rest[:n]),
                                              tuple(rest[n:]), tuple(row)))
            self._answered_at[source] = time.monotonic()
            return
        self._file(source, tag, array)
