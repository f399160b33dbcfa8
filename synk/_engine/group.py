"""The master's side of a group: start the workers, talk to them, watch them, stop them.

::

    master (rank 0)                                   worker rank r  (spawn.worker_command)
    ---------------                                   ---------------
    Group.__init__  -- spawn, key via watch pipe -->  read the key
                    <-- HMAC challenge, both ways ->  (before anything is unpickled)
                    -- Init ---------------------->   apply Init, reply OK  (ready)
    Group.send      -- pickled message ----------->   run it (ship / call / reduce)
    (rank 0 runs its own share meanwhile; the Watchdog interrupts it on a death or timeout)
    Group.recv      <-- OK payload | ERR ----------   reply
                    <-- EOF (worker died) ---------   (SIGKILL, os._exit, segfault...)
                        => kill the rest, sweep shared memory, raise WorkerDiedError

Each worker has two channels: an AF_UNIX socketpair for messages (it has no address, so no
other process can connect; EOF there is how a waiting master sees a death) and a pipe it only
reads: first the group's key, then EOF when the master is gone, so it exits on its own (the
kernel's parent-death signal backs this up; workers are started from the group's spawner
thread, to which that signal is tied).

Here: start-up, one call at a time, death and shutdown. The group's other jobs are its parts
in their own modules: ``messaging`` (send and receive, within deadlines) and ``comm_join``
(the device communicator).
"""
from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from .. import _settings
from .._devices import host as _devices
from .._devices.discovery import open as open_device
from .._wire import protocol as P, ring as _ring, shm as _shm
from .._wire.shm import ATTACHED
from .._wire.waiting import Waiter
from ..comm._mesh import Mesh
from ..comm.nccl import shared_gpu_plan
from ..errors import (
    CallTimeoutError,
    GroupBrokenError,
    ReentrantCallError,
    ShmSpaceError,
    WorkerDiedError,
    WorkerStartError,
)
from . import auth as _auth
from .channel import Channel, frame
from .comm_join import DeviceComms
from .messaging import Messaging
from .spawn import Spawner, worker_command
from .watchdog import Watchdog

_SYNK_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CLOSE_WAIT = 10.0  # seconds a close() from another thread waits for the running call to end


