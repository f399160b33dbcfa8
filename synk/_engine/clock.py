"""A group's call clock: numbers the calls and the rounds of requests, and keeps the running
call's deadline."""
from __future__ import annotations

import time


class CallClock:
    """Numbers the calls (``calls``: ``synk.comm`` keeps messages within their call) and
    the rounds of requests (``round``: every reply names its round); ``deadline`` and
    ``limit`` are the running call's (None: no limit); ``dropped``, the last call whose
    request had the workers drop the values they keep (``_call.bound_values``)."""

    __slots__ = ("calls", "round", "deadline", "limit", "dropped", "settled")

    def __init__(self) -> None:
        self.calls = 0
        self.settled = 0  # the newest call whose every reply has been read
        self.dropped = 0
        self.round = 0
        self.deadline: float | None = None
        self.limit: float | None = None

    def begin(self, timeout: float | None) -> int:
        """Start the clock of a call with ``timeout`` seconds (None: no limit); its number."""
        self.calls += 1
        self.limit = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        return self.calls

    def end(self) -> None:
        self.deadline = self.limit = None

    def next_round(self) -> int:
        """Number a new round of requests (their replies are checked against it)."""
        self.round += 1
        return self.round
