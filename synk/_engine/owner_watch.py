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
    """Start the watcher of the owner of ``prefix``; returns its pid (it needs no reaping), or None
    where it could not start (a later synk job sweeps then). For prefixes a process can leave behind
    without a chance to clean up (SIGKILL; Open MPI ending a process at once when a peer's
    connection closes; the launcher's SIGKILL 0.25 s after its SIGTERM). The watcher (``_ENTRY``,
    Python without ``site``) is detached in a session of its own (a launcher signals whole process
    groups), waits for the owner's ``flock`` (dropped however it ends), and if the lock file is
    still there sweeps by ``shm.sweep_orphans``' rule. Never judging by pid, it holds in any pid
    namespace sharing the host's ``/dev/shm``."""
    try:  # -I -S: nothing of the environment's or the working directory's runs in it
        started = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _ENTRY, _shm.SHM_DIR, prefix, _shm.LOCK],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True, check=True)
        return int(started.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
