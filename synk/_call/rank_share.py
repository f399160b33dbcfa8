"""One rank's whole share of a call, the same on the master (rank 0) and on every worker:
enter the call's ``synk.comm`` context, run ``fn`` on the rank's rows on its device, and hand
the outputs on to be combined (``outputs.finish``) before leaving."""
from __future__ import annotations

import time

from ..comm import _context as comm_context
from . import outputs, placement
from .runner import Plan, run_share


class Alone:
    """Where ``Function.local`` runs a share: rank 0 of 1, in the master, without a group."""

    rank, size, device, mesh, transport = 0, 1, None, None, None


ALONE = Alone()


def run(where, call_id: int, fn, fname: str, reduce, args, kwargs, spos, skeys, plan: Plan,
        marks: list | None = None) -> tuple:
    """This rank's share of call ``call_id`` (see ``runner.run_share``; ``marks`` as there):
    (its ``Share`` to reply with, or None if it had no rows; on rank 0, {output index:
    result} of the outputs combined already (on the devices), else None; the seconds that
    took).

    ``where``: the rank's ``rank``, ``size``, ``device``, ``mesh`` (host transport),
    ``transport`` (device communicator) and ``export_outputs`` (see ``outputs.finish``):
    the master's group, a worker's state, or ``ALONE``. If the share raises, the other
    ranks of the call hear of it first (their waits for this rank end), and the exception
    carries when it failed (``_synk_failed_at``), which decides which rank's error a call
    reports."""
    rank, device = where.rank, where.device
    comm_context.enter(where.mesh, call_id, rank, where.size, device, where.transport)
    try:
        with placement.on_device(device, rank):
            share = run_share(fn, fname, reduce, args, kwargs, spos, skeys, plan, rank,
                              marks, device)
            comm_context.settle()  # (the non-blocking operations fn did not wait for)
            return outputs.finish(where, share, reduce, fname)
    except Exception as exc:
        try:
            exc._synk_failed_at = time.monotonic()  # type: ignore[attr-defined]
        except AttributeError:
            pass
        comm_context.fail(exc)
        raise
    finally:
        comm_context.leave()
