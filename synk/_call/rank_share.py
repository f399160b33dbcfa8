"""One rank's whole share of a call, the same on the master (rank 0) and on every worker:
enter the call's ``synk.comm`` context, run ``fn`` on the rank's rows on its device, and hand
the outputs on to be combined (``outputs.finish``) before leaving."""
from __future__ import annotations

import time
from typing import Any, NamedTuple

from .._process import PROCESS
from ..comm import context as comm_context
from . import outputs, placement, replica_tensors
from .records import FunctionSpec, Marks, ShareResult, ShareTask
from .runner import run_share


class RankEnv(NamedTuple):
    """Where a rank's share runs: the master's group, a worker's state, or ``ALONE``."""

    rank: int
    size: int
    device: Any  # the rank's Device (None: the master without a group)
    mesh: Any  # its end of the synk.comm mesh (None: alone)
    device_comm: Any  # its device communicator (NCCL, staged), if any
    outputs: Any  # where its large outputs go for the master (``outputs.OutputSink``)


ALONE = RankEnv(0, 1, None, None, None, None)  # ``Function.local``: rank 0 of 1, no group


def run(env: RankEnv, spec: FunctionSpec, task: ShareTask,
        marks: Marks | None = None) -> ShareResult:
    """This rank's share of the call ``task`` belongs to (see ``runner.run_share``).

    If the share raises, the other ranks of the call hear of it first (their waits for this
    rank end), and the exception carries when it failed (``_synk_failed_at``), which decides
    which rank's error a call reports."""
    rank, device = env.rank, env.device
    copies = replica_tensors.point_at_replicas(device) if PROCESS.replica_tensors else ()
    comm_context.enter(env.mesh, task.call_id, rank, env.size, device, env.device_comm,
                       task.plan.total)
    ended = False  # (the share returned, rather than raised or was interrupted)
    try:
        if device is None or device.is_host:  # (nothing to make current: no ``with``)
            result = _run(env, spec, task, marks, rank, None)
        else:
            with placement.on_device(device, rank):
                result = _run(env, spec, task, marks, rank, device)
        if copies:
            replica_tensors.write_back(copies, device)
        ended = True
        return result
    except Exception as exc:
        try:
            exc._synk_failed_at = time.monotonic()  # type: ignore[attr-defined]
        except AttributeError:
            pass
        comm_context.fail(exc)
        raise
    finally:
        comm_context.leave(ended)


def _run(env: RankEnv, spec: FunctionSpec, task: ShareTask, marks: Marks | None, rank: int,
         device) -> ShareResult:
    share = run_share(spec, task, rank, marks, device)
    comm_context.settle()  # (the non-blocking operations fn did not wait for)
    return outputs.finish(env, share, spec.reduce, spec.name)
