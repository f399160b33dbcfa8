"""A process that removes a group's shared memory if its master dies without doing so."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

_ENTRY = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"  # a Ctrl-C or a SIGTERM sent to the
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # whole process group is the master's
    "if not getattr(sys.flags, 'safe_path', False) and sys.path[:1] == ['']:\n"
    "    del sys.path[0]\n"
    "fd, said = int(sys.argv[1]), b''\n"
    "while chunk := os.read(fd, 4096):\n"
    "    said += chunk\n"
    "    if said.endswith(b'.\\n'):\n"
    "        sys.exit(0)\n"  # the group was closed: nothing to do
    "deadline = time.monotonic() + 5\n"
    "for pid in [int(p) for p in said.split()]:\n"
    "    while time.monotonic() < deadline:\n"
    "        try:\n"
    "            with open(f'/proc/{pid}/stat') as f:\n"
    "                if f.read().rsplit(')', 1)[1].split()[0] == 'Z':\n"
    "                    break\n"
    "        except OSError:\n"
    "            break\n"
    "        time.sleep(0.01)\n"
    "from synk._wire import shm\n"
    "shm.sweep_orphans()\n"
)


class Guardian:
    """The master's end of a guardian process, for a group forked while SIGTERM has its default
    action (only the main thread can install ``api._on_sigterm``): without it a terminated
    master would leave the group's segments and its ``Data`` blocks until the next
    ``synk.fork()`` swept them. The guardian (importing nothing of synk's until needed) reads a
    pipe only the master holds; if it ends without ``dismiss``'s word, it waits for the workers
    to die (up to 5 s), then runs ``shm.sweep_orphans``."""

    def __init__(self, env: dict) -> None:
        read, self._write = os.pipe()  # (not inherited by the workers: no pass_fds there)
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _ENTRY, str(read)],
                                         pass_fds=(read,), env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)

    def watch(self, pid: int) -> None:
        """A worker started: wait for its death before sweeping."""
        with contextlib.suppress(OSError):
            os.write(self._write, f"{pid}\n".encode())

    def dismiss(self) -> None:
        """The group was closed: the guardian exits without sweeping, and is reaped."""
        if self._write < 0:
            return
        with contextlib.suppress(OSError):
            os.write(self._write, b".\n")
        os.close(self._write)
        self._write = -1
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
