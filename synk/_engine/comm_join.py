"""The ranks' device communicator (NCCL on GPU groups, or the staged device_comm where NCCL
refuses ranks that share a GPU): ``DeviceComms``, one of ``Group``'s parts, which has every
rank join it by a deadline and makes it anew after a failed call."""
from __future__ import annotations

import time
from collections.abc import Callable

from .._devices.discovery import use_group_prefix
from .._wire import protocol as P
from ..comm.communicators import communicator_class
from ..comm.host.shm_mesh import CommError
from ..comm.nccl.nccl_comm import CommInitError, CommInitTimeout
from ..errors import DeviceFailedError, WorkerDiedError, WorkerStartError
from .clock import CallClock
from .health import Health
from .messaging import Messaging


class DeviceComms:
    """Rank 0's device communicator (``device_comm``) and how the ranks join theirs. ``kind``:
    "nccl", or "staged" (device arrays through the host) when the ranks share GPUs and NCCL cannot
    or should not have them (``staged_why`` says why)."""

    def __init__(self, size: int, device, prefix: str, kind: str, staged_why: str,
                 shares_gpus: bool, nccl_env: dict, messaging: Messaging, clock: CallClock,
                 health: Health,
                 worker_exit: Callable[[], str | None],
                 stop_reason: Callable[[int], str | None]) -> None:
        self.size, self.device, self.prefix = size, device, prefix
        self.kind, self.staged_why, self.shares_gpus = kind, staged_why, shares_gpus
        self.nccl_env = nccl_env  # NCCL variables every rank's NCCL must read
        self.messaging, self.clock, self.health = messaging, clock, health
        self._worker_exit, self._stop_reason = worker_exit, stop_reason
        self.device_comm = None

    def join(self, deadline: float | None = None) -> None:
        """Make a fresh device communicator on every rank: NCCL (rank 0 makes the id and sends it
        over the control channel), or, when ranks share a GPU, the device_comm that stages through
        the host. Every rank joins by ``deadline``, or the group stops with ``WorkerStartError``."""
        deadline = time.monotonic() + 120.0 if deadline is None else deadline
        self.abort("replaced")
        if self.kind == "nccl":
            use_group_prefix(self.prefix)  # the simulator's segments: swept with the group's
            how = ("nccl", communicator_class("nccl").new_id(self.device), self.nccl_env)
            if not self._join(how, deadline):
                return
            self.kind = "staged"  # NCCL refused ranks that share a GPU
            self.staged_why = "NCCL refused ranks that share a GPU"
        self._join(("staged",), deadline)

    def refresh(self) -> None:
        """After a failed call (``Health.comms_stale``), make the ranks' communicators anew:
        some ranks may have aborted theirs."""
        if not self.health.comms_stale:
            return
        if self.device_comm is None:  # (a CPU group, or one of one rank: none to make)
            self.health.comms_stale = False
            return
        self.join()

    def abort(self, why: str) -> None:
        """Give up rank 0's communicator (the group stops, or it is replaced)."""
        old, self.device_comm = self.device_comm, None
        if old is not None:
            old.abort(why)

    def _join(self, how: tuple, deadline: float) -> bool:
        """Every rank makes the communicator ``how``; True if NCCL refused ranks that share
        a GPU (then none is kept, and the caller falls back)."""
        during = f"while joining the device communicator ({how[0]})"
        refusable = how[0] == "nccl" and self.shares_gpus
        rid = self.clock.next_round()
        replies, mine = self._join_all(how, deadline, refusable, rid, during)
        failed = {rank: cause for rank, reply in sorted(replies.items())
                  if (cause := P.failure(reply, rank)) is not None}
        if refusable and (mine is not None or failed) and all(
                isinstance(e, CommInitError) and not isinstance(e, CommInitTimeout)
                for e in failed.values()):
            self.abort("NCCL refused ranks that share a GPU")
            return True
        for rank, cause in failed.items():
            raise self._join_failure(rank, cause, how) from cause
        self.health.comms_stale = False
        return False

    def _join_all(self, how: tuple, deadline: float, refusable: bool, rid: int,
                  during: str) -> tuple[dict, CommInitError | None]:
        """Ask the workers to make the communicator ``how`` and make rank 0's meanwhile:
        (the workers' replies, rank 0's own refusal where ``refusable``, else None)."""
        payload = P.request(P.COMM, how, max(1.0, deadline - time.monotonic()))
        workers = range(1, self.size)
        mine = None
        early: dict = {}  # replies that came while rank 0 was still joining
        stop = self._worker_exit if refusable else (
            lambda: self._worker_exit() or self._worker_failed(early, rid, during))
        try:
            self.messaging.send(workers, payload, during, rid)
            try:
                self.device_comm = self._make(how, deadline, stop)
            except DeviceFailedError as err:  # rank 0's own GPU
                self.health.break_with(err)
                raise
            except CommInitError as err:
                if not refusable or isinstance(err, CommInitTimeout):
                    self._raise_failed(early, rid, how, during)
                    raise
                mine = err  # the workers' replies are read all the same
            left = [r for r in workers if r not in early]
            replies = self.messaging.recv(left, during, deadline=deadline,
                                          rid=rid) if left else {}
            replies.update(self.messaging.read_replies(early, rid, during))
        except (WorkerDiedError, TimeoutError, CommError) as err:
            first = self._first_failure(early, rid)
            if first is not None:  # a worker's failure stopped rank 0's set-up: say it
                rank, cause = first
                raise self._join_failure(rank, cause, how) from cause
            raise self.health.break_with(WorkerStartError(
                f"the ranks could not join their device communicator ({how[0]}): {err}"
            )) from err
        return replies, mine

    def _join_failure(self, rank: int, cause: BaseException, how: tuple) -> BaseException:
        """Break the group as ``rank`` failed to join the communicator ``how``; the error."""
        return self.health.break_with(WorkerStartError(
            f"rank {rank} could not join the device communicator ({how[0]}): {cause}"))

    def _make(self, how: tuple, deadline: float, setup_stop):
        return communicator_class(how[0]).join(self.device, how, self.size, 0,
                                               deadline=deadline,
                                               should_stop=self._should_stop,
                                               setup_stop=setup_stop)

    @staticmethod
    def _first_failure(early: dict, rid: int) -> tuple | None:
        """(rank, exception) of the first worker among the replies ``early`` that failed."""
        for rank, message in sorted(early.items()):
            if P.rid_of(message) == rid:
                cause = P.failure(P.read(message), rank)
                if cause is not None:
                    return rank, cause
        return None

    def _worker_failed(self, early: dict, rid: int, during: str) -> str | None:
        """Why rank 0 should give up joining: a worker already answered that its own join
        failed (rank 0 would otherwise wait for it until the deadline). Replies read here
        are kept in ``early``."""
        for rank in range(1, self.size):
            if rank in early:
                continue
            try:
                message = self.messaging.take_waiting(rank, during)
                if message is None:
                    continue
                early[rank] = message
                failed = P.rid_of(message) != rid or P.failure(P.read(message), rank)
            except Exception as err:  # a death, a reply that cannot be read: said later
                return f"rank {rank}: {type(err).__name__}"
            if failed:
                return f"rank {rank} could not join it"
        return None

    def _raise_failed(self, early: dict, rid: int, how: tuple, during: str) -> None:
        """Raise a worker's own failure to join, read while rank 0 was joining."""
        for rank, reply in sorted(self.messaging.read_replies(early, rid, during).items()):
            cause = P.failure(reply, rank)
            if cause is not None:
                raise self._join_failure(rank, cause, how) from cause

    def _should_stop(self, number: int = 0) -> str | None:
        """Why rank 0's device communicator should give up a wait (in the call's collective
        ``number``; 0, any): a worker died, or a rank of the running call failed."""
        return self._worker_exit() or self._stop_reason(number)
