"""The few control messages between the master and its workers.

Every message, both ways, is an 8-byte request id followed by a small pickled tuple whose
first item is a tag (through the worker's shared-memory ring when it fits, else on its
socket: see ``channel``); array bytes never travel here (they live in shared memory and are
referenced by name). The id numbers each round of requests; a worker answers with the id of
the request, read before anything is unpickled, so that a reply is always matched to its
request (the master checks it) even when the request could not be unpickled.

master -> worker
    (INIT, Init)                          first message after start (id 0)
    (SHIP, blob, forget)                  cloudpickled {fid: (fn, name, reduce)} to install,
                                          and fids of collected functions to drop
    (CALL, tuple(Call))                   run a share of a function (plain tuples pickle
                                          much faster than named ones on this hot path)
    (REDUCE, [task, ...])                 combine chunks of large outputs (see _call.collect)
    (COMM, how, seconds)                  make the device communicator: ("nccl", id made by
                                          rank 0), joined within that many seconds, or
                                          ("staged",) (device arrays through the host)
    (SHARED, [(id, array), ...], drop)    new values of shared variables, ids to forget
    (FILL, drop, [item, ...])             under MPI, to the first rank of another host, before
                                          a CALL: the rows its host's ranks read, to copy into
                                          the host's own blocks (see hosts.py); no reply
    (EXIT,)                               close mappings and exit
worker -> master
    (OK, payload)                         pid after INIT; None after SHIP / SHARED; seconds after
                                          REDUCE; after CALL (tuple(Share) or None, retired
                                          block names[, (input, compute, output, combining
                                          on the devices) seconds and the bytes copied
                                          host->device and device->host, when profiling])
    (ERR, exc_bytes, traceback_text, when)  the request raised
"""
from __future__ import annotations

import struct
from typing import NamedTuple

INIT, SHIP, CALL, REDUCE, SHARED, COMM, FILL, EXIT = (
    "init", "ship", "call", "reduce", "shared", "comm", "fill", "exit")
OK, ERR = "ok", "err"
RID = struct.Struct("<Q")  # the request id in front of every message


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


class Call(NamedTuple):
    fid: int
    args: tuple
    kwargs: dict
    spos: tuple  # positions of scattered arguments in args
    skeys: tuple  # names of scattered arguments in kwargs
    plan: tuple  # the fields of a _runner.Plan
    updates: tuple  # (block names to unmap, refs of moved Data): see data.take_updates
    profile: bool  # time the parts of this call and send the times back
    call_id: int  # numbers the call, so that synk.comm messages stay within it
