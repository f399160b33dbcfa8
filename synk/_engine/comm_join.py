"""Joining the ranks' device communicator (NCCL on GPU groups, or the staged transport
where NCCL refuses ranks that share a GPU), for ``Group``.

``DeviceComms`` is one of ``Group``'s parts (it is mixed into ``Group``); it uses the
group's ``device``, ``transport``, ``comm_kind``, ``staged_why``, ``nccl_env``,
``shares_gpus``, ``mesh``
and ``procs``, and its messaging (``send``, ``recv``, ``next_round``).
"""
from __future__ import annotations

import time

from .._devices.discovery import use_group_prefix
from .._wire import protocol as P
from ..comm._mesh import CommError
from ..comm.nccl import CommInitError, CommInitTimeout
from ..comm.transports import communicator_class
from ..errors import WorkerDiedError, WorkerStartError


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
            how = ("nccl", communicator_class("nccl").new_id(self.device), self.nccl_env)
            if not self._join(how, deadline):
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
        try:
            self.send(self.workers, payload, during, rid)
            try:
                self.transport = self._make_transport(how, deadline)
            except CommInitError as err:
                if not refusable or isinstance(err, CommInitTimeout):
                    raise
                mine = err  # the workers' replies are read all the same
            replies = self.recv(self.workers, during, deadline=deadline, rid=rid)
        except (WorkerDiedError, TimeoutError, CommError) as err:
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

    def _make_transport(self, how: tuple, deadline: float):
        return communicator_class(how[0]).join(self.device, how, self.size, 0,
                                               deadline=deadline,
                                               should_stop=self._comm_stop_reason,
                                               setup_stop=self._worker_exit)

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
