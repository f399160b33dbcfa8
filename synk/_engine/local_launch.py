"""How a group on one host starts, loses and stops its workers: they are the master's
children, spawned with a socketpair to every other rank, shared-memory rings for small
messages, and a watch pipe that first carries the group's key and then, by its EOF, the
master's death."""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time

from .._call.across_hosts import ONE_HOST
from .._devices import host_threads as _devices
from .._devices.discovery import bind as bind_device, open as open_device
from .._wire import protocol as P, ring as _ring, shm as _shm
from ..comm.host import shm_board as _board
from ..comm.host.shm_mesh import Mesh
from ..comm.nccl.nccl_comm import shared_gpu_plan
from ..errors import ShmSpaceError, WorkerDiedError, WorkerStartError
from . import auth as _auth
from .channel import Channel
from .guardian import Guardian
from .launch import GroupSpec, Started, start_workers, starting
from .messaging import Messaging
from .spawn import Spawner, worker_command
from .workers import Workers

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
        self._control: dict = {}  # rank -> the name of its control ring (None: no ring)
        self._inits: dict = {}  # rank -> its protocol.Init
        self._cores: list | None = None  # each rank's cores (None: any)

    # -- start-up -------------------------------------------------------------------------
    def start(self, spec: GroupSpec, workers: Workers, messaging: Messaging,
              timeout: float) -> Started:
        """Spawn the workers, authenticate them, send each its ``Init``; what else it
        started (rank 0's device, the mesh) and the deadline of the start (``timeout``
        seconds from the spawns). What it started is let go again if the start fails."""
        device = open_device(spec.backend, spec.device_ids[0])
        mesh = None
        try:
            bind_device(device)  # rank 0 runs on the first device, in this thread
            started = self._spawn_all(spec, workers, device, timeout)
            mesh = started.mesh
            with starting(who=lambda rank: f"rank {rank}"):
                for rank in range(1, spec.size):
                    self._authenticate(messaging, spec.key, rank, started.deadline)
            start_workers(messaging, self._inits, started.deadline,
                          who=lambda rank: f"rank {rank}")
        except BaseException:
            if mesh is not None:
                mesh.stop()
            device.close()
            raise
        for rank, name in self._control.items():  # every worker has mapped its ring by now
            workers.use_ring(rank, _ring.attach(name, 0, _ring.CONTROL_RING))
        return started._replace(thread_limit=_devices.MasterThreadLimit(
            spec.size, None if self._cores is None else self._cores[0]))

    def _spawn_all(self, spec: GroupSpec, workers: Workers, device, timeout: float) -> Started:
        """Spawn every worker; the ``Started`` record (its thread limit still to come) and,
        kept here, each worker's ``Init`` and control ring."""
        size = spec.size
        comm_kind, staged_why, nccl_env = "nccl", "", {}
        shares_gpus = len(set(spec.device_ids)) < size
        env = _devices.worker_env(size)
        cores = self._cores = _devices.rank_cores(size) if spec.backend == "cpu" else None
        if spec.backend == "cuda" and shares_gpus:
            extra, staged_why = shared_gpu_plan(device.xp, spec.device_ids)
            if extra is None:
                comm_kind = "staged"  # NCCL cannot (or should not) have these ranks
            nccl_env = dict(extra or {})  # (also read by the master's first one)
            for var, value in nccl_env.items():  # the workers' only, never the master's
                env.setdefault(var, value)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SYNK_PARENT, env.get("PYTHONPATH")]))
        if size > 1 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._guardian = Guardian(env)  # (no handler of synk's: see guardian.py)
        ends = self._pair_up(size)
        peer_fds = {rank: {peer: s.fileno() for peer, s in ends[rank].items()}
                    for rank in range(1, size)}  # the same numbers in the worker (pass_fds)
        control, mesh_rings, board = self._make_rings(spec)
        for rank in range(1, size):
            self._spawner.call(functools.partial(self._spawn, spec.key, workers, rank, env,
                                                 peer_fds[rank]))
        self._close_spares()
        mesh = None
        if size > 1:
            mesh = Mesh(0, size, ends[0], spec.spin_s, spec.prefix,
                        {peer: mesh_rings.get((0, peer)) for peer in range(1, size)}, board)
        self._control = control
        self._inits = {rank: P.Init(
            rank=rank, size=size, sys_path=list(sys.path), prefix=spec.prefix,
            inline_output_bytes=spec.inline_output_bytes, spin_s=spec.spin_s,
            peers=peer_fds[rank], backend=spec.backend,
            device_id=spec.device_ids[rank], ring=control.get(rank),
            mesh_rings={peer: mesh_rings.get((rank, peer)) for peer in range(size)
                        if peer != rank}, mesh_board=board, seed=spec.seed,
            whereabouts=spec.whereabouts, cores=None if cores is None else cores[rank],
        ) for rank in range(1, size)}
        return Started(time.monotonic() + timeout, device, mesh, spec.device_ids,
                       shares_gpus, comm_kind, staged_why, spec.spin_s, None, ONE_HOST, None,
                       nccl_env=nccl_env)

    def _authenticate(self, messaging: Messaging, key: bytes, rank: int,
                      deadline: float) -> None:
        send, recv = messaging.raw_io(rank, deadline, "while starting", _auth.MAX_MESSAGE)
        try:
            _auth.handshake(send, recv, key, first=True)
        except (_auth.AuthenticationError, ValueError) as err:
            raise WorkerStartError(
                f"rank {rank} failed authentication on its control channel ({err}); "
                "it was stopped"
            ) from None

    def _make_rings(self, spec: GroupSpec) -> tuple[dict, dict, str | None]:
        """Shared-memory rings: {worker: name} for the control channels, {(rank, peer): (name,
        side)} for synk.comm, and synk.comm's board (``shm_board``). Without room in /dev/shm for
        the rings, messages take the sockets; for the board, collectives take messages."""
        control, mesh, board = {}, {}, None
        try:
            for rank in range(1, spec.size):
                control[rank] = _ring.create(spec.prefix, f"ring-c{rank}", _ring.CONTROL_RING)
            for i in range(spec.size):
                for j in range(i + 1, spec.size):
                    name = _ring.create(spec.prefix, f"ring-m{i}-{j}",
                                        _ring.mesh_ring_bytes(spec.size))
                    mesh[(i, j)], mesh[(j, i)] = (name, 0), (name, 1)
        except ShmSpaceError:
            for name in [*control.values(), *(n for n, side in mesh.values() if side == 0)]:
                _shm.unlink(name)
            return {}, {}, None
        if spec.size > 1 and _board.USABLE:
            with contextlib.suppress(ShmSpaceError):
                board = _board.create(spec.prefix, spec.size)
        return control, mesh, board

    def _pair_up(self, size: int) -> dict:
        """A socketpair between every two ranks: {rank: {peer: that rank's socket}}."""
        ends: dict = {rank: {} for rank in range(size)}
        for i in range(size):
            for j in range(i + 1, size):
                ends[i][j], ends[j][i] = socket.socketpair()
                self._spare_socks += [ends[j][i]] + ([ends[i][j]] if i else [])
        return ends

    def _spawn(self, key: bytes, workers: Workers, rank: int, env: dict,
               peer_fds: dict) -> None:
        """Start worker ``rank`` with an AF_UNIX socketpair (no address, so no other process can
        connect; EOF is how a waiting master sees a death) and a pipe it only reads: the group's
        key, then EOF when the master is gone. The parent-death signal backs this up; it is tied
        to the starting thread (``spawn.Spawner``)."""
        ours, theirs = socket.socketpair()
        watch_r, watch_w = os.pipe()
        try:
            proc = subprocess.Popen(  # (run in the spawner thread: see spawn.py)
                worker_command(theirs.fileno(), watch_r, os.getpid()),
                pass_fds=(theirs.fileno(), watch_r, *peer_fds.values()),
                env=env,
                stdin=subprocess.DEVNULL,
            )
            self._give_key(key, watch_w)
        except BaseException:
            ours.close()
            os.close(watch_w)
            raise
        finally:
            theirs.close()
            os.close(watch_r)
        workers.add(rank, proc, Channel(ours), _pidfd(proc.pid))
        if self._guardian is not None:
            self._guardian.watch(proc.pid)
        self._watch_fds[rank] = watch_w

    @staticmethod
    def _give_key(key: bytes, watch_w: int) -> None:
        os.write(watch_w, key)  # 32 bytes: fits the pipe buffer, never blocks

    def _close_spares(self) -> None:
        for sock in self._spare_socks:
            sock.close()
        self._spare_socks.clear()

    def failed_to_start(self, err: BaseException) -> None:
        """The group could not start (it is killed already): nothing more to end here."""

    # -- deaths and the end ---------------------------------------------------------------
    def stuck(self, workers: Workers, reason: tuple, limit: float | None) -> None:
        """Nothing: no share on one host waits in a call that an interrupt cannot cut."""

    def death(self, workers: Workers, rank: int, during: str) -> WorkerDiedError:
        """The error for rank ``rank``'s death, with its exit code."""
        try:
            code = workers.procs[rank].wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        return WorkerDiedError(rank, code, during)

    def stopping(self, workers: Workers, ready: bool, broken, mesh) -> bool:
        """The group is being killed: stop spawning (after any start in progress, so that
        its worker is in ``procs``). Whether it ends cleanly does not matter here."""
        self._close_spares()
        self._spawner.stop()
        return True

    def release(self) -> None:
        """The workers are reaped: close their watch pipes."""
        for fd in self._watch_fds.values():
            os.close(fd)
        self._watch_fds.clear()

    def stopped(self, ready: bool, broken, clean: bool) -> None:
        """Everything of the group's is released: its guardian, if any, may go."""
        if self._guardian is not None:
            self._guardian.dismiss()
            self._guardian = None

    def terminate(self, workers: Workers, owner) -> None:
        """SIGKILL every worker and remove the group's segments, taking no lock."""
        for proc in workers.procs.values():
            if proc.returncode is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                    os.waitpid(proc.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
        owner.release()
