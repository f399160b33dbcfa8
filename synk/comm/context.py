"""Which call, if any, this process is running, and which group of it each thread's
``synk.comm`` calls run in (``now``): ``synk.comm`` works only inside a call.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from .._process import PROCESS
from ..errors import CommAborted, SynkError, stamp_failure

_get_ident = threading.get_ident


class Context:
    __slots__ = ("active", "mesh", "call_id", "seq", "rank", "size", "device", "device_comm",
                 "attached", "in_fn", "host", "ops", "scope", "root", "rows", "lanes",
                 "sliced", "entered", "thread", "threaded", "joining", "number", "refused",
                 "cleared", "launched", "refusals", "refused_in", "nccl_names", "finished")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Every field as a new context has it (where a call's share starts: ``enter``)."""
        self.active, self.call_id, self.seq, self.rank, self.size = False, 0, 0, 0, 1
        # (duck-typed here: the communicators import this module)
        self.mesh: Any = None  # the call's mesh (a host's, MPI's, a sub-group's); None alone
        self.device: Any = None  # the rank's ``Device``
        self.device_comm: Any = None  # its device ``Communicator`` (NCCL, staged), if any
        self.host: Any = None  # the call's host communicator, made on first use
        self.attached = False  # the device communicator has the call's host one (``_route``)
        self.in_fn = False  # the user's function is running (not synk's code around it)
        self.ops = 0  # the collectives this rank has called in the call (synk.comm's)
        self.scope: tuple = ()  # a sub-group's (``_groups``): in its tags; () for the call
        self.root: Context | None = None  # a sub-group's: the call's context
        self.rows = 0  # the rows the call uses over every rank (0: none scattered)
        self.lanes: list = []  # the threads of non-blocking operations started in the call
        # (its sub-groups' too: they share the call's list), each ended with the share
        self.sliced = 0  # num_slices of the call when it cuts the rows into pieces, else 0
        self.entered = 0  # the collectives this rank entered in the call, its sub-groups'
        # too (the call's context only: its place in the call, ``where``)
        self.thread = 0  # the ident of the thread that runs the share
        self.threaded = False  # another thread called synk.comm in the call (``Stall``)
        self.joining: Any = None  # the lane whose operation the share's thread waits for
        self.number = 0  # the number of the collective this context runs (``numbered``)
        self.refused = 0  # the call's: the number of its last collective this rank refused
        self.cleared = 0  # the last such number ``before_launch`` found every peer refused
        self.launched = 0  # the NCCL operations this rank launched in the call (``launch``)
        self.refusals: set = set()  # the call's: the numbers of all it refused
        self.refused_in: set = set()  # the call's: its sub-groups' it refused (``scoped``)
        self.nccl_names: dict = {}  # the call's: number -> name code (``running_name``) of
        # each of its collectives that launched an NCCL operation (``launching_nccl``)
        self.finished: dict = {}  # the call's: a numbering's scope (``scope``: () for the
        # call's own, a sub-group's) -> the number up to which every collective of it
        # returned on this rank with no non-blocking operation under way (``fail``)


current = Context()  # the running call's (one per process)
class _Threads(threading.local):
    context: Context | None = None  # the group a thread runs a method of, if any (a class
    # default: a thread that set none finds it without an AttributeError, every collective)


_threads = _Threads()


def now() -> Context:
    """The context this thread's ``synk.comm`` calls run in: the group whose method it
    runs, else the call's."""
    c = _threads.context
    return current if c is None else c


@contextlib.contextmanager
def using(c: Context) -> Iterator[None]:
    """``c`` (a group's context, or the call's) this thread's context inside the ``with``
    (a sub-group's method runs in its group's). Only this thread's: another thread's
    collective meanwhile keeps the call's context and numbering, as threads started in the
    function do unless they name a group."""
    previous = _threads.context
    _threads.context = c
    _recall_lanes()
    try:
        yield
    finally:
        _threads.context = previous
        _recall_lanes()


def _recall_lanes() -> None:
    """The call's lanes lent to synk's XLA target taken back (``shm_mesh.recall_all``): a
    sendrecv described in another context lends none."""
    recall = getattr(current.mesh, "recall_all", None)
    if recall is not None:
        recall()


