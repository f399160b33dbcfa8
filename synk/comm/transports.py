"""The name -> communicator class table: the one way a transport is chosen.

"host": numpy arrays over the call's mesh (shared memory on one machine, MPI between
machines); "nccl": device arrays on NCCL; "staged": device arrays through the host, for GPU
ranks that NCCL refuses and for a group of one GPU rank. The engine joins a device
communicator by name (``communicator_class(how[0]).join(...)``); ``_route`` makes a call's
host communicator by name.
"""
from __future__ import annotations

from .host import HostCommunicator
from .nccl import NcclTransport
from .staged import StagedTransport

TRANSPORTS: dict = {"host": HostCommunicator, "nccl": NcclTransport, "staged": StagedTransport}


def communicator_class(name: str) -> type:
    """The communicator class of transport ``name``."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(TRANSPORTS)}") from None
