"""What one call needs of its group: the ``Port`` the engine's group gives the call path, and
its parts. The call path names these, never the engine's classes, and never calls back up
into the engine::

    Port
      size, workers, generation    the group's ranks; which of this process's groups it is
      device                       rank 0's device
      env()                        where rank 0's share runs (``share.RankEnv``)
      send / recv                  requests to the workers and their replies, within the
                                   deadline, a worker's death raised as the group's error
      outstanding / settle         the submitted calls whose replies are still to be read
                                   (``master``), and reading them all
      check_alive                  a worker seen dying breaks the group (before a call is sent)
      watched(work)                rank 0's share, interrupted by a death or the deadline
                                   (``blocking``: it waits inside MPI; the job ends then)
      clock, health, blocks, hosts  (their protocols below)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn, Protocol


class Clock(Protocol):
    """Numbers the calls and rounds of requests; the running call's deadline."""

    calls: int  # the running call's number (synk.comm keeps messages within their call)
    deadline: float | None  # when the running call must end (None: no limit)
    limit: float | None  # its timeout in seconds
    dropped: int  # the last call whose request had the workers drop the arguments they keep
    settled: int  # the newest call whose every reply has been read

    def begin(self, timeout: float | None) -> int: ...

    def end(self) -> None: ...

    def next_round(self) -> int: ...


class Health(Protocol):
    """How a call fails the group: each method raises (or returns) the group's error."""

    broken: BaseException | None

    def died(self, rank: int, during: str) -> NoReturn: ...

    def timed_out(self, ranks: Iterable[int], during: str) -> BaseException: ...

    def unfinished(self, ranks: Iterable[int]) -> list[int]: ...

    def device_failed(self, error: BaseException) -> None: ...

    def comms_failed(self) -> None: ...

    def break_with(self, error: BaseException) -> BaseException: ...

    def kill(self) -> None: ...


class Blocks(Protocol):
    """The group's blocks that calls reuse (staging, scratch), and the names of those
    replaced since the last request, which every rank unmaps with the next one."""

    prefix: str
    scratch: dict
    retired: list

    def retire(self, names: Iterable[str]) -> None: ...

    def scratch_block(self, key: str, tag: str, what: str) -> Any: ...


class HostSteps(Protocol):
    """The steps a call adds across hosts (``across_hosts.AcrossHosts`` under MPI: the
    inputs other hosts read); on one host each does nothing (``across_hosts.ONE_HOST``)."""

    spans: bool  # the ranks span hosts

    def send_inputs(self, port: Port, prep: Any, drop: tuple, during: str,
                    rid: int, whole: bool = False) -> dict: ...

    def inputs_sent(self, port: Port, during: str) -> None: ...

    def call_failed(self) -> None: ...


class Port(Protocol):
    """What a call needs of its group (see the module)."""

    size: int
    generation: int
    restarts_left: int  # a call keeps its shared variables' values while any are left
    device: Any
    clock: Clock
    health: Health
    blocks: Blocks
    hosts: HostSteps
    parallel_reduce_ranks: int  # from this many ranks, large outputs combine in parallel
    framework_settings: tuple  # JAX's and torch's settings the workers were last given

    @property
    def workers(self) -> range: ...

    def env(self) -> Any: ...

    def send(self, ranks: Iterable[int], payload: bytes, during: str,
             rid: int | None = None) -> None: ...

    def recv(self, ranks: Iterable[int], during: str, deadline: float | None = None,
             rid: int | None = None) -> dict: ...

    def outstanding(self) -> Any: ...

    def settle(self) -> None: ...

    def check_alive(self, during: str) -> None: ...

    def watched(self, work: Callable[[], None], blocking: bool = False) -> tuple | None: ...
