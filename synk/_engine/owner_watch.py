"""A process that removes an owner's segments when the process that owns them dies first."""
from __future__ import annotations

import subprocess
import sys

from .._wire import shm as _shm

_ENTRY = (
    "import fcntl, os, signal, sys, time\n"
    "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(sig, signal.SIG_IGN)\n"
    "folder, prefix, lock = sys.argv[1:4]\n"
    "child = os.fork()\n"  # detached: its parent's exit leaves it to init
    "if child:\n"
    "    print(child, flush=True)\n"
    "    os._exit(0)\n"
    "os.dup2(os.open(os.devnull, os.O_WRONLY), 1)\n"  # its parent's reader sees EOF
    "def claim(owner, wait):\n"  # its lock's descriptor, held, or None: alive or not ours
    "    try:\n"
    "        fd = os.open(os.path.join(folder, owner + lock), os.O_RDONLY | os.O_NOFOLLOW)\n"
    "    except OSError:\n"
    "        return None\n"
    "    try:\n"
    "        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
    "    except OSError:\n"
    "        os.close(fd)\n"
    "        return None\n"
    "    return fd\n"
    "def remove(owner):\n"
    "    names = [n for n in os.listdir(folder) if n.startswith(owner)]\n"
    "    for name in sorted(names, key=lambda n: n == owner + lock):\n"  # the lock last
    "        try:\n"
    "            os.unlink(os.path.join(folder, name))\n"
    "        except OSError:\n"
    "            pass\n"
    "def sweep():\n"  # every owner gone without removing its segments
    "    for name in os.listdir(folder):\n"
    "        if name.startswith('synk-') and name.endswith('-' + lock):\n"
    "            fd = claim(name[:-len(lock)], False)\n"
    "            if fd is not None:\n"
    "                if os.fstat(fd).st_nlink:\n"
    "                    remove(name[:-len(lock)])\n"
    "                os.close(fd)\n"
    "fd = claim(prefix, True)\n"  # the owner released it, or died
    "if fd is None or not os.fstat(fd).st_nlink:\n"
    "    sys.exit(0)\n"  # released: nothing to do
    "os.close(fd)\n"
    "for pause in (0, 0.05, 0.15, 0.3, 0.5, 1.0):\n"  # (a dying process drops its locks one
    "    time.sleep(pause)\n"  # by one, and its peers may die just after it)
    "    sweep()\n"
)


def watch(prefix: str) -> int | None:
    """Start the watcher of the owner of ``prefix``; returns its pid (it needs no reaping),
    or None where it could not start: then a later synk job on the host sweeps what the
    owner leaves.

    Each rank of an MPI job on a host other than the master's starts one: it keeps
    segments there under its own prefix and lock (``hosts``: a leader's copies of the inputs
    and the host's mark, any rank's output blocks). So does the master, for its ``Data``'s
    prefix (which lives as long as the process's group). Each removes its own segments when
    the job ends (the master at ``synk.close()`` or its SIGTERM, a rank with
    ``mpi_job._leave_nothing`` at the master's hang-up or the launcher's SIGTERM), and so
    does a rank of the host for one killed before it. But a process can die with no chance
    to: SIGKILL; Open MPI ends a process at once, with no clean-up, when a peer's TCP
    connection to it closes, so that one rank's death takes the ranks connected to it with
    it within milliseconds; the launcher's SIGKILL follows its SIGTERM by 0.25 s.

    The watcher is a small process (Python without ``site``, importing ``fcntl``, ``os``,
    ``signal``, ``sys`` and ``time`` only), detached (it forks and its first process exits:
    no one waits for it, and its end is no one's event), in a session of its own (an MPI
    launcher signals each rank's whole process group), holding nothing of the owner's. It
    waits for the owner's lock (a blocking ``flock``: the kernel drops it however the owner
    ends). If the lock file is gone once it has the lock, the owner released its segments
    itself. If it is still there, the owner died first, and others of the host may have
    died with it: the watcher removes the segments of every owner whose lock it can take,
    each lock file last (``shm.sweep_orphans``' rule), in passes over two seconds. A live
    owner is never judged by a pid, so this holds in any pid namespace that shares the
    host's ``/dev/shm``."""
    try:  # -I -S: nothing of the environment's or the working directory's runs in it
        started = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _ENTRY, _shm.SHM_DIR, prefix, _shm.LOCK],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True, check=True)
        return int(started.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
