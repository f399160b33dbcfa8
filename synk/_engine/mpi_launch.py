"""How the master's group under MPI starts, loses and stops its workers: they are the
job's other MPI processes.

``MpiLaunch`` is the strategy a ``Group`` is given (beside ``local_launch.LocalLaunch``):
its start connects to processes that the launcher started (see ``mpi``) instead of
spawning children, and its ranks may live on other machines: each worker is a
``RemoteRank`` (the part of ``subprocess.Popen`` that ``Group`` uses), whose death shows as
EOF or a reset on its TCP control channel. Everything else — request ids, deadlines, the
watchdog of the master's share, shared variables, timeouts — is ``Group``'s own code. A
broken group ends the MPI job (``Job.end``).
"""
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

from .._devices import host as _devices
from .._devices.discovery import bind as bind_device, job_device_ids, open as open_device
from .._wire import arrays as _wire, protocol as P, shm as _shm
from ..comm.mpi import MpiMesh
from ..errors import WorkerDiedError, WorkerStartError
from . import auth as _auth
from .channel import Channel
from .group import spin_seconds
from .hosts import Placement
from .mpi import Job, recv_frame, send_frame, tune


class RemoteRank:
    """A worker that is an MPI process, maybe on another machine: not this process's child,
    so its exit status is unknown; it is gone when its control channel reads EOF."""

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
    """The workers of a group are the other processes of MPI job ``job``."""

    def __init__(self, job: Job, *, spin_us: float | None = None, devices=None) -> None:
        self.job = job
        self._spin_us = spin_us
        self._devices = devices  # the GPU of each local rank on a host (None: 0, 1, ...)

    # -- start-up -------------------------------------------------------------------------
    def start(self, group, timeout: float) -> float:
        """Connect every worker and send each its ``Init``; the deadline of the start."""
        deadline = time.monotonic() + timeout
        listener = socket.create_server(("", 0), backlog=max(64, group.size))
        try:
            group.hosts = self.job.start_master(group.key, listener.getsockname()[1])
            self._place(group)
            group.device = open_device(group.backend, group.device_ids[0])
            bind_device(group.device)
            group.mesh = MpiMesh(self.job.comm, 0, group.size, group.spin_s)
            hellos = self._accept(group, listener, deadline)
        finally:
            listener.close()
        self._initialize(group, hellos, deadline)
        return deadline

    def _place(self, group) -> None:
        """Per-host choices, now that the hosts are known."""
        hosts = group.hosts
        local = len(hosts.ranks(0))
        group.spin_s = spin_seconds(local, self._spin_us)  # the master's host's cores
        group.thread_limit.restore()
        group.thread_limit = _devices.MasterThreadLimit(local)
        group.remote_hosts = tuple(range(1, hosts.count))
        _wire.SPANS_HOSTS = bool(group.remote_hosts)
        if group.remote_hosts:  # phase two reads every rank's blocks by name: one host only
            group.parallel_reduce_ranks = 1 << 30
        if group.backend == "cuda":  # from the devices each rank's launcher lets it see
            group.device_ids, group.shares_gpus = job_device_ids(
                [hosts.label(r) for r in range(group.size)], self.job.visible, self._devices)

    def _accept(self, group, listener: socket.socket, deadline: float) -> dict:
        """Connect every worker: authenticate each connection (in a thread of its own, so
        that a stranger's connection cannot hold up the others), then read its hello."""
        pending, hellos, results = set(group.workers), {}, queue.SimpleQueue()
        listener.settimeout(0.05)
        while pending:
            if time.monotonic() > deadline:
                raise WorkerStartError(
                    f"rank(s) {sorted(pending)} did not connect to the master in time "
                    f"({group.hosts.describe()}); a firewall between the hosts, or the wrong "
                    "address? Set SYNK_MASTER_ADDR to an address of the master's host that "
                    "the others can reach")
            with contextlib.suppress(socket.timeout):
                sock, _ = listener.accept()
                threading.Thread(target=self._greet, args=(group.key, sock, deadline, results),
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
                group.channels[rank] = Channel(sock)
                group.procs[rank] = RemoteRank(rank, hello[1], group.hosts.label(rank),
                                               group.channels[rank])
                group.death_fds[rank] = None
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

    def _initialize(self, group, hellos: dict, deadline: float) -> None:
        hosts = group.hosts
        leader_prefix = {h: (group.prefix if h == 0 else hellos[hosts.leader(h)][2])
                         for h in range(hosts.count)}
        inits = {}
        for rank in group.workers:
            host = hosts.of_rank[rank]
            placement = Placement(host, hosts.labels[host], hosts.leader(host),
                                  leader_prefix[host])
            inits[rank] = P.Init(
                rank=rank, size=group.size, sys_path=[],
                prefix=group.prefix if host == 0 else leader_prefix[host],
                inline_output_bytes=group.inline_output_bytes, spin_s=group.spin_s,
                peers={}, backend=group.backend, device_id=group.device_ids[rank],
                mpi=tuple(placement),
            )
        group.start_workers(inits, deadline,
                            who=lambda rank: f"rank {rank} (host {hosts.label(rank)!r})")

    def failed_to_start(self, group, err: BaseException) -> None:
        """End the job: its other processes wait for a group that will not come."""
        self.job.failed_to_start(err)

    # -- deaths and the end of the job ----------------------------------------------------
    def death(self, group, rank: int, during: str) -> WorkerDiedError:
        """The error for rank ``rank``'s death (its exit code is not known here): closed,
        or timed out (no answer to TCP's probes within SYNK_PEER_TIMEOUT: a host gone)."""
        lost = group.channels[rank].lost
        if lost is None:  # (the poll that saw it may have left the error on the socket)
            lost = _socket_error(group.channels[rank])
        return WorkerDiedError(rank, None, during, host=group.hosts.label(rank),
                               timed_out=isinstance(lost, TimeoutError))

    def stopping(self, group) -> bool:
        """Whether the group ends cleanly (every rank left after EXIT); if not, the mesh
        stops at once (sends to a dead rank would never finish)."""
        clean = group.started and group.broken is None and all(
            p.exited for p in group.procs.values())  # (a failed start is never clean:
        # MPI_Finalize would wait for ranks that wait for the master)
        if not clean and group.mesh is not None:
            group.mesh.stop(grace=0.0)
        return clean

    def release(self, group) -> None:
        """Nothing of the workers' to close here."""

    def stopped(self, group, clean: bool) -> None:
        """End the job, unless every rank left cleanly."""
        _wire.SPANS_HOSTS = False
        if clean:
            self.job.closed_cleanly()
            return
        _shm.sweep_orphans()  # a killed host leader's copies of inputs, if on this host
        if group.started:  # (a failed start is ended by failed_to_start)
            self.job.end(group.broken or "the group was stopped in the middle of a call "
                         "(an interrupt?); its ranks cannot be reused")

    def terminate(self, group) -> None:
        """SIGTERM (the launcher is ending the job): close the channels, remove the
        segments; nothing here to kill."""
        for proc in group.procs.values():
            proc.kill()
        group.owner.release()


def _socket_error(channel) -> OSError | None:
    """The error pending on ``channel``'s socket, if any (SO_ERROR)."""
    try:
        code = channel.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    except OSError:
        return None
    return OSError(code, os.strerror(code)) if code else None
