"""One rank's whole share of a call, the same on the master (rank 0) and on every worker:
enter the call's ``synk.comm`` context, run ``fn`` on the rank's rows on its device, and on
GPU ranks combine the outputs on the devices before leaving."""
from __future__ import annotations

import time
from typing import NamedTuple

from ..comm import _context as comm_context
from . import device_collect, placement
from .ops import Share
from .runner import Plan, run_share


class Finished(NamedTuple):
    """A rank's share, done."""

    share: Share | None  # None: the rank had no rows
    combined: dict | None  # rank 0 of a GPU group: {output index: result combined on devices}
    combining: float  # seconds combining outputs on the devices


def run(fn, fname: str, reduce, args, kwargs, spos, skeys, plan: Plan, *, rank: int,
        size: int, device, mesh, transport, call_id: int,
        marks: list | None = None) -> Finished:
    """This rank's share of call ``call_id`` (see ``runner.run_share``; ``marks`` as there).

    If it raises, the other ranks of the call hear of it first (their waits for this rank
    end), and the exception carries when it failed (``_synk_failed_at``), which decides
    which rank's error a call reports."""
    comm_context.enter(mesh, call_id, rank, size, device, transport)
    try:
        with placement.on_device(device, rank):
            share = run_share(fn, fname, reduce, args, kwargs, spos, skeys, plan, rank,
                              marks, device)
            if device is None or device.is_host:
                return Finished(share, None, 0.0)
            began = time.perf_counter()  # outputs combined on the devices (NCCL)
            share, combined = device_collect.finish(device, comm_context.current, share,
                                                    reduce, fname)
            return Finished(share, combined, time.perf_counter() - began)
    except Exception as exc:
        try:
            exc._synk_failed_at = time.monotonic()  # type: ignore[attr-defined]
        except AttributeError:
            pass
        comm_context.fail(exc)
        raise
    finally:
        comm_context.leave()
