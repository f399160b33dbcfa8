"""The board: one shared-memory segment where the ranks of a group on one host meet for
their collectives, with no message; the collective numbered s takes slot ``s % SLOTS`` of
every rank, whose two counters (``posted``, ``done``) only that rank writes.

::

    collective s of call c: word = c << 24 | s, slot j = s % SLOTS
    post      wait until every peer's done[j] reached this rank's last word   _post
              write slot j (a header, then the array); posted[j] = word
    collect   wait until every peer's posted[j] is word                       _wait
              read the peers' slots in place (headers checked first)          _read
    finished  done[j] = word                                                  finished

csrc/jax_ffi.cc reads this layout too (``xla_handler.Allreduce`` describes it to it).
"""
from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np

from ... import _reduction
from ..._wire import ring as _ring, shm as _shm
from .. import stalls as _stalls
from .mailbox import OWN, P2P, crossed, ended_without

SLOTS = 4  # per rank; the collective numbered s takes slot s % SLOTS
_LINE = 64  # a slot's two counters, alone on their cache line
_POSTED, _DONE = 0, 1  # the counters' places in it (8-byte words)
_HEAD = 192  # a slot's header (_HEADER, padded to cache lines); the array's bytes follow
_KIND = 32  # a header's bytes of the collective's kind (its op or root included)
_HEADER = struct.Struct("<qqq32s32s8q")  # status, seq, ndim, kind, dtype, shape
_LEAD, _TAIL = struct.Struct("<qq"), struct.Struct("<q32s32s8q")  # (its two parts)
_TAILS_KEPT = 256  # the tails of the last headers' collectives and arrays, kept
_MAX_NDIM = 8
INLINE, NONE = 1, 3  # a slot holds: an array; nothing (a barrier's)
_BYTES = np.dtype(np.uint8)  # the dtype of what ``post_into`` fills
_BUDGET = 2 << 20  # bytes of slots in all, at most where the least slot allows it (every
# segment's memory is reserved, and Docker's /dev/shm is 64 MiB)
_SLOT_MOST, _SLOT_LEAST = 256 << 10, 16 << 10
# the ring's rule (``_wire.ring``): on x86, stores become visible in order, so a peer that
# sees a counter sees the slot written before it, and a counter is written with one 8-byte
# store (CPython, through a memoryview cast to ``Q``); elsewhere there is no board (the
# messages' checked rings carry the collectives)
USABLE = _ring.ORDERED
_PAUSE_LEAST, _PAUSE_MOST = 50e-6, 500e-6  # a wait's sleeps between looks, once polling ends
_SEQ_BITS = 24  # a word's bits for the collective's number; larger numbers take messages
_SEQ_MASK = (1 << _SEQ_BITS) - 1
_VIEWS = 256  # views of the peers' slots kept, at most


def slot_bytes(size: int) -> int:
    """The bytes of one slot's array in a group of ``size``: a power of two from 16 KiB to
    256 KiB (2 ranks; 128 KiB for 4, 64 KiB for 8), so that the slots' arrays stay within
    2 MiB in all where they can."""
    slot = _SLOT_MOST
    while slot > _SLOT_LEAST and SLOTS * size * slot > _BUDGET:
        slot //= 2
    return slot


def segment_bytes(size: int) -> int:
    return SLOTS * size * (_LINE + _HEAD + slot_bytes(size))


def create(prefix: str, size: int) -> str:
    """Make a group's board (zeroed: nothing posted); returns its name. The ranks
    ``attach``; the group's sweep of its prefix removes it."""
    shm = _shm.create(f"{prefix}board", segment_bytes(size), "the synk.comm board")
    name = shm.name
    _shm.release(shm)
    return name


def other_size(rank: int, tag: tuple, me: int) -> ValueError:
    """The error of a collective that ``rank`` posted on the board and ``me`` sent messages
    for, or the other way round: their arrays differ (a disagreement: the transport names
    what each rank passed in its place)."""
    return _reduction.disagreement(
        f"rank {rank} passed {tag[1]} an array of another size than rank {me}'s; every rank "
        "must pass the same shape and dtype")


class Posted:
    """What the ranks posted for one collective: each rank's (shape, dtype) and array (a
    view of its slot, valid inside ``Board.gather``; this rank's own: its array itself), or
    None and None for a barrier's."""

    __slots__ = ("specs", "parts")

    def __init__(self, specs: list, parts: list | None) -> None:
        self.specs, self.parts = specs, parts


class Ticket(NamedTuple):
    """This rank's post of one collective (``Board.post``)."""

    tag: tuple
    slot: int
    word: int
    head: bytes
    x: np.ndarray | None


