"""The internals synk's own tests look at, in one place.

Tests go through the public API wherever a behaviour has a public handle. What has none is
reached through this facade alone, under stable names, so that moving a module changes
this file, not the tests. Not part of the public API: names here may change in any
release. What is here, and why it has no public handle:

* **The CUDA/NCCL simulator's insides** (the ``sim_*`` modules; what a program may read of
  it is public, ``synk.simulator``): the names of CuPy it serves and how, its fault
  injection's bookkeeping, its pointer resolution and its network transport, which its
  own tests check against CuPy's and NCCL's sources.
* **The CUDA layer** (``cuda_api``, ``cuda_host``, ``device_dtypes``, ``discovery``,
  ``devices``): the contract tests hold synk's list of CuPy names against the real wheels,
  and ``discovery`` says whether the GPU tests run on real devices.
* **The wire** (``protocol``, ``ring``, ``shm``, ``shm_channel``, ``waiting``): the rings
  and segments are stressed across processes, and a test sends a worker a message of its
  own or looks for segments left behind.
* **The running group** (``running_group``, ``worker_process``, ``worker_channel``,
  ``control_rings``, ``kill_group``, ``group_hosts``, ``auth``, ``hosts``,
  ``local_launch``, ``owner_watch``, ``spawn``): killing a worker, writing to its
  channel, forging a key, reading where MPI put the ranks.
* **A share's communicators** (``comm_context``, ``device_comm``, ``host_comm``,
  ``comm_collectives``, ``comm_mesh``, ``fused``, ``nccl_*``): an NCCL operation run
  straight on a rank's transport (no exchange over the host before it), the master's
  communicator's guard, the sizes at which the host's collectives change their way, and the
  fused layouts a process keeps (a cache's one rule). What a program may read of a rank's
  simulated NCCL is public: ``synk.simulator.nccl_communicator``.
* **The call's records** (``Plan``, ``ShareTask``, ``across_hosts``, ``kept``,
  ``PROFILED_MODULES``, ``output_ways``, ``process``): which way an output was combined,
  what a rank keeps, which modules read the profiler's clock.
* **The settings tables** (``settings``, ``framework_settings``, ``interrupts``,
  ``selftest``): every ``SYNK_*`` variable and framework setting, checked one by one.
"""
from __future__ import annotations

from typing import Any

from . import (
    _arrays as arrays,
    _devices as devices,
    _interrupts as interrupts,
    _selftest as selftest,
    _settings as settings,
)
from ._arrays import framework_settings
from ._call import across_hosts, kept
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
from ._engine import auth, hosts, local_launch, owner_watch, spawn
from ._process import PROCESS
from ._wire import protocol, ring, shm, waiting
from .comm import context as comm_context
from .comm.algorithms import fused
from .comm.host import (
    host_collectives as comm_collectives,
    host_comm,
    shm_channel,
    shm_mesh as comm_mesh,
)
from .comm.nccl import nccl_comm, nccl_guard, nccl_setup

#: the modules that read the clock during a profiled call (profiling off: none may)
PROFILED_MODULES = ("synk._call.master", "synk._call.records", "synk._call.share")

# single names the tests use, wherever they live now
CHECKS = selftest.CHECKS
FRAMEWORK_CHECKS = selftest.FRAMEWORK_CHECKS
CollectiveError = nccl_guard.CollectiveError
CommAborted = comm_mesh.CommAborted
Guard = nccl_guard.Guard
HostCommunicator = host_comm.HostCommunicator
Hosts, mirror_name = hosts.Hosts, hosts.mirror_name
ID_BYTES, NcclCommunicator = nccl_comm.ID_BYTES, nccl_comm.NcclCommunicator
check_id, make_id = nccl_comm.check_id, nccl_comm.make_id
LocalLaunch = local_launch.LocalLaunch
# the least bytes of a message that surely goes through shared memory (in any group)
SHM_FROM = shm_channel.ring_shm_from(2)
Waiter = waiting.Waiter
connect_ops = nccl_setup.connect_ops
worker_command = spawn.worker_command
rows_of_runs, runs_of_ranks = across_hosts._rows, across_hosts._runs

__all__ = [
    "Plan", "ShareTask", "across_hosts", "arrays", "auth", "comm_collectives", "comm_context",
    "comm_mesh", "cuda_api", "cuda_host", "device_dtypes", "devices", "discovery",
    "framework_settings", "host_comm",
    "hosts", "interrupts", "local_launch", "nccl_comm", "nccl_guard", "nccl_setup", "owner_watch",
    "protocol",
    "kept", "ring", "selftest", "settings", "shm", "shm_channel", "sim_core",
    "sim_errors", "sim_faults", "sim_generic", "sim_memory", "sim_names",
    "sim_nccl_rules", "sim_net", "spawn", "waiting",
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
    return fused._LAYOUTS


def jax_direct_put() -> Any:
    """JAX's put that makes this process's JAX arrays of numpy memory directly
    (``_arrays._jax_put``); None where ``jnp.asarray`` makes them, or none was made yet."""
    import sys

    module = sys.modules.get("synk._arrays._jax_put")
    return module._CHECKED[0] if module is not None and module._CHECKED else None
