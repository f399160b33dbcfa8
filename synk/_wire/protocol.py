"""The control messages between the master and its workers, and their codec: every message is
an 8-byte request id then a small pickled tuple whose first item is a tag (through the
worker's ring when it fits, else its socket: ``channel``); array bytes never travel here
(they live in shared memory, referenced by name)::

    master -> worker   (INIT, ...) (SHIP, ...) (CALL, ...) (REDUCE, ...) (COMM, ...)
                       (SHARED, ...) (SETTINGS, ...) (EXIT,): each answered with
    worker -> master   (OK, payload) or (ERR, exc_bytes, traceback_text, when, comm)
    master -> worker   under MPI: (FILL, ...) (COMBINE, ...): no reply
"""
from __future__ import annotations

import pickle
import struct
from typing import Any, NamedTuple

from ..errors import pack_exception, unpack_exception
from .arrays import dumps, dumps_to_master

# The requests, master -> worker:
#   (INIT, Init)            the first message after start (id 0)
#   (SHIP, blob, forget)    cloudpickled {fid: (fn, name, reduce)} to install, and fids of
#                           collected functions to drop
#   (CALL, task, updates, plan, keep)   run a share of a function (``call()``)
#   (REDUCE, [task, ...])   combine chunks of large outputs (see ``_call.collect``)
#   (COMM, how, seconds)    make the device communicator: ("nccl", id made by rank 0),
#                           joined within that many seconds, or ("staged",) (device arrays
#                           through the host)
#   (SHARED, [(id, array), ...], drop, keep)   new values of shared variables, ids to
#                           forget, and the ``Keep`` as for CALL
#   (SETTINGS, settings)    the master's settings of JAX and torch, before a call, when they
#                           changed (see ``_arrays.framework_settings``)
#   (FILL, drop, [item, ...])   under MPI, to the first rank of another host, before a CALL:
#                           the rows its host's ranks read, to copy into the host's own
#                           blocks (see ``_engine.hosts``), small ones inline, large ones over
#                           MPI; no reply
#   (COMBINE, plan)         under MPI across hosts, to every worker after a call's replies:
#                           run the collectives of its large outputs (see
#                           ``_call.mpi_collect``); no reply
#   (EXIT,)                 close mappings and exit
INIT, SHIP, CALL, REDUCE, SHARED, COMM, FILL, COMBINE, SETTINGS, EXIT = (
    "init", "ship", "call", "reduce", "shared", "comm", "fill", "combine", "settings", "exit")
OK, ERR = "ok", "err"
# the request id in front of every message: it numbers each round of requests, and a worker
# answers with the id of its request
RID = struct.Struct("<Q")


class Init(NamedTuple):
    rank: int
    size: int
    sys_path: list
    prefix: str  # name prefix for the segments this worker creates
    inline_output_bytes: int  # outputs at least this large go back through shared memory
    spin_s: float  # busy-poll this long for the next message before sleeping
    peers: dict  # other rank -> this worker's fd of the socketpair to it (synk.comm)
    backend: str  # "cpu" or "cuda": the device layer this rank opens first thing
    device_id: int | None  # its CUDA device (an ordinal after CUDA_VISIBLE_DEVICES)
    mpi: tuple | None = None  # under MPI: this rank's hosts.Placement as a tuple
    ring: str | None = None  # its control ring's segment (side 1), used once it has
    # answered INIT; None: messages take the socket alone
    mesh_rings: dict | None = None  # other rank -> (segment, side) of the synk.comm ring
    # to it, or None
    mesh_board: str | None = None  # the synk.comm board's segment (comm.host.shm_board)
    seed: int | None = None  # fork()'s seed: this rank's generators seeded from it (None:
    # left as the interpreter seeds them)
    whereabouts: str | None = None  # the segment where it keeps its place in its calls
    # (``_engine.whereabouts``; None: it keeps none)
    cores: tuple | None = None  # the cores it runs on (``host_threads.rank_cores``; None:
    # any)


