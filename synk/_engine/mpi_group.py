"""The master's group under MPI: its workers are the job's other MPI processes.

``MpiGroup`` is a ``Group`` whose start connects to processes that the launcher started
(see ``mpi``) instead of spawning children, and whose ranks may live on other machines:
each worker is a ``RemoteRank`` (the part of ``subprocess.Popen`` that ``Group`` uses),
whose death shows as EOF or a reset on its TCP control channel. Everything else — request
ids, deadlines, the watchdog of the master's share, shared variables, timeouts — is
``Group``'s own code. A broken group ends the MPI job (``Job.end``).
"""
from __future__ import annotations

import contextlib
import pickle
import queue
import select
import socket
import subprocess
import threading
import time

from .._devices import host as _devices
from .._devices.discovery import open as open_device
from .._wire import protocol as P, shm as _shm
from ..comm.mpi import MpiMesh
from ..errors import WorkerDiedError, WorkerStartError
from . import auth as _auth
from .channel import Channel
from .group import Group, spin_seconds
from .hosts import Placement
from .mpi import Job, recv_frame, send_frame, tune
from .watchdog import Watchdog


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


class MpiGroup(Group):
    """A running group whose ranks are the processes of an MPI job."""

    def __init__(self, job: Job, size: int, *, backend: str = "cpu", device_ids=None,
                 settings=None, start_timeout: float = 120.0, devices=None) -> None:
        self.job = job
        self.hosts = None
        self._spin_us = None if settings is None else settings.spin_us
        self._devices = devices  # the GPU of each local rank on a host (None: 0, 1, ...)
        self._started = False
        try:
            super().__init__(size, backend=backend, device_ids=device_ids, settings=settings,
                             start_timeout=start_timeout)
        except BaseException as err:
            job.end(f"the group failed to start: {type(err).__name__}: {err}")
            raise
        self._started = True

    def _start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        listener = socket.create_server(("", 0), backlog=max(64, self.size))
        try:
            self.hosts = self.job.start_master(self._key, listener.getsockname()[1])
            self._place()
            self.device = open_device(self.backend, self.device_ids[0])
            self.device.bind()
            self.mesh = MpiMesh(self.job.comm, 0, self.size, self.spin_s)
            hellos = self._accept(listener, deadline)
        finally:
            listener.close()
        self._initialize(hellos, deadline)

    def _place(self) -> None:
        """Per-host choices, now that the hosts are known."""
        hosts = self.hosts
        local = len(hosts.ranks(0))
        self.spin_s = spin_seconds(local, self._spin_us)  # the master's host's cores
        self._thread_limit.restore()
        self._thread_limit = _devices.MasterThreadLimit(local)
        self.remote_hosts = tuple(range(1, hosts.count))
        if self.remote_hosts:  # phase two reads every rank's blocks by name: one host only
            self.parallel_reduce_ranks = 1 << 30
        if self.backend == "cuda":  # one GPU per rank of a host, by its place on the host
            chosen = self._devices
            ids = []
            for rank in range(self.size):
                i = hosts.local_index(rank)
                if chosen is not None and i >= len(chosen):
                    raise ValueError(f"host {hosts.label(rank)!r} has more ranks than the "
                                     f"devices {list(chosen)} given")
                ids.append(i if chosen is None else chosen[i])
            self.device_ids = ids
            # ranks share a GPU only on the same host (as NCCL checks it: per host)
            self.shares_gpus = len({(hosts.label(r), d) for r, d in enumerate(ids)}) < len(ids)

    def _accept(self, listener: socket.socket, deadline: float) -> dict:
        """Connect every worker: authenticate each connection (in a thread of its own, so
        that a stranger's connection cannot hold up the others), then read its hello."""
        pending, hellos, results = set(self.workers), {}, queue.SimpleQueue()
        listener.settimeout(0.05)
        while pending:
            if time.monotonic() > deadline:
                raise WorkerStartError(
                    f"rank(s) {sorted(pending)} did not connect to the master in time "
                    f"({self.hosts.describe()}); a firewall between the hosts, or the wrong "
                    "address? Set SYNK_MASTER_ADDR to an address of the master's host that "
                    "the others can reach")
            with contextlib.suppress(socket.timeout):
                sock, _ = listener.accept()
                threading.Thread(target=self._greet, args=(sock, deadline, results),
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
                self.channels[rank] = Channel(sock)
                self.procs[rank] = RemoteRank(rank, hello[1], self.hosts.label(rank),
                                              self.channels[rank])
                self.death_fds[rank] = None
        return hellos

    def _greet(self, sock: socket.socket, deadline: float, results) -> None:
        try:
            tune(sock)
            sock.settimeout(max(0.1, min(30.0, deadline - time.monotonic())))
            _auth.handshake(lambda d: send_frame(sock, d),
                            lambda: recv_frame(sock, _auth.MAX_MESSAGE), self._key, first=True)
            rank, pid, prefix = pickle.loads(recv_frame(sock, 4096))  # (authenticated)
            sock.settimeout(None)
            results.put((sock, (int(rank), int(pid), prefix)))
        except Exception:  # not one of ours (or it died): drop it
            sock.close()
            results.put((None, None))

    def _initialize(self, hellos: dict, deadline: float) -> None:
        hosts = self.hosts
        leader_prefix = {h: (self.prefix if h == 0 else hellos[hosts.leader(h)][2])
                         for h in range(hosts.count)}
        try:
            for rank in self.workers:
                host = hosts.of_rank[rank]
                placement = Placement(host, hosts.labels[host], hosts.leader(host),
                                      leader_prefix[host])
                init = P.Init(
                    rank=rank, size=self.size, sys_path=[],
                    prefix=self.prefix if host == 0 else leader_prefix[host],
                    inline_output_bytes=self.inline_output_bytes, spin_s=self.spin_s,
                    peers={}, backend=self.backend, device_id=self.device_ids[rank],
                    mpi=tuple(placement),
                )
                self._send(rank, P.request(P.INIT, init), "while starting", 0, deadline)
            replies = self.recv(self.workers, "while starting", deadline=deadline, rid=0)
        except WorkerDiedError as err:
            raise WorkerStartError(
                f"rank {err.rank} (host {hosts.label(err.rank)!r}) failed to start; its "
                "error output is above") from err
        except TimeoutError as err:
            raise WorkerStartError(str(err)) from None
        for rank, reply in sorted(replies.items()):
            cause = P.failure(reply, rank)
            if cause is not None:
                raise WorkerStartError(f"rank {rank} (host {hosts.label(rank)!r}) failed to "
                                       f"start: {cause!r}") from cause
        self.watchdog = Watchdog(
            self.procs, {r: c.fileno() for r, c in self.channels.items()}, self.death_fds
        )
        if self.backend == "cuda" and self.size > 1:
            self.join_comms(deadline)

    # -- deaths and the end of the job ----------------------------------------------------
    def died(self, rank: int, during: str):
        if self.broken is None:
            self.broken = WorkerDiedError(rank, None, during, host=self.hosts.label(rank))
        self.kill()
        raise self.broken

    def kill(self) -> None:
        with self._kill_lock:
            if self.closed:
                return
            clean = self.broken is None and all(p.exited for p in self.procs.values())
            if not clean and self.mesh is not None:
                self.mesh.stop(grace=0.0)  # sends to a dead rank would never finish
            super().kill()
        if clean:
            self.job.closed_cleanly()
            return
        _shm.sweep_orphans()  # a killed host leader's copies of inputs, if on this host
        if self._started:  # (a failed start is reported by __init__)
            self.job.end(self.broken or "the group was stopped in the middle of a call "
                         "(an interrupt?); its ranks cannot be reused")

    def terminate(self) -> None:
        """SIGTERM (the launcher is ending the job): close the channels, remove the
        segments; nothing here to kill."""
        for proc in self.procs.values():
            proc.kill()
        self.owner.release()
