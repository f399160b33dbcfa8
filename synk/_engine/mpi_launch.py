"""How the master's group under MPI starts, loses and stops its workers: they are the
job's other MPI processes, reached over TCP and maybe on other machines."""
from __future__ import annotations

import contextlib
import os
import pickle
import queue
import select
import socket
import subprocess
import threading
import time
from typing import Any

from .._call.across_hosts import ONE_HOST, AcrossHosts
from .._call.mpi_collect import MpiOutputs
from .._devices import host_threads as _devices
from .._devices.discovery import (
    bind as bind_device,
    gpu_status,
    job_device_ids,
    open as open_device,
)
from .._process import PROCESS
from .._wire import protocol as P, ring as _ring, shm as _shm
from .._wire.interfaces import tune
from .._wire.waiting import Idle
from ..comm.host.mpi_mesh import MpiMesh
from ..comm.nccl.nccl_comm import shared_gpu_plan
from ..errors import CallTimeoutError, ShmSpaceError, WorkerDiedError, WorkerStartError
from . import auth as _auth, owner_watch
from .channel import Channel
from .group import spin_seconds
from .hosts import Placement
from .launch import GroupSpec, Started, start_workers
from .messaging import Messaging
from .mpi_job import Job, recv_frame, send_frame
from .workers import Workers


class RemoteRank:
    """A worker that is an MPI process, maybe on another machine: the part of
    ``subprocess.Popen`` that ``Group`` uses. It is not this process's child, so its exit
    status is unknown; it is gone when its TCP control channel reads EOF or a reset."""

    def __init__(self, rank: int, pid: int, host: str, channel: Channel) -> None:
        self.rank, self.pid, self.host, self._channel = rank, pid, host, channel
        self.returncode = None
        self.exited = False  # its channel closed after EXIT
        self._killed = False

    def poll(self):
        return None

    def wait(self, timeout: float | None = None):
        """Wait up to ``timeout`` seconds for the channel to close (after EXIT)."""
        if self._killed or timeout is None or self._channel.closed:
            return None
        poller = select.poll()
        poller.register(self._channel.fileno(), select.POLLIN | select.POLLRDHUP)
        if not poller.poll(max(0.0, timeout) * 1000):
            raise subprocess.TimeoutExpired(f"rank {self.rank}", timeout)
        self.exited = True
        return None

    def kill(self) -> None:
        """Close the channel: the rank leaves its loop, and the job's end stops it."""
        self._killed = True
        if not self._channel.closed:
            with contextlib.suppress(OSError):
                self._channel.sock.shutdown(socket.SHUT_RDWR)


