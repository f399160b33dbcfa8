"""Joining the ranks' device communicator (NCCL on GPU groups, or the staged transport
where NCCL refuses ranks that share a GPU), for ``Group``.

``DeviceComms`` is one of ``Group``'s parts (it is mixed into ``Group``); it uses the
group's ``device``, ``transport``, ``comm_kind``, ``staged_why``, ``shares_gpus``, ``mesh``
and ``procs``, and its messaging (``send``, ``recv``, ``next_round``).
"""
from __future__ import annotations

import time

from .._devices.discovery import use_group_prefix
from .._wire import protocol as P
from ..comm._mesh import CommError
from ..comm.nccl import CommInitError, CommInitTimeout
from ..comm.transports import communicator_class
from ..errors import DeviceFailedError, WorkerDiedError, WorkerStartError


class DeviceComms:
    """Making the device communicator on every rank (see the module)."""

    def join_comms(self, deadline: float | None = None) -> None:
        """Make a fresh device communicator on every rank (replacing the old one): NCCL,
        for which rank 0 makes the id and sends it over the control channel; or, when ranks
        share a GPU and NCCL cannot have them (``comm_kind``), the transport that stages
        device arrays through the host. Every rank joins by ``deadline``, or the group is
        stopped with ``WorkerStartError``."""
        deadline = time.monotonic() + 120.0 if deadline is None else deadline
        old, self.transport = self.transport, None
        if old is not None:
            old.abort("replaced")
        if self.comm_kind == "nccl":
            use_group_prefix(self.prefix)  # the simulator's segments: swept with the group's
            if not self._join(("nccl", communicator_class("nccl").new_id(self.device)), deadline):
                return
            self.comm_kind = "staged"  # NCCL refused ranks that share a GPU
            self.staged_why = "NCCL refused ranks that share a GPU"
        self._join(("staged",), deadline)

    def _join(self, how: tuple, deadline: float) -> bool:
        """Every rank makes the communicator ``how``; True if NCCL refused ranks that share
        a GPU (then none is kept, and the caller falls back)."""
        during = f"while joining the device communicator ({how[0]})"
        refusable = how[0] == "nccl" and self.shares_gpus
        rid = self.next_round()
        payload = P.request(P.COMM, how, max(1.0, deadline - time.monotonic()))
        mine = None
        early: dict = {}  # rank -> its reply, read while rank 0 was still joining

        def give_up() -> str | None:  # (rank 0's set-up waits for every rank: not for one
            return self._worker_exit() or self._failed_early(rid, during, early)  # failed)

        try:
            self.send(self.workers, payload, during, rid)
            try:
                self.transport = self._make_transport(how, deadline, give_up)
            except CommInitError as err:
                if not refusable or isinstance(err, CommInitTimeout):
                    raise
                mine = err  # the workers' replies are read all the same
            except DeviceFailedError as err:  # rank 0's own GPU
                self.broken = err
                self.kill()
                raise
            rest = [r for r in self.workers if r not in early]
            replies = {**self._unpickle(early, rid, during),
                       **self.recv(rest, during, deadline=deadline, rid=rid)}
        except (WorkerDiedError, TimeoutError, CommError) as err:
            failed = self._first_failure(early, rid)
            if failed is not None:  # a worker's failure stopped rank 0's set-up: say it
                rank, cause = failed
                self.broken = WorkerStartError(
                    f"rank {rank} could not join the device communicator ({how[0]}): {cause}")
                self.kill()
                raise self.broken from cause
            self.broken = WorkerStartError(f"the ranks could not join their device "
                                           f"communicator ({how[0]}): {err}")
            self.kill()
            raise self.broken from err
        failed = {rank: cause for rank, reply in sorted(replies.items())
                  if (cause := P.failure(reply, rank)) is not None}
        if refusable and (mine is not None or failed) and all(
                isinstance(e, CommInitError) and not isinstance(e, CommInitTimeout)
                for e in failed.values()):
            if self.transport is not None:
                self.transport.abort("NCCL refused ranks that share a GPU")
                self.transport = None
            return True
        for rank, cause in failed.items():
            self.broken = WorkerStartError(
                f"rank {rank} could not join the device communicator ({how[0]}): {cause}")
            self.kill()
            raise self.broken from cause
        self.comm_stale = False
        return False

    def _make_transport(self, how: tuple, deadline: float, setup_stop=None):
        return communicator_class(how[0]).join(self.device, how, self.size, 0,
                                               deadline=deadline,
                                               should_stop=self._comm_stop_reason,
                                               setup_stop=setup_stop or self._worker_exit)

    def _failed_early(self, rid: int, during: str, early: dict) -> str | None:
        """Why rank 0 should give up joining: a worker has already answered that it could
        not join (its GPU failed, say), so rank 0's set-up, which waits for every rank,
        would wait until its deadline. The replies read are kept in ``early``."""
        for rank in self.workers:
            if rank in early:
                continue
            self.channels[rank].drain()
            message = self._receive(rank, during)
            if message is not None:
                early[rank] = message
        failed = self._first_failure(early, rid)
        return None if failed is None else f"rank {failed[0]} could not join: {failed[1]}"

    @staticmethod
    def _first_failure(early: dict, rid: int) -> tuple | None:
        """(rank, exception) of the first worker among the replies ``early`` that failed."""
        for rank, message in sorted(early.items()):
            if P.rid_of(message) == rid:
                cause = P.failure(P.read(message), rank)
                if cause is not None:
                    return rank, cause
        return None

    def _worker_exit(self) -> str | None:
        """Why rank 0's device communicator should give up its set-up: a worker exited."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return f"rank {rank} exited"
        return None

    def _comm_stop_reason(self) -> str | None:
        """Why rank 0's device communicator should give up a wait: a worker died, or a rank
        of the running call failed."""
        return self._worker_exit() or (None if self.mesh is None else self.mesh.stop_reason())
