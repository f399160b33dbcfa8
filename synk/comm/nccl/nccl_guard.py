"""Every NCCL call of one rank's communicator, made safe to wait on and to abort (``Guard``).

::

    call      under the lock (abort, close wait for it) -> NCCL, watched    call, _watch_loop
    launched  an event after the operation; its buffers kept with it        launched
    wait      the event polled, slept on -> done: the buffers let go        wait, prune
              a CUDA or NCCL error, or ``should_stop()``: an abort
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any

from ... import _interrupts
from ...errors import (
    POISONED,
    POISONED_EXIT,
    CollectiveError,
    CommAborted,
    CommError,
    DeviceFailedError,
)

NOT_READY = 600  # cudaErrorNotReady
BLOCKED_AFTER = 0.5  # seconds inside one NCCL call before the watcher asks should_stop()
ABORT_PATIENCE = 2.0  # seconds abort() waits for a call in progress before aborting anyway
REMOTE_GRACE = 0.5  # seconds to hear why a peer aborted, after NCCL reported that it did
POISON_GRACE = 2.0  # seconds a thread blocked in an aborted call has to come back
_SLICE = 0.0005  # seconds of the first sleep between polls, after a short spin
_MAX_SLICE = 0.01  # the longest: how soon a failure (a peer's, NCCL's) is seen meanwhile
_SPINS = 200


class Guard:
    """One rank's NCCL communicator (CuPy's ``NcclCommunicator``) and its calls."""

    def __init__(self, xp, nccl, comm, rank: int, size: int, should_stop=None,
                 exit_when_poisoned: bool = False) -> None:
        self.xp, self.nccl, self.comm = xp, nccl, comm
        self.rank, self.size = rank, size
        self.should_stop = should_stop
        self.exit_when_poisoned = exit_when_poisoned
        self.broken: str | None = None  # why the communicator is gone
        self.poisoned: str | None = None  # why: aborted while a thread was inside NCCL
        self._lock = threading.RLock()
        self._inside: tuple | None = None  # (since, call) while a thread is inside NCCL
        self._aborted_for: str | None = None  # the watcher's reason, for the blocked caller
        # [(event, buffers kept alive until it completes)], in the order launched
        self._inflight: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._watcher: threading.Thread | None = None
        self._side: Any = None  # (a CuPy stream) the stream that wakes a waiting thread (see wait)
        self.stranded = False  # an operation never ended after an abort: its kernel may run
        # Started now, not at the first call: a thread started during the master's share
        # can catch the watchdog's interrupt meant for the master (CPython gives the new
        # thread's state the starter's id until it runs, and PyThreadState_SetAsyncExc
        # sets every state with that id), and Thread.start() then waits forever.
        self._watch()

    # ------------------------------------------------------------ calls
    def call(self, what: str, fn, *args):
        """``fn(comm, *args)``: one NCCL call, under the lock and watched. The lock is around
        every NCCL call, so that ``abort()``/``close()`` never free the communicator while
        another thread is inside a call on it (ncclCommAbort frees it)."""
        with self._lock:
            comm = self.live()
            self._inside = (time.monotonic(), what)
            self._watch()
            try:
                return fn(comm, *args)
            except KeyError as err:  # CuPy 14.2: NcclError(7) and NcclError(8) are KeyErrors
                raise self._failed(what, _status_of(err), f"NCCL returned status "
                                   f"{err.args[0] if err.args else '?'}") from None
            except self.nccl.NcclError as err:
                raise self._failed(what, getattr(err, "status", None), str(err)) from err
            finally:
                self._inside = None

    def live(self):
        if self.comm is None:
            raise CommError(f"the NCCL communicator of rank {self.rank} is "
                            f"{self.broken or 'closed'}")
        return self.comm

    def _failed(self, what: str, status, text: str) -> CommError:
        why = self._aborted_for
        if why is not None:
            return CommAborted(f"NCCL {what} on rank {self.rank} given up: {why}")
        self.abort(f"{what} failed: {text}")
        return CollectiveError(f"NCCL {what} on rank {self.rank} of {self.size} failed: {text}; "
                               "the communicator was aborted", status)

    # ------------------------------------------------------------ the watcher
    def _watch(self) -> None:
        if self._watcher is None and self.should_stop is not None:
            self._watcher = threading.Thread(target=self._watch_loop, daemon=True,
                                             name=f"synk-nccl-watch-r{self.rank}")
            self._watcher.start()
        self._wake.set()

    def _watch_loop(self) -> None:
        """The watcher of the one call that can block the host: since NCCL 2.22 the first use
        of an algorithm or peer connects inside the call and waits, without a timeout, for the
        peers (synk connects every algorithm and peer at set-up: this is the last resort). A
        call inside NCCL ``BLOCKED_AFTER`` seconds while ``should_stop()`` gives a reason: the
        communicator aborted without the lock, which NCCL leaves undefined ("the thread can
        possibly get stuck inside NCCL calls ... might hang forever", usage/communicators.rst),
        so the rank is **poisoned** and its process not reused (a worker's ends after replying,
        or at once if the thread is stuck: ``_leave_if_stuck``)."""
        while self.comm is not None:
            if not self._wake.wait(1.0):
                continue
            inside = self._inside
            if inside is None:
                self._wake.clear()
                if self._inside is not None:  # (entered meanwhile)
                    self._wake.set()
                continue
            if time.monotonic() - inside[0] >= BLOCKED_AFTER:
                why = self.should_stop()
                if why and self._inside is inside:
                    self._abort_blocked(f"{why}, while this rank was blocked inside NCCL "
                                        f"{inside[1]} (connecting to its peers on first use)")
                    self._leave_if_stuck(inside)
                    return
            time.sleep(0.02)

    def _abort_blocked(self, why: str) -> None:
        """Abort while a thread is blocked inside a call (without the lock: the only way to
        free it)."""
        comm, self.comm = self.comm, None
        if comm is None:
            return
        self._aborted_for, self.broken = why, f"aborted ({why})"
        self.poisoned = why
        try:
            comm.abort()
        except Exception:  # noqa: BLE001 (the blocked caller reports the failure)
            pass

    def _leave_if_stuck(self, inside: tuple) -> None:
        """After aborting under a blocked thread: a worker's process ends if that thread has
        not come back within ``POISON_GRACE`` (it may never: NCCL leaves it undefined)."""
        if not self.exit_when_poisoned:
            return
        deadline = time.monotonic() + POISON_GRACE
        while self._inside is inside and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._inside is inside:
            print(f"synk: rank {self.rank} stops: {POISONED} ({self.poisoned})",
                  file=sys.stderr, flush=True)
            os._exit(POISONED_EXIT)

    # ------------------------------------------------------------ waiting
    def launched(self, stream, keep: tuple):
        """An event after the operations just launched on ``stream``; ``keep`` (their
        buffers: inputs, temporaries, the result) lives until a query sees it complete,
        whether or not anyone waits for the result. CuPy's memory pool hands a freed block
        back to its stream at once, with no event: a buffer freed while NCCL still reads or
        writes it would be reused under it."""
        self.prune()
        done = self.xp.cuda.Event(disable_timing=True)
        done.record(stream)
        self._inflight.append((done, keep))
        return done

    def prune(self) -> None:
        """Let go of the buffers of completed operations, oldest first, up to the first still
        running (in stream order; asking every event cost a thousand in flight half a million
        queries)."""
        query, inflight = self.xp.cuda.runtime.eventQuery, self._inflight
        while inflight and query(inflight[0][0].ptr) == 0:
            inflight.popleft()

    def wait(self, what: str, done, refused=None, when_done: bool = True,
             sleeping=None, number: int = 0) -> None:
        """Until the event ``done`` has completed; aborting, gives up on a CUDA error
        (``DeviceFailedError``), an NCCL error, or ``should_stop(number)`` (``number``: the
        collective waited for, 0 for another wait); with ``ValueError`` where ``refused()``
        (asked once the wait sleeps and, ``when_done``, once done) says a peer refused its
        part, so this never completes or matched the peer's next one (NCCL matches by order).
        ``sleeping()`` is called at each sleep.

        Polled with ``cudaEventQuery``, which never raises (CuPy 14's ``Event.done`` reads a
        sticky CUDA error as not done forever), and NCCL's errors as NCCL documents (poll
        ncclCommGetAsyncError, abort on error): a few hundred quick polls, then sleeps growing
        to ``_MAX_SLICE``, cut short by a host function at completion (``_wake_when``)."""
        query = self.xp.cuda.runtime.eventQuery
        spins, pause, woken = 0, _SLICE, None
        while True:
            status = query(done.ptr)
            if status == 0:
                if refused is not None and when_done:  # (NCCL may have matched the
                    self._raise_if_refused(what, refused)  # refusing peer's next one)
                return
            if status != NOT_READY:
                self.abort(f"CUDA error {status}")
                raise DeviceFailedError(self.rank, status, f"while waiting for NCCL {what}")
            try:
                self.call(what, lambda comm: comm.check_async_error())
            except CollectiveError as err:
                why = self._cause(err)
                if why:  # a peer gave up for a reason this rank hears of too: say that
                    raise CommAborted(f"NCCL {what} on rank {self.rank} given up: {why}") \
                        from err
                raise
            why = self.should_stop(number) if self.should_stop is not None else None
            if why:
                self.abort(why)
                raise CommAborted(f"NCCL {what} on rank {self.rank} given up: {why}")
            spins += 1
            if spins < _SPINS:  # (a yield: time.sleep(0) sleeps on Linux, for the timer
                os.sched_yield()  # slack, 50 us by default, which would make these polls slow)
                continue
            if sleeping is not None:
                sleeping()
            if refused is not None:
                self._raise_if_refused(what, refused)
            if woken is None:
                woken = self._wake_when(done)
            woken.wait(pause)
            pause = min(2 * pause, _MAX_SLICE)

    def _raise_if_refused(self, what: str, refused) -> None:
        why = refused()
        if why:
            self.abort(why)
            raise ValueError(f"synk.comm: NCCL {what} on rank {self.rank} given up: {why}")

    def _wake_when(self, done) -> threading.Event:
        """A flag CUDA sets (from its own thread, by a host function) once ``done`` has
        completed: on a side stream of the communicator's device (current in ``wait``),
        ordered after the event, so that it neither delays nor waits for other work."""
        if self._side is None:
            self._side = self.xp.cuda.Stream(non_blocking=True)
        woken = threading.Event()
        self._side.wait_event(done)
        self._side.launch_host_func(_set, woken)
        return woken

    def _cause(self, err: CollectiveError) -> str | None:
        """Why a peer aborted, when ``err`` is NCCL's remote error (6) and ``should_stop``
        says it within a moment (the peers' note travels apart from NCCL's error)."""
        if err.status != 6 or self.should_stop is None:
            return None
        deadline = time.monotonic() + REMOTE_GRACE
        while True:
            why = self.should_stop()
            if why or time.monotonic() > deadline:
                return why
            time.sleep(0.005)

    def settle(self, stream, refused=None, number: int = 0) -> None:
        """Wait for everything launched on ``stream``, handles never waited on included, and
        let go of their buffers (``refused``: a peer launched fewer; ``number``: the call's last
        collective; as in ``wait``). After an abort the kernels are waited for a while; buffers
        of operations that never end are kept for good, not handed to new arrays."""
        if not self._inflight:
            return
        done = self.xp.cuda.Event(disable_timing=True)
        done.record(stream)
        try:
            if self.comm is not None:
                self.wait("operations in flight", done, refused,  # (aborts before it
                          when_done=False, number=number)  # raises)
                self._inflight.clear()
        finally:
            if self._inflight:
                if not _ends(self.xp.cuda.runtime.eventQuery, done, ABORT_PATIENCE):
                    _STRANDED.extend(keep for _, keep in self._inflight)
                    self.stranded = True
                self._inflight.clear()

    # ------------------------------------------------------------ teardown
    def abort(self, reason: str = "aborted") -> None:
        self._end(reason, "abort")

    def close(self) -> None:
        self._end("closed", "destroy")

    def _end(self, reason: str, how: str) -> None:
        """Free the communicator once no other thread is inside a call on it; a thread still
        inside after ``ABORT_PATIENCE`` is blocked connecting, and only an abort frees it.
        The watchdog's interrupt of the master waits until it is freed: landing between
        letting go of the handle and freeing it, it left the communicator allocated."""
        acquired = self._lock.acquire(timeout=ABORT_PATIENCE)
        try:
            with _interrupts.uninterruptible():
                comm, self.comm = self.comm, None
                if comm is not None:
                    self.broken = reason if how == "destroy" else f"aborted ({reason})"
                    if not acquired:  # a thread is still inside a call, blocked: abort it
                        self._aborted_for = self.poisoned = reason
                        how = "abort"
                    getattr(comm, how)()
        finally:
            self._wake.set()
            if acquired:
                self._lock.release()
        watcher = self._watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=ABORT_PATIENCE)  # it holds should_stop, and so the group


_STRANDED: list = []  # buffers of operations that never ended (a broken device): never freed


def _ends(query, event, seconds: float) -> bool:
    """Whether ``event`` completes within ``seconds`` (False on a CUDA error)."""
    deadline = time.monotonic() + seconds
    while True:
        status = query(event.ptr)
        if status == 0:
            return True
        if status != NOT_READY or time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def _set(flag: threading.Event) -> None:
    flag.set()


def _status_of(err: KeyError):
    try:
        return int(err.args[0])
    except (IndexError, TypeError, ValueError):
        return None
