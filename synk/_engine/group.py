"""The master's side of a group: start the workers, talk to them, watch them, stop them
(the exchange with a worker: the package's docstring)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
from collections.abc import Callable

from .. import _settings
from .._call.across_hosts import ONE_HOST
from .._call.collect import GroupBlocks, MasterOutputs
from .._call.master import Outstanding
from .._call.mpi_collect import MpiOutputs
from .._call.share import RankEnv
from .._devices import discovery, host_threads as _devices
from .._interrupts import Interrupted
from .._wire import protocol as P, shm as _shm
from .._wire.shm import ATTACHED
from .._wire.waiting import Waiter
from ..errors import GroupBrokenError, ReentrantCallError
from . import auth as _auth
from .clock import CallClock
from .comm_join import DeviceComms
from .health import Health
from .launch import GroupSpec, Started
from .local_launch import LocalLaunch
from .messaging import Messaging
from .settler import Settler
from .watchdog import Watchdog
from .whereabouts import Reporter, Whereabouts
from .workers import Workers

_CLOSE_WAIT = 10.0  # seconds a close() from another thread waits for the running call to end


def spin_seconds(size: int, spin_us: float | None) -> float:
    """The most a rank polls (then yields) for a message before it sleeps (``waiting.Waiter``).
    Waking takes tens of microseconds, so a short poll halves a small call's round trip; only
    when every rank has a core of its own."""
    if spin_us is None:
        spin_us = 1000.0 if size <= _devices.cpu_count() else 0.0
    return spin_us * 1e-6


class Group:
    """A running group of ``size`` ranks; rank 0 is this process. It is the ``_call.port.Port``
    its calls run through, made of parts with one job each::

        launch      how the workers start, die and stop (``local_launch``, ``mpi_launch``);
                    ``start`` fills the ``Workers`` and returns ``launch.Started``
        processes   the workers' processes, control channels, death descriptors and rings
        clock       the calls' numbers, their deadlines, the rounds of requests
        health      broken or closed: the one way to fail or stop the group
        messaging   requests out and replies back within the deadline
        comms       the device communicator (GPU groups)
        blocks      shared-memory blocks that calls reuse
        watchdog    interrupts the master's own share on a death or the deadline
    """

    rank = 0  # the master's
    generation = 0  # which of this process's groups it is (set by fork())
    lineage = 0  # the generation of the group fork() started, which this one replaces
    restarts_left = 0  # how many more times it may be replaced when a rank dies
    replacement: Callable[[], Group] | None = None  # starts the group that replaces it

    def __init__(self, size: int, *, backend: str, device_ids=None,
                 settings: _settings.Settings, start_timeout: float, launch=None,
                 seed: int | None) -> None:
        """``backend``: "cpu" or "cuda"; ``device_ids``: each rank's CUDA device (cuda);
        ``launch``: how the workers start, die and stop (default: ``LocalLaunch``, this
        host's children; ``mpi_launch.MpiLaunch``: an MPI job's processes); ``seed``: the
        workers' generators seeded from it (``_arrays.seeds``; the master seeds its own)."""
        self.launch = LocalLaunch() if launch is None else launch
        self.size, self.backend = size, backend
        self.pid = os.getpid()  # only this process may stop the group (not an os.fork() child)
        self.owner = _shm.Owner()  # the prefix of the group's segments, locked while in use
        self.prefix = self.owner.prefix
        self.key = _auth.new_key()
        self.lock = threading.RLock()
        self._owner: tuple | None = None  # (thread id, what) of the running call
        self.share_running = False  # the master is computing its own share of that call
        self._kill_at_release = False  # closed from inside the running call: torn down when
        # the call lets go of the group (its frames still hold views of the group's memory)
        self.clock = CallClock()
        self._outstanding = Outstanding()  # submitted calls whose replies are unread
        self.settler = Settler(self)  # completes their futures as the replies arrive
        self._outstanding.added = self.settler.poke
        self.processes = Workers()
        self.blocks = GroupBlocks(self.prefix)
        self.health = Health(self._teardown, self._death, self._unfinished, self.clock)
        spin_s = spin_seconds(size, settings.spin_us)
        self.messaging = Messaging(size, self.processes, self.clock, self.health,
                                   Waiter(spin_s))
        self.inline_output_bytes = settings.inline_output_bytes
        self.framework_settings: tuple = ()  # the master's JAX and torch settings that its
        # workers were last given (``_call.shipping.send_settings``): none, at first
        self.parallel_reduce_ranks = settings.parallel_reduce_ranks
        self.watchdog: Watchdog | None = None
        self.started: Started | None = None
        self.comms: DeviceComms | None = None
        self._outputs: MasterOutputs | MpiOutputs | None = None
        self._env: RankEnv | None = None  # where rank 0's share runs, once made
        self._ready = False  # every rank started (and joined its device communicator)
        self.whereabouts: Whereabouts | None = None  # the ranks' places in their calls
        self.reporter: Reporter | None = None  # names the ranks a call waits for
        try:
            if size > 1:
                self.whereabouts = Whereabouts(self.prefix, size)
        except BaseException:
            self.owner.release()
            raise
        spec = GroupSpec(size, backend, list(device_ids) if device_ids is not None
                         else [None] * size, self.prefix, self.key, self.inline_output_bytes,
                         spin_s, seed, None if self.whereabouts is None else self.whereabouts.name)
        try:
            started = self.started = self.launch.start(spec, self.processes, self.messaging,
                                                       start_timeout)
            if started.parallel_reduce_ranks is not None:
                self.parallel_reduce_ranks = started.parallel_reduce_ranks
            self.messaging.waiter = Waiter(started.spin_s)
            self._outputs = started.outputs or MasterOutputs(
                self.blocks, size, self.parallel_reduce_ranks, self.inline_output_bytes)
            w = self.processes
            self.watchdog = Watchdog(w.procs, {r: c.fileno() for r, c in w.channels.items()},
                                     w.death_fds, self._stuck)
            self.comms = DeviceComms(size, started.device, self.prefix, started.comm_kind,
                                     started.staged_why, started.shares_gpus,
                                     started.nccl_env, self.messaging, self.clock,
                                     self.health, w.exited, self._mesh_stop)
            if backend == "cuda" and size > 1:
                self.comms.join(started.deadline)
            if self.whereabouts is not None:
                self.health.explain = self.whereabouts.timeout_report
                limit = _settings.stuck_report()
                if limit > 0:
                    self.reporter = Reporter(self.whereabouts, limit, self._running)
        except BaseException as err:
            self.health.kill()
            self.launch.failed_to_start(err)
            raise
        self._ready = True

    # -- what it started ------------------------------------------------------------------
    @property
    def workers(self) -> range:
        return range(1, self.size)

    @property
    def device(self):
        """Rank 0's device."""
        return None if self.started is None else self.started.device

    @property
    def mesh(self):
        """Rank 0's end of the synk.comm mesh (None: one rank)."""
        return None if self.started is None else self.started.mesh

    @property
    def device_ids(self) -> list:
        assert self.started is not None
        return self.started.device_ids

    @property
    def shares_gpus(self) -> bool:
        assert self.started is not None
        return self.started.shares_gpus

    @property
    def hosts(self):
        """Steps of a call across hosts (``_call.across_hosts``), or ``ONE_HOST``."""
        return ONE_HOST if self.started is None else self.started.across

    @property
    def broken(self) -> BaseException | None:
        return self.health.broken

    @property
    def closed(self) -> bool:
        return self.health.closed

    def env(self) -> RankEnv:
        """Where rank 0's share of a call runs."""
        started = self.started
        assert started is not None and self.comms is not None
        env, device_comm = self._env, self.comms.device_comm
        if env is None or env.device_comm is not device_comm:  # (made anew: ``refresh``)
            env = self._env = RankEnv(0, self.size, started.device, started.mesh,
                                      device_comm, self._outputs)
        return env

    def describe(self) -> str:
        """One line: the backend, the ranks and devices (``synk.backend()``)."""
        if self.backend != "cuda":
            return f"backend 'cpu': running on {self.size} CPU rank(s)"
        sim = discovery.simulated(getattr(self.device, "xp", None))
        line = (f"backend 'gpu': running on {'simulated ' if sim else ''}CUDA devices "
                f"{self.device_ids}")
        if sim:
            line += " (the CUDA simulator, SYNK_SIMULATE_GPUS: no GPU is used)"
        if self.shares_gpus:
            gpus = len(set(self.device_ids))
            comms = self.comms
            assert comms is not None
            line += (f" ({self.size} ranks on {gpus} GPU(s); " + (
                "NCCL with NCCL_MULTI_RANK_GPU_ENABLE" if comms.kind == "nccl" else
                f"device arrays staged through host memory: {comms.staged_why}") + ")")
        return line

    # -- messages (the Port's) ------------------------------------------------------------
    def send(self, ranks, payload: bytes, during: str, rid: int | None = None) -> None:
        self.messaging.send(ranks, payload, during, rid)

    def recv(self, ranks, during: str, deadline: float | None = None,
             rid: int | None = None) -> dict:
        if rid is None and self._outstanding:  # (their replies come first: read them)
            self._outstanding.settle()
        return self.messaging.recv(ranks, during, deadline, rid)

    def check_alive(self, during: str) -> None:
        """Raise ``WorkerDiedError`` (the group broken) where a worker was seen dying: a
        message to it would go unnoticed into its ring."""
        dead = [] if self.watchdog is None else self.watchdog.dead()
        if dead:
            self.health.died(dead[0], during)

    def watched(self, work: Callable[[], None], blocking: bool = False) -> tuple | None:
        """Run ``work`` (rank 0's share, which catches its own errors) under the watchdog;
        why it was interrupted (("died", rank) or ("timeout",)), or None. ``blocking``:
        ``work`` waits inside MPI, which an interrupt cannot cut short: a death or the
        deadline then ends the job at once (``launch.stuck``)."""
        watchdog = self.watchdog
        assert watchdog is not None
        try:
            try:
                if watchdog.enter(self.clock.deadline, blocking) is None:
                    self.share_running = True
                    work()
            finally:
                self.share_running = False
                reason = watchdog.leave()
        except Interrupted:
            reason = watchdog.leave()
        return reason

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

    def hold(self, what: str, settle: bool = True) -> None:
        """``exclusive`` without the context manager (a call's hot path): pair with ``release()`` in
        a ``finally``. Remakes device communicators a failed call may have aborted; settles the
        outstanding submitted calls first, unless ``settle=False`` (another submit)."""
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
            self.health.check_usable()
            self.check_alive(f"before {what}")  # (a death the next message would miss)
            self._owner = (me, what)
            if self._outstanding and (settle or self.health.comms_stale):  # (the ranks'
                self._outstanding.settle()  # communicators are made anew after them)
                self.health.check_usable()
            if self.comms is not None:
                self.comms.refresh()
        except BaseException:
            self._owner = None
            self.lock.release()
            self._outstanding.deliver()  # (what the settling gave, failed or not)
            raise

    def outstanding(self) -> Outstanding:
        """The submitted calls whose replies are still to be read."""
        return self._outstanding

    def settle(self) -> None:
        """Read the replies of every outstanding submitted call (with the group held)."""
        self._outstanding.settle()

    def release(self) -> None:
        self._owner = None
        self.share_running = False
        self.lock.release()
        if self._kill_at_release:
            self.health.kill()
        self._outstanding.deliver()  # (the futures' callbacks run with the group let go)

    # -- the settler's (``settler``) --------------------------------------------------------
    def reply_fds(self) -> list:
        return self.messaging.reply_fds()

    def oldest_outstanding(self):
        """The oldest submitted call whose replies are unread, or None."""
        calls = self._outstanding.calls
        try:
            return calls[0]
        except IndexError:
            return None

    def may_have_arrived(self, call) -> bool:
        """Whether ``call``'s replies may be in, a worker may have died, or its deadline
        passed (a look that takes no lock)."""
        deadline = call.deadline[1] if call.deadline else None
        if deadline is not None and time.monotonic() >= deadline:
            return True
        return self.messaging.may_have_replied(self.workers)

    def settle_arrived(self, stopping: Callable[[], bool]) -> None:
        """With the group held (waiting for it while not ``stopping()``): settle the
        outstanding calls whose replies are in or whose deadline passed, oldest first."""
        while not self.lock.acquire(timeout=0.05):
            if stopping():
                return
        try:
            if self.health.closed or self.health.broken is not None:
                return
            self._owner = (threading.get_ident(), "reading the replies of submitted calls")
            with self._scope():
                self._outstanding.settle(ready=self._replied)
        except Exception:  # (the group broke: every future has its error)
            pass
        finally:
            self._owner = None
            self.lock.release()
            self._outstanding.deliver()

    def _replied(self, call) -> bool:
        deadline = call.deadline[1] if call.deadline else None
        return (deadline is not None and time.monotonic() >= deadline) or \
            self.messaging.replied(self.workers)

    def _scope(self):
        """Rank 0's device current in this thread (GPU groups), for its outputs."""
        device = self.device
        return contextlib.nullcontext() if device is None else device.scope()

    # -- start-up (for the launch) --------------------------------------------------------
    def _death(self, rank: int, during: str) -> BaseException:
        return self.launch.death(self.processes, rank, during)

    def _stuck(self, reason: tuple) -> None:
        """The watchdog's word that rank 0 waits inside MPI for a rank that died, or past
        the deadline (see ``watched``)."""
        self.launch.stuck(self.processes, reason, self.clock.limit)

    def _running(self) -> str:
        """What the running call is, in words (for the stuck-rank report)."""
        owner = self._owner
        return "no call" if owner is None else owner[1]

    def _unfinished(self, ranks) -> list:
        return self.messaging.unfinished(ranks)

    def _mesh_stop(self, number: int = 0) -> str | None:
        mesh = self.mesh
        return None if mesh is None else mesh.stop_reason(number)

    # -- shutdown -------------------------------------------------------------------------
    def close(self, timeout: float = 5.0) -> bool:
        """Ask every worker to exit, kill any that linger, and release all resources. Called while a
        call runs (from another thread or inside it) it stops the group: the call raises
        ``GroupBrokenError``. Returns True when called from inside the call: the group is released
        when the call lets go of it (``release``), not now."""
        if self.health.closed:
            return False
        owner = self._owner
        if owner is not None:
            return self._stop_running_call(owner)
        if self._outstanding and self.health.broken is None:
            try:  # the submitted calls end as a blocking one would have: their replies read
                with self.exclusive("synk.close()"):
                    pass
            except Exception:  # (each future has its error)
                pass
        if self.health.broken is None:
            exit_message = (P.RID.pack(self.clock.next_round()), P.request(P.EXIT))
            for channel in self.processes.channels.values():
                try:
                    channel.send(exit_message)
                except OSError:
                    pass
            deadline = time.monotonic() + timeout
            for proc in self.processes.procs.values():
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.health.kill()
        return False

    def terminate(self) -> None:
        """Kill the workers and remove the group's segments at once, taking no lock and
        waiting on no thread: for a process about to die (SIGTERM), whose main thread may
        have been interrupted anywhere."""
        self.launch.terminate(self.processes, self.owner)

    def _stop_running_call(self, owner: tuple) -> bool:
        """Break the group under the running call; True: called from inside it."""
        self.health.mark_broken(GroupBrokenError(
            f"the group was closed (synk.close()) while {owner[1]} was running; call "
            "synk.fork() to start a new group"))
        self.processes.kill()  # the running call sees the deaths and ends
        if owner[0] == threading.get_ident():
            self._kill_at_release = True
            return True
        # Let the call end (it sees the deaths at once) before its descriptors close.
        if self.lock.acquire(timeout=_CLOSE_WAIT):
            self.lock.release()
        self.health.kill()
        return False

    def _teardown(self) -> None:
        """Stop every worker now (SIGKILL), reap them, and release all resources (run once,
        by ``health.kill``)."""
        clean = self.launch.stopping(self.processes, self._ready, self.health.broken,
                                     self.mesh)
        self.settler.stop()
        self._outstanding.fail_all(self.health.broken or GroupBrokenError(
            "the group was closed before this submitted call's replies were read"))
        if self.comms is not None:
            self.comms.abort("the group is stopping")
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.reporter is not None:
            self.reporter.stop()
        if self.whereabouts is not None:
            self.whereabouts.close()
        mesh = self.mesh
        if mesh is not None:
            mesh.stop()
        self.processes.reap()
        self.launch.release()
        self.blocks.destroy()
        self.owner.release()  # every segment of the group's, then the lock
        ATTACHED.release_all(self.prefix)  # the workers' blocks this master had mapped
        if self.started is not None:
            self.started.thread_limit.restore()
            if self.started.device is not None:
                self.started.device.close()
        self.launch.stopped(self._ready, self.health.broken, clean)

