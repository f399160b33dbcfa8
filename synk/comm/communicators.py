"""The name -> communicator class table (``COMMUNICATORS``), the one way a communicator is
chosen: by the engine (``communicator_class(how[0]).join(...)``) and by ``route``.
"""
from __future__ import annotations

from typing import Literal, overload

from .communicator import Communicator
from .host.host_comm import HostCommunicator
from .host.staged_comm import StagedCommunicator
from .nccl.nccl_comm import NcclCommunicator

# "host": numpy arrays over the call's mesh (shared memory on one machine, MPI between
# machines); "nccl": device arrays on NCCL; "staged": device arrays through the host, for GPU
# ranks that NCCL refuses and for a group of one GPU rank
COMMUNICATORS: dict[str, type[Communicator]] = {
    "host": HostCommunicator, "nccl": NcclCommunicator, "staged": StagedCommunicator}


@overload
def communicator_class(name: Literal["host"]) -> type[HostCommunicator]: ...
@overload
def communicator_class(name: Literal["nccl"]) -> type[NcclCommunicator]: ...
@overload
def communicator_class(name: Literal["staged"]) -> type[StagedCommunicator]: ...
@overload
def communicator_class(name: str) -> type[Communicator]: ...


def communicator_class(name: str) -> type[Communicator]:
    """The communicator class named ``name``."""
    try:
        return COMMUNICATORS[name]
    except KeyError:
        raise ValueError(f"unknown communicator {name!r}; known: {sorted(COMMUNICATORS)}") from None