def enter(mesh, call_id: int, rank: int, size: int, device, device_comm, rows: int) -> None:
    """A share of call ``call_id`` starts on this rank (``mesh``: None for one rank;
    ``device``: None or a host one on CPU ranks; ``device_comm``: its device communicator,
    if any; ``rows``: the rows the call uses, over every rank)."""
    c = current
    c.reset()
    c.active, c.mesh, c.call_id, c.rank, c.size, c.rows = True, mesh, call_id, rank, size, rows
    c.device, c.device_comm, c.thread = device, device_comm, threading.get_ident()
    if device_comm is not None:
        device_comm.host = None  # (the call's, once synk.comm's route attaches it)
    row = _where[0]
    if row is not None:  # (its position reset before its call: see ``share_ended``)
        row[THREAD] = c.thread
        row[POSITION] = 0
        row[WAITING] = 0
        row[REFUSED] = row[RUNNING] = row[REFUSED_IN] = row[TOOK] = row[LAUNCHED] = 0
        row[CALL] = call_id
    if mesh is not None:
        mesh.begin(call_id)


def settle() -> None:
    """The share's function returned: the non-blocking operations it started and did not
    wait for finish now, before the share ends (the other ranks take part in them), so that
    none of their threads outlives the call; then what it sent leaves this rank before the
    exchanges after the function (a peer that sees one of those reads it)."""
    for lane in current.lanes:
        lane.finish()
    if current.mesh is not None:
        current.mesh.flush()


AFTER_FUNCTION_SEQ = 1 << 23  # where the numbers of synk's own exchanges after a rank's
# function start (``after_function``): below the board's limit of 2**24


def after_function() -> None:
    """The rank's function is over: synk's own exchanges that follow are numbered from
    ``AFTER_FUNCTION_SEQ`` on every rank, so that ranks whose functions called different
    numbers of collectives still meet there (and their errors reach the master). Its row
    says so, with how many numbers the function took (TOOK: one more), for ``skipped_by``."""
    c = current
    row = _where[0]
    if row is not None and c.active:
        row[TOOK] = c.seq + 1
    c.seq = AFTER_FUNCTION_SEQ


def leave(ended: bool) -> None:
    """The share ended (``ended``: it returned; else it raised or was interrupted): end
    what is left of its non-blocking operations (after a failure or an interrupt: dropped,
    and their waits ended), and forget its group's objects too (a broken group must not be
    kept alive through them, with all it holds)."""
    c = current
    _recall_lanes()
    c.active = False
    row = _where[0]
    if row is not None:
        if ended and c.mesh is not None:  # (what it sent is with its peers before they read
            c.mesh.flush()  # that it ended: ``share_ended``)
        row[POSITION] = DONE if ended else FAILED
    lanes = c.lanes
    if lanes:
        c.lanes = []
        if any(lane.busy() for lane in lanes):
            if c.mesh is not None:
                c.mesh.end_call(c.call_id, f"rank {c.rank}'s share of the call ended "
                                           "before this non-blocking operation finished")
            for lane in lanes:
                lane.finish(cancel=True)
    c.mesh = c.device = c.device_comm = c.host = None
    c.attached = False


def fail(exc: BaseException) -> None:
    """This rank's share raised: tell the other ranks, whose waits in this call then end,
    but for those in a collective this rank finished (``Context.finished``): what it sent
    in them is on its way, and the live ranks finish them too, so that every rank makes the
    same updates before the failure (``aborts``)."""
    c = current
    if c.mesh is not None:
        c.mesh.abort(c.call_id, f"{type(exc).__name__}: {exc}", finished=dict(c.finished))


def left(exc: BaseException) -> None:
    """This rank had no rows and its function failed on them before its first collective
    (``_call.share``): tell the others, whose waits for it inside their function end."""
    c = current
    if c.mesh is not None:
        c.mesh.abort(c.call_id, f"{type(exc).__name__}: {exc}", left=True)


