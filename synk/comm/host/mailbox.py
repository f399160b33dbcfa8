"""What every host mesh keeps (the one-host ``shm_mesh.Mesh`` and the many-host
``mpi_mesh.MpiMesh``): per-(source, tag) mailboxes of the running call, the peers' notes on
it (``aborts``), the call's id, and the checks of a peer's rank."""
from __future__ import annotations

import collections
import copy
import threading

import numpy as np

from ... import _reduction
from ...errors import CommAborted
from .. import context as _context
from .aborts import Notes

NOTE_BYTES = 2000  # an abort note is cut to this many bytes of UTF-8
ANY = -1  # a receive's source or tag that matches any (synk.comm.ANY_SOURCE, ANY_TAG)
P2P = "p"  # the kind (second item) of a point-to-point message's tag
# the kinds of synk's own exchanges after a rank's function (its outputs'): a rank there
# while others are still in the function's collectives is one whose function failed with
# no rows (its note of leaving tells the others), not one that called another collective
OWN = "synk "
WAIT_SLICE = 0.02  # waits wake this often, so that an interrupt of the master lands


def bytes_of(array: np.ndarray) -> np.ndarray:
    """The raw bytes of a C-contiguous array, as a flat uint8 view (any dtype, any ndim)."""
    return array.reshape(-1).view(np.uint8)


#: The one rule of what synk.comm's arrays may hold, on every mesh and in every operation.
OBJECTS_REFUSED = (
    "synk.comm moves arrays of fixed-size dtypes (numbers, bool, strings, bytes, records, "
    "datetimes); this one has dtype object (Python objects, which travel only pickled): "
    "use synk.comm.broadcast_object, allgather_object, gather_object or scatter_object for "
    "those, or convert the array to a fixed-size dtype")


def nothing() -> None:
    """What ``take_view`` returns to call when a message's array is the rank's own."""


def abort_note(why: str) -> np.ndarray:
    """The note of an ``ABORT`` message: ``why`` in UTF-8, cut to ``NOTE_BYTES`` on a
    character boundary."""
    data = why.encode()
    if len(data) > NOTE_BYTES:
        data = data[:NOTE_BYTES].decode(errors="ignore").encode()
    return np.frombuffer(data, np.uint8)


def _matches(tag: tuple, pattern: tuple) -> bool:
    return len(tag) == len(pattern) and all(p == ANY or p == t for p, t in zip(pattern, tag))


def _point(tag: tuple) -> tuple:
    """Where a collective's tag stands in its call: (call, number, group's scope)."""
    scope = tag[3] if len(tag) > 3 and type(tag[3]) is tuple else ()
    return tag[0], tag[2], scope


def _collective_point(tag: tuple) -> tuple | None:
    """(its numbering's scope, its number) of the collective ``tag`` is of, else None (a
    message, synk's own)."""
    kind = tag[1] if len(tag) >= 3 else None
    if type(kind) is not str or kind == P2P or kind.startswith(OWN):
        return None
    return _point(tag)[2], tag[2]


def crossed(rank: int, tag: tuple, other_rank: int, other: tuple) -> ValueError:
    """The error of ranks that called different collectives (or ops, or roots) at the
    same point of a call: the same on every rank that sees it."""
    return ValueError(
        f"the ranks called different collectives at the same point: rank {rank} called "
        f"{tag[1]} (its collective #{tag[2]} of this call), rank {other_rank} called "
        f"{other[1]} (#{other[2]}); every rank must call the same collectives, with the same "
        "op and root, in the same order")


def ended_without(rank: int, tag: tuple, other_rank: int) -> ValueError:
    """The error of a rank that waits for a message of ``tag`` from ``other_rank`` (``ANY``:
    any other rank), whose function returned without sending it: the ranks did not call
    the same collectives (or one received what the other never sent)."""
    kind = tag[1] if len(tag) > 1 else None
    if kind == P2P:
        user_tag = tag[2] if len(tag) > 2 else ANY
        waited = "a message" + ("" if user_tag == ANY else f" with tag {user_tag!r}")
        rule = "a receive needs a send on the other rank"
    else:
        number = f"its collective #{tag[2]} of this call" if len(tag) > 2 else "a collective"
        named = type(kind) is str and kind.split(" ")[0] in _context.NAMES
        waited = f"its part of {kind} ({number})" if named else f"its part of {number}"
        rule = ("every rank must call the same collectives, with the same op and root, in "
                "the same order")
    if other_rank == ANY:
        return ValueError(f"rank {rank} waited for {waited} from any rank, and every other "
                          f"rank's function returned without sending it: {rule}")
    return ValueError(f"rank {rank} waited for {waited} from rank {other_rank}, whose "
                      f"function returned without sending it: {rule}")


