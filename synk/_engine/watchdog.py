"""Watching the workers while the master computes its own share: a thread per group that
interrupts the share when a worker dies or the call's deadline passes."""
from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable

from .. import _interrupts


class Watchdog:
    """Interrupts the master's share when a worker dies or the call's deadline passes: while rank 0
    runs ``fn`` it is not waiting on the workers. The thread waits on every worker's pidfd and the
    deadline, and raises ``Interrupted`` in the calling thread (``_interrupts``) at its next
    bytecode: after one long C call, or after a release (``_interrupts.uninterruptible``). A share
    waiting inside MPI (``enter(blocking=True)``) is also reported to ``stuck``, which ends an MPI
    job. ``enter`` and ``leave`` cost two uncontended locks; the wake pipe is written only with a
    deadline."""

    def __init__(self, procs: dict, conn_fds: dict, death_fds: dict,
                 stuck: Callable[[tuple], None] | None = None) -> None:
        """``death_fds``: rank -> a pidfd (owned by the caller) or None where pidfds are
        missing (Linux < 5.3): then the hang-up of the rank's control socket is watched.
        ``stuck(reason)``: called, in this thread, when a share that waits in a blocking
        call it cannot leave (``enter(blocking=True)``) should be interrupted."""
        self._stuck = stuck
        self._blocking = False  # the share waits in a call that an interrupt cannot cut
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._poller = select.poll()
        self._poller.register(self._wake_r, select.POLLIN)
        self._ranks: dict[int, int] = {}  # death fd -> rank
        for rank in procs:
            fd = death_fds.get(rank)
            if fd is None:  # the peer's close: POLLRDHUP (a TCP FIN), POLLHUP or POLLERR
                self._poller.register(conn_fds[rank], select.POLLRDHUP)
                self._ranks[conn_fds[rank]] = rank
            else:
                self._poller.register(fd, select.POLLIN)
                self._ranks[fd] = rank
        self._thread_id: int | None = None  # the thread running the master's share
        self._deadline: float | None = None
        self._reason: tuple | None = None  # why the share was interrupted
        self._dead: list[int] = []  # ranks seen dying
        self._stopping = False
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, name="synk-watchdog", daemon=True)
        self._thread.start()

    def enter(self, deadline: float | None, blocking: bool = False) -> tuple | None:
        """Watch the share the calling thread is about to run (``blocking``: it waits in
        MPI, where the interrupt lands only once MPI returns; ``stuck`` is called then too).
        Returns the reason to stop at once (a worker already died), else None."""
        with self._lock:
            self._reason = ("died", self._dead[0]) if self._dead else None
            if self._reason is None:
                self._thread_id = threading.get_ident()
                self._deadline = deadline
                self._blocking = blocking
        if deadline is not None:
            self._wake(b"d")  # let the thread sleep until the new deadline
        return self._reason

    def dead(self) -> list[int]:
        """The ranks seen dying so far."""
        return self._dead[:]

    def leave(self) -> tuple | None:
        """Stop watching; the reason the share was interrupted, or None. Safe to repeat."""
        with self._lock:
            if self._thread_id is not None and self._reason is not None:
                _interrupts.take_back(self._thread_id)  # (if it has not landed)
            self._thread_id = self._deadline = None
            self._blocking = False
            return self._reason

    def stop(self) -> None:
        """End the thread and close its descriptors."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake(b"s")
        self._thread.join(timeout=5)
        self._thread = None
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _wake(self, byte: bytes) -> None:
        try:
            os.write(self._wake_w, byte)
        except BlockingIOError:
            pass  # the pipe is full of wake-ups already

    def _fire(self, reason: tuple) -> None:
        with self._lock:
            if self._thread_id is None or self._reason is not None:
                return
            if reason[0] == "timeout" and (
                self._deadline is None or time.monotonic() < self._deadline
            ):
                return  # that call ended; the one running now has a later deadline
            self._reason = reason
            _interrupts.interrupt(self._thread_id)
            stuck = self._stuck if self._blocking else None
        if stuck is not None:
            stuck(reason)

    def _run(self) -> None:
        while not self._stopping:
            deadline = self._deadline
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = self._poller.poll(None if timeout is None else timeout * 1000 + 1)
            for fd, _ in events:
                if fd == self._wake_r:
                    os.read(self._wake_r, 512)
                    continue
                self._poller.unregister(fd)  # stays ready: watch it no more
                rank = self._ranks[fd]
                self._dead.append(rank)
                self._fire(("died", rank))
            if deadline is not None and time.monotonic() >= deadline:
                self._fire(("timeout",))
