"""Worker entry point: ``main(CONTROL_FD, WATCH_FD, MASTER_PID)``, run by the command line
of ``spawn.worker_command``: read the group key from the watch pipe, authenticate the
master, then receive, run, reply."""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection


def _exit_when_master_dies(watch_fd: int) -> None:
    """The master never writes to this pipe; EOF means it is gone, so stop even mid-call."""
    def watch():
        while os.read(watch_fd, 1):
            pass
        os._exit(70)

    threading.Thread(target=watch, name="synk-master-watch", daemon=True).start()


def _read_key(watch_fd: int, size: int) -> bytes:
    key = b""
    while len(key) < size:
        chunk = os.read(watch_fd, size - len(key))
        if not chunk:
            os._exit(70)  # the master is gone before it handed over the key
        key += chunk
    return key


def _die_with_master(master_pid: int) -> None:
    """Ask the kernel for SIGKILL when the master goes, even if this process is stuck in C code
    holding the GIL (the watch thread could not run then); it is tied to the master's thread that
    started this worker (``spawn.Spawner``). 0: no such request (a test's direct launch)."""
    if not master_pid:
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != master_pid:
        os._exit(70)  # it died before the request took effect


def main(control_fd: int, watch_fd: int, master_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the master's to handle
    faulthandler.enable()
    from . import auth as _auth

    for fd in (control_fd, watch_fd):  # not for processes the user's functions start
        os.set_inheritable(fd, False)
    key = _read_key(watch_fd, _auth.KEY_BYTES)
    _exit_when_master_dies(watch_fd)
    _die_with_master(master_pid)
    conn = Connection(control_fd)
    try:
        _auth.handshake(conn.send_bytes, lambda: conn.recv_bytes(_auth.MAX_MESSAGE), key,
                        first=False)
    except (_auth.AuthenticationError, OSError, EOFError) as err:
        print(f"synk worker: refused its control channel: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    serve(conn, control_fd)


def serve(conn: Connection, control_fd: int, job=None) -> bool:
    """After authentication: take the Init message, start, then answer requests until EXIT (or EOF).
    Also the loop of an MPI process made a worker by ``synk.fork()`` (``job``: its ``mpi.Job``).
    Returns True after EXIT, False when the master went away (or this rank failed to start)."""
    from .._wire import protocol as P
    from ..errors import POISONED_EXIT

    tag, init = P.read(conn.recv_bytes())
    if init.mpi is None:  # (an MPI process runs the user's script, with its own sys.path)
        sys.path[:] = init.sys_path
    from . import worker_state as _worker_state

    reply: bytes | None
    try:
        state = _worker_state.WorkerState(init, job)
        reply = P.reply(0, os.getpid())
    except BaseException as exc:
        state, reply = None, P.error_reply(0, exc, init.rank)
    conn.send_bytes(reply)
    if state is None:
        return False
    from .link import Link

    link = Link(conn, state.ring, init.spin_s, state.progress)  # from here on, the ring
    exited = False
    while True:
        try:
            data = link.recv()
        except EOFError:
            break
        reply, more = state.handle(data)
        if not more:
            exited = True
            break
        if reply is not None:  # (FILL has none)
            link.send(reply)
            state.replied()
        if state.comm_state() == "poisoned":  # never reused: see synk.errors.POISONED
            state.close()
            if job is None:
                os._exit(POISONED_EXIT)
            return False
    state.close()
    return exited
