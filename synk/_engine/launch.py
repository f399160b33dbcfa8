"""What a group's launch is given and returns: the strategy by which a ``Group``'s workers
start, die and stop (``local_launch.LocalLaunch``, ``mpi_launch.MpiLaunch``). ``start``
fills the ``Workers`` and returns a ``Started`` record; the group writes nothing back."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from .._wire import protocol as P
from ..errors import WorkerDiedError, WorkerStartError
from .messaging import Messaging
from .workers import Workers


class GroupSpec(NamedTuple):
    """The group a launch starts."""

    size: int
    backend: str  # "cpu" or "cuda"
    device_ids: list  # each rank's CUDA device (None on CPU ranks), as fork() chose them
    prefix: str  # the name prefix of the group's segments
    key: bytes  # the group's key, which every worker proves it holds
    inline_output_bytes: int
    spin_s: float  # how long ranks poll before they sleep, as the master's host allows
    seed: int | None  # fork()'s seed, for every rank's generators (``_arrays.seeds``)
    whereabouts: str | None  # the segment of the ranks' places in their calls


class Started(NamedTuple):
    """What a launch started besides the workers, and what it chose."""

    deadline: float  # the start's deadline (the device communicator joins by it too)
    device: Any  # rank 0's Device, open and bound
    mesh: Any  # rank 0's end of the synk.comm mesh (None: one rank)
    device_ids: list  # each rank's CUDA device (under MPI, as the launcher placed them)
    shares_gpus: bool  # some ranks share a GPU
    comm_kind: str  # "nccl", or "staged" where NCCL cannot have ranks that share GPUs
    staged_why: str  # why not NCCL, in words ("" with NCCL)
    spin_s: float  # how long the master polls for replies before it sleeps
    thread_limit: Any  # the master's BLAS/OpenMP thread caps (``restore()`` at the end)
    across: Any  # the steps of a call across hosts (``_call.port.HostSteps``)
    parallel_reduce_ranks: int | None  # a launch's override of the setting, or None
    hosts: Any = None  # under MPI: where every rank runs (``hosts.Hosts``)
    nccl_env: dict = {}  # NCCL variables every rank's NCCL must read (ranks sharing GPUs)
    outputs: Any = None  # rank 0's output sink when not the group's own (under MPI across
    # hosts: ``_call.mpi_collect.MpiOutputs``)


class Launch(Protocol):
    """How a group's workers start, die and stop."""

    def start(self, spec: GroupSpec, workers: Workers, messaging: Messaging,
              timeout: float) -> Started: ...

    def failed_to_start(self, err: BaseException) -> None: ...

    def death(self, workers: Workers, rank: int, during: str) -> BaseException: ...

    def stuck(self, workers: Workers, reason: tuple, limit: float | None) -> None: ...

    def stopping(self, workers: Workers, ready: bool, broken: BaseException | None,
                 mesh: Any) -> bool: ...

    def release(self) -> None: ...

    def stopped(self, ready: bool, broken: BaseException | None, clean: bool) -> None: ...

    def terminate(self, workers: Workers, owner: Any) -> None: ...


@contextlib.contextmanager
def starting(who: Callable[[int], str]):
    """A worker's death or a timeout while starting as a ``WorkerStartError`` naming the
    rank (``who(rank)``)."""
    try:
        yield
    except WorkerDiedError as err:
        code = "" if err.exitcode is None else f" (exit code {err.exitcode})"
        raise WorkerStartError(
            f"{who(err.rank)} failed to start{code}; its error output is above"
        ) from err
    except TimeoutError as err:
        raise WorkerStartError(str(err)) from None


def start_workers(messaging: Messaging, inits: dict, deadline: float,
                  who: Callable[[int], str]) -> None:
    """Send each worker its ``Init`` ({rank: Init}) and wait for every one to be ready; a
    failure is a ``WorkerStartError`` naming the rank (``who(rank)``)."""
    with starting(who):
        for rank, init in inits.items():
            messaging.send((rank,), P.request(P.INIT, init), "while starting", 0, deadline)
        replies = messaging.recv(list(inits), "while starting", deadline=deadline, rid=0)
    for rank, reply in sorted(replies.items()):
        cause = P.failure(reply, rank)
        if cause is not None:
            raise WorkerStartError(f"{who(rank)} failed to start: {cause!r}") from cause
