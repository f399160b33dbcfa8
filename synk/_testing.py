"""The internals synk's own tests look at, under stable names: a test reaches what has no
public handle through this facade alone (its docstring says why), so that moving a module
changes this file, not the tests. Not public API: names may change in any release.
"""
from __future__ import annotations

import socket
import time
from typing import Any

from . import (
    _arrays as arrays,
    _devices as devices,
    _interrupts as interrupts,
    _selftest as selftest,
    _settings as settings,
)
from ._call import across_hosts as _across_hosts
from ._call.records import ShareTask
from ._call.rows import Plan
from ._devices import cuda_api, cuda_host, device_dtypes, discovery
from ._devices.sim import (
    _core as sim_core,
    _errors as sim_errors,
    _faults as sim_faults,
    _memory as sim_memory,
    _nccl_rules as sim_nccl_rules,
    _net as sim_net,
)
from ._devices.sim.cupy import _generic as sim_generic, _names as sim_names
from ._engine import (
    auth,
    channel,
    hosts as _hosts,
    local_launch as _local_launch,
    owner_watch,
    spawn as _spawn,
)
from ._process import PROCESS
from ._wire import protocol, ring, shm, waiting
from .comm import context as comm_context
from .comm.algorithms import fused as _fused
from .comm.host import (
    host_collectives as comm_collectives,
    host_comm as _host_comm,
    shm_board as comm_board,
    shm_channel as _shm_channel,
    shm_mesh as comm_mesh,
)
from .comm.nccl import nccl_comm, nccl_guard as _nccl_guard, nccl_setup

#: the modules that read the clock during a profiled call (profiling off: none may)
PROFILED_MODULES = ("synk._call.master", "synk._call.records", "synk._call.share")

# single names the tests use, wherever they live now
CHECKS = selftest.CHECKS
FRAMEWORK_CHECKS = selftest.FRAMEWORK_CHECKS
CollectiveError = _nccl_guard.CollectiveError
Guard = _nccl_guard.Guard
HostCommunicator = _host_comm.HostCommunicator
Hosts, mirror_name = _hosts.Hosts, _hosts.mirror_name
ID_BYTES, NcclCommunicator = nccl_comm.ID_BYTES, nccl_comm.NcclCommunicator
check_id, make_id = nccl_comm.check_id, nccl_comm.make_id
LocalLaunch = _local_launch.LocalLaunch
# the least bytes of a message that surely goes through shared memory (in any group)
SHM_FROM = _shm_channel.ring_shm_from(2)
Waiter = waiting.Waiter
connect_ops = nccl_setup.connect_ops
worker_command = _spawn.worker_command
rows_of_runs, runs_of_ranks = _across_hosts._rows, _across_hosts._runs

# The entries reach the simulator's insides (``sim_*``), the CUDA layer, synk's NCCL
# transport, the wire, the running group, the many-host code's pure parts, a call's records
# and the self-test's table.
__all__ = [
    "CHECKS", "FRAMEWORK_CHECKS", "PROFILED_MODULES", "SHM_FROM", "CollectiveError", "Guard",
    "HostCommunicator", "Hosts", "ID_BYTES", "LocalLaunch", "NcclCommunicator", "Plan",
    "ReplyReader", "ShareTask", "Waiter", "arrays", "auth", "check_id", "comm_board",
    "channel", "comm_collectives", "comm_context",
    "comm_mesh", "connect_ops", "control_rings", "cuda_api", "cuda_host", "device_comm",
    "device_dtypes", "devices", "discovery", "fused_layouts", "group_hosts", "interrupts",
    "jax_direct_put", "kill_group", "make_id", "mirror_name", "nccl_comm", "nccl_setup",
    "output_ways", "owner_watch", "process", "protocol", "ring", "rows_of_runs",
    "running_group", "runs_of_ranks", "selftest", "settings", "shm", "sim_core", "sim_errors",
    "sim_faults", "sim_generic", "sim_memory", "sim_names", "sim_nccl_rules", "sim_net",
    "waiting", "worker_channel", "worker_command", "worker_process",
]