def require(what: str) -> Context:
    c = now()
    if _get_ident() != current.thread:
        current.threaded = True
    if not c.active:
        raise SynkError(
            f"synk.comm.{what}() can only be called inside a synk function while it runs on "
            "the ranks (it talks to the other ranks of that call); wrap the code that calls "
            "it with synk.function"
        )
    if c.sliced and c.in_fn and what not in ("rank", "size"):
        _refuse_sliced(what, c.sliced)
    return c


def rank() -> int:
    """This rank's number in the running call (0 is the master)."""
    return require("rank").rank


def size() -> int:
    """The number of ranks in the running call."""
    return require("size").size


def collective(what: str) -> Context:
    """``require``, counting a collective of ``synk.comm`` (see ``_call.share``)."""
    c = now()
    if not c.active or c.sliced:
        require(what)  # (raises)
    if _get_ident() != current.thread:
        current.threaded = True
    c.ops += 1
    row = _where[0]
    if row is not None:  # (POSITION: 1, the collectives entered and the last one's name)
        call = current
        call.entered = entered = call.entered + 1
        row[1] = entered << 6 | _CODES.get(what, 0)
    return c


def numbered(collective_fn: Callable) -> Callable:
    """``collective_fn``, a collective of ``synk.comm``, with a number of its own
    (``Context.number`` while it runs: its first tag's, else drawn as it ends where it
    launched NCCL), so that every collective takes one number on every rank. One that
    raises before drawing one (a value this rank refused) must not leave its number to the
    rank's next collective, which the others would take for the one they wait in; the row
    notes it (REFUSED), so a peer waiting in it raises at once (``Stall.check``,
    ``refused_by``)."""
    @functools.wraps(collective_fn)
    def counted(*args, **kwargs):
        c = now()
        seq, outer = c.seq, c.number
        c.number = seq + 1
        row = _where[0]
        if row is not None and not c.scope and c.active:
            row[RUNNING] = seq + 1
        launched = current.launched
        try:
            result = collective_fn(*args, **kwargs)
        except Exception as exc:
            if c.active and c.seq == seq:
                stamp_failure(exc)  # (before the row says so: the peers' errors come after)
                c.seq += 1
                if c.scope:  # (a sub-group's: its peers that wait in it read this)
                    current.refused_in.add(scoped(c.scope, c.seq))
                    if row is not None:
                        row[REFUSED_IN] = with_group_refusal(int(row[REFUSED_IN]), c.scope,
                                                             c.seq)
                elif current.launched == launched:  # (one that launched an NCCL
                    c.refused = c.seq  # operation took part: its peers' completes)
                    c.refusals.add(c.seq)
                    if row is not None:  # (peers that wait in it read this)
                        row[REFUSED] = with_refusal(int(row[REFUSED]), c.seq)
            raise
        finally:
            c.number = outer
        if c.active and c.seq == seq and current.launched != launched:
            c.seq += 1  # (NCCL's alone: one that neither drew a tag nor launched ran
            # nowhere, as a trace of jax.jit on some ranks only, and takes no number)
        if c.active and not any(lane.busy() for lane in c.lanes):  # (what it sent is on
            (c.root or c).finished[c.scope] = c.seq  # its way; NCCL's: launched)
        return result

    return counted


def skipped_by(collective: tuple[int, int, int], code: int = 0) -> str | None:
    """Why a wait of this rank inside NCCL in ``collective`` (named by ``code``) can never
    end well, else None: a peer on this host waits inside NCCL in another collective of
    that number (one of them skipped one), or returned without taking that number (its
    NCCL operations completed by then: ``share.settle``), so it never launched it or
    launched it against an earlier one of this rank's (NCCL matches by order)."""
    rows = _rows[0]
    if rows is None:
        return None
    call_id, rank, number = collective
    for peer in range(len(rows)):
        row = rows[peer]
        word = int(row[WAITING])
        theirs = word >> 40 & 63
        if (code and word & IN_NCCL and word & SEQ_MASK == number and theirs != code
                and peer != rank and int(row[CALL]) == call_id):
            return (f"rank {rank} waits inside NCCL in its collective #{number} "
                    f"({NAMES[code]}) for rank {peer}, which waits inside NCCL in its "
                    f"collective #{number} ({NAMES[theirs]}): the ranks called different "
                    "collectives at the same point, so neither can go on. Every rank must "
                    "call the same collectives in the same order")
        took = int(row[TOOK]) - 1
        if peer != rank and int(row[CALL]) == call_id and 0 <= took < number:
            called = f"up to its #{took} only" if took else "none of this call's"
            return (f"rank {rank} waits inside NCCL in its collective #{number} for rank "
                    f"{peer}, whose function returned having called {called}: every rank "
                    "must call the same collectives in the same order (NCCL matches them by "
                    "order: a rank that skipped one met another rank's next one with its "
                    "own)")
    return None


