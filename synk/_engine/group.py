"""The master's side of a group: start the workers, talk to them, watch them, stop them.

::

    master (rank 0)                                   worker rank r  (python -m synk._engine.worker)
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
kernel's parent-death signal backs this up).
"""
from __future__ import annotations

import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

from .. import devices as _devices
from .._call import collect as _collect
from ..comm._mesh import Mesh
from ..errors import (
    CallTimeoutError,
    GroupBrokenError,
    WorkerDiedError,
    WorkerStartError,
    unpack_exception,
)
from . import auth as _auth, protocol as P, shm as _shm
from .shm import ATTACHED
from .watchdog import Watchdog

_SYNK_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_INLINE_OUTPUT_BYTES = 256 << 10  # measured: below it, pickling in the reply is faster


def spin_seconds(size: int) -> float:
    """How long a rank busy-polls for a message before it sleeps.

    A sleeping process takes tens of microseconds to wake on a message; polling for a short
    while first halves a small call's round trip. Only when every rank has a core of its own.
    """
    default = 200.0 if size <= _devices.cpu_count() else 0.0
    return float(os.environ.get("SYNK_SPIN_US", default)) * 1e-6


def poll(poller: select.poll, spin_s: float, timeout: float | None) -> list:
    """Events of ``poller``: busy-poll for up to ``spin_s``, then sleep up to ``timeout``
    seconds (None: no limit). An empty list means the timeout passed."""
    events = poller.poll(0)
    if not events and spin_s:
        end = time.perf_counter() + spin_s
        while not events and time.perf_counter() < end:
            events = poller.poll(0)
    if not events:
        events = poller.poll(None if timeout is None else max(0.0, timeout) * 1000)
    return events


