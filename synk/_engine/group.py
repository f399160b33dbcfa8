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
from .._devices.discovery import open as open_device, use_group_prefix
from .._wire import protocol as P, ring as _ring, shm as _shm
from .._wire.shm import ATTACHED
from .._wire.waiting import Waiter
from ..comm._mesh import CommError, Mesh
from ..comm.nccl import CommInitError, CommInitTimeout, shared_gpu_plan
from ..comm.transports import communicator_class
from ..errors import (
    CallTimeoutError,
    GroupBrokenError,
    ReentrantCallError,
    RemoteError,
    ShmSpaceError,
    WorkerDiedError,
    WorkerStartError,
)
from . import auth as _auth
from .channel import Channel, frame
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


class Group:
    """A running group of ``size`` ranks; rank 0 is this process."""

    remote_hosts: tuple = ()  # under MPI: the hosts other than the master's (mpi_group.py)

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

    # -- the device communicator (NCCL on GPU groups) -------------------------------------
    def join_comms(self, deadline: float | None = None) -> None:
        """Make a fresh device communicator on every rank (replacing the old one): NCCL,
        for which rank 0 makes the id and sends it over the control channel; or, when ranks
        share a GPU and NCCL cannot have them (``comm_kind``), the transport that stages
        device arrays through the host. Every rank joins by ``deadline``, or the group is
        stopped with ``WorkerStartError``."""
        deadline = time.monotonic() + 120.0 if deadline is None else deadline
        old, self.transport = self.transport, None
        if old is not None:
            old.abort("replaced")
        if self.comm_kind == "nccl":
            use_group_prefix(self.prefix)  # the simulator's segments: swept with the group's
            if not self._join(("nccl", communicator_class("nccl").new_id(self.device)), deadline):
                return
            self.comm_kind = "staged"  # NCCL refused ranks that share a GPU
            self.staged_why = "NCCL refused ranks that share a GPU"
        self._join(("staged",), deadline)

    def _join(self, how: tuple, deadline: float) -> bool:
        """Every rank makes the communicator ``how``; True if NCCL refused ranks that share
        a GPU (then none is kept, and the caller falls back)."""
        during = f"while joining the device communicator ({how[0]})"
        refusable = how[0] == "nccl" and self.shares_gpus
        rid = self.next_round()
        payload = P.request(P.COMM, how, max(1.0, deadline - time.monotonic()))
        mine = None
        try:
            self.send(self.workers, payload, during, rid)
            try:
                self.transport = self._make_transport(how, deadline)
            except CommInitError as err:
                if not refusable or isinstance(err, CommInitTimeout):
                    raise
                mine = err  # the workers' replies are read all the same
            replies = self.recv(self.workers, during, deadline=deadline, rid=rid)
        except (WorkerDiedError, TimeoutError, CommError) as err:
            self.broken = WorkerStartError(f"the ranks could not join their device "
                                           f"communicator ({how[0]}): {err}")
            self.kill()
            raise self.broken from err
        failed = {rank: cause for rank, reply in sorted(replies.items())
                  if (cause := P.failure(reply, rank)) is not None}
        if refusable and (mine is not None or failed) and all(
                isinstance(e, CommInitError) and not isinstance(e, CommInitTimeout)
                for e in failed.values()):
            if self.transport is not None:
                self.transport.abort("NCCL refused ranks that share a GPU")
                self.transport = None
            return True
        for rank, cause in failed.items():
            self.broken = WorkerStartError(
                f"rank {rank} could not join the device communicator ({how[0]}): {cause}")
            self.kill()
            raise self.broken from cause
        self.comm_stale = False
        return False

    def _make_transport(self, how: tuple, deadline: float):
        return communicator_class(how[0]).join(self.device, how, self.size, 0,
                                               deadline=deadline,
                                               should_stop=self._comm_stop_reason,
                                               setup_stop=self._worker_exit)

    def _worker_exit(self) -> str | None:
        """Why rank 0's device communicator should give up its set-up: a worker exited."""
        for rank, proc in self.procs.items():
            if proc.poll() is not None:
                return f"rank {rank} exited"
        return None

    def _comm_stop_reason(self) -> str | None:
        """Why rank 0's device communicator should give up a wait: a worker died, or a rank
        of the running call failed."""
        return self._worker_exit() or (None if self.mesh is None else self.mesh.stop_reason())

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

    def send(self, ranks, payload: bytes, during: str, rid: int | None = None) -> None:
        """Send ``payload`` (a pickled request) to each of ``ranks`` as request ``rid``
        (default: the current round), within the call's deadline."""
        parts = (P.RID.pack(self.round if rid is None else rid), payload)
        left = {}
        for rank in ranks:
            rest = self._send_now(rank, parts, during, self.deadline)
            if rest:
                left[rank] = rest
        if left:
            self._flush(left, self.deadline, during)

    def _send(self, rank: int, payload: bytes, during: str, rid: int | None = None,
              deadline: float | None = None) -> None:
        rid = self.round if rid is None else rid
        deadline = self.deadline if deadline is None else deadline
        rest = self._send_now(rank, (P.RID.pack(rid), payload), during, deadline)
        if rest:
            self._flush({rank: rest}, deadline, during)

    def _send_now(self, rank: int, parts, during: str, deadline: float | None) -> list:
        """Send a message through the rank's ring or socket; what is left to write on the
        socket. A full ring (a worker not reading) is waited on until ``deadline``."""
        channel = self.channels[rank]
        while True:
            try:
                rest = channel.send(parts)
            except OSError:  # it exited (BrokenPipeError, ConnectionResetError), or was closed
                self.died(rank, during)
            if rest is not None:
                return rest
            poller, _, deaths = self._poller([rank], 0)
            if deadline is not None and time.monotonic() >= deadline:
                self._late([rank], during)
            if poller.poll(1):
                self.died(rank, during)

    def _write(self, rank: int, buffers: list, deadline: float | None, during: str) -> None:
        rest = self._write_now(rank, buffers, during)
        if rest:
            self._flush({rank: rest}, deadline, during)

    def _write_now(self, rank: int, buffers: list, during: str) -> list:
        try:
            return self.channels[rank].write(buffers)
        except OSError:  # it exited (BrokenPipeError, ConnectionResetError), or was closed
            self.died(rank, during)

    def _flush(self, left: dict, deadline: float | None, during: str) -> None:
        """Push the rest of messages to ranks that are not reading (yet), waiting on their
        sockets, their deaths and ``deadline`` together."""
        poller, socks, deaths = self._poller(left, select.POLLOUT)
        while left:
            timeout = None if deadline is None else deadline - time.monotonic()
            events = poller.poll(None if timeout is None else max(0.0, timeout) * 1000)
            if not events:
                self._late(left, during)
            for fd, _ in events:
                if fd in deaths:
                    self.died(deaths[fd], during)
                rank = socks[fd]
                left[rank] = self._write_now(rank, left[rank], during)
                if not left[rank]:
                    del left[rank]
                    self._forget(poller, rank)

    def _poller(self, ranks, events: int):
        """A poller over the sockets of ``ranks`` (for ``events``) and their deaths."""
        poller, socks, deaths = select.poll(), {}, {}
        for rank in ranks:
            fd = self.channels[rank].fileno()
            socks[fd] = rank
            poller.register(fd, events)  # a death shows as POLLHUP too, unless inherited
            death = self.death_fds.get(rank)
            if death is not None:
                deaths[death] = rank
                poller.register(death, select.POLLIN)
        return poller, socks, deaths

    def _forget(self, poller, rank: int) -> None:
        poller.unregister(self.channels[rank].fileno())
        death = self.death_fds.get(rank)
        if death is not None:
            poller.unregister(death)

    def _late(self, ranks, during: str):
        if self.limit is None:  # only start-up waits without a call's timeout
            self.kill()
            raise TimeoutError(f"ranks {sorted(ranks)} did not answer {during}")
        raise self.timed_out(ranks, during)

    def _read(self, rank: int, during: str, limit: int | None = None) -> bytes | None:
        try:
            return self.channels[rank].read(limit)
        except (EOFError, OSError):
            self.died(rank, during)

    def _recv_one(self, rank: int, deadline: float, during: str, limit: int | None) -> bytes:
        """The next raw message from ``rank``, waiting until ``deadline``."""
        poller, _, deaths = self._poller([rank], select.POLLIN)
        while True:
            message = self._read(rank, during, limit)
            if message is not None:
                return message
            events = poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
            if not events:
                self._late([rank], during)
            if any(fd in deaths for fd, _ in events):
                message = self._read(rank, during, limit)
                if message is None:
                    self.died(rank, during)
                return message

    def _receive(self, rank: int, during: str) -> bytes | None:
        try:
            return self.channels[rank].receive()
        except (EOFError, OSError):
            self.died(rank, during)

    def recv(self, ranks, during: str, deadline: float | None = None,
             rid: int | None = None) -> dict:
        """One reply from each of ``ranks`` to request ``rid`` (default: the current round),
        waiting on all of them and on every worker's death until ``deadline`` (default: the
        running call's). Every reply is read before any is unpickled, so one that cannot be
        unpickled leaves none unread."""
        deadline = self.deadline if deadline is None else deadline
        rid = self.round if rid is None else rid
        left = set(ranks)
        channels = self.channels
        raw = {}
        for rank in ranks:  # replies already in
            message = self._receive(rank, during)
            if message is not None:
                raw[rank] = message
                left.discard(rank)
        if not left:
            return self._unpickle(raw, rid, during)
        poller, socks, deaths = self._replies or self._reply_poller()
        ringless = self._ringless
        lanes = [channels[r].ring.inbox for r in left if channels[r].ring is not None]
        if len(lanes) == 1 and not ringless:
            ready = lanes[0].pending  # (the usual case on 2 ranks: one look, no loop)
        else:
            def ready() -> bool:
                return any(channels[r].pending() for r in left) or (
                    ringless and bool(poller.poll(0)))

        start = time.perf_counter()
        while left:
            if self.waiter.poll(ready):
                for rank in [r for r in left if channels[r].pending()]:  # ring replies
                    message = self._receive(rank, during)
                    if message is not None:
                        raw[rank] = message
                        left.discard(rank)
                if not ringless:
                    continue
                events = poller.poll(0)
            else:
                events = self._sleep(left, poller, deadline, during, start)
            for fd, polled in events:
                rank = socks.get(fd)
                if rank is None:  # a worker exited: with its reply sent, or not
                    rank = deaths[fd]
                    channels[rank].drain()
                    message = self._receive(rank, during) if rank in left else None
                    if message is None:
                        self.died(rank, during)
                else:
                    if polled:  # (0: a message in its ring)
                        channels[rank].drain()
                    message = self._receive(rank, during)
                    if message is None:
                        continue
                if rank not in left:  # nobody asked it: the ranks are out of step
                    raw[rank] = message
                    continue
                raw[rank] = message
                left.discard(rank)
        return self._unpickle(raw, rid, during)

    def _sleep(self, left: set, poller, deadline: float | None, during: str,
               start: float) -> list:
        """Sleep until a reply, a socket event or a death, telling the ranks' rings that a
        wake-up is needed; the events (the rings' as their sockets'). Raises past
        ``deadline``."""
        lanes = [self.channels[r].ring.inbox for r in left if self.channels[r].ring is not None]
        for lane in lanes:
            lane.set_sleeping(True)
        try:
            while True:
                ready = [(self.channels[r].fileno(), 0) for r in left
                         if self.channels[r].pending()]
                if ready:
                    return ready
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    self._late(left, during)
                wait = _ring.SLEEP_SLICE if lanes else timeout
                if timeout is not None and wait is not None:
                    wait = min(wait, timeout)
                events = poller.poll(None if wait is None else max(0.0, wait) * 1000)
                if events:
                    self.waiter.slept(time.perf_counter() - start)
                    return events
        finally:
            if not self.closed:  # (a stop on the way unmapped the rings)
                for lane in lanes:
                    lane.set_sleeping(False)

    def _reply_poller(self):
        """One poller over every worker's socket and death, made once per group."""
        self._replies = self._poller(self.workers, select.POLLIN)
        self._ringless = any(self.channels[r].ring is None for r in self.workers)
        return self._replies

    def _unpickle(self, raw: dict, rid: int, during: str) -> dict:
        replies, failed, stray = {}, [], {}
        for rank, message in raw.items():
            got = P.rid_of(message)
            if got != rid:
                stray[rank] = got
                continue
            try:
                replies[rank] = P.read(message)
            except Exception as err:
                failed.append((rank, err))
        if stray:
            self.broken = GroupBrokenError(
                f"ranks answered the wrong requests {during} ({stray} instead of {rid}); the "
                "ranks were out of step with the master and were stopped. Call synk.fork() "
                "to start a new group."
            )
            self.kill()
            raise self.broken
        if failed:
            failed.sort()
            listing = "; ".join(f"rank {r}: {err!r}" for r, err in failed)
            raise RemoteError(
                f"the master could not unpickle the reply of rank(s) {[r for r, _ in failed]} "
                f"{during} ({listing}). Every rank's reply was read, so the group is still "
                "usable. Return numpy arrays or plain Python values, or objects whose class "
                "the master can import and rebuild."
            ) from failed[0][1]
        return replies

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
