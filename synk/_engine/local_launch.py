"""How a group on one host starts, loses and stops its workers: they are the master's
children, spawned with a socketpair to every other rank, shared-memory rings for small
messages, and a watch pipe that first carries the group's key and then, by its EOF, the
master's death.

A group's launch is a strategy (``Group(launch=...)``): this one, or ``mpi_launch``'s for
the processes of an MPI job. ``Group`` does everything else the same for both.
"""
from __future__ import annotations

import functools
import os
import signal
import socket
import subprocess
import sys
import time

from .._devices import host as _devices
from .._devices.discovery import bind as bind_device, open as open_device
from .._wire import protocol as P, ring as _ring, shm as _shm
from ..comm._mesh import Mesh
from ..comm.nccl import shared_gpu_plan
from ..errors import ShmSpaceError, WorkerDiedError, WorkerStartError
from . import auth as _auth
from .channel import Channel
from .guardian import Guardian
from .spawn import Spawner, worker_command

_SYNK_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` exits (Linux >= 5.3), so that a
    death is seen even when the worker's sockets live on in processes it started."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class LocalLaunch:
    """Workers spawned by the master, on its host."""

    def __init__(self) -> None:
        self._spawner = Spawner()
        self._spare_socks: list = []  # the workers' ends, closed here once they are started
        self._watch_fds: dict[int, int] = {}  # rank -> the write end of its watch pipe
        self._guardian: Guardian | None = None

    # -- start-up -------------------------------------------------------------------------
    def start(self, group, timeout: float) -> float:
        """Spawn the workers, authenticate them, send each its ``Init``; the deadline of
        the start (``timeout`` seconds from the spawns)."""
        group.device = open_device(group.backend, group.device_ids[0])
        bind_device(group.device)  # rank 0 runs on the first device, in this thread
        env = _devices.worker_env(group.size)
        if group.backend == "cuda" and group.shares_gpus and group.size > 1:
            extra, group.staged_why = shared_gpu_plan(group.device.xp, group.device_ids)
            if extra is None:
                group.comm_kind = "staged"  # NCCL cannot (or should not) have these ranks
            for var, value in (extra or {}).items():  # the workers' only, never the master's
                env.setdefault(var, value)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SYNK_PARENT, env.get("PYTHONPATH")]))
        if group.size > 1 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._guardian = Guardian(env)  # (no handler of synk's: see guardian.py)
        ends = self._pair_up(group.size)
        peer_fds = {rank: {peer: s.fileno() for peer, s in ends[rank].items()}
                    for rank in group.workers}  # the same numbers in the worker (pass_fds)
        control, mesh_rings = self._make_rings(group)
        for rank in group.workers:
            self._spawner.call(functools.partial(self._spawn, group, rank, env, peer_fds[rank]))
        self._close_spares()
        if group.size > 1:
            group.mesh = Mesh(0, group.size, ends[0], group.spin_s, group.prefix,
                              {peer: mesh_rings.get((0, peer)) for peer in group.workers})
        deadline = time.monotonic() + timeout
        with group.starting(who=lambda rank: f"rank {rank}"):
            for rank in group.workers:
                self._authenticate(group, rank, deadline)
        group.start_workers({rank: P.Init(
            rank=rank, size=group.size, sys_path=list(sys.path), prefix=group.prefix,
            inline_output_bytes=group.inline_output_bytes, spin_s=group.spin_s,
            peers=peer_fds[rank], backend=group.backend,
            device_id=group.device_ids[rank], ring=control.get(rank),
            mesh_rings={peer: mesh_rings.get((rank, peer)) for peer in range(group.size)
                        if peer != rank},
        ) for rank in group.workers}, deadline, who=lambda rank: f"rank {rank}")
        for rank, name in control.items():  # every worker has mapped its ring by now
            group.rings[rank] = _ring.attach(name, 0, _ring.CONTROL_RING)
            group.channels[rank].use_ring(group.rings[rank])
        return deadline

    def _authenticate(self, group, rank: int, deadline: float) -> None:
        send, recv = group.raw_io(rank, deadline, "while starting", _auth.MAX_MESSAGE)
        try:
            _auth.handshake(send, recv, group.key, first=True)
        except (_auth.AuthenticationError, ValueError) as err:
            raise WorkerStartError(
                f"rank {rank} failed authentication on its control channel ({err}); "
                "it was stopped"
            ) from None

    def _make_rings(self, group) -> tuple[dict, dict]:
        """Shared-memory rings for small messages: {worker: name} for the control channels
        and {(rank, peer): (name, side)} for synk.comm. Every rank here is on this host.
        With no room in /dev/shm for them, messages take the sockets alone."""
        control, mesh = {}, {}
        try:
            for rank in group.workers:
                control[rank] = _ring.create(group.prefix, f"ring-c{rank}", _ring.CONTROL_RING)
            for i in range(group.size):
                for j in range(i + 1, group.size):
                    name = _ring.create(group.prefix, f"ring-m{i}-{j}", _ring.MESH_RING)
                    mesh[(i, j)], mesh[(j, i)] = (name, 0), (name, 1)
        except ShmSpaceError:
            for name in [*control.values(), *(n for n, side in mesh.values() if side == 0)]:
                _shm.unlink(name)
            return {}, {}
        return control, mesh

    def _pair_up(self, size: int) -> dict:
        """A socketpair between every two ranks: {rank: {peer: that rank's socket}}."""
        ends: dict = {rank: {} for rank in range(size)}
        for i in range(size):
            for j in range(i + 1, size):
                ends[i][j], ends[j][i] = socket.socketpair()
                self._spare_socks += [ends[j][i]] + ([ends[i][j]] if i else [])
        return ends

    def _spawn(self, group, rank: int, env: dict, peer_fds: dict) -> None:
        ours, theirs = socket.socketpair()
        watch_r, watch_w = os.pipe()
        try:
            proc = subprocess.Popen(  # (run in the spawner thread: see spawn.py)
                worker_command(theirs.fileno(), watch_r, os.getpid()),
                pass_fds=(theirs.fileno(), watch_r, *peer_fds.values()),
                env=env,
                stdin=subprocess.DEVNULL,
            )
            self._give_key(group.key, watch_w)
        except BaseException:
            ours.close()
            os.close(watch_w)
            raise
        finally:
            theirs.close()
            os.close(watch_r)
        group.procs[rank] = proc
        if self._guardian is not None:
            self._guardian.watch(proc.pid)
        group.channels[rank] = Channel(ours)
        group.death_fds[rank] = _pidfd(proc.pid)
        self._watch_fds[rank] = watch_w

    @staticmethod
    def _give_key(key: bytes, watch_w: int) -> None:
        os.write(watch_w, key)  # 32 bytes: fits the pipe buffer, never blocks

    def _close_spares(self) -> None:
        for sock in self._spare_socks:
            sock.close()
        self._spare_socks.clear()

    def failed_to_start(self, group, err: BaseException) -> None:
        """The group could not start (it is killed already): nothing more to end here."""

    # -- deaths and the end ---------------------------------------------------------------
    def death(self, group, rank: int, during: str) -> WorkerDiedError:
        """The error for rank ``rank``'s death, with its exit code."""
        try:
            code = group.procs[rank].wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return WorkerDiedError(rank, code, during)

    def stopping(self, group) -> bool:
        """The group is being killed: stop spawning (after any start in progress, so that
        its worker is in ``procs``). Whether it ends cleanly does not matter here."""
        self._close_spares()
        self._spawner.stop()
        return True

    def release(self, group) -> None:
        """The workers are reaped: close their watch pipes."""
        for fd in self._watch_fds.values():
            os.close(fd)
        self._watch_fds.clear()

    def stopped(self, group, clean: bool) -> None:
        """Everything of the group's is released: its guardian, if any, may go."""
        if self._guardian is not None:
            self._guardian.dismiss()
            self._guardian = None

    def terminate(self, group) -> None:
        """SIGKILL every worker and remove the group's segments, taking no lock."""
        for proc in group.procs.values():
            if proc.returncode is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                    os.waitpid(proc.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
        group.owner.release()
