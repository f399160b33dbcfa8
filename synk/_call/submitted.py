"""Calls that do not wait: ``Function.submit`` and ``Step.submit``.

::

    submit       as a blocking call: prepare, send the CALL, rank 0's share (in the
                 caller's thread: fn's state on rank 0 is this process's, which the caller's
                 next lines may use); then return a ``CallFuture`` without waiting for the
                 workers' replies: the call is *outstanding*
    next submit  its CALL goes at once: each worker runs its calls in the order they were
                 sent, replying to each
    settle       the outstanding calls' replies read and combined, oldest first, each
                 result (or error) put in its future: when a future's ``result()`` is
                 asked, when ``MAX_OUTSTANDING`` are outstanding, and before anything else
                 the group does (a blocking call, shipping, a shared variable's value,
                 ``synk.comm`` groups, ``close()``: ``Group.hold``)

What makes it safe for the ranks to run call k+1 before the master has read call k's
replies: a submitted call's outputs ride its replies whatever their size (``ShareTask.
inline_outputs``), and rank 0's stay where its share left them (``exports.OwnOutputs``), so
no rank's scratch block holds them; a call that copies a plain array into a staging block
settles the outstanding calls first (their workers may still read the block: ``args``).

A call whose error is read (its own, or a dead rank's) fails its future; every call
submitted after it fails too, with ``EarlierCallFailedError`` (its cause: that error),
since it ran (or would run) on what the failed call left: those outstanding then, and those
submitted later, which are not sent, until a caller reads a failed future. A dead rank, a
timeout, ``close()`` and Ctrl-C end the outstanding calls as they end a blocking one: their
futures raise the group's error.
"""
from __future__ import annotations

import concurrent.futures
from collections import deque
from typing import Any

from ..errors import EarlierCallFailedError, GroupBrokenError

MAX_OUTSTANDING = 8  # submitted calls whose replies may wait unread; one more settles the
# oldest


class CallFuture(concurrent.futures.Future):
    """The result of a submitted call (a ``concurrent.futures.Future``): ``result()`` reads
    the replies of the outstanding calls up to this one, if not yet read, and gives what the
    call would have returned. It cannot be cancelled: its CALL was sent when it was made."""

    def __init__(self, settle, outstanding: Outstanding) -> None:
        super().__init__()
        self._settle = settle  # reads every outstanding call's replies
        self._outstanding = outstanding
        self.set_running_or_notify_cancel()

    def result(self, timeout: float | None = None) -> Any:
        return self._read(super().result, timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._read(super().exception, timeout)

    def _read(self, get, timeout: float | None):
        """``get(timeout)`` of the future, its call's replies read first if they are not."""
        if not self.done():
            self._settle()
        try:
            return get(timeout)
        finally:
            self._outstanding.read(self)


class Outstanding:
    """A group's submitted calls whose replies are still to be read, oldest first (each an
    object with ``future`` and ``settle()``, which returns its result or raises its error:
    ``MasterCall``), and the failure that later submitted calls fail with until it is read."""

    def __init__(self) -> None:
        self.calls: deque = deque()
        self.failed: BaseException | None = None  # a failure no caller has read yet

    def __bool__(self) -> bool:
        return bool(self.calls)

    def add(self, call) -> None:
        self.calls.append(call)

    def settle(self, upto=None) -> None:
        """Read the replies of the outstanding calls, oldest first (to ``upto``
        included, else all), and give each future its result or error. Ctrl-C and other
        BaseExceptions go up (the group is then stopped: ``fail_all``)."""
        while self.calls:
            call = self.calls.popleft()
            try:
                result = call.settle()
            except Exception as exc:
                if self.failed is None:
                    self.failed = exc
                    call.future.set_exception(exc)
                else:
                    call.future.set_exception(self.later())
            except BaseException as exc:  # (Ctrl-C: the group was stopped; this future,
                call.future.set_exception(GroupBrokenError(  # off the queue, is ended here)
                    "the group was stopped while this submitted call's replies were read "
                    f"({type(exc).__name__}); call synk.fork() again"))
                raise
            else:
                if self.failed is None:
                    call.future.set_result(result)
                else:
                    call.future.set_exception(self.later())
            if call is upto:
                break

    def later(self) -> EarlierCallFailedError:
        """The error of a call submitted after the one that failed."""
        error = EarlierCallFailedError(
            "this call was submitted after a call that failed (the cause below), and would "
            "run on what that call left; its result is not given. Read the failed call's "
            "error (its future's result()) to submit calls again")
        error.__cause__ = self.failed
        return error

    def read(self, future: CallFuture) -> None:
        """A caller read ``future``: where it failed, later calls may run again."""
        if future.done() and concurrent.futures.Future.exception(future, 0) is not None:
            self.failed = None

    def fail_all(self, error: BaseException) -> None:
        """The group stopped: every outstanding call fails with ``error``."""
        while self.calls:
            future = self.calls.popleft().future
            if not future.done():
                future.set_exception(error)
