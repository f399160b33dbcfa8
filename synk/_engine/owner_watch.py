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

    Each rank of an MPI job on a host other than the master's starts one for its own prefix
    (``hosts``: a leader's copies of the inputs, any rank's output blocks), and so does the
    master for its ``Data``'s prefix. Each removes its own segments when the job ends, but a
    process can die with no chance to: SIGKILL; Open MPI ends a process at once, with no
    clean-up, when a peer's TCP connection to it closes; the launcher's SIGKILL follows its
    SIGTERM by 0.25 s.

    The watcher (``_ENTRY``: Python without ``site``, holding nothing of the owner's) is
    detached, in a session of its own (an MPI launcher signals each rank's whole process
    group). It waits for the owner's lock (``flock``: the kernel drops it however the owner
    ends); if the lock file is still there then, the owner died first, and the watcher
    removes the segments of every owner whose lock it can take (``shm.sweep_orphans``' rule).
    A live owner is never judged by a pid, so this holds in any pid namespace that shares
    the host's ``/dev/shm``."""
    try:  # -I -S: nothing of the environment's or the working directory's runs in it
        started = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _ENTRY, _shm.SHM_DIR, prefix, _shm.LOCK],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True, check=True)
        return int(started.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
