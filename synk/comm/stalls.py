"""Two ranks that wait for each other for ever, named rather than waited out: a wait of one
rank says in the rank's row what it waits for (``Stall``; inside NCCL, ``NcclWait``), and a
rank that finds the rank it waits for waiting for it in a way neither can end raises
(``Stall.check``), rather than both waiting until the call's timeout.
"""
from __future__ import annotations

import threading
import time

from .context import (
    AFTER_FUNCTION_SEQ,
    CALL,
    DONE,
    IN_NCCL,
    NAMES,
    POSITION,
    REFUSAL,
    REFUSED,
    REFUSED_IN,
    SEQ_MASK,
    STALL_S,
    THREADED,
    WAIT_COLLECTIVE,
    WAIT_GROUP,
    WAIT_MESSAGE,
    WAITING,
    current,
    host_rows,
    own_row,
    refused_by,
    refused_in_group_word,
    refused_in_word,
    scope_bits,
)

_THREADS_S = 0.1  # how often a wait looks at the rank's threads again
_get_ident = threading.get_ident
_WHAT = {WAIT_MESSAGE: "a message", WAIT_GROUP: "its part of a sub-group's collective"}
_RULE = ("neither can go on. Every rank must call the same collectives in the same order, "
         "and send a message before the collective its receiver calls after receiving it")


def _threaded() -> bool:
    """Whether something of this rank other than the waiting thread may yet send or call a
    collective: another thread called ``synk.comm`` in the call, a user's non-daemon thread
    runs (a notebook kernel's and a data loader's are daemons; synk's are named ``synk-``),
    or a lane the share's thread does not wait for is busy."""
    c = current
    if c.threaded:
        return True
    for lane in c.lanes:
        if lane is not c.joining and lane.busy():
            return True
    share, main = c.thread, threading.main_thread()
    for thread in threading.enumerate():
        if (thread.ident != share and thread is not main and not thread.daemon
                and not thread.name.startswith("synk-")):
            return True
    return False


class Stall:
    """A wait for one rank at a time (``check``'s ``peer``) of the share's thread, or of
    the lane it waits for, said in its row while it lasts (``end``; the ``WAITING`` word of
    ``context``). ``check`` finds the ranks stuck where each waits for the other, neither
    moved for ``STALL_S``, nothing else of either can send or call (``_threaded``), and:
    one waits in a collective of the call the other has not called; one waits in a
    collective (or a sub-group's) while the other waits for a message or sub-group
    collective from it (a message, for a sub-group's); or each waits for a message from the
    other. At once, whatever the peer waits for, where the peer refused the value of the
    collective this rank waits in (its row's REFUSED, or REFUSED_IN: ``key``)."""

    __slots__ = ("row", "rows", "call_id", "rank", "kind", "seq", "key", "peer", "seen",
                 "since", "threaded", "threaded_at", "lane", "says")

    def __init__(self, row, rows, kind: int, seq: int, lane: bool,
                 key: tuple = (0, 0)) -> None:
        self.row, self.rows, self.call_id, self.rank = row, rows, current.call_id, current.rank
        self.kind, self.seq, self.key = kind, seq, key
        self.peer = -1
        self.seen: tuple | None = None
        self.since = 0.0
        self.threaded, self.threaded_at = THREADED, -1.0  # (``_threaded``, looked at
        # every ``_THREADS_S``: it lists the process's threads)
        self.lane = lane  # a lane's wait: it speaks for the rank while the share's thread
        # waits for that lane, which may begin after this wait did
        self.says = False  # the rank's row says what this wait waits for

    def check(self, peer: int, answered: tuple | None = None) -> str | None:
        """Why this rank and ``peer`` wait for each other for ever, once they have for
        ``STALL_S``, or why this wait for ``peer`` can never end, at once; else None (this
        rank's row says it waits for ``peer``). ``answered``: the peer's row as it said it
        since it was last asked, where it has none here (under MPI: ``place_in``); ``()``
        where it has said nothing since."""
        if answered is None and self.kind != WAIT_MESSAGE and (  # (its refusals otherwise:
                why := self._refused(peer)) is not None:  # in its answer, judged by the mesh)
            return why
        if self.lane:
            joining = current.joining
            if joining is None or not joining.running_here():
                if self.says:  # (no longer waited for: the share's thread speaks)
                    self.end()
                self.peer = -1
                return None
        now_s = time.monotonic()
        if peer != self.peer:
            self.peer, self.seen = peer, None
        if now_s - self.threaded_at > _THREADS_S:
            self.threaded, self.threaded_at = THREADED if _threaded() else 0, now_s
        seq = self.seq if self.kind == WAIT_COLLECTIVE else current.seq
        self.row[WAITING] = self.kind << 56 | (peer + 1) << 40 | seq | self.threaded
        self.says = True
        if answered is not None:
            if not answered:  # (no word from it since it was last asked: nothing to judge)
                return None
            theirs = answered
        elif not 0 <= peer < len(self.rows):
            return None
        else:
            theirs = self.rows[peer]
        look = (int(theirs[CALL]), int(theirs[POSITION]), int(theirs[WAITING]),
                int(self.row[POSITION]), int(self.row[WAITING]))
        if look != self.seen:
            self.seen, self.since = look, now_s
            return None
        if now_s - self.since < STALL_S:
            return None
        return self._stalled(look, peer)

    def _refused(self, peer: int) -> str | None:
        """Why this wait in a collective (the call's or a sub-group's; a lane's too) can
        never end: ``peer`` refused its value of it; else None."""
        if not 0 <= peer < len(self.rows):
            return None
        theirs = self.rows[peer]
        if self.kind == WAIT_COLLECTIVE:
            if refused_in_word(int(theirs[REFUSED]), self.seq) and \
                    int(theirs[CALL]) == self.call_id:
                return refused_by((self.call_id, self.rank, self.seq))
        elif refused_in_group_word(int(theirs[REFUSED_IN]), *self.key) and \
                int(theirs[CALL]) == self.call_id:
            return (f"rank {self.rank} waits for its part of a sub-group's collective from "
                    f"rank {peer}, which refused its value of that collective {REFUSAL}")
        return None

    def _stalled(self, look: tuple, peer: int) -> str | None:
        """Why this rank and ``peer`` can never go on, ``look`` (the peer's call, position
        and WAITING word, then this rank's position and word) unchanged for ``STALL_S``."""
        call, position, word, mine, my_word = look
        in_nccl = word & IN_NCCL
        if (call != self.call_id or position >= DONE or not word
                or (word | my_word) & THREADED
                or not (in_nccl or (word >> 40 & 0xFFFF) - 1 == self.rank)):
            return None
        kind, their_seq = word >> 56 & 3, word & SEQ_MASK
        me, them = f"rank {self.rank}", f"rank {peer}"
        if in_nccl and their_seq <= current.seq and (
                current.nccl_names.get(their_seq) != word >> 40 & 63):
            return (f"{me} waits for {self._what(mine)} from {them}, which waits inside NCCL "
                    f"in its collective #{their_seq} ({NAMES[word >> 40 & 63]}), where {me} "
                    "called another collective: the ranks called different collectives at "
                    "the same point, so neither can go on. Every rank must call the same "
                    "collectives in the same order")
        if kind == WAIT_COLLECTIVE and current.seq < their_seq:
            return (f"{me} waits for {self._what(mine)} from {them}, which waits in its "
                    f"collective #{their_seq} ({_name(position)}) for {me}, which has called "
                    f"{current.seq} collective(s) of this call: {_RULE}")
        if self.kind == WAIT_COLLECTIVE and kind != WAIT_COLLECTIVE:
            waiting = f"{me} waits in its collective #{self.seq} ({_name(mine)}) for {them}, "
            what = _WHAT.get(kind, _WHAT[WAIT_GROUP])
            if their_seq < self.seq:
                return (f"{waiting}which waits for {what} from {me} and has called "
                        f"{their_seq} collective(s) of this call: {_RULE}")
            # (it passed this one without sending its part: a run of refusals longer than
            # its row holds)
            return (f"{waiting}which has called {their_seq} collective(s) of this call, this "
                    f"one among them, without its part of it reaching {me}, and waits for "
                    f"{what} from {me}: {_RULE}")
        if self.kind == WAIT_GROUP and kind == WAIT_MESSAGE:
            return (f"{me} waits for its part of a sub-group's collective from {them}, which "
                    f"waits for a message from {me}: {_RULE}")
        if self.kind == WAIT_MESSAGE and kind == WAIT_MESSAGE:
            return (f"{me} waits for a message from {them}, which waits for a message from "
                    f"{me}: each receives before it sends, so neither can go on. Send first "
                    "on one of them (or exchange with sendrecv)")
        return None

    def _what(self, position: int) -> str:
        if self.kind == WAIT_COLLECTIVE:
            return f"its part of its collective #{self.seq} ({_name(position)})"
        return _WHAT[self.kind]

    def end(self) -> None:
        """The wait is over."""
        if self.says:
            self.row[WAITING] = 0
            self.says = False