def outlived_by(call_id: int) -> Callable[[], str | None]:
    """For the wait of this rank for its NCCL operations in flight as its share of call
    ``call_id`` ends: why they can never complete (else None), once a peer on this host
    returned from its function ``STALL_S`` ago or more: every operation it launched has
    ended (``share.settle``), so it never launched what is left (it skipped a collective
    this rank started without waiting, or failed first). The callable remembers when it
    first saw such a peer."""
    seen: list[float] = []

    def why() -> str | None:
        rows = _rows[0]
        if rows is None:
            return None
        for peer in range(len(rows)):
            row = rows[peer]
            if peer == current.rank or int(row[CALL]) != call_id or not (
                    int(row[TOOK]) or int(row[POSITION]) >= DONE):
                continue
            now_s = time.monotonic()
            if not seen:
                seen.append(now_s)
            if now_s - seen[0] < STALL_S:
                return None
            return (f"rank {current.rank} waits inside NCCL for its operations in flight as "
                    f"its share of the call ends, which rank {peer}, whose function returned "
                    f"(or failed) {STALL_S:g} s ago, never launched: every rank must call "
                    "the same collectives in the same order")
        return None

    return why


def scoped(scope: tuple, seq: int) -> int:
    """A sub-group's collective ``seq`` of the group ``scope`` (its tags' last two items),
    as a row's REFUSED_IN holds it: the same on every rank (a hash of ints only), never 0."""
    return hash((scope, seq)) & SEQ_MASK or 1


def running_collective() -> tuple[int, int, int] | None:
    """(call id, this rank, number) of the call's collective this thread runs
    (``numbered``), or None: outside one, or in a sub-group's (numbered in its scope)."""
    c = now()
    if not c.active or c.scope or not c.number:
        return None
    return c.call_id, c.rank, c.number


def running_name() -> int:
    """The code of the name of the collective this rank entered last (``NAMES``), its
    non-blocking form's and blocking form's alike; 0 where it has no row."""
    row = _where[0]
    return 0 if row is None else _blocking_form(int(row[POSITION]) & 63)


def _blocking_form(code: int) -> int:
    name = NAMES[code]
    return _CODES.get(name[1:], code) if name.startswith("i") else code


def launching_nccl() -> None:
    """Before this rank launches an NCCL operation: ``ValueError`` where a peer on this host
    launched one of another collective at the same number (NCCL matches by order: a hang or
    wrong numbers). Else the launch is counted and named in the row (``LAUNCHED``) and for
    ``Stall.check``. Of two ranks launching at once, one sees the other's (``_FENCE``) and
    raises; the other's wait ends on its refusal (``refused_by``)."""
    c = current
    _after_earlier_calls(c)
    collective = running_collective()
    if collective is not None:
        code = running_name()
        why = _launched_elsewhere(collective, code)
        if why is not None:
            raise ValueError(why)
        c.nccl_names[collective[2]] = code
    c.launched += 1


def _after_earlier_calls(c: Context) -> None:
    """Wait until no peer on this host is still in an earlier call: one whose share of it
    has not ended may be inside NCCL in that call's collective, which NCCL would match with
    this one (calls submitted without waiting run back to back, and a rank whose share
    failed early goes on to the next while its peers wait out the failed one)."""
    rows = _rows[0]
    if rows is None:
        return
    pause = 20e-6
    while any(peer != c.rank and rows[peer][PID] and int(rows[peer][CALL]) < c.call_id
              for peer in range(len(rows))):
        mesh = c.mesh
        if mesh is not None and (why := mesh.stop_reason()) is not None:
            raise CommAborted(why)
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