class Board:
    """One rank's view of the group's board: a collective (its tag's number, the same on
    every rank) costs two copies and one wait, where a message costs a pickled header, a
    ring record, a mailbox and a copy out at each end. Collectives of several threads run
    at once, each in its own slot; the mesh ends a wait when the call is aborted or a peer
    is gone (``check``)."""

    def __init__(self, name: str, rank: int, size: int, waiter_of: Callable,
                 check: Callable[[int, tuple], bool]) -> None:
        """``waiter_of()``: the calling thread's ``Waiter``; ``check(rank, tag)`` raises when
        a wait for ``rank`` should end (the call failed, the rank is gone, or it sent this
        collective messages: its array does not fit a slot, so the ranks' arrays differ),
        and says whether the rank's function or share is over, its posts made."""
        self.rank, self.size = rank, size
        self._waiter_of, self._check = waiter_of, check
        self._shm = _shm.attach(name)
        buf = self._shm.buf
        assert buf is not None
        self.slot = slot_bytes(size)
        lines = SLOTS * size * _LINE
        self._words = buf[:lines].cast("Q")  # (rank r, slot j)'s at (r * SLOTS + j) * 8
        step = _HEAD + self.slot
        self._slots = [[buf[lines + (r * SLOTS + j) * step:lines + (r * SLOTS + j + 1) * step]
                        for j in range(SLOTS)] for r in range(size)]
        self._written = [0] * SLOTS  # the word this rank last posted in each slot
        self._latest = 0  # the word of this rank's latest post, in any slot
        self._in_place = [False] * SLOTS  # whether that post's array is the slot itself
        self._views: dict = {}  # (rank, slot, shape, dtype) -> a view (writable: its own)
        self._tails: dict = {}  # (kind, shape, dtype) -> its header's bytes after the seq
        self._my_done = [self._at(rank, j, _DONE) for j in range(SLOTS)]  # (its counters)
        self._my_posted = [self._at(rank, j, _POSTED) for j in range(SLOTS)]
        self._places = [[[(p, self._at(p, j, which)) for p in range(size) if p != rank]
                         for which in (_POSTED, _DONE)] for j in range(SLOTS)]
        self.call_id = 0

    def _at(self, rank: int, slot: int, which: int) -> int:
        return (rank * SLOTS + slot) * (_LINE // 8) + which

    def begin(self, call_id: int) -> None:
        """Call ``call_id`` starts on this rank: it reads nothing of earlier calls now, so its
        ``done`` counters go to the call's start. A new call's words are above every earlier
        call's, so a rank still in an earlier call (or one that failed half way) is simply
        not there yet."""
        self.call_id = call_id
        start = self._latest = call_id << _SEQ_BITS
        words = self._words
        for at in self._my_done:
            words[at] = start

    def post(self, tag: tuple, x: np.ndarray | None, inline: bool) -> Ticket | None:
        """Post this rank's ``x`` (None: a barrier's nothing) for the collective of ``tag``,
        on the thread that drew its tag (so a rank posts in order). None where it takes
        messages instead: a sub-group's, outside the running call, or an array not
        ``inline`` or past a slot (a rank waiting on the board then sees messages, and
        raises)."""
        if x is not None and not (inline and x.nbytes <= self.slot and x.ndim <= _MAX_NDIM):
            return None
        return self._post(tag, None if x is None else (x.shape, x.dtype), x)

    def post_into(self, tag: tuple, nbytes: int,
                  fill: Callable[[np.ndarray], None]) -> Ticket | None:
        """``post`` of ``nbytes`` bytes that ``fill(block)`` writes straight into this
        rank's slot (``block``: a uint8 view of it), where an array of the caller's own
        would be copied there: a fused allreduce packs its leaves into the slot itself."""
        if nbytes > self.slot:
            return None
        return self._post(tag, ((nbytes,), _BYTES), fill)

    def _post(self, tag: tuple, spec: tuple | None, content) -> Ticket | None:
        """Write this rank's slot for ``tag``: nothing (``spec`` None), else an array of
        ``spec`` (shape, dtype), ``content`` copied in or, when callable, called with the
        slot's view to fill it; then publish it."""
        if (len(tag) != 3 or tag[0] != self.call_id or type(tag[2]) is not int
                or type(tag[1]) is not str or not 0 < tag[2] < 1 << _SEQ_BITS):
            return None
        seq, kind = tag[2], tag[1]
        j = seq % SLOTS
        word = self.call_id << _SEQ_BITS | seq
        if word <= self._latest:  # (a slot's reuse waits for the peers to read its last post:
            # a later one posted first would be taken for it, or overwritten)
            raise RuntimeError(
                f"synk.comm: {kind} (collective #{seq}) was posted after collective "
                f"#{self._latest & _SEQ_MASK} of the same call; a rank posts its collectives "
                "in the order it numbers them, on the thread that calls them")
        self._latest = word
        self._wait(j, _DONE, self._written[j], tag)
        if self._in_place[j]:  # (its last post is read from the slot itself: ``_wait_own``)
            self._wait_own(j, self._written[j], tag)
        self._in_place[j] = callable(content)
        slot = self._slots[self.rank][j]
        x = None
        head = _LEAD.pack(NONE if spec is None else INLINE, seq) + self._tail(kind, spec)
        if spec is not None:
            shape, dtype = spec
            if callable(content):
                x = self._view(self.rank, j, shape, dtype)
                content(x)
            else:
                x = content
                if x.nbytes:
                    self._view(self.rank, j, shape, dtype)[...] = x
        slot[:len(head)] = head
        self._written[j] = word
        self._words[self._my_posted[j]] = word  # (after the slot: x86 order)
        return Ticket(tag, j, word, head, x)

    def _tail(self, kind: str, spec: tuple | None) -> bytes:
        """A header's bytes after its status and seq, for collective ``kind`` of an array
        of ``spec`` (None: nothing); a step's collectives post the same ones every time."""
        key = (kind, spec)
        tail = self._tails.get(key)
        if tail is None:
            if spec is None:
                tail = _TAIL.pack(0, kind.encode(), b"", *(0,) * _MAX_NDIM)
            else:
                shape, dtype = spec
                tail = _TAIL.pack(len(shape), kind.encode(), dtype.str.encode(), *shape,
                                  *(0,) * (_MAX_NDIM - len(shape)))
            if len(self._tails) >= _TAILS_KEPT:
                self._tails.clear()
            self._tails[key] = tail
        return tail

    @contextlib.contextmanager
    def gather(self, ticket: Ticket) -> Iterator[Posted]:
        """Every rank's post of ``ticket``'s collective, once all are in (the peers'
        arrays are read inside the ``with``). ValueError where the ranks posted different
        collectives."""
        try:
            yield self.collect(ticket)
        finally:  # (read or not: nothing more of this collective is read here)
            self.finished(ticket)

    def collect(self, ticket: Ticket) -> Posted:
        """``gather`` without the ``with``: every rank's post, once all are in; the caller
        reads the peers' arrays, then calls ``finished(ticket)``, whether this raised or
        not."""
        self._wait(ticket.slot, _POSTED, ticket.word, ticket.tag)
        return self._read(ticket.slot, ticket)

    def check_sends(self, rank: int, tag: tuple) -> None:
        """Raise where ``rank`` posted the collective of ``tag`` on the board, so that it
        sends no message for it (its array fits a slot where this rank's does not), or
        posted another collective at its point (another kind, op or root)."""
        if (len(tag) != 3 or tag[0] != self.call_id or type(tag[2]) is not int
                or type(tag[1]) is not str or tag[1] == P2P
                or not 0 < tag[2] < 1 << _SEQ_BITS):  # (a message's tag: not a collective)
            return
        j = tag[2] % SLOTS
        if self._words[self._at(rank, j, _POSTED)] != self.call_id << _SEQ_BITS | tag[2]:
            return
        _, seq, _, kind = _HEADER.unpack_from(self._slots[rank][j], 0)[:4]
        if seq == tag[2]:
            kind = kind.rstrip(b"\0").decode()
            if kind == tag[1][:_KIND]:
                raise other_size(rank, tag, self.rank)
            if not (kind.startswith(OWN) or tag[1].startswith(OWN)):
                raise crossed(self.rank, tag, rank, (tag[0], kind, seq))

    def posted_own(self, rank: int, call_id: int) -> bool:
        """Whether ``rank`` posted one of synk's own exchanges after its function (``OWN``)
        in call ``call_id``: its function has returned, its posts before are in."""
        for j in range(SLOTS):
            if self._words[self._at(rank, j, _POSTED)] >> _SEQ_BITS != call_id:
                continue
            kind = _HEADER.unpack_from(self._slots[rank][j], 0)[3]
            if kind.rstrip(b"\0").decode(errors="replace").startswith(OWN):
                return True
        return False

    def finished(self, ticket: Ticket) -> None:
        """Nothing more of ``ticket``'s collective is read here: its slots may be reused."""
        self._words[self._my_done[ticket.slot]] = ticket.word

    def _wait(self, j: int, which: int, word: int, tag: tuple) -> None:
        """Until every peer's counter ``which`` of slot ``j`` is at least ``word``, or,
        for ``posted``, is ``word`` itself: a peer whose post in the slot is of a later
        call has left this one (its share of it failed or ended: ``check`` says which)
        and never posts this collective, whose number its own post does not have."""
        words = self._words
        places = self._places[j][which]
        exact = which == _POSTED
        for _, at in places:
            if words[at] < word or exact and words[at] != word:
                break
        else:  # (the usual case: every peer is there)
            return

        def late() -> int | None:
            for p, at in places:
                if words[at] < word or exact and words[at] != word:
                    return p
            return None

        waiter = self._waiter_of()
        if waiter.poll(lambda: late() is None):
            return
        start = time.perf_counter()
        pause = _PAUSE_LEAST
        stall = _stalls.stall(tag, message=False)
        try:
            while (peer := late()) is not None:
                if self._check(peer, tag) and late() == peer:  # (its function or share is
                    raise ended_without(self.rank, tag, peer)  # over: it posted before, if at all)
                if stall is not None and (why := stall.check(peer)) is not None:
                    raise ValueError(why)
                time.sleep(pause)
                pause = min(2 * pause, _PAUSE_MOST)
        finally:
            if stall is not None:
                stall.end()
        waiter.slept(time.perf_counter() - start)

    def _wait_own(self, j: int, word: int, tag: tuple) -> None:
        """Until this rank has read slot ``j``'s last collective (``word``) itself: a post
        filled in place (``post_into``) is read back from the slot by its own rank, maybe
        later, on its lane, while the calling thread posts the next collective of that slot
        (which the peers' ``done`` counters alone would allow)."""
        words, at = self._words, self._my_done[j]
        if words[at] >= word:  # (the usual case: nothing of this rank's is in flight there)
            return
        waiter = self._waiter_of()
        if waiter.poll(lambda: words[at] >= word):
            return
        pause = _PAUSE_LEAST
        while words[at] < word:
            self._check(self.rank, tag)  # (a call that ended: its lane reads no more)
            time.sleep(pause)
            pause = min(2 * pause, _PAUSE_MOST)

    def _read(self, j: int, ticket: Ticket) -> Posted:
        """Every rank's post in slot ``j`` (this rank's from ``ticket``: its own slot may
        hold a later collective already, once every peer has read this one)."""
        head, x = ticket.head, ticket.x
        n, me = len(head), self.rank
        # (plain loops rather than comprehensions: this runs in every collective)
        same = True
        for r in range(self.size):
            if r != me and self._slots[r][j][:n] != head:
                same = False
                break
        if same:  # (the usual case: the same header everywhere)
            if x is None:
                return Posted([None] * self.size, None)
            arrays = []
            for r in range(self.size):
                arrays.append(x if r == me else self._view(r, j, x.shape, x.dtype))
            return Posted([(x.shape, x.dtype)] * self.size, arrays)
        seq, kind = ticket.tag[2], ticket.tag[1]
        heads = [memoryview(head) if r == me else self._slots[r][j][:n]
                 for r in range(self.size)]
        specs: list = []
        parts: list | None = []
        for r, their_head in enumerate(heads):
            status, their_seq, ndim, their_kind, dtype, *shape = _HEADER.unpack_from(
                their_head, 0)
            their_kind = their_kind.rstrip(b"\0").decode()
            if their_seq != seq or their_kind != kind[:_KIND] or (status == NONE) != (x is None):
                raise crossed(self.rank, ticket.tag, r, (ticket.tag[0], their_kind, their_seq))
            if status == NONE:
                specs.append(None)
                parts = None
                continue
            spec = (tuple(shape[:ndim]), np.dtype(dtype.rstrip(b"\0").decode()))
            specs.append(spec)
            assert parts is not None
            parts.append(x if r == self.rank else self._view(r, j, *spec))
        return Posted(specs, parts)

    def _view(self, r: int, j: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
        """Rank ``r``'s array in its slot ``j``, of ``shape`` and ``dtype`` (views kept for
        the shapes of the last collectives: a step's are the same every time); this rank's
        own, to write."""
        key = (r, j, shape, dtype)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= _VIEWS:
                self._views.clear()
            view = self._views[key] = np.ndarray(shape, dtype, self._slots[r][j], _HEAD)
            if r != self.rank:
                view.flags.writeable = False
        return view

    def close(self) -> None:
        """Let go of the board (the mapping, and the descriptor the mmap holds, go with the
        last view of a slot)."""
        self._words.release()
        self._slots, self._views = [], {}
        _shm.release(self._shm)
