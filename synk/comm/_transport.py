"""The communicator interface of device transports, and the name -> class table.

A transport moves one rank's arrays to and from the other ranks of its group: collectives
(every rank calls them, in the same order) and point-to-point messages. Each keeps its own
dtype and op tables. The CPU ranks' shared-memory mesh predates this table and is used by
``synk.comm`` directly.
"""
from __future__ import annotations

import abc

TRANSPORTS: dict = {}


def register(name: str):
    """Class decorator: make a transport available as ``transport(name)``."""
    def add(cls):
        cls.name = name
        TRANSPORTS[name] = cls
        return cls
    return add


def transport(name: str) -> type:
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(TRANSPORTS)}") from None


class Communicator(abc.ABC):
    """One rank's end of a group communicator."""

    name: str
    rank: int
    size: int

    @abc.abstractmethod
    def allreduce(self, x, op: str = "sum"):
        """``x`` combined over every rank with ``op``; every rank gets the result."""

    @abc.abstractmethod
    def broadcast(self, x, root: int = 0, *, shape=None, dtype=None):
        """Rank ``root``'s ``x`` on every rank."""

    @abc.abstractmethod
    def allgather(self, x, counts=None):
        """Every rank's ``x`` joined along axis 0 in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, x, op: str = "sum"):
        """Rank r's share of ``x`` split along axis 0, combined over every rank."""

    @abc.abstractmethod
    def send(self, x, peer: int) -> None:
        """Send ``x`` to rank ``peer``."""

    @abc.abstractmethod
    def recv(self, peer: int, shape, dtype):
        """An array of ``shape`` and ``dtype`` sent by rank ``peer``."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Return once every rank has called it."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Give up: unfinished operations end on this rank and fail on the others."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the communicator after the last operation."""