def _launched_elsewhere(collective: tuple[int, int, int], code: int) -> str | None:
    """Why this rank must not launch ``collective`` (``running_collective``'s, named by
    ``code``) inside NCCL, as its row now says it does: a peer on this host launched
    another collective of the same number; else None."""
    row, rows = _where[0], _rows[0]
    if row is None:
        return None
    call_id, rank, number = collective
    row[LAUNCHED] = number << 6 | code
    if rows is None:
        return None
    with _FENCE:  # (of two ranks that launch at once, one sees the other's word, below)
        pass
    for peer in range(len(rows)):
        theirs = rows[peer]
        word = int(theirs[LAUNCHED])
        if (peer != rank and word >> 6 == number and word & 63 != code and code
                and word & 63 and int(theirs[CALL]) == call_id):
            return (f"rank {rank} would launch its collective #{number} ({NAMES[code]}) "
                    f"inside NCCL, where rank {peer} launched its #{number} "
                    f"({NAMES[word & 63]}): the ranks called different collectives at the "
                    "same point (NCCL would match the two). Every rank must call the same "
                    "collectives in the same order")
    return None


def whole_call() -> tuple[int, int, int] | None:
    """(call id, this rank, a number past every collective's) of this rank's running or
    last call, or None before any: for ``refused_by`` with ``since``, any refusal of a
    peer in that call that this rank did not make."""
    c = current
    return (c.call_id, c.rank, AFTER_FUNCTION_SEQ) if c.call_id else None


REFUSAL = ("(it raised there before sending any of it) and went on: every rank must call "
           "the same collectives in the same order, so a rank that catches such an error "
           "must not go on with the call's collectives")


def refused_by(collective: tuple[int, int, int], since: bool = False) -> str | None:
    """Why a wait of this rank in ``collective`` (``running_collective``'s) can never end
    well: a peer on this host refused its value of it (its row's REFUSED), or with
    ``since``, of it or of an earlier one that this rank did not refuse (NCCL matches
    operations by their order, so each of the peer's later ones meets one of this rank's
    earlier ones); else None."""
    rows = _rows[0]
    if rows is None:
        return None
    call_id, rank, number = collective
    mine = current.refusals if current.call_id == call_id else ()  # (one behind this
    # rank's may be one this rank refused too)
    for peer in range(len(rows)):
        row = rows[peer]
        word = int(row[REFUSED])
        if peer == rank or not word or int(row[CALL]) != call_id:
            continue
        if refused_in_word(word, number):
            return (f"rank {rank} waits for its part of its collective #{number} from rank "
                    f"{peer}, which refused its value of that collective {REFUSAL}")
        if not since:
            continue
        earlier = [n for n in refusals_in_word(word) if n < number and n not in mine]
        if not earlier:
            continue
        waits = (f"in its collective #{number}" if number < AFTER_FUNCTION_SEQ
                 else "for its operations in flight as its share of the call ends")
        return (f"rank {rank} waits inside NCCL {waits}, which NCCL matches by order with "
                f"other operations of rank {peer}: rank {peer} refused its value of its "
                f"collective #{earlier[0]} {REFUSAL}")
    return None


def place_in(call_id: int) -> tuple[bool, tuple, tuple, tuple] | None:
    """Where this rank is in call ``call_id``, for a peer that waits in it and has no row of
    this rank to read (under MPI): None before its share of that call has started here;
    else (whether its function has returned, the numbers of the call's collectives it
    refused, the ``scoped`` keys of its sub-groups' collectives it refused, its row as it
    is now), the refusals known only while the call is this rank's latest."""
    c = current
    if c.call_id < call_id:
        return None
    row = _where[0]
    now_row = (0,) * FIELDS if row is None else tuple(row)
    if c.call_id > call_id:
        return True, (), (), now_row
    return (not c.active or c.seq >= AFTER_FUNCTION_SEQ), tuple(c.refusals), \
        tuple(c.refused_in), now_row


