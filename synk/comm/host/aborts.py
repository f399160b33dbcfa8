"""The notes from a rank's peers that end its waits in the call under way (a peer failed,
or left its function early), kept per call for both meshes (shared memory and MPI)."""
from __future__ import annotations

from .. import context as _context

# A rank failed in the call: every wait of the call ends with ``CommAborted``, but for a
# wait in a collective that the failed rank finished (its note says how far it got in each
# numbering, the call's and its sub-groups': ``Context.finished``). What it sent there is on
# its way (the note, sent out of order, may overtake it), and the live ranks send theirs or
# fail with a note of their own, so the collective completes, or fails, alike on every rank,
# and each rank makes the same updates to its state before the failure.
ABORT = "abort"
# A rank with no rows ran its function on them (to take part in the collectives), and the
# function failed before its first one (see ``_call.share``): it sends nothing more in the
# function. This ends a wait for its messages only while the waiting rank is inside its
# function: synk's own exchanges after it (combining outputs) still count on that rank.
LEFT = "left"


class Notes:
    """The notes received, per call."""

    __slots__ = ("failed", "left", "over", "here")

    def __init__(self) -> None:
        self.failed: dict = {}  # call id -> {rank: (why, how far it got: its ``finished``)}
        self.left: dict = {}  # call id -> {rank: why}
        self.over: dict = {}  # call id -> why this rank's own share of it ended unfinished
        self.here: dict = {}  # call id -> the error of this rank's first failed
        # non-blocking operation in it (``Mailboxes.failed_here``)

    def __bool__(self) -> bool:
        return bool(self.failed or self.left or self.over or self.here)

    def about(self, call_id: int) -> bool:
        """Whether there is a note for ``call_id`` (a look without a lock)."""
        return (call_id in self.failed or call_id in self.left or call_id in self.over
                or call_id in self.here)

    def take(self, source: int, tag: tuple, array) -> bool:
        """Keep the note a message from ``source`` is, if it is one (True): its tag is
        (call id, ABORT or LEFT, how far the rank got)."""
        if len(tag) != 3 or tag[1] not in (ABORT, LEFT):
            return False
        why = array.tobytes().decode(errors="replace")
        if tag[1] == ABORT:
            self.failed.setdefault(tag[0], {})[source] = (f"rank {source} failed: {why}",
                                                          tag[2])
        else:
            self.left.setdefault(tag[0], {})[source] = (
                f"rank {source} had no rows, and its function failed on them before its "
                f"first collective: {why}")
        return True

    def forget_before(self, call_id: int) -> None:
        for notes in (self.failed, self.left, self.over, self.here):
            for old in [c for c in notes if c < call_id]:
                del notes[old]

    def reason(self, call_id: int, source: int | None = None,
               point: tuple | None = None) -> str | None:
        """Why a wait in ``call_id`` (for ``source``'s message; None: for any rank, as
        NCCL's collectives need them all) should end, or None. ``point``: the collective
        the wait is in, (its numbering's scope, its number); None, another wait (a
        message, synk's own)."""
        why = self.over.get(call_id)
        if why is None:
            why = next((why for why, finished in self.failed.get(call_id, {}).values()
                        if point is None or finished.get(point[0], 0) < point[1]), None)
        left = self.left.get(call_id)
        if why is None and left and _context.now().in_fn:
            why = next(iter(left.values())) if source is None else left.get(source)
        return why