def spin_seconds(size: int, spin_us: float | None = None) -> float:
    """The most a rank polls (then yields) for a message before it sleeps (see
    ``waiting.Waiter``, which polls less when waits are longer or the cores are busy).

    A sleeping process takes tens of microseconds to wake on a message; polling for a short
    while first halves a small call's round trip. Only when every rank has a core of its own.
    """
    if spin_us is None:
        spin_us = 1000.0 if size <= _devices.cpu_count() else 0.0
    return spin_us * 1e-6


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when process ``pid`` exits (Linux >= 5.3), so that a
    death is seen even when the worker's sockets live on in processes it started."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class Group(Messaging, DeviceComms):
    """A running group of ``size`` ranks; rank 0 is this process."""

    remote_hosts: tuple = ()  # under MPI: the hosts other than the master's (mpi_group.py)
    rank = 0  # the master's (a share runs with the group's rank, size, device, mesh...)

    def __init__(self, size: int, *, backend: str = "cpu", device_ids=None,
                 settings: _settings.Settings | None = None,
                 start_timeout: float = 120.0) -> None:
        """``backend``: "cpu" or "cuda"; ``device_ids``: each rank's CUDA device (cuda)."""
        settings = _settings.read() if settings is None else settings
        self.size = size
        self.backend = backend
        self.device_ids = list(device_ids) if device_ids is not None else [None] * size
        self.device = None  # the master's Device (rank 0's), opened and bound in _start
        self.transport = None  # rank 0's device communicator (NCCL), on GPU groups
        self.comm_stale = False  # a failed call may have aborted some ranks' communicators
        # several ranks on one GPU: NCCL takes them from 2.30 on, else the staged transport
        self.shares_gpus = len(set(self.device_ids)) < len(self.device_ids)
        self.comm_kind = "nccl"  # or "staged"
        self.staged_why = ""  # why the ranks that share GPUs do not use NCCL
        self._replies = None  # (poller, socket fds, death fds) over every worker, once made
        self._ringless = False  # some worker has no ring (known once _replies is made)
        self.pid = os.getpid()  # only this process may stop the group (not an os.fork() child)
        self.owner = _shm.Owner()  # the prefix of the group's segments, locked while in use
        self.prefix = self.owner.prefix
        self._spawner = Spawner()
        self.lock = threading.RLock()
        self.procs: dict[int, subprocess.Popen] = {}
        self.channels: dict[int, Channel] = {}
        self.death_fds: dict[int, int | None] = {}  # rank -> pidfd (None where unsupported)
        self._watch_fds: dict[int, int] = {}
        self._key = _auth.new_key()
        self.watchdog: Watchdog | None = None
        self.mesh: Mesh | None = None  # rank 0's ends of the synk.comm socketpairs
        self._spare_socks: list = []  # the workers' ends, closed here once they are started
        self.calls = 0  # numbers the calls (synk.comm keeps messages within their call)
        self.round = 0  # numbers the rounds of requests; every reply names its round
        self.deadline: float | None = None  # of the running call, if it has a timeout
        self.limit: float | None = None  # that timeout in seconds
        self.broken: BaseException | None = None
        self.closed = False
        self._owner: tuple | None = None  # (thread id, what) of the running call
        self.share_running = False  # the master is computing its own share of that call
        self._kill_lock = threading.RLock()
        self.scratch: dict = {}  # key -> _shm.Scratch owned by this group
        self.retired: list[str] = []  # staging blocks replaced since the last call
        self.inline_output_bytes = settings.inline_output_bytes
        self.parallel_reduce_ranks = settings.parallel_reduce_ranks
        self.spin_s = spin_seconds(size, settings.spin_us)
        self.waiter = Waiter(self.spin_s)  # how the caller's thread waits for replies
        self.rings: dict = {}  # rank -> its control ring.Ring (workers on this host)
        self._thread_limit = _devices.MasterThreadLimit(size)
        try:
            self._start(start_timeout)
        except BaseException:
            self.kill()
            raise

    @property
    def workers(self) -> range:
        return range(1, self.size)

    # -- start-up -------------------------------------------------------------------------
    def _start(self, timeout: float) -> None:
        self.device = open_device(self.backend, self.device_ids[0])
        self.device.bind()  # rank 0 runs on the first device, in this thread
        env = _devices.worker_env(self.size)
        if self.backend == "cuda" and self.shares_gpus and self.size > 1:
            extra, self.staged_why = shared_gpu_plan(self.device.xp, self.device_ids)
            if extra is None:
                self.comm_kind = "staged"  # NCCL cannot (or should not) have these ranks
            for var, value in (extra or {}).items():  # the workers' only, never the master's
                env.setdefault(var, value)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SYNK_PARENT, env.get("PYTHONPATH")]))
        ends = self._pair_up()
        peer_fds = {rank: {peer: s.fileno() for peer, s in ends[rank].items()}
                    for rank in self.workers}  # the same numbers in the worker (pass_fds)
        control, mesh_rings = self._make_rings()
        for rank in self.workers:
            self._spawner.call(functools.partial(self._spawn, rank, env, peer_fds[rank]))
        for sock in self._spare_socks:
            sock.close()
        self._spare_socks.clear()
        if self.size > 1:
            self.mesh = Mesh(0, self.size, ends[0], self.spin_s, self.prefix,
                             {peer: mesh_rings.get((0, peer)) for peer in self.workers})
        deadline = time.monotonic() + timeout
        try:
            for rank in self.workers:
                self._authenticate(rank, deadline)
            for rank in self.workers:
                init = P.Init(
                    rank=rank, size=self.size, sys_path=list(sys.path), prefix=self.prefix,
                    inline_output_bytes=self.inline_output_bytes, spin_s=self.spin_s,
                    peers=peer_fds[rank], backend=self.backend,
                    device_id=self.device_ids[rank], ring=control.get(rank),
                    mesh_rings={peer: mesh_rings.get((rank, peer)) for peer in range(self.size)
                                if peer != rank},
                )
                self._send(rank, P.request(P.INIT, init), "while starting", 0, deadline)
            replies = self.recv(self.workers, "while starting", deadline=deadline, rid=0)
        except WorkerDiedError as err:
            raise WorkerStartError(
                f"rank {err.rank} failed to start (exit code {err.exitcode}); "
                "its error output is above"
            ) from err
        except TimeoutError as err:
            raise WorkerStartError(str(err)) from None
        for rank, reply in sorted(replies.items()):
            cause = P.failure(reply, rank)
            if cause is not None:
                raise WorkerStartError(f"rank {rank} failed to start: {cause!r}") from cause
        for rank, name in control.items():  # every worker has mapped its ring by now
            self.rings[rank] = _ring.attach(name, 0, _ring.CONTROL_RING)
            self.channels[rank].use_ring(self.rings[rank])
        self.watchdog = Watchdog(
            self.procs, {r: c.fileno() for r, c in self.channels.items()}, self.death_fds
        )
        if self.backend == "cuda" and self.size > 1:
            self.join_comms(deadline)

    def _authenticate(self, rank: int, deadline: float) -> None:
        during = "while starting"

        def recv() -> bytes:
            return self._recv_one(rank, deadline, during, limit=_auth.MAX_MESSAGE)

        def send(data: bytes) -> None:
            self._write(rank, frame(data), deadline, during)

        try:
            _auth.handshake(send, recv, self._key, first=True)
        except (_auth.AuthenticationError, ValueError) as err:
            raise WorkerStartError(
                f"rank {rank} failed authentication on its control channel ({err}); "
                "it was stopped"
            ) from None

    def _make_rings(self) -> tuple[dict, dict]:
        """Shared-memory rings for small messages: {worker: name} for the control channels
        and {(rank, peer): (name, side)} for synk.comm. Every rank here is on this host.
        With no room in /dev/shm for them, messages take the sockets alone."""
        control, mesh = {}, {}
        try:
            for rank in self.workers:
                control[rank] = _ring.create(self.prefix, f"ring-c{rank}", _ring.CONTROL_RING)
            for i in range(self.size):
                for j in range(i + 1, self.size):
                    name = _ring.create(self.prefix, f"ring-m{i}-{j}", _ring.MESH_RING)
                    mesh[(i, j)], mesh[(j, i)] = (name, 0), (name, 1)
        except ShmSpaceError:
            for name in [*control.values(), *(n for n, side in mesh.values() if side == 0)]:
                _shm.unlink(name)
            return {}, {}
        return control, mesh

    def _pair_up(self) -> dict:
        """A socketpair between every two ranks: {rank: {peer: that rank's socket}}."""
        ends: dict = {rank: {} for rank in range(self.size)}
        for i in range(self.size):
            for j in range(i + 1, self.size):
                ends[i][j], ends[j][i] = socket.socketpair()
                self._spare_socks += [ends[j][i]] + ([ends[i][j]] if i else [])
        return ends

    def _spawn(self, rank: int, env: dict, peer_fds: dict) -> None:
        ours, theirs = socket.socketpair()
        watch_r, watch_w = os.pipe()
        try:
            proc = subprocess.Popen(  # (run in the spawner thread: see spawn.py)
                worker_command(theirs.fileno(), watch_r, os.getpid()),
                pass_fds=(theirs.fileno(), watch_r, *peer_fds.values()),
                env=env,
                stdin=subprocess.DEVNULL,
            )
            self._give_key(watch_w)
        except BaseException:
            ours.close()
            os.close(watch_w)
            raise
        finally:
            theirs.close()
            os.close(watch_r)
        self.procs[rank] = proc
        self.channels[rank] = Channel(ours)
        self.death_fds[rank] = _pidfd(proc.pid)
        self._watch_fds[rank] = watch_w

    def _give_key(self, watch_w: int) -> None:
        os.write(watch_w, self._key)  # 32 bytes: fits the pipe buffer, never blocks

    # -- one call at a time ---------------------------------------------------------------
    @contextlib.contextmanager
    def exclusive(self, what: str):
        """Hold the group for ``what`` (a call, shipping, a collective...), refusing a call
        made from inside the running one (it would take the other's replies or deadlock)."""
        self.hold(what)
        try:
            yield self
        finally:
            self.release()

    def hold(self, what: str) -> None:
        """``exclusive`` without the context manager (the hot path of a call): pair it with
        ``release()`` in a ``finally``."""
        me = threading.get_ident()
        owner = self._owner
        if owner is not None and (owner[0] == me or self.share_running):
            where = ("from inside it (its master share, or code it called)" if owner[0] == me
                     else "from another thread while the master computes its share of it "
                          "(e.g. a thread pool inside the function)")
            raise ReentrantCallError(
                f"{what} was called while {owner[1]} is running on this group, {where}. The "
                "ranks run one call at a time and are busy with that one: call it after "
                f"{owner[1]} returns, or use synk.comm inside the function to talk to the "
                "other ranks. (Calls from several unrelated threads are run one at a time; "
                "they must not overlap the master's share of another call.)"
            )
        self.lock.acquire()
        try:
            self.check_usable()
        except BaseException:
            self.lock.release()
            raise
        self._owner = (me, what)

    def release(self) -> None:
        self._owner = None
        self.share_running = False
        self.lock.release()

    # -- messages -------------------------------------------------------------------------
    def check_usable(self) -> None:
        if self.broken is not None:
            raise GroupBrokenError(
                f"this group of ranks is broken ({self.broken}); call synk.fork() again"
            ) from self.broken
        if self.closed:
            raise GroupBrokenError("this group of ranks was closed; call synk.fork() again")

    def begin_call(self, timeout: float | None) -> None:
        """Start the clock of a call with ``timeout`` seconds (None: no limit), and number
        it."""
        self.calls += 1
        self.limit = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def end_call(self) -> None:
        self.deadline = self.limit = None

    def next_round(self) -> int:
        """Number a new round of requests (their replies are checked against it)."""
        self.round += 1
        return self.round

    def timed_out(self, ranks, during: str) -> CallTimeoutError:
        """Stop the group because ``ranks`` did not finish in time; the error to raise."""
        ranks = sorted(ranks)
        if self.broken is not None:
            return self.broken
        self.broken = CallTimeoutError(
            f"rank(s) {ranks} did not finish {during} within {self.limit:g} s; the group was "
            "stopped. Look for an endless loop or a rank waiting on the others, give the call "
            "a longer timeout, and call synk.fork() to start a new group.", ranks,
        )
        self.kill()
        return self.broken

    def unfinished(self, ranks) -> list:
        """Those of ``ranks`` with no reply (nor EOF) waiting to be read."""
        poller = select.poll()
        fds = {self.channels[r].fileno(): r for r in ranks}
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = set()
        for fd, _ in poller.poll(0):
            channel = self.channels[fds[fd]]
            channel.drain()  # with a ring: wake-ups are not replies
            if channel.ring is None or channel.eof:
                ready.add(fds[fd])
        return [r for r in ranks if r not in ready and not self.channels[r].pending()]

    def died(self, rank: int, during: str):
        if self.broken is not None:  # stopped already (closed, timed out, another death)
            self.kill()
            raise self.broken
        proc = self.procs[rank]
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.broken = WorkerDiedError(rank, code, during)
        self.kill()
        raise self.broken

    # -- shutdown -------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> None:
        """Ask every worker to exit, kill any that linger, and release all resources.

        Called while a call runs (from another thread, or from inside the call itself), it
        stops the group instead: the call raises ``GroupBrokenError``."""
        if self.closed:
            return
        owner = self._owner
        if owner is not None:
            self._stop_running_call(owner)
            return
        if self.broken is None:
            exit_message = (P.RID.pack(self.next_round()), P.request(P.EXIT))
            for rank in self.workers:
                try:
                    self.channels[rank].send(exit_message)
                except OSError:
                    pass
            deadline = time.monotonic() + timeout
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.kill()

    def terminate(self) -> None:
        """Kill the workers and remove the group's segments at once, taking no lock and
        waiting on no thread: for a process about to die (SIGTERM), whose main thread may
        have been interrupted anywhere."""
        for proc in self.procs.values():
            if proc.returncode is None:
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                    os.waitpid(proc.pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
        self.owner.release()

    def _stop_running_call(self, owner: tuple) -> None:
        if self.broken is None:
            self.broken = GroupBrokenError(
                f"the group was closed (synk.close()) while {owner[1]} was running; call "
                "synk.fork() to start a new group"
            )
        for proc in self.procs.values():  # the running call sees the deaths and ends
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
        if owner[0] != threading.get_ident():
            # Let the call end (it sees the deaths at once) before its descriptors close.
            if self.lock.acquire(timeout=_CLOSE_WAIT):
                self.lock.release()
            self.kill()

    def kill(self) -> None:
        """Stop every worker now (SIGKILL), reap them, and release all resources (each
        descriptor once, whichever thread gets here first)."""
        with self._kill_lock:
            if self.closed:
                return
            self.closed = True
            if self.transport is not None:
                self.transport.abort("the group is stopping")
                self.transport = None
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.mesh is not None:
                self.mesh.stop()
            for sock in self._spare_socks:
                sock.close()
            self._spare_socks.clear()
            self._spawner.stop()  # (after any start in progress, so that its worker is in procs)
            for proc in self.procs.values():
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            for proc in self.procs.values():
                proc.wait()
            for channel in self.channels.values():
                channel.close()
            for ring in self.rings.values():
                ring.close()
            self.rings.clear()
            for fd in [*self._watch_fds.values(), *self.death_fds.values()]:
                if fd is not None:
                    os.close(fd)
            self._watch_fds.clear()
            self.death_fds.clear()
            for scratch in self.scratch.values():
                scratch.destroy()
            self.scratch.clear()
            self.owner.release()  # every segment of the group's, then the lock
            ATTACHED.release_all(self.prefix)  # the workers' blocks this master had mapped
            self._thread_limit.restore()
            if self.device is not None:
                self.device.close()
