"""Receives with wildcards, probes and messages to oneself, shared by every host mesh: the
one-host mesh (``shm_mesh.Mesh``), MPI's (``mpi_mesh.MpiMesh``) and ``Lone``, the mailboxes
of a call of one rank."""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import numpy as np

from ...errors import CommAborted, CommError
from .. import stalls as _stalls
from .mailbox import ANY, OBJECTS_REFUSED, Mailboxes, ended_without


class Matching(Mailboxes):
    """The wildcard receives (``ANY`` as source or in the tag), probes and messages to
    itself of a mesh: progress on every peer in turn, the first match taken, else sleeps
    of ``WAIT_SLICE`` (an interrupt lands) until something arrives, the call aborts or a
    peer is gone. A subclass defines ``_progress_all``, ``_napper`` and ``_gone_why``."""

    def post_own(self, tag: tuple, array) -> None:
        """Send ``array`` to this rank itself: a copy, in its own mailbox at once (buffered,
        as MPI's)."""
        array = np.array(array, order="C", copy=True)
        if array.dtype.hasobject:
            raise TypeError(OBJECTS_REFUSED)
        with self._mail_lock:
            self._file(self.rank, tag, array)
            self._mail_lock.notify_all()

    def match(self, source: int, pattern: tuple, take: bool = True, block: bool = True):
        """The first message from ``source`` (``ANY``: any rank) whose tag matches
        ``pattern`` (``ANY`` for any item): ``((source, tag), array)``, taken; with ``take``
        False, ``((source, tag), item)`` left there (an array or a stand-in with its
        ``shape`` and ``dtype``). ``block`` False: looks, progresses once, looks again. None
        where only this rank could send it and has not (no waiting forever on itself)."""
        nap = None
        stall = None  # (the share's thread's wait for one rank, once it sleeps)
        try:
            for attempt in itertools.count():
                with self._mail_lock:
                    key = self._first(source, pattern)
                    if key is not None:
                        if not take:
                            return key, self._peek(key)
                        item = self._pop(key)
                        break
                    if source == self.rank or self.size == 1:
                        return None
                    self._raise_unless_coming(source, pattern[0])
                    if block and self._returned_all(source, pattern):
                        raise ended_without(self.rank, pattern, source)
                    seen = self._arrivals
                if attempt and not block:
                    return None
                self._progress_all()
                if attempt and self._arrivals == seen:
                    if self._senders_ended(source, pattern[0]):  # (what they sent: read now)
                        with self._mail_lock:
                            if self._first(source, pattern) is None:
                                raise ended_without(self.rank, pattern, source)
                        continue
                    if source != ANY:
                        stall = self._stall_checked(stall, source, pattern)
                    nap = nap or self._napper()
                    nap(seen)
        finally:
            if stall is not None:
                stall.end()
        assert key is not None  # (the loop ends with a message only)
        return key, self._opened(key, item)

    def _stall_checked(self, stall, source: int, pattern: tuple):
        """The wait's ``stall`` (made at its first nap), having raised on a stall."""
        stall = stall or _stalls.stall(pattern, message=True)
        if stall is not None and (why := stall.check(
                source, self._answered_row(source, pattern[0]))) is not None:
            raise ValueError(why)
        return stall

    def _returned_all(self, source: int, pattern: tuple) -> bool:
        """Whether the function of ``source`` (``ANY``: every other rank) has returned in the
        call of ``pattern``, what it sent before then in (holding the lock): its share may
        outlast it, waiting for this rank in synk's own exchanges."""
        others = [source] if source != ANY else [r for r in range(self.size) if r != self.rank]
        return all(self._returned(r, pattern) for r in others)

    def _raise_unless_coming(self, source: int, call_id: int) -> None:
        """Raise if no message from ``source`` (``ANY``: any other rank) can come in call
        ``call_id``: a rank of it failed, the sender left (every other rank, for ``ANY``),
        or a peer is gone."""
        others = [source] if source != ANY else [r for r in range(self.size) if r != self.rank]
        whys = [self._aborted.reason(call_id, r) for r in others]
        whom = "any rank" if source == ANY else f"rank {source}"
        if all(whys):
            raise CommAborted(f"rank {self.rank} stopped waiting for a message from {whom}: "
                              f"{whys[0]}")
        gone = self._gone_why(source)
        if gone is not None:
            raise CommError(f"{gone}; rank {self.rank} was waiting for a message from {whom}")

    def _opened(self, key: tuple, item):
        """A message taken by ``match``, as ``take`` gives it."""
        return item

    def _senders_ended(self, source: int, call_id: int) -> bool:
        """Whether the share of call ``call_id`` of ``source`` (``ANY``: of every other
        rank) has ended, what it sent then read into the mailboxes (where a mesh can
        tell)."""
        return False

    def _answered_row(self, source: int, call_id: int) -> tuple | None:
        """``source``'s row in call ``call_id`` as it said it, where the mesh asks its peers
        (``Stall.check``'s ``answered``); None where its row is read here."""
        return None

    def _progress_all(self) -> None:
        """Receive what has arrived from every peer, once."""
        raise NotImplementedError

    def _napper(self) -> Callable[[int], None]:
        """A wait's way to sleep a slice, unless more than ``seen`` point-to-point messages
        have arrived."""
        raise NotImplementedError

    def _gone_why(self, source: int) -> str | None:
        """Why ``source`` (``ANY``: any peer) can send nothing more, or None."""
        return None


class Lone(Matching):
    """The mailboxes of a call of one rank (which has no mesh): its messages to itself."""

    def __init__(self, call_id: int) -> None:
        super().__init__(0, 1)
        self._mail_lock = threading.Condition()
        self.call_id = call_id