class MpiLaunch:
    """A ``Group``'s launch whose workers are the other processes of MPI job ``job``: its start
    connects to them (``mpi_job``), each a ``RemoteRank``. A broken group ends the MPI job
    (``Job.end``)."""

    def __init__(self, job: Job, *, spin_us: float | None = None, devices=None) -> None:
        self.job = job
        self._spin_us = spin_us
        self._devices = devices  # the GPU of each local rank on a host (None: 0, 1, ...)
        self._hosts: Any = None  # where every rank runs (hosts.Hosts), once the ranks met

    # -- start-up -------------------------------------------------------------------------
    def start(self, spec: GroupSpec, workers: Workers, messaging: Messaging,
              timeout: float) -> Started:
        """Connect every worker and send each its ``Init``; what else it started, the
        deadline of the start among it."""
        deadline = time.monotonic() + timeout
        owner_watch.watch(_shm.process_prefix())  # its segments, should the launcher kill it
        listener = socket.create_server(("", 0), backlog=max(64, spec.size))
        device = mesh = started = None
        try:
            try:
                self._hosts = hosts = self.job.start_master(
                    spec.key, listener.getsockname()[1], spec.backend == "cuda")
                started = self._place(spec, hosts, deadline)
                device = open_device(spec.backend, started.device_ids[0])
                bind_device(device)
                mesh = MpiMesh(self.job.comm, 0, spec.size, started.spin_s)
                messaging.idle = Idle(mesh.progress)
                started = started._replace(device=device, mesh=mesh)
                hellos = self._accept(spec, workers, listener, deadline)
            finally:
                listener.close()
            self._initialize(spec, started, workers, messaging, hellos, deadline)
        except BaseException:
            if device is not None:
                device.close()
            if started is not None:
                started.thread_limit.restore()
            raise
        across: Any = ONE_HOST
        outputs = None
        if hosts.count > 1:
            assert self.job.collectives is not None  # (made by the job across hosts)
            across = AcrossHosts(hosts, mesh.comm, workers.channels, device.is_host)
            outputs = MpiOutputs(self.job.collectives, 0, spec.inline_output_bytes,
                                 pack=False)
        return started._replace(across=across, outputs=outputs)

    def _place(self, spec: GroupSpec, hosts, deadline: float) -> Started:
        """Per-host choices, now that the hosts are known."""
        local = len(hosts.ranks(0))
        remote_hosts = hosts.count > 1
        PROCESS.spans_hosts = remote_hosts
        device_ids, shares_gpus = spec.device_ids, False
        comm_kind, staged_why, nccl_env = "nccl", "", {}
        if spec.backend == "cuda":  # from the devices each rank's launcher lets it see
            device_ids, shares_gpus = job_device_ids(
                [hosts.label(r) for r in range(spec.size)], self.job.visible, self._devices,
                self.job.device_counts)
            if shares_gpus:  # as fork() decides on one host
                extra, staged_why = shared_gpu_plan(gpu_status().xp, device_ids)
                comm_kind = "nccl" if extra is not None else "staged"
                nccl_env = dict(extra or {})
        # phase two reads every rank's blocks by name: one host only
        return Started(deadline, None, None, device_ids, shares_gpus, comm_kind, staged_why,
                       spin_seconds(local, self._spin_us),  # the master's host's cores
                       _devices.MasterThreadLimit(local), ONE_HOST,
                       (1 << 30) if remote_hosts else None, hosts, nccl_env=nccl_env)

    def _accept(self, spec: GroupSpec, workers: Workers, listener: socket.socket,
                deadline: float) -> dict:
        """Connect every worker: authenticate each connection (in a thread of its own, so
        that a stranger's connection cannot hold up the others), then read its hello."""
        pending, hellos = set(range(1, spec.size)), {}
        results: queue.SimpleQueue = queue.SimpleQueue()
        listener.settimeout(0.05)
        while pending:
            if time.monotonic() > deadline:
                raise WorkerStartError(
                    f"rank(s) {sorted(pending)} did not connect to the master in time "
                    f"({self._hosts.describe()}); a firewall between the hosts, or the wrong "
                    "address? Set SYNK_MASTER_ADDR to an address of the master's host that "
                    "the others can reach")
            with contextlib.suppress(socket.timeout):
                sock, _ = listener.accept()
                threading.Thread(target=self._greet, args=(spec.key, sock, deadline, results),
                                 name="synk-mpi-greet", daemon=True).start()
            while not results.empty():
                sock, hello = results.get()
                if sock is None or hello[0] not in pending:
                    if sock is not None:
                        sock.close()
                    continue
                rank = hello[0]
                pending.discard(rank)
                hellos[rank] = hello
                channel = Channel(sock)
                workers.add(rank, RemoteRank(rank, hello[1], self._hosts.label(rank), channel),
                            channel, None)
        return hellos

    @staticmethod
    def _greet(key: bytes, sock: socket.socket, deadline: float, results) -> None:
        try:
            tune(sock)
            sock.settimeout(max(0.1, min(30.0, deadline - time.monotonic())))
            _auth.handshake(lambda d: send_frame(sock, d),
                            lambda: recv_frame(sock, _auth.MAX_MESSAGE), key, first=True)
            rank, pid, prefix = pickle.loads(recv_frame(sock, 4096))  # (authenticated)
            sock.settimeout(None)
            results.put((sock, (int(rank), int(pid), prefix)))
        except Exception:  # not one of ours (or it died): drop it
            sock.close()
            results.put((None, None))

    def _initialize(self, spec: GroupSpec, started: Started, workers: Workers,
                    messaging: Messaging, hellos: dict, deadline: float) -> None:
        """Send every worker its ``Init``; the workers on the master's host get a control
        ring, as on one host (their messages skip TCP, which costs a call tens of us)."""
        hosts = started.hosts
        leader_prefix = {h: (spec.prefix if h == 0 else hellos[hosts.leader(h)][2])
                         for h in range(hosts.count)}
        rings = _control_rings(spec.prefix, [r for r in range(1, spec.size)
                                             if hosts.of_rank[r] == 0])
        inits = {}
        for rank in range(1, spec.size):
            host = hosts.of_rank[rank]
            placement = Placement(host, hosts.labels[host], hosts.leader(host),
                                  leader_prefix[host])
            inits[rank] = P.Init(
                rank=rank, size=spec.size, sys_path=[],
                prefix=spec.prefix if host == 0 else leader_prefix[host],
                inline_output_bytes=spec.inline_output_bytes, spin_s=started.spin_s,
                peers={}, backend=spec.backend, device_id=started.device_ids[rank],
                mpi=tuple(placement), ring=rings.get(rank), seed=spec.seed,
                whereabouts=spec.whereabouts if host == 0 else None,
            )
        start_workers(messaging, inits, deadline,
                      who=lambda rank: f"rank {rank} (host {hosts.label(rank)!r})")
        for rank, name in rings.items():  # every worker has mapped its ring by now
            workers.use_ring(rank, _ring.attach(name, 0, _ring.CONTROL_RING))

    def failed_to_start(self, err: BaseException) -> None:
        """End the job: its other processes wait for a group that will not come."""
        self.job.failed_to_start(err)

    # -- deaths and the end of the job ----------------------------------------------------
    def death(self, workers: Workers, rank: int, during: str) -> WorkerDiedError:
        """The error for rank ``rank``'s death (its exit code is not known here): closed,
        or timed out (no answer to TCP's probes within SYNK_PEER_TIMEOUT: a host gone)."""
        lost = workers.channels[rank].lost
        if lost is None:  # (the poll that saw it may have left the error on the socket)
            lost = _socket_error(workers.channels[rank])
        return WorkerDiedError(rank, None, during, host=self._hosts.label(rank),
                               timed_out=isinstance(lost, TimeoutError))

    def stuck(self, workers: Workers, reason: tuple, limit: float | None) -> None:
        """Rank 0 waits inside MPI (the outputs' collectives) for a rank that died, or past
        the call's deadline, and MPI cannot be interrupted: say why and end the job now,
        as a broken group does (``Job.end``: MPI_Abort in a few seconds, which also ends
        this process's wait)."""
        during = "while the master waited inside MPI's collectives"
        if reason[0] == "died":
            error: BaseException = self.death(workers, reason[1], during)
        else:
            error = CallTimeoutError(
                f"the call did not finish within {limit:g} s (the master waited inside "
                "MPI's collectives); the MPI job is ending", tuple(sorted(workers.procs)))
        self.job.end(error)

    def stopping(self, workers: Workers, ready: bool, broken, mesh) -> bool:
        """Whether the group ends cleanly (every rank left after EXIT); if not, the mesh
        stops at once (sends to a dead rank would never finish)."""
        clean = ready and broken is None and all(
            p.exited for p in workers.procs.values())  # (a failed start is never clean:
        # MPI_Finalize would wait for ranks that wait for the master)
        if not clean and mesh is not None:
            mesh.stop(grace=0.0)
        return clean

    def release(self) -> None:
        """Nothing of the workers' to close here."""

    def stopped(self, ready: bool, broken, clean: bool) -> None:
        """End the job, unless every rank left cleanly."""
        PROCESS.spans_hosts = False
        if clean:
            self.job.closed_cleanly()
            return
        _shm.sweep_orphans()  # a killed host leader's copies of inputs, if on this host
        if ready:  # (a failed start is ended by failed_to_start)
            self.job.end(broken or "the group was stopped in the middle of a call "
                         "(an interrupt?); its ranks cannot be reused")

    def terminate(self, workers: Workers, owner) -> None:
        """SIGTERM (the launcher is ending the job): close the channels, remove the
        segments; nothing here to kill."""
        for proc in workers.procs.values():
            proc.kill()
        owner.release()


def _control_rings(prefix: str, ranks: list) -> dict:
    """{rank: the name of its control ring} for ``ranks`` (on the master's host); none
    where /dev/shm has no room for them (messages then take the sockets alone)."""
    rings: dict = {}
    try:
        for rank in ranks:
            rings[rank] = _ring.create(prefix, f"ring-c{rank}", _ring.CONTROL_RING)
    except ShmSpaceError:
        for name in rings.values():
            _shm.unlink(name)
        return {}
    return rings


def _socket_error(channel) -> OSError | None:
    """The error pending on ``channel``'s socket, if any (SO_ERROR)."""
    try:
        code = channel.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except OSError:
        return None
    return OSError(code, os.strerror(code)) if code else None
