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
import os
import select
import subprocess
import threading
import time

from .. import _settings
from .._call import collect as _collect
from .._devices import host as _devices
from .._wire import protocol as P, shm as _shm
from .._wire.shm import ATTACHED
from .._wire.waiting import Waiter
from ..comm._mesh import Mesh
from ..errors import (
    CallTimeoutError,
    GroupBrokenError,
    ReentrantCallError,
    WorkerDiedError,
    WorkerStartError,
)
from . import auth as _auth, interrupts as _interrupts
from .channel import Channel
from .comm_join import DeviceComms
from .local_launch import LocalLaunch
from .messaging import Messaging
from .watchdog import Watchdog

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


class Group(Messaging, DeviceComms):
    """A running group of ``size`` ranks; rank 0 is this process."""

    remote_hosts: tuple = ()  # under MPI: the hosts other than the master's (mpi_launch.py)
    hosts = None  # under MPI: where every rank runs (hosts.Hosts)
    rank = 0  # the master's (a share runs with the group's rank, size, device, mesh...)
    generation = 0  # which of this process's groups it is (set by fork())

    def __init__(self, size: int, *, backend: str = "cpu", device_ids=None,
                 settings: _settings.Settings | None = None,
                 start_timeout: float = 120.0, launch=None) -> None:
        """``backend``: "cpu" or "cuda"; ``device_ids``: each rank's CUDA device (cuda);
        ``launch``: how the workers start, die and stop (default: ``LocalLaunch``, this
        host's children; ``mpi_launch.MpiLaunch``: an MPI job's processes)."""
        settings = _settings.read() if settings is None else settings
        self.launch = LocalLaunch() if launch is None else launch
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
        self.lock = threading.RLock()
        self.procs: dict[int, subprocess.Popen] = {}
        self.channels: dict[int, Channel] = {}
        self.death_fds: dict[int, int | None] = {}  # rank -> pidfd (None where unsupported)
        self.key = _auth.new_key()
        self.watchdog: Watchdog | None = None
        self.mesh: Mesh | None = None  # rank 0's ends of the synk.comm socketpairs
        self.calls = 0  # numbers the calls (synk.comm keeps messages within their call)
        self.round = 0  # numbers the rounds of requests; every reply names its round
        self.deadline: float | None = None  # of the running call, if it has a timeout
        self.limit: float | None = None  # that timeout in seconds
        self.broken: BaseException | None = None
        self.closed = False
        self._owner: tuple | None = None  # (thread id, what) of the running call
        self.share_running = False  # the master is computing its own share of that call
        self._kill_lock = threading.RLock()
        self.scratch: dict = {}  # key -> per-group call state (a Staging...): destroy()ed
        self.retired: list[str] = []  # staging blocks replaced since the last call
        self.inline_output_bytes = settings.inline_output_bytes
        self.parallel_reduce_ranks = settings.parallel_reduce_ranks
        self.spin_s = spin_seconds(size, settings.spin_us)
        self.waiter = Waiter(self.spin_s)  # how the caller's thread waits for replies
        self.rings: dict = {}  # rank -> its control ring.Ring (workers on this host)
        self.thread_limit = _devices.MasterThreadLimit(size)
        self.started = False
        try:
            deadline = self.launch.start(self, start_timeout)
            self.watchdog = Watchdog(
                self.procs, {r: c.fileno() for r, c in self.channels.items()}, self.death_fds
            )
            if self.backend == "cuda" and self.size > 1:
                self.join_comms(deadline)
        except BaseException as err:
            self.kill()
            self.launch.failed_to_start(self, err)
            raise
        self.started = True

    @property
    def workers(self) -> range:
        return range(1, self.size)

    # -- start-up -------------------------------------------------------------------------
    @contextlib.contextmanager
    def starting(self, who):
        """A worker's death or a timeout while starting as a ``WorkerStartError`` naming
        the rank (``who(rank)``)."""
        try:
            yield
        except WorkerDiedError as err:
            code = "" if err.exitcode is None else f" (exit code {err.exitcode})"
            raise WorkerStartError(
                f"{who(err.rank)} failed to start{code}; its error output is above"
            ) from err
        except TimeoutError as err:
            raise WorkerStartError(str(err)) from None

    def start_workers(self, inits: dict, deadline: float, who) -> None:
        """Send each worker its ``Init`` ({rank: Init}) and wait for every one to be ready;
        a failure is a ``WorkerStartError`` naming the rank (``who(rank)``)."""
        with self.starting(who):
            for rank, init in inits.items():
                self._send(rank, P.request(P.INIT, init), "while starting", 0, deadline)
            replies = self.recv(self.workers, "while starting", deadline=deadline, rid=0)
        for rank, reply in sorted(replies.items()):
            cause = P.failure(reply, rank)
            if cause is not None:
                raise WorkerStartError(f"{who(rank)} failed to start: {cause!r}") from cause

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

    def export_outputs(self, share, reduce, fname: str):
        """Rank 0's ``share``, its large outputs moved into shared memory while the workers
        do the same with theirs, when the parallel combining needs them there
        (``outputs.finish``)."""
        return _collect.export_master(self, fname, reduce, share)

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
        if self.broken is None:  # else stopped already (closed, timed out, another death)
            self.broken = self.launch.death(self, rank, during)
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
        self.launch.terminate(self)

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
        with self._kill_lock, _interrupts.deferred():  # (stopped half way, nothing would
            if self.closed:  # release the rest: a later kill() finds the group closed)
                return
            clean = self.launch.stopping(self)
            self.closed = True
            if self.transport is not None:
                self.transport.abort("the group is stopping")
                self.transport = None
            if self.watchdog is not None:
                self.watchdog.stop()
            if self.mesh is not None:
                self.mesh.stop()
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
            self.launch.release(self)
            for fd in self.death_fds.values():
                if fd is not None:
                    os.close(fd)
            self.death_fds.clear()
            for scratch in self.scratch.values():
                scratch.destroy()
            self.scratch.clear()
            self.owner.release()  # every segment of the group's, then the lock
            ATTACHED.release_all(self.prefix)  # the workers' blocks this master had mapped
            self.thread_limit.restore()
            if self.device is not None:
                self.device.close()
        self.launch.stopped(self, clean)