def refused_there(tag: tuple, rank: int, peer: int, refused, refused_in) -> str | None:
    """Why the wait of ``rank`` for ``peer``'s part of the collective of ``tag`` can never
    end, where ``peer`` refused its value of it and went on (``refused``, ``refused_in``:
    ``place_in``'s, as the peer said them); else None."""
    if len(tag) < 3 or type(tag[2]) is not int:
        return None
    if len(tag) > 3 and type(tag[3]) is tuple:
        if scoped(tag[3], tag[2]) not in refused_in:
            return None
        return (f"rank {rank} waits for its part of a sub-group's collective from rank {peer}, "
                f"which refused its value of that collective {REFUSAL}")
    if tag[2] not in refused:
        return None
    return (f"rank {rank} waits for its part of its collective #{tag[2]} from rank {peer}, "
            f"which refused its value of that collective {REFUSAL}")


def before_launch(should_stop) -> None:
    """Before this rank launches an NCCL operation after refusing its value of one of the
    call's collectives (``Context.refused``), whose part a peer may have launched (NCCL
    matches by order: the launch would meet it; a hang, wrong numbers, buffers overrun).
    Waits until every peer on this host refused it too (then launches), took part in it, or
    has no row here (``ValueError``), or the call is given up (``should_stop()``: a peer
    waiting in it raises once it reads this rank's refusal)."""
    c = current
    number, rows = c.refused, _rows[0]
    apart = [peer for peer in range(c.size) if peer != c.rank and (
        rows is None or peer >= len(rows) or not int(rows[peer][PID]))]
    if apart:
        raise ValueError(
            f"synk.comm: rank {c.rank} refused its value of its collective #{number} (it "
            "raised there before sending any of it) and went on to an NCCL operation, which "
            f"NCCL would match with that collective's part of rank {apart[0]} (on another "
            "host, where synk cannot see whether it refused it too): every rank must call "
            "the same collectives in the same order, so a rank that catches such an error "
            "must not go on with the call's collectives")
    pause = 0.0005
    while rows is not None:
        waiting = False
        for peer in range(len(rows)):
            row = rows[peer]
            if peer == c.rank or refused_in_word(int(row[REFUSED]), number):
                continue
            if int(row[CALL]) == c.call_id and (int(row[RUNNING]) > number
                                                or int(row[POSITION]) >= DONE):
                raise ValueError(
                    f"synk.comm: rank {c.rank} refused its value of its collective #{number} "
                    f"(it raised there before sending any of it) and went on, but rank {peer} "
                    "did not refuse it (it took part in it, or its share ended): every rank "
                    "must call the same collectives in the same "
                    "order, so a rank that catches such an error must not go on with the "
                    "call's collectives (its next NCCL operation would meet the others' part "
                    "of that one)")
            waiting = True
        if not waiting:
            break
        why = should_stop() if should_stop is not None else None
        if why:
            raise CommAborted(f"rank {c.rank} stopped before its next NCCL operation: {why}")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    c.cleared = number


def _refuse_sliced(what: str, num_slices: int) -> None:
    """A function that talks to the other ranks cannot be run in slices: each slice's
    collective would combine only that slice's rows across the ranks (a sum of the slices'
    maxima is not the maximum of the sum), a different answer than ``num_slices=1``'s. Every
    rank runs as many slices as the others, so each raises this at the same place."""
    raise SynkError(
        f"synk.comm.{what}() was called inside a call with num_slices={num_slices}: each "
        "slice would combine only its own rows across the ranks, which gives another answer "
        "than num_slices=1. Call a function that uses synk.comm with num_slices=1 (use "
        "batch= or local_batch= to bound its memory), or take the collective out of the "
        "function and combine the slices' results with its reduce op")


# -- where this rank is in its call -----------------------------------------------------------
# A row of int64 in shared memory per rank (``track``), which the master reads to name the
# ranks that the others wait for (``_engine.whereabouts``): the call the rank's share is in,
# its place in it (the collectives it entered, and the last one's name, or DONE once the
# share ended), the thread that runs the share, where a dump of its threads' stacks goes, its
# process, what the share's thread waits for while it sleeps in a wait (``Stall``), the
# collectives of the call's own numbering whose value the rank refused before sending any
# of it (``numbered``: the last one's number, and which of the ones before it, in one word:
# ``with_refusal``; 0: none), the number of the last one it
# entered, the sub-group collectives it refused so (``with_group_refusal``; 0: none), and
# once its function returned, one more than the numbers it took (``after_function``; 0: not
# returned), and the collective of its last NCCL launch (``launching_nccl``: its number and name).
CALL, POSITION, THREAD, STACKS, PID, WAITING, REFUSED, RUNNING, REFUSED_IN, TOOK, \
    LAUNCHED = range(11)
