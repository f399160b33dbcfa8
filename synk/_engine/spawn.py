"""Starting worker processes: their command line, and the thread that starts them."""
from __future__ import annotations

import queue
import sys
import threading

# The worker's entry. ``-c`` puts the working directory ('') first on sys.path, unless
# PYTHONSAFEPATH / -P (Python >= 3.11) keeps it off; nothing has been imported from it yet.
_ENTRY = (
    "import sys\n"
    "if not getattr(sys.flags, 'safe_path', False) and sys.path[:1] == ['']:\n"
    "    del sys.path[0]\n"
    "from synk._engine.worker import main\n"
    "main(*map(int, sys.argv[1:]))\n"
)


def worker_command(control_fd: int, watch_fd: int, master_pid: int) -> list[str]:
    """A worker's command line: its control socket and watch pipe descriptors, and the master's
    pid (0: no parent-death signal). The short ``-c`` entry keeps the master's working
    directory off ``sys.path`` until the worker has authenticated the master (else a
    ``hmac.py`` there would run first); synk comes through ``PYTHONPATH``, and ``sys.path`` is
    restored after the handshake (``protocol.Init``)."""
    return [sys.executable, "-c", _ENTRY, str(control_fd), str(watch_fd), str(master_pid)]


class Spawner:
    """Runs process starts in one thread of its own, until ``stop()``: ``PR_SET_PDEATHSIG``
    (which kills a worker even stuck in C code) fires when the starting *thread* ends, so the
    thread lives until the group stops or the process ends."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="synk-spawner", daemon=True
        )
        self._thread.start()

    def call(self, fn):
        """``fn()`` run in the spawner thread; its result, or its exception raised here.
        An interrupt (Ctrl-C) here waits for the job to end, so that nothing is left half
        started, then propagates."""
        done, box = threading.Event(), []
        self._jobs.put((fn, done, box))
        try:
            done.wait()
        finally:
            while not done.is_set():
                done.wait(0.05)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        """End the thread (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, done, box = job
            try:
                box.append((True, fn()))
            except BaseException as exc:  # handed to the caller
                box.append((False, exc))
            finally:
                done.set()