class CallReply(NamedTuple):
    """A worker's answer to CALL (sent as a plain tuple: ``call_reply()``, read back by
    ``call_reply_fields()``)."""

    share: tuple | None  # its ``_call.records.Share`` as a tuple (outputs exported), or
    # None: it had no rows; a call of many steps: a tuple of those, one per step
    retired: list  # names of its scratch blocks replaced since, for every rank to unmap
    timing: tuple | None = None  # when profiling: ``_call.records.Marks.record``'s tuple
    comm: str = ""  # "aborted" when its device communicator was aborted during the call
    # (the ranks' are then made anew before the next one), else ""
    ended: float = 0.0  # when its share ended (``time.monotonic``: a call whose share ended
    # past its deadline timed out, however late its reply is read)


def rid_of(message) -> int:
    """The id of the request ``message`` is, or answers (read before anything is unpickled)."""
    return RID.unpack_from(message)[0]


def read(message) -> tuple:
    """``message`` (id included) unpickled: a request's or an answer's tuple."""
    return pickle.loads(memoryview(message)[RID.size:])


def request(tag: str, *fields: Any) -> bytes:
    """A request to the workers (any but CALL), pickled."""
    return pickle.dumps((tag, *fields), protocol=pickle.HIGHEST_PROTOCOL)


def call(what: str, task: tuple, updates: tuple, plan: tuple | None = None,
         keep: tuple | None = None) -> bytes:
    """A CALL request: a ``ShareTask`` as its plain tuple (``ShareTask.wire``: it pickles much
    faster than an object), the ``Data`` updates the ranks apply first
    (``data_updates.take_updates``), under MPI across hosts the plan of its large outputs'
    collectives, run once the reply is out (``_call.mpi_collect``), and ``keep``, where the rank
    copies its replicas while the group may be replaced (``rank_copies.Keep``), else None.
    ``what`` names the arguments if they cannot be pickled. Its request id is the call's number
    (``synk.comm`` keeps its messages within their call)."""
    return dumps((CALL, task, updates, plan, keep), what)


def call_reply(*, share: tuple | None, retired: list, timing: tuple | None = None,
               comm: str = "", ended: float = 0.0) -> tuple:
    """A ``CallReply``'s fields, given by name, as the plain tuple that is sent."""
    return share, retired, timing, comm, ended


def call_reply_fields(reply: tuple) -> CallReply:
    """A CALL's reply payload (``call_reply``), its fields by name."""
    return CallReply(*reply)


def reply(rid: int, payload: Any) -> bytes:
    """A worker's answer to request ``rid`` (``payload``: its pid after INIT; None after SHIP,
    SHARED and SETTINGS; seconds after REDUCE; ``call_reply()``'s tuple after CALL). The id
    comes first, read before unpickling, so that a reply always matches its request, even one
    that could not be unpickled."""
    return RID.pack(rid) + dumps_to_master((OK, payload), "the reply")


def error_reply(rid: int, exc: BaseException, rank: int, comm: str = "") -> bytes:
    """A worker's answer to request ``rid`` that raised ``exc`` (``comm``: "aborted" when the
    worker's device communicator was aborted on the way, so every rank's must be renewed;
    "poisoned" when that happened under a thread inside NCCL: the worker then exits)."""
    return RID.pack(rid) + dumps_to_master((ERR, *pack_exception(exc, rank), comm),
                                           "the reply")


# The master reads a reply with ``failed()``, ``payload()`` and ``failure()`` alone: no other
# module reads one by index.
def failed(answer: tuple) -> bool:
    """Whether a worker's answer says its request raised."""
    return answer[0] == ERR


def payload(answer: tuple) -> Any:
    """What a worker answered a request that succeeded with (``reply``)."""
    return answer[1]


def failure(answer: tuple, rank: int) -> BaseException | None:
    """The exception ``rank`` answered with (rebuilt here), or None if it succeeded."""
    if answer[0] != ERR:
        return None
    return unpack_exception(answer[1], answer[2], rank)


def failed_at(answer: tuple) -> float:
    """When (``time.monotonic``, the same clock on every rank of a host) a failed request raised."""
    return answer[3]


def comm_aborted(answer: tuple) -> bool:
    """Whether the rank that failed with ``answer`` aborted its device communicator."""
    return answer[0] == ERR and bool(answer[4])


def comm_poisoned(answer: tuple) -> bool:
    """Whether the rank that failed with ``answer`` aborted its communicator under a thread
    inside NCCL (its process exits: ``synk.errors.POISONED``)."""
    return answer[0] == ERR and answer[4] == "poisoned"
