"""Running under an MPI launcher (``mpiexec``, ``srun``): a start-up handshake in which
every rank takes part; then world rank 0 is the master and every other process serves it
from inside ``synk.fork()``, over a TCP control channel::

    world rank 0 (master)                        world rank r > 0 (worker, inside fork())
    listen on a TCP port; new group key
    barrier, then broadcast (key, addresses,  --> (MPI)       or a refusal: exit
      port) or a refusal ("fork(n=5) ...")
    host keys: allgather (SYNK_HOST_ID, or    <-> (MPI)       which ranks share a host
      the machine: Split_type(SHARED))
    duplicate COMM_WORLD: synk.comm's own     <-> (MPI)
                                              <-- TCP connect; HMAC challenge both ways
    Init ------------------------------------->  start (device, host copies, synk.comm)
          <----------------------------------   ready, or its exception
"""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import io
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, cast

from .. import _settings
from .._devices import discovery
from .._process import PROCESS
from .._wire import shm as _shm
from .._wire.interfaces import interface_addresses, tune
from ..comm.host.mpi_collectives import HostCollectives
from ..errors import SynkError
from . import auth as _auth, hosts as _hosts, launcher as _launcher, owner_watch

ABORT_GRACE = 3.0  # seconds from a broken group to MPI_Abort, if the master has not exited
# At least this long from the master hanging up on the workers to its MPI_Abort: each
# worker removes what it owns when the master hangs up, before the abort tears MPI's
# connections down (Open MPI's TCP transport then ends a process at once, with no cleanup)
HANGUP_GRACE = 0.5
_CLEAN_EXIT_WAIT = 0.1  # seconds a worker whose master hung up waits to see an EXIT first
_CONNECT_TIMEOUT = 10.0
_FAILED_TAG = 7301  # on COMM_WORLD: the master's word that its group failed to start
_FAILED_WAIT = 5.0  # seconds a rank that cannot connect waits for that word
_SHORT = struct.Struct("!i")

def detect() -> Job | None:
    """This process's MPI job, or None when it was not launched as one of several MPI
    processes. mpi4py is imported only when the launcher's environment (or ``SYNK_MPI=1``)
    says so, and mpi4py's ``COMM_WORLD`` must agree (more than one process)."""
    if PROCESS.mpi_job is not None:
        return PROCESS.mpi_job
    setting = _settings.mpi_mode()
    found = _settings.mpi_launcher()
    if setting is False or (found is None and setting is None):
        return None
    what = f"{found[0]}={os.environ[found[0]]}" if found else "SYNK_MPI=1"
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise SynkError(f"this process was started by an MPI launcher ({what}), but mpi4py "
                        f"cannot be imported ({err}): pip install \"synk[mpi]\", or set "
                        f"SYNK_MPI=0 to run an independent group in each process") from None
    world = MPI.COMM_WORLD
    if world.Get_size() == 1:
        if found is not None and found[1] is not None:
            raise SynkError(
                f"this process is one of {found[1]} tasks ({what}), but MPI sees a world of "
                "1 process: the launcher and mpi4py's MPI do not match (with Slurm, use "
                f"srun --mpi=pmix). Set SYNK_MPI=0 to run an independent group in each process")
        return None
    PROCESS.mpi_job = Job(MPI, world)
    return PROCESS.mpi_job