def running_group() -> Any:
    """The master's running group (``_engine.group.Group``), or None."""
    return PROCESS.group


def process() -> Any:
    """This process's synk state (``_process.Process``)."""
    return PROCESS


def worker_process(rank: int) -> Any:
    """The running group's worker ``rank``: its ``subprocess.Popen`` (a stand-in under MPI)."""
    return PROCESS.group.processes.procs[rank]


def seen_dead(rank: int, timeout: float = 10.0) -> bool:
    """Wait until the running group's watchdog has seen worker ``rank`` die (after a kill
    from outside); whether it has."""
    group = PROCESS.group
    stop = time.monotonic() + timeout
    while time.monotonic() < stop:
        if group.watchdog is None or rank in group.watchdog.dead() or group.broken:
            return True
        time.sleep(0.005)
    return False


def worker_channel(rank: int) -> Any:
    """The master's end of worker ``rank``'s control channel (``_engine.channel.Channel``)."""
    return PROCESS.group.processes.channels[rank]


def control_rings() -> dict:
    """rank -> the shared-memory ring of its control channel (workers that have one)."""
    return PROCESS.group.processes.rings


def device_comm() -> Any:
    """The master's device communicator (NCCL...) of the running GPU group."""
    return PROCESS.group.comms.device_comm


def group_hosts() -> Any:
    """Under MPI: where the running group's ranks run (``_engine.hosts.Hosts``)."""
    return PROCESS.group.started.hosts


def output_ways() -> dict:
    """Under MPI across hosts: (op, result dtype string) -> the way the running group's
    last call of it combined a large output ("reduce", "gather" or "fold":
    ``_call.mpi_collect``); {} elsewhere."""
    return dict(getattr(PROCESS.group.env().outputs, "ways", {}))


def kill_group() -> None:
    """Stop the running group at once, as a death or a timeout does."""
    PROCESS.group.health.kill()


def fused_layouts() -> dict:
    """The structures synk.comm's fused allreduce laid out in this process, and their
    packing messages (``comm.algorithms.fused._LAYOUTS``)."""
    return _fused._LAYOUTS


def jax_direct_put() -> Any:
    """JAX's put that makes this process's JAX arrays of numpy memory directly
    (``_arrays._jax_put``); None where ``jnp.asarray`` makes them, or none was made yet."""
    import sys

    module = sys.modules.get("synk._arrays._jax_put")
    return module._CHECKED[0] if module is not None and module._CHECKED else None


class ReplyReader:
    """The master's reader of workers' replies (``_engine.messaging.Messaging``) over a
    socket pair per rank (a control channel without a ring): ``write`` puts a worker's
    message on the other end, ``recv`` is the master's. ``close`` closes the sockets."""

    def __init__(self, ranks: list) -> None:
        from ._engine.channel import Channel
        from ._engine.clock import CallClock
        from ._engine.health import Health
        from ._engine.messaging import Messaging
        from ._engine.workers import Workers

        self.pairs = {rank: socket.socketpair() for rank in ranks}
        workers = Workers()
        for rank, (master_end, _) in self.pairs.items():
            workers.add(rank, None, Channel(master_end), None)
        clock = CallClock()
        health = Health(lambda: None, lambda rank, during: RuntimeError(
            f"rank {rank} died {during}"), lambda ranks: list(ranks), clock)
        self.messaging = Messaging(max(ranks) + 1, workers, clock, health, waiting.Waiter(0.0))

    def write(self, rank: int, message: bytes) -> None:
        from ._engine.channel import frame

        self.pairs[rank][1].sendall(b"".join(frame(message)))

    def recv(self, ranks: list, rid: int, within_s: float) -> dict:
        return self.messaging.recv(ranks, "a test", time.monotonic() + within_s, rid)

    def close(self) -> None:
        for pair in self.pairs.values():
            for sock in pair:
                sock.close()
