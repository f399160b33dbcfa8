"""The end of every rank's share, on every back end: its outputs handed on to be combined.

How they are combined is the rank's output communicator's choice (``combines_outputs``):
the device communicator's when the group has one, else the host communicator's, both from
the one communicators table; nothing here asks whether a rank is a CPU or a GPU one.

* ``"collectives"`` (NCCL): every rank joins a reduce or gather into rank 0 inside the call,
  on the devices (``device_collect``); rank 0 holds the results.
* ``"replies"`` (the host communicator; the staged one, whose arrays go through the host):
  the outputs, on the host, ride each rank's reply. A large one is left in the rank's
  shared memory (on another host: sent over MPI, or combined there with its host's) and
  only its place travels; the master combines them after the replies, reading them in place
  (``collect``). Here the rank only puts them where the master reads them: its
  ``OutputSink`` (``RankEnv.outputs``: ``exports.ScratchOutputs`` on a worker,
  ``exports.MasterOutputs`` on rank 0). Where the group's ranks span hosts (MPI), the
  sink is a *collective* one (``mpi_collect.MpiOutputs``): every rank, with rows or
  without, ends its share there (``finish``) and keeps its large outputs, which the
  master, once every reply is in, has combined into rank 0 by MPI's own collectives; the
  small ones ride the replies.

Either way the rules are the same (``ops``, ``synk._reduction``): the structure and shape
checks, the result's dtype, and one ``mean``.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

from ..comm import context as comm_context
from ..comm.communicators import communicator_class
from . import device_collect, device_ops
from .ops import share_ops
from .records import Share, ShareResult, share_result

_HOST = communicator_class("host")


class OutputSink(Protocol):
    """Where a rank puts its share's large outputs for the master to read."""

    collective: bool  # every rank's share ends in its ``finish`` (``mpi_collect.MpiOutputs``)

    def export(self, share: Share, ops: tuple) -> Share:
        """``share`` with its large outputs put where the master reads them, replaced by
        where they are."""


def finish(env: Any, share: Share | None, reduce, fname: str) -> ShareResult:
    """After this rank's share (``env``: a ``rank_share.RankEnv``): the share to reply with,
    and on rank 0 the outputs combined already (on the devices)."""
    context = comm_context.current
    comm = context.device_comm or _HOST
    if context.size > 1 and comm.combines_outputs == "collectives":
        began = time.perf_counter()
        share, combined = device_collect.finish(env.device, context, share, reduce, fname)
        return ShareResult(share, combined, time.perf_counter() - began)
    device = env.device
    if share is not None and device is not None and not device.is_host:
        share = on_host(device, share)
    if context.size > 1 and env.outputs.collective:  # every rank, with rows or not
        return env.outputs.finish(share, reduce, fname, context.call_id)
    if share is None:
        return _NOTHING
    if context.size > 1:
        share = env.outputs.export(share, share_ops(reduce, share, fname))
    return share_result(share)


_NOTHING = share_result(None)  # a share that had no rows


def on_host(device, share: Share) -> Share:
    """``share`` with its outputs on ``device`` (a GPU) copied to the host."""
    return share.replace_outputs(
        (kind, device_ops.to_host(device, value)) for kind, value in share.outputs)