def _machine() -> tuple:
    """What tells this machine (and pid namespace) from others: two ranks with the same
    value may connect over the loopback interface."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = 0
    return socket.gethostname(), boot, pidns


def master_addresses() -> list[str]:
    """Where the workers may reach the master, best first (``SYNK_MASTER_ADDR`` alone if
    set): the addresses of its host name, then of its interfaces, loopback last."""
    chosen = _settings.master_addr()
    if chosen:
        return [chosen]
    found: list[str] = []
    with contextlib.suppress(OSError):
        found += [str(ai[4][0]) for ai in socket.getaddrinfo(socket.gethostname(), None,
                                                         socket.AF_INET)]
    found += [address for _, address, _ in interface_addresses()]
    unique = list(dict.fromkeys(a for a in found if not a.startswith("127.")))
    return unique + ["127.0.0.1"]


def send_frame(sock: socket.socket, data: bytes) -> None:
    """One message as ``multiprocessing.connection`` frames it (a blocking socket)."""
    sock.sendall(_SHORT.pack(len(data)) + data)


def recv_frame(sock: socket.socket, limit: int) -> bytes:
    """One framed message of at most ``limit`` bytes (a blocking socket)."""
    (size,) = _SHORT.unpack(_recv_exactly(sock, 4))
    if not 0 <= size <= limit:
        raise ValueError(f"a message of {size} bytes, more than the {limit} expected")
    return _recv_exactly(sock, size)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError("the peer closed the connection")
        data += chunk
    return data


def _hang_up(fd: int) -> None:
    """Shut the connection on ``fd`` down both ways (the peer reads EOF)."""
    sock = socket.socket(fileno=os.dup(fd))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


def _leave_nothing() -> None:
    """A process of a job that is ending: remove what it owns in /dev/shm, and what ranks
    of its host that died first (killed: no cleanup of their own) left there."""
    _shm.release_owners()
    _shm.sweep_orphans()


def _on_sigterm(signum, frame) -> None:
    """A worker told to end by the launcher (SIGTERM, SIGKILL 0.25 s later under Open MPI):
    remove what it owns in /dev/shm (its outputs, a host leader's copies of inputs) and what
    killed ranks of its host left, then die by SIGTERM as without this handler."""
    try:
        _leave_nothing()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


class Job:
    """This process's MPI world: its rank and size, and what synk has done with it."""

    def __init__(self, MPI, world) -> None:
        self.MPI, self.world = MPI, world
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.used = False  # the one group of the job started (or was refused)
        self.comm: Any = None  # synk.comm's communicator (a duplicate of COMM_WORLD)
        self.collectives: HostCollectives | None = None  # synk's own, by host (several)
        self.hosts: _hosts.Hosts | None = None
        self.visible: list = []  # each rank's CUDA_VISIBLE_DEVICES (None: unset)
        self.device_counts: list = []  # the CUDA devices each rank sees (None: not asked)
        self._mirrors: _hosts.Mirrors | None = None  # a leader's copies of inputs
        self._owner: _shm.Owner | None = None  # ... under its own prefix and lock
        self._abort_at: float | None = None
        self._ended_at: float | None = None  # when the master ended the job (end())
        self._vanished: str | None = None  # the host whose connection timed out, if any
        self._told: list = []  # the master's word to the ranks that its start failed
        self._clean_exit = False
        self._threads = None  # a worker's cap on its BLAS/OpenMP pools
        atexit.register(self._at_exit)  # (runs before mpi4py finalizes MPI)

    # -- both sides ------------------------------------------------------------------------
    def wait_all(self) -> None:
        """A barrier that sleeps while it waits (the others may be far behind): as in
        ``mpi4py.futures``, a rank waiting for the others polls MPI with a backoff rather
        than busy-waiting in a blocking call."""
        request = self.world.Ibarrier()
        pause = 1e-4
        while not request.Test():
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _meet(self, start) -> tuple:
        """Every rank: the master's start message, then hosts and synk.comm's communicator."""
        self.wait_all()
        start = self.world.bcast(start, root=0)
        if start[0] == "refused":
            return start, None
        node = self.world.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
        first = node.allreduce(self.rank, op=self.MPI.MIN)
        node.Free()
        key = _settings.host_id()  # (SYNK_HOST_ID: pretend hosts on one machine; else None)
        label = key or socket.gethostname()
        gpu = start[5]  # (a GPU group: each rank counts the devices it sees)
        keys = self.world.allgather((("id", key) if key else ("node", first), label,
                                     os.environ.get("CUDA_VISIBLE_DEVICES"),
                                     len(discovery.gpu_status().devices) if gpu else None))
        self.hosts = _hosts.Hosts.from_keys([k[:2] for k in keys])
        self.visible = [k[2] for k in keys]  # what each rank's launcher let it see
        self.device_counts = [k[3] for k in keys]
        self.comm = self.world.Dup()
        # errors come back as exceptions (synk.comm raises CommError), whatever the user's
        # mpi4py.rc.errors made of COMM_WORLD's handler
        self.comm.Set_errhandler(self.MPI.ERRORS_RETURN)
        if self.hosts.count > 1:  # the communicators by host of synk's own collectives
            self.collectives = HostCollectives(self.MPI, self.world, self.hosts.of_rank,
                                               self.rank)
        return start, self.hosts

    # -- the master ------------------------------------------------------------------------
    def check_size(self, n: int | None) -> int:
        """The number of ranks: the world's size; ``n`` must be None or equal to it."""
        if self.used:
            raise SynkError(
                "under MPI a job runs one synk group: its ranks are the job's MPI "
                "processes, which exit when the group closes. Call synk.fork() once, and "
                "synk.close() at the end (or let it run at exit)")
        if n is not None and n != self.size:
            raise ValueError(
                f"synk.fork(n={n}) under MPI: this job has {self.size} MPI processes and "
                "each one is a rank (world rank 0 is the master). Call synk.fork() without "
                f"n, or launch {n} processes (mpiexec -n {n} ..., srun -n {n} ...)")
        return self.size

    def refuse(self, why: str) -> None:
        """The master will not start a group: let the workers exit (they wait in fork())."""
        if not self.used:
            self.used = True
            self._meet(("refused", why))
            self._clean_exit = True

    def start_master(self, key: bytes, port: int, gpu: bool) -> _hosts.Hosts:
        """Master: announce the group (on GPU ranks: ``gpu``); returns the hosts (collective with
        every rank). The group key travels over MPI only, never in argv or the environment."""
        self.used = True
        _, hosts = self._meet(("start", key, master_addresses(), port, _machine(), gpu))
        return hosts

    def end(self, why) -> None:
        """The group broke (or failed to start): say so now, and end the job with MPI_Abort at exit
        or in ``ABORT_GRACE`` seconds, whichever comes first, so that no rank is left waiting in
        MPI. Such a group cannot be replaced: its ranks are the job's processes."""
        if self._abort_at is not None or self._clean_exit:
            return
        what = f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else why
        with contextlib.suppress(OSError):  # (the launcher may be gone: say it if it can)
            print(f"synk: {what}\nsynk: ending the MPI job (MPI_Abort) at exit, or in "
                  f"{ABORT_GRACE:g} s", file=sys.stderr, flush=True)
        self._abort_at = time.monotonic() + ABORT_GRACE
        if getattr(why, "timed_out", False):  # a host vanished: the launcher may wait for it
            self._vanished = repr(why.host)
        self._ended_at = time.monotonic()  # (the group hung up on its workers just before)
        threading.Thread(target=self._abort_later, name="synk-mpi-abort", daemon=True).start()

    def failed_to_start(self, why: BaseException) -> None:
        """The master's group failed after the ranks heard of it: tell them why (they are
        connecting to it, and would otherwise blame the network), then end the job."""
        what = f"{type(why).__name__}: {why}"
        self._told = [self.world.isend(what, dest=r, tag=_FAILED_TAG)
                      for r in range(1, self.size)]
        heard = [self.world.irecv(source=r, tag=_FAILED_TAG + 1) for r in range(1, self.size)]
        deadline = time.monotonic() + _FAILED_WAIT / 2  # each rank says so before the end
        while not all(h.Test() for h in heard) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.end(f"the group failed to start: {what}")

    def _master_failed(self) -> str | None:
        """A worker that cannot reach the master: the master's word that its start failed,
        if it comes within ``_FAILED_WAIT`` seconds."""
        deadline = time.monotonic() + _FAILED_WAIT
        while time.monotonic() < deadline:
            if self.world.Iprobe(source=0, tag=_FAILED_TAG):
                return self.world.recv(source=0, tag=_FAILED_TAG)
            time.sleep(0.01)
        return None

    def closed_cleanly(self) -> None:
        """Every worker acknowledged EXIT: leave MPI with them (MPI_Finalize waits for every
        process of the job), so that their processes end now, not with this one."""
        self._clean_exit = True
        with contextlib.suppress(Exception):
            if not self.MPI.Is_finalized():
                self.MPI.Finalize()

    def _abort_later(self) -> None:
        time.sleep(ABORT_GRACE)
        self.abort(1)

    def abort(self, code: int) -> None:
        """End the job (MPI_Abort), after removing what this process owns in /dev/shm:
        the launcher's SIGKILL follows, and nothing may remain on a host for a later synk
        process to sweep."""
        with contextlib.suppress(Exception):
            _leave_nothing()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        if self._ended_at is not None:  # the workers clean up when the master hangs up
            time.sleep(max(0.0, self._ended_at + HANGUP_GRACE - time.monotonic()))
        # MPI_Abort waits on the launcher, which may wait for a host that is gone: leave
        # anyway after a grace, so that this process is never what keeps the job alive
        # (SIGALRM's default action ends the process even inside MPI, with the GIL held)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(int(ABORT_GRACE) + 1)
        if self._vanished:
            launcher = _launcher.waiting_launcher()
            if launcher is not None:
                _launcher.end_if_waiting(launcher, self._vanished)
        self.world.Abort(code)

    def _at_exit(self) -> None:
        if self._abort_at is not None:
            self.abort(1)

    # -- a worker --------------------------------------------------------------------------
    def serve(self) -> None:
        """World rank r > 0 inside ``fork()``: serve the master over the TCP connection made
        here (the same ``Channel`` code as on one machine) until the group closes, then exit
        the process, never running the rest of the script."""
        self.used = True
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the master's to handle
        signal.signal(signal.SIGTERM, _on_sigterm)  # the launcher ending the job
        faulthandler.enable()
        with contextlib.suppress(AttributeError, ValueError):  # (whatever stdout is)
            cast(io.TextIOWrapper, sys.stdout).reconfigure(line_buffering=True)
        start, hosts = self._meet(None)
        if start[0] == "refused":
            self._finish(0)
        _, key, addresses, port, machine, _ = start
        host = hosts.of_rank[self.rank]
        if host != 0:  # its outputs (and a leader's copies of inputs) live under its own
            leader = hosts.leader(host) == self.rank  # prefix and lock on this host
            if leader:
                _shm.sweep_orphans()  # what killed ranks of an earlier job left on this host
            self._owner = _shm.Owner()
            owner_watch.watch(self._owner.prefix)  # should this rank die first
            if leader:
                self._mirrors = _hosts.Mirrors(self._owner.prefix, self.comm)
        try:
            sock = self._connect(addresses, port, machine == _machine())
            _auth.handshake(lambda d: send_frame(sock, d),
                            lambda: recv_frame(sock, _auth.MAX_MESSAGE), key, first=False)
            owner = self._owner if self._mirrors is not None else None  # (a leader's)
            prefix = None if owner is None else owner.prefix
            send_frame(sock, pickle.dumps((self.rank, os.getpid(), prefix)))
        except Exception as err:
            failed = self._master_failed()
            if failed is not None:
                print(f"synk worker (MPI rank {self.rank}): the master's fork() failed "
                      f"({failed}); this rank ends with the job", file=sys.stderr, flush=True)
                self.world.send(None, dest=0, tag=_FAILED_TAG + 1)  # said
            else:
                print(f"synk worker (MPI rank {self.rank}): could not join the master: {err}",
                      file=sys.stderr, flush=True)
            self._give_up()
        sock.settimeout(None)
        conn = Connection(sock.detach())
        self._watch(conn.fileno())
        from .worker import serve

        try:
            exited = serve(conn, conn.fileno(), job=self)
        except BaseException:
            exited = False
        if not exited:  # the master went away: it ends the job (or the launcher does)
            self._give_up()
        self._clean_exit = True
        _hang_up(conn.fileno())  # the master sees EOF: this rank is done (a close alone
        conn.close()  # would not end the connection while the watch thread polls it)
        self._finish(0)

    def _connect(self, addresses: list, port: int, same_machine: bool) -> socket.socket:
        if same_machine:
            addresses = ["127.0.0.1", *addresses]
        errors = []
        for address in dict.fromkeys(addresses):
            try:
                sock = socket.create_connection((address, port), timeout=_CONNECT_TIMEOUT)
            except OSError as err:
                errors.append(f"{address}: {err}")
                continue
            tune(sock)
            sock.settimeout(60.0)
            return sock
        raise ConnectionError(f"no address of the master answered on port {port} "
                              f"({'; '.join(errors)}); set SYNK_MASTER_ADDR to one that does")

    def scratch_prefix(self, prefix: str) -> str:
        """Where a worker's output blocks live: on a host other than the master's, under
        its own prefix and lock there (removed however it ends); else the group's."""
        return prefix if self._owner is None else self._owner.prefix

    def start_rank(self, init):
        """A worker's WorkerState starts: host copies of inputs, thread caps, synk.comm."""
        from .._devices import host_threads as _devices
        from ..comm.host.mpi_mesh import MpiMesh

        placement = _hosts.Placement(*init.mpi)
        PROCESS.spans_hosts = self.hosts.count > 1
        if placement.remote:
            PROCESS.host_copies = _hosts.Remote(placement, init.rank, self._mirrors)
        self._threads = _devices.MasterThreadLimit(len(self.hosts.ranks(placement.host)))
        return MpiMesh(self.comm, init.rank, init.size, init.spin_s)

    def _watch(self, fd: int) -> None:
        """Should the master go away while this rank is busy (in fn, or waiting in MPI),
        end the job after a grace period (the master, if alive, ends it first)."""
        def watch():
            poller = select.poll()
            poller.register(fd, select.POLLRDHUP)
            poller.poll()
            give_up = time.monotonic() + _CLEAN_EXIT_WAIT
            while not self._clean_exit and time.monotonic() < give_up:
                time.sleep(0.005)
            if self._clean_exit:
                return
            # The job is ending: remove what this rank owns now, before the launcher's
            # signals or MPI's own end of a process whose connections close (no cleanup)
            with contextlib.suppress(Exception):
                _leave_nothing()
            time.sleep(ABORT_GRACE + 2)
            if not self._clean_exit:
                self.abort(70)

        threading.Thread(target=watch, name="synk-mpi-watch", daemon=True).start()

    def _release_owner(self) -> None:
        if self._owner is not None:
            self._owner.release()

    def _give_up(self) -> None:
        self._release_owner()
        time.sleep(ABORT_GRACE + 2)  # the master's MPI_Abort normally comes first
        self.abort(70)

    def _finish(self, code: int) -> None:
        """Leave MPI and exit, never returning to the user's script."""
        self._release_owner()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        with contextlib.suppress(Exception):
            self.MPI.Finalize()
        os._exit(code)