FIELDS = 11
DONE = 1 << 62  # the share returned
FAILED = DONE + 1  # it raised, or was interrupted
#: what a position's low 6 bits name (0: another of synk.comm's operations)
NAMES = ("", "allreduce", "iallreduce", "broadcast", "ibroadcast", "allgather", "iallgather",
         "reduce_scatter", "ireduce_scatter", "reduce", "ireduce", "gather", "igather",
         "scatter", "iscatter", "alltoall", "ialltoall", "scan", "iscan", "exscan", "iexscan",
         "send", "isend", "recv", "irecv", "sendrecv", "barrier", "ibarrier", "probe",
         "iprobe", "split", "new_group", "broadcast_object", "allgather_object",
         "gather_object", "scatter_object", "allreduce_init")
_CODES = {name: code for code, name in enumerate(NAMES)}
_where: list = [None]  # this process's row, once tracked
# A lock taken and let go between a store to the row and the loads of the peers' rows that
# must see what they stored before. Intel's SDM (vol. 3A, "Memory Ordering in P6 and More
# Recent Processor Families"): "Reads may be reordered with older writes to different
# locations", but "Reads or writes cannot be reordered with I/O instructions, locked
# instructions, or serializing instructions" (the lock's sem_wait and sem_post are locked
# instructions). So of two ranks that each store and then load, at least one sees the
# other's store.
_FENCE = threading.Lock()
_rows: list = [None]  # every rank's row on this host (rows by rank), once tracked

_LAST_REFUSED = (1 << 24) - 1  # a refusal word's low bits: the last refused number (below
# 2**24, as every number of the rank's function is: ``AFTER_FUNCTION_SEQ``)
_BEHIND = 39  # REFUSED's bits above them: which of the numbers before it were refused too
_GROUP_BEHIND = 15  # REFUSED_IN's (above those, 24 bits name the sub-group: ``scope_bits``)


def with_refusal(word: int, number: int, behind_bits: int = _BEHIND) -> int:
    """A row's REFUSED word (``word``) once the rank refused collective ``number``, later
    than any before: the number, and which of the ``behind_bits`` numbers before it were
    refused. One word, so that a peer never reads half of it; older refusals are left
    out."""
    last, behind = word & _LAST_REFUSED, word >> 24
    gap = number - last
    if last and 0 < gap <= behind_bits:
        behind = ((behind << gap) | 1 << (gap - 1)) & ((1 << behind_bits) - 1)
    else:
        behind = 0
    return behind << 24 | number & _LAST_REFUSED


def refused_in_word(word: int, number: int, behind_bits: int = _BEHIND) -> bool:
    """Whether a row's REFUSED ``word`` says its rank refused collective ``number``."""
    last = word & _LAST_REFUSED
    if not last:
        return False
    gap = last - (number & _LAST_REFUSED)
    return gap == 0 or (0 < gap <= behind_bits and bool(word >> (23 + gap) & 1))


def refusals_in_word(word: int) -> list:
    """The numbers a row's REFUSED ``word`` says its rank refused, from the first."""
    last = word & _LAST_REFUSED
    if not last:
        return []
    behind = word >> 24
    return [last - 1 - k for k in reversed(range(_BEHIND)) if behind >> k & 1] + [last]


def scope_bits(scope: tuple) -> int:
    """A sub-group's 24 bits in its ranks' REFUSED_IN words: the same on every rank (a
    hash of ints only), never 0."""
    return hash(scope) & _LAST_REFUSED or 1