class NcclWait:
    """A wait of this rank inside NCCL in a collective of the call (named by ``code``): once
    it sleeps (``sleeps``), the row says it waits there for every rank, so that a peer
    waiting for it on the host in another collective of that number, or in one called after
    fewer collectives, names both (``Stall.check``; inside NCCL: ``skipped_by``). Not where
    a wait of the host already speaks for the rank."""

    __slots__ = ("number", "code", "said")

    def __init__(self, collective: tuple[int, int, int], code: int) -> None:
        self.number, self.code, self.said = collective[2], code, False

    def sleeps(self) -> None:
        row = own_row()
        if self.said or row is None or not current.active or int(row[WAITING]):
            return
        self.said = True
        row[WAITING] = (WAIT_COLLECTIVE << 56 | self.code << 40 | self.number | IN_NCCL
                        | (THREADED if _threaded() else 0))

    def end(self) -> None:
        if self.said:
            row = own_row()
            if row is not None:
                row[WAITING] = 0
            self.said = False


def _name(position: int) -> str:
    return NAMES[position & 63] or "a collective"


def stall(tag: tuple, message: bool) -> Stall | None:
    """A ``Stall`` for a wait of this thread on ``tag`` (a collective's, or a message's
    where ``message``), or None for synk's own exchanges after the function or without a
    row. Another thread's wait speaks for the rank only while the share's thread waits for
    its lane."""
    c = current
    row, rows = own_row(), host_rows()
    if row is None or not c.active or tag[0] != c.call_id:
        return None
    if rows is None:  # (a rank with a row of its own only: its peers ask it, under MPI)
        rows = ()
    lane = _get_ident() != c.thread
    if message:
        return Stall(row, rows, WAIT_MESSAGE, 0, lane)
    if len(tag) > 3 and type(tag[3]) is tuple:  # (a sub-group's numbering; after the
        return Stall(row, rows, WAIT_GROUP, 0, lane, (scope_bits(tag[3]), tag[2]))  # number, a
        # part's index is no tuple)
    seq = tag[2]
    if type(seq) is not int or not 0 < seq < AFTER_FUNCTION_SEQ:
        return None
    return Stall(row, rows, WAIT_COLLECTIVE, seq, lane)
