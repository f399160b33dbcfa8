"""The settler: a group's thread that completes submitted calls' futures as their replies
arrive, so that ``concurrent.futures.wait``, ``as_completed`` and callbacks work unasked::

    submit ----> Outstanding.add ----> poke(): the thread starts, or wakes if idle
    thread: wait, holding no lock, until the oldest call's replies may be in, a worker
            may have died, or its deadline passed (``Group.may_have_arrived``); then
            ``Group.settle_arrived``: the arrived calls settled, oldest first, with the
            group held, their futures set once it is let go
"""
from __future__ import annotations

import os
import select
import threading
import time

from .._wire.ring import SLEEP_SLICE


class Settler:
    """The settler thread of ``group``, the ``Group`` whose submitted calls it settles. A
    caller's own ``result()`` does not wait for it: it reads the replies itself. A future
    nobody reads completes within a slice or two (``ring.SLEEP_SLICE``) of its replies."""

    def __init__(self, group) -> None:
        self._group = group
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._idle = True  # (set before the thread looks for an outstanding call: a call
        # added after that look finds it set and wakes the thread)

    def poke(self) -> None:
        """A call was submitted: start the thread, or wake it."""
        if self._stopping:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="synk-settler",
                                            daemon=True)
            self._thread.start()
        if self._idle:
            self._wake(b"w")

    def stopping(self) -> bool:
        return self._stopping

    def stop(self) -> None:
        """End the thread (waiting for it, unless called from it) and close its descriptors."""
        if self._stopping:
            return
        self._stopping = True
        thread = self._thread
        if thread is not None:
            self._wake(b"s")
            if thread is not threading.current_thread():
                thread.join(timeout=10)
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    def _wake(self, byte: bytes) -> None:
        try:
            os.write(self._wake_w, byte)
        except BlockingIOError:
            pass  # (woken already)

    def _run(self) -> None:
        """The thread. It looks at the rings and polls the sockets and death descriptors for
        ``ring.SLEEP_SLICE`` at most at a time (a reply in a ring wakes no one). A submit wakes it
        only when idle, and it first waits a slice: else a run of submits would wake it each time
        and take the group from the caller between calls."""
        group = self._group
        idle, busy = select.poll(), select.poll()
        for poller in (idle, busy):
            poller.register(self._wake_r, select.POLLIN)
        for fd in group.reply_fds():
            busy.register(fd, select.POLLIN)
        woken = False
        while not self._stopping:
            self._idle = True
            oldest = group.oldest_outstanding()
            if oldest is None:
                self._sleep(idle, None)
                woken = True
                continue
            self._idle = False
            if not woken and group.may_have_arrived(oldest):
                group.settle_arrived(self.stopping)
            else:  # (woken by a submit: its caller keeps the group for a slice, in which
                # it may submit more or read the results itself)
                woken = False
                deadline = oldest.deadline[1] if oldest.deadline else None
                left = SLEEP_SLICE if deadline is None else deadline - time.monotonic()
                self._sleep(busy, max(0.0, min(SLEEP_SLICE, left)))

    def _sleep(self, poller, seconds: float | None) -> None:
        """Wait until woken, a descriptor of ``poller`` stirs, or ``seconds`` pass."""
        events = poller.poll(None if seconds is None else seconds * 1000)
        if any(fd == self._wake_r for fd, _ in events) and not self._stopping:
            try:
                os.read(self._wake_r, 512)
            except OSError:  # (closed meanwhile by stop)
                pass
