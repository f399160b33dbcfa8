"""The end of every rank's share, on every back end: its outputs handed on to be combined.

How they are combined is the rank's output communicator's choice (``combines_outputs``):
the device communicator's when the group has one, else the host communicator's, both from
the one transports table; nothing here asks whether a rank is a CPU or a GPU one.

* ``"collectives"`` (NCCL): every rank joins a reduce or gather into rank 0 inside the call,
  on the devices (``device_collect``); rank 0 holds the results.
* ``"replies"`` (the host communicator; the staged one, whose arrays go through the host):
  the outputs, on the host, ride each rank's reply. A large one is left in the rank's
  shared memory (on another host: sent over MPI, or combined there with its host's) and
  only its place travels; the master combines them after the replies, reading them in place
  (``collect``). Here the rank only puts them where the master reads them
  (``where.export_outputs``).

Either way the rules are the same (``ops``, ``synk._reduction``): the structure and shape
checks, the result's dtype, and one ``mean``.
"""
from __future__ import annotations

import time

from ..comm import _context as comm_context
from ..comm.transports import communicator_class
from . import device_collect, device_ops
from .ops import Share

_HOST = communicator_class("host")


def finish(where, share: Share | None, reduce, fname: str) -> tuple:
    """After this rank's share: (the share to reply with, {output index: result} of the
    outputs rank 0 holds combined already, else None; the seconds combining took here).

    ``where``: as in ``rank_share.run``; with several ranks, its ``export_outputs(share,
    reduce, fname)`` puts a share's large outputs where the master reads them."""
    context = comm_context.current
    comm = context.transport or _HOST
    if context.size > 1 and comm.combines_outputs == "collectives":
        began = time.perf_counter()
        share, combined = device_collect.finish(where.device, context, share, reduce, fname)
        return share, combined, time.perf_counter() - began
    if share is None:
        return None, None, 0.0
    device = where.device
    if device is not None and not device.is_host:
        share = on_host(device, share)
    if context.size > 1:
        share = where.export_outputs(share, reduce, fname)
    return share, None, 0.0


def on_host(device, share: Share) -> Share:
    """``share`` with its outputs on ``device`` (a GPU) copied to the host."""
    outputs = tuple((kind, device_ops.to_host(device, value)) for kind, value in share.outputs)
    return Share(share.weight, share.multi, outputs)