class Group:
    """A running group of ``size`` ranks; rank 0 is this process."""

    def __init__(self, size: int, *, start_timeout: float = 120.0) -> None:
        self.size = size
        self.prefix = _shm.session_prefix()
        self.lock = threading.RLock()
        self.procs: dict[int, subprocess.Popen] = {}
        self.conns: dict[int, Connection] = {}
        self._watch_fds: dict[int, int] = {}
        self._key = _auth.new_key()
        self.watchdog: Watchdog | None = None
        self.mesh: Mesh | None = None  # rank 0's ends of the synk.comm socketpairs
        self._spare_socks: list = []  # the workers' ends, closed here once they are started
        self.calls = 0  # numbers the calls (synk.comm keeps messages within their call)
        self.deadline: float | None = None  # of the running call, if it has a timeout
        self.limit: float | None = None  # that timeout in seconds
        self.broken: BaseException | None = None
        self.closed = False
        self.scratch: dict = {}  # key -> _shm.Scratch owned by this group
        self.retired: list[str] = []  # staging blocks replaced since the last call
        self.inline_output_bytes = int(
            os.environ.get("SYNK_INLINE_OUTPUT_BYTES", DEFAULT_INLINE_OUTPUT_BYTES)
        )
        self.parallel_reduce_ranks = int(  # see _collect.PARALLEL_FROM_RANKS
            os.environ.get("SYNK_PARALLEL_REDUCE_RANKS", _collect.PARALLEL_FROM_RANKS)
        )
        self.spin_s = spin_seconds(size)
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
        env = _devices.worker_env(self.size)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SYNK_PARENT, env.get("PYTHONPATH")]))
        ends = self._pair_up()
        peer_fds = {rank: {peer: s.fileno() for peer, s in ends[rank].items()}
                    for rank in self.workers}  # the same numbers in the worker (pass_fds)
        for rank in self.workers:
            self._spawn(rank, env, peer_fds[rank])
        for sock in self._spare_socks:
            sock.close()
        if self.size > 1:
            self.mesh = Mesh(0, self.size, ends[0], self.spin_s, self.prefix)
        deadline = time.monotonic() + timeout
        try:
            for rank in self.workers:
                self._authenticate(rank, deadline)
            for rank in self.workers:
                init = P.Init(
                    rank, self.size, list(sys.path), self.prefix, self.inline_output_bytes,
                    self.spin_s, peer_fds[rank],
                )
                self._send(rank, pickle.dumps((P.INIT, init)), "while starting")
            replies = self.recv(self.workers, "while starting", deadline=deadline)
        except WorkerDiedError as err:
            raise WorkerStartError(
                f"rank {err.rank} failed to start (exit code {err.exitcode}); "
                "its error output is above"
            ) from err
        except TimeoutError as err:
            raise WorkerStartError(str(err)) from None
        for rank, reply in sorted(replies.items()):
            if reply[0] == P.ERR:
                cause = unpack_exception(reply[1], reply[2], rank)
                raise WorkerStartError(f"rank {rank} failed to start: {cause!r}") from cause
        self.watchdog = Watchdog(self.procs, {r: c.fileno() for r, c in self.conns.items()})

    def _authenticate(self, rank: int, deadline: float) -> None:
        conn = self.conns[rank]

        def recv() -> bytes:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"rank {rank} did not answer while starting")
            try:
                return conn.recv_bytes(_auth.MAX_MESSAGE)
            except (EOFError, OSError):
                self.died(rank, "while starting")

        def send(data: bytes) -> None:
            try:
                conn.send_bytes(data)
            except OSError:  # it exited already (BrokenPipeError, ConnectionResetError)
                self.died(rank, "while starting")

        try:
            _auth.handshake(send, recv, self._key, first=True)
        except _auth.AuthenticationError as err:
            raise WorkerStartError(
                f"rank {rank} failed authentication on its control channel ({err}); "
                "it was stopped"
            ) from None

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
            in_main = threading.current_thread() is threading.main_thread()
            proc = subprocess.Popen(
                [sys.executable, "-m", "synk._engine.worker", str(theirs.fileno()), str(watch_r),
                 str(os.getpid() if in_main else 0)],
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
        self.conns[rank] = Connection(ours.detach())
        self._watch_fds[rank] = watch_w

    def _give_key(self, watch_w: int) -> None:
        os.write(watch_w, self._key)  # 32 bytes: fits the pipe buffer, never blocks

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

    def timed_out(self, ranks, during: str) -> CallTimeoutError:
        """Stop the group because ``ranks`` did not finish in time; the error to raise."""
        ranks = sorted(ranks)
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
        fds = {self.conns[r].fileno(): r for r in ranks}
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = {fds[fd] for fd, _ in poller.poll(0)}
        return [r for r in ranks if r not in ready]

    def send(self, ranks, payload: bytes, during: str) -> None:
        for rank in ranks:
            self._send(rank, payload, during)

    def _send(self, rank: int, payload: bytes, during: str) -> None:
        try:
            self.conns[rank].send_bytes(payload)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
            self.died(rank, during)

    def recv(self, ranks, during: str, deadline: float | None = None) -> dict:
        """One reply from each of ``ranks``, waiting on all of them and on their deaths,
        until ``deadline`` (default: the running call's)."""
        deadline = self.deadline if deadline is None else deadline
        pending = {self.conns[r].fileno(): r for r in ranks}
        poller = select.poll()
        for fd in pending:
            poller.register(fd, select.POLLIN)  # a death shows as POLLHUP, then EOF
        replies = {}
        while pending:
            timeout = None if deadline is None else deadline - time.monotonic()
            events = poll(poller, self.spin_s, timeout)
            if not events:
                if self.limit is None:  # only start-up waits without a call's timeout
                    self.kill()
                    raise TimeoutError(f"ranks {sorted(pending.values())} did not answer {during}")
                raise self.timed_out(pending.values(), during)
            for fd, _ in events:
                rank = pending.pop(fd)
                poller.unregister(fd)
                try:
                    data = self.conns[rank].recv_bytes()
                except (EOFError, OSError):
                    self.died(rank, during)
                replies[rank] = pickle.loads(data)
        return replies

    def died(self, rank: int, during: str):
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
        """Ask every worker to exit, kill any that linger, and release all resources."""
        if self.closed:
            return
        if self.broken is None:
            for rank in self.workers:
                try:
                    self.conns[rank].send_bytes(pickle.dumps((P.EXIT,)))
                except OSError:
                    pass
            deadline = time.monotonic() + timeout
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self.kill()

    def kill(self) -> None:
        """Stop every worker now (SIGKILL), reap them, and release all resources."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.mesh is not None:
            self.mesh.stop()
        for sock in self._spare_socks:
            sock.close()
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
        for proc in self.procs.values():
            proc.wait()
        for conn in self.conns.values():
            conn.close()
        for fd in self._watch_fds.values():
            os.close(fd)
        self.conns.clear()
        self._watch_fds.clear()
        for scratch in self.scratch.values():
            scratch.destroy()
        self.scratch.clear()
        _shm.sweep(self.prefix)
        ATTACHED.release_all(self.prefix)  # the workers' blocks this master had mapped
        self._thread_limit.restore()
        self.closed = True