class Mailboxes:
    """A host mesh's mailboxes for ``rank`` of ``size``. A tag starts with the id of its
    call: a message of an older call is dropped, so that a failed call cannot confuse the
    next. A subclass holds its own lock around these methods, ``_mail_lock`` (a Condition);
    the ones that start with ``_`` expect it held."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._mail: dict = collections.defaultdict(collections.deque)  # (src, tag) -> items
        self._aborted = Notes()  # what the peers said of the calls under way
        self._arrivals = 0  # point-to-point messages filed so far (their arrival numbers)
        self._mail_lock: threading.Condition  # set by the subclass
        self.call_id = 0

    def _returned(self, source: int, tag: tuple) -> bool:
        """Whether ``source``'s function has returned in the call of ``tag``, a function's
        collective or message (holding the lock): a message of synk's own exchanges after
        its function (``OWN``) came from it. Messages from one rank arrive in order, so
        what it sent in its function is in by then."""
        kind = tag[1] if len(tag) > 1 else None
        if type(kind) is not str or kind.startswith(OWN):
            return False
        call_id = tag[0]
        for src, other in self._mail:
            if (src == source and other[0] == call_id and len(other) > 1
                    and type(other[1]) is str and other[1].startswith(OWN)):
                return True
        return False

    def flush(self) -> None:
        """Wait until what this rank sent has left it (a mesh that queues sends)."""

    def check_peer(self, peer, sending: bool) -> None:
        """``ValueError`` unless ``peer`` is another rank of the group."""
        if not (isinstance(peer, (int, np.integer)) and 0 <= peer < self.size
                and peer != self.rank):
            what = "to send to" if sending else "to receive from"
            raise ValueError(f"no rank {peer} {what}: ranks are 0..{self.size - 1}, and this "
                             f"is rank {self.rank}")

    def _forget_before(self, call_id: int) -> None:
        """Call ``call_id`` starts: drop the mail and notes of earlier calls."""
        self.call_id = call_id
        for key in [k for k in self._mail if k[1][0] < call_id]:
            del self._mail[key]
        self._aborted.forget_before(call_id)

    def end_call(self, call_id: int, why: str) -> None:
        """This rank's share of call ``call_id`` ended unfinished: every wait in it still
        under way ends with ``CommAborted`` within a slice, so no thread outlives the share."""
        with self._mail_lock:
            self._aborted.over[call_id] = why
            self._mail_lock.notify_all()

    def failed_here(self, call_id: int, error: BaseException) -> None:
        """A non-blocking operation of this rank failed in call ``call_id`` with ``error``:
        the collectives started after it may never be met, so every wait of this rank in
        that call, on any thread, raises ``error`` again (``_raise_if_aborted``)."""
        with self._mail_lock:
            self._aborted.here.setdefault(call_id, error)
            self._mail_lock.notify_all()

    def _file(self, source: int, tag: tuple, item) -> None:
        """A message from ``source`` arrived, in order: into its mailbox (an abort note, the
        notes), dropped if its call is over; numbered, so a wildcard receive takes the first
        that matches, as MPI's do."""
        if tag[0] < self.call_id:
            return  # (a segment it names is freed by its sender: Outbox.reclaim)
        if tag[1] == P2P:
            self._arrivals += 1
            self._mail[(source, tag)].append((self._arrivals, item))
        elif not self._aborted.take(source, tag, item):
            self._mail[(source, tag)].append(item)

    def _pop(self, key: tuple):
        """The next message with ``key`` (source, tag), or None."""
        box = self._mail.get(key)
        if not box:
            return None
        item = box.popleft()
        if not box:
            del self._mail[key]
        return item[1] if key[1][1] == P2P else item

    def _first(self, source: int, pattern: tuple) -> tuple | None:
        """The key (source, tag) of the point-to-point message that came first among those
        from ``source`` (``ANY``: any rank) whose tag matches ``pattern`` (a tag with
        ``ANY`` for any item), or None."""
        first, found = None, None
        for key, box in self._mail.items():
            if ((source == ANY or key[0] == source) and _matches(key[1], pattern)
                    and (first is None or box[0][0] < first)):
                first, found = box[0][0], key
        return found

    def _peek(self, key: tuple):
        """The next point-to-point message with ``key``, left in its mailbox."""
        return self._mail[key][0][1]

    def _raise_if_aborted(self, source: int, tag: tuple) -> None:
        """``CommAborted`` if a rank of the call of ``tag`` said it failed (or ``source``
        that it left): the message waited for will not come."""
        error = self._aborted.here.get(tag[0])
        if error is not None:
            raise _again(error) from error
        why = self._aborted.reason(tag[0], source, _collective_point(tag))
        if why is not None:
            raise CommAborted(f"rank {self.rank} stopped waiting for rank {source}: {why}")

    def _noted(self, source: int, tag: tuple) -> bool:
        """Whether a note ends the wait for ``tag`` from ``source`` (``_raise_if_aborted``
        raises): a look without the lock, that wakes a wait (a note that does not end it,
        of a rank that finished the collective, leaves it asleep)."""
        notes = self._aborted
        if not notes.about(tag[0]):
            return False
        try:
            return tag[0] in notes.here or notes.reason(tag[0], source,
                                                         _collective_point(tag)) is not None
        except RuntimeError:  # (a note came meanwhile: look again under the lock)
            return True

    def _raise_if_crossed(self, source: int, tag: tuple) -> None:
        """``ValueError`` where ``source`` sent a message for another collective at the
        point of the call where this rank waits for ``tag``'s (the same call, number and
        group, another kind: another collective, op or root), which it will never send:
        the ranks called different collectives there. Looked at before a wait sleeps."""
        kind = tag[1]
        if len(tag) < 3 or type(kind) is not str or kind == P2P or kind.startswith(OWN):
            return
        point = _point(tag)
        for src, other in self._mail:
            if (src == source and len(other) >= 3 and type(other[1]) is str
                    and other[1] != kind and other[1] != P2P and not other[1].startswith(OWN)
                    and _point(other) == point):
                raise crossed(self.rank, tag, source, other)

    def _running_call_aborted(self, number: int = 0) -> str | None:
        """Why the running call's waits (in its collective ``number``; 0, any) should end
        (a rank of it failed), or None."""
        return self._aborted.reason(self.call_id, point=((), number) if number else None)


def _again(error: BaseException) -> BaseException:
    """``error`` to raise once more, in another thread (its type and message; a
    ``CommAborted`` saying what failed where it cannot be made again)."""
    try:
        again = copy.copy(error)
    except Exception:
        return CommAborted(f"an earlier non-blocking operation failed: "
                           f"{type(error).__name__}: {error}")
    again.__traceback__ = None
    _reduction.settled(again)  # (a disagreement found by that operation, not by this wait)
    return again
