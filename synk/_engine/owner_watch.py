"""A process that removes an owner's segments when the process that owns them dies first.

A rank of an MPI job on a host other than the master's keeps segments there under its own
prefix and lock (``hosts``): a leader's copies of the inputs and the host's mark, any rank's
output blocks. It removes them itself when the job ends (``mpi_job._leave_nothing``: at the
master's hang-up, or at the launcher's SIGTERM), and so does a rank of the host for one
killed before it. But a rank can die with no chance to: SIGKILL; Open MPI ends a process at
once, with no clean-up, when a peer's TCP connection to it closes, so that one rank's death
takes the ranks connected to it with it within milliseconds, before the master has even
seen it; the launcher's SIGKILL follows its SIGTERM by 0.25 s. Then nothing of the job is
left on the host to remove what they made, until a later synk job there sweeps it.

So each such rank starts a watcher for its owner: a small process (Python without ``site``,
importing ``fcntl``, ``os``, ``signal`` and ``sys`` only) in a session of its own (an MPI
launcher signals each rank's whole process group: the watcher must outlive it), holding
nothing of the rank's. It waits for the owner's lock (a blocking ``flock``: the kernel
drops the rank's however it ends). If the lock file is gone once it has the lock, the owner
released its segments itself; if it is still there, the owner died first: the watcher
removes every segment under the prefix, the lock file last (``shm.sweep_orphans``' rule).
Either way it then exits. A live owner is never judged by a pid, so this holds in any pid
namespace that shares the host's ``/dev/shm``.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys

from .._wire import shm as _shm

_ENTRY = (
    "import fcntl, os, signal, sys\n"
    "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(sig, signal.SIG_IGN)\n"
    "folder, prefix, lock = sys.argv[1:4]\n"
    "try:\n"
    "    fd = os.open(os.path.join(folder, prefix + lock), os.O_RDONLY | os.O_NOFOLLOW)\n"
    "except OSError:\n"
    "    sys.exit(0)\n"  # released already
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"  # the owner released it, or died
    "if os.fstat(fd).st_nlink:\n"  # died without removing its segments
    "    names = [n for n in os.listdir(folder) if n.startswith(prefix)]\n"
    "    for name in sorted(names, key=lambda n: n == prefix + lock):\n"  # the lock last
    "        try:\n"
    "            os.unlink(os.path.join(folder, name))\n"
    "        except OSError:\n"
    "            pass\n"
)


class OwnerWatch:
    """This process's watcher of ``owner`` (see the module)."""

    def __init__(self, owner: _shm.Owner) -> None:
        # -I -S: nothing of the environment's or the working directory's runs in it
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _ENTRY, _shm.SHM_DIR, owner.prefix, _shm.LOCK],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)

    def reap(self, timeout: float = 1.0) -> None:
        """The owner was released: the watcher exits at once; wait for it a moment, so that
        it is not left to the process's parent."""
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            self.proc.wait(timeout=timeout)
