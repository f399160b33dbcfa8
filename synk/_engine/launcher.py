"""The launcher that started this MPI job, ended by the master when a host has vanished and the
launcher waits for it past the master's ``MPI_Abort``."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

# After ``MPI_Abort``, Open MPI's launcher (``prterun``, which ``mpiexec`` and ``mpirun`` are)
# ends the job's processes, then waits for its daemon on every host to say so. A vanished
# host's daemon (power, network: its connections end without a word) never answers, and the
# launcher waits as long as its out-of-band keepalive allows: 300 s + 9 x 20 s by default
# (PRRTE's ``oob_tcp_keepalive_time``/``_intvl``/``_probes``), about 15 minutes of TCP
# retransmissions once it has sent that daemon something. Its own SIGTERM and SIGINT wait
# the same way (checked on hosts that share nothing).
#: Launchers that wait for a vanished host's daemon; checked with Open MPI 5 (prterun).
WAITING_LAUNCHERS = ("prterun",)
LAUNCHER_GRACE = 2.0  # seconds into MPI_Abort before a still waiting launcher is ended


def waiting_launcher() -> int | None:
    """The pid of this process's parent when it is a launcher of ``WAITING_LAUNCHERS``."""
    parent = os.getppid()
    return parent if _name(parent) in WAITING_LAUNCHERS else None


def _name(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return None


# Run by the helper: wait; if the launcher still runs, SIGKILL it, then SIGTERM the children
# it leaves (its ranks on this host; the ssh sessions to its daemons, one of which would
# wait for the vanished host as the launcher did).
_HELPER = """
import os, signal, sys, time
pid, name, grace, message = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), sys.argv[4]
time.sleep(grace)
def comm(p):
    try:
        return open(f"/proc/{p}/comm").read().strip()
    except OSError:
        return None
def parent(p):
    try:
        return int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
if comm(pid) == name:
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and parent(p) == pid]
    os.write(2, (message + "\\n").encode())
    os.kill(pid, signal.SIGKILL)
    for child in children:
        try:
            os.kill(child, signal.SIGTERM)
        except OSError:
            pass
"""


def end_if_waiting(launcher: int, host: str) -> None:
    """SIGKILL ``launcher`` in ``LAUNCHER_GRACE`` seconds if it still runs (``MPI_Abort`` waits
    for the vanished ``host``), and SIGTERM the children it leaves, from a helper in a session
    of its own: ``MPI_Abort`` holds the GIL, this process may end first, and the launcher kills
    its ranks' process groups. For the master, once a worker's connection timed out
    (``WorkerDiedError.timed_out``); the other hosts' daemons then end their ranks, as when
    ``mpiexec`` is killed by hand."""
    message = (f"synk: the MPI launcher (pid {launcher}) still waits for its daemon on the "
               f"vanished host {host}: ending it (SIGKILL)")
    with contextlib.suppress(OSError):  # (said now too: the launcher forwards this output)
        print(f"synk: host {host} vanished: if the MPI launcher still waits for it in "
              f"{LAUNCHER_GRACE:g} s (Open MPI's does, as long as its keepalive allows: "
              "minutes), synk ends it (SIGKILL)", file=sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _HELPER, str(launcher),
                          _name(launcher) or "", str(LAUNCHER_GRACE), message],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         start_new_session=True, close_fds=True)