def with_group_refusal(word: int, scope: tuple, seq: int) -> int:
    """A row's REFUSED_IN word (``word``) once the rank refused its collective ``seq`` of the
    sub-group ``scope``: the sub-group, and the refusals of its numbering as REFUSED holds
    the call's (``with_refusal``; a refusal in another sub-group starts again)."""
    bits = scope_bits(scope)
    low = word & ((1 << 24 + _GROUP_BEHIND) - 1) if word >> 24 + _GROUP_BEHIND == bits else 0
    return bits << 24 + _GROUP_BEHIND | with_refusal(low, seq, _GROUP_BEHIND)


def refused_in_group_word(word: int, scope_bits: int, seq: int) -> bool:
    """Whether a row's REFUSED_IN ``word`` says its rank refused collective ``seq`` of the
    sub-group whose bits (``scope_bits()``) are ``scope_bits``."""
    return word >> 24 + _GROUP_BEHIND == scope_bits and refused_in_word(
        word & ((1 << 24 + _GROUP_BEHIND) - 1), seq, _GROUP_BEHIND)


def track(row, rows=None) -> None:
    """Keep this rank's place in its calls in ``row`` (a writable int64 numpy array of
    ``FIELDS`` items), or no longer (None); ``rows``: every rank's, which ``share_ended``
    reads."""
    _where[0] = None if row is None else memoryview(row)  # (its items set faster than
    # a numpy array's: every collective sets one)
    _rows[0] = None if row is None else rows


def share_ended(rank: int, call_id: int) -> bool:
    """Whether ``rank``'s share of call ``call_id`` has ended, as its row says (it returned
    or is in a later call; one that raised tells its peers itself: ``fail``): it sends
    nothing more, and what it sent is with its peers (``leave`` flushes first). False
    without a row here. The row is written and read in one order (its position reset before
    its call's number, at ``enter``), so a rank starting the call is never taken for one
    that ended it."""
    place = _place(rank)
    return place is not None and (place[0] > call_id or place == (call_id, DONE))


def left_call(rank: int, call_id: int) -> bool:
    """Whether ``rank`` is done with call ``call_id``, as its row says: its share returned
    or raised, or the rank is in a later call (it reads none of that call's messages any
    more). False where the rank has no row here."""
    place = _place(rank)
    return place is not None and (place[0] > call_id or
                                   (place[0] == call_id and place[1] >= DONE))


def _place(rank: int) -> tuple[int, int] | None:
    """``rank``'s call and position in it, as its row says (the call read first); None
    where it has no row here."""
    rows = _rows[0]
    if rows is None or not 0 <= rank < len(rows):
        return None
    row = rows[rank]
    if not row[PID]:
        return None
    call = int(row[CALL])
    return call, int(row[POSITION])


def group_mark() -> int:
    """Which group this process serves now (a worker serves one; the master counts the
    groups it started): what a handle kept across calls belongs to."""
    return 0 if PROCESS.worker else PROCESS.generation


def next_tag(kind: str) -> tuple:
    """A tag for the next collective: every rank calls collectives in the same order (a
    sub-group's own, and its scope in them)."""
    c = now()
    c.seq += 1
    if c.scope:
        return (c.call_id, kind, c.seq, c.scope)
    return (c.call_id, kind, c.seq)


# A row's WAITING word (written by ``stalls``): what the share's thread waits for (its kind,
# in bits 56-57), the rank it waits for plus one (bits 40-55; for a wait inside NCCL, the
# collective's name code), the number of the collective of the call's own numbering it
# waits in (or, for other waits, of the call's collectives this rank has called: the low 40
# bits), and two flags.
WAIT_COLLECTIVE, WAIT_MESSAGE, WAIT_GROUP = 1, 2, 3  # what a rank waits for
SEQ_MASK = (1 << 40) - 1
THREADED = 1 << 58  # another thread of the rank may yet send or call
IN_NCCL = 1 << 59  # it waits inside NCCL, for every rank of the call, in the collective
# named in the peer's place (``running_name``)
STALL_S = 2.0  # how long two ranks wait for each other, unchanged, before one raises


def own_row():
    """This process's row, once tracked (``track``); else None."""
    return _where[0]


def host_rows():
    """Every rank's row on this host (by rank), once tracked; else None (under MPI a rank
    may have a row of its own only)."""
    return _rows[0]
