"""synk: run one Python function on many CPU cores (or GPUs) at once, data-parallel.

    synk.fork()                                 # start the ranks
    f = synk.function(fn, bcast_inputs=["y"])   # wrap a plain function
    synk.distribute()                           # ship functions (optional)
    x = synk.data(array)                        # shared-memory input
    result = f(x, y)                            # run on every rank, reduce the outputs
    synk.close()
"""
from typing import TYPE_CHECKING

from . import comm
from ._call.profile import Profile
from ._devices.discovery import GpuUnavailableError
from .api import backend, close, devices, fork, rank, restarts_left, size, xp
from .data import Data, data
from .errors import (
    CallTimeoutError,
    DeviceFailedError,
    DistributeError,
    EarlierCallFailedError,
    GroupBrokenError,
    NotForkedError,
    RankReplacedWarning,
    ReentrantCallError,
    RemoteError,
    ShmSpaceError,
    StepClosedError,
    StuckRanksWarning,
    SynkError,
    WorkerDiedError,
    WorkerStartError,
)
from .function import Function, Step, distribute, function
from .shared import (
    DEPRECATED as _DEPRECATED,
    Shared,
    assign,
    shared,
    shared_all_gather,
    shared_all_reduce,
    shared_broadcast,
    shared_gather,
    shared_reduce,
    shared_scatter,
)

__version__: str  # the installed distribution's version (pyproject.toml), read on first use

__all__ = [
    "fork", "close", "function", "distribute", "data", "xp", "rank", "size", "comm",
    "devices", "backend",
    "shared", "Shared", "assign", "shared_broadcast", "shared_all_reduce", "shared_reduce",
    "shared_gather", "shared_all_gather", "shared_scatter",
    "Function", "Step", "Data", "Profile",
    "SynkError", "NotForkedError", "GroupBrokenError", "WorkerDiedError", "WorkerStartError",
    "CallTimeoutError", "DeviceFailedError", "DistributeError", "RemoteError",
    "ReentrantCallError", "EarlierCallFailedError", "StepClosedError",
    "ShmSpaceError", "GpuUnavailableError", "StuckRanksWarning", "RankReplacedWarning",
    "restarts_left",
]


if not TYPE_CHECKING:  # (for type checkers, synk has no other dynamic attributes)

    def __getattr__(name: str) -> str:
        # importlib.metadata takes ~20 ms to import, which every worker would pay at start-up
        if name == "__version__":
            from importlib.metadata import PackageNotFoundError, version

            try:
                value = version("synk")
            except PackageNotFoundError:  # a source tree that was never installed
                value = "0+unknown"
            globals()["__version__"] = value
            return value
        if name == "simulator":  # (imported when asked for: only tests and GPU-less runs use it)
            import importlib

            return importlib.import_module("synk.simulator")
        if name in _DEPRECATED:  # synk.broadcast, all_reduce...: the shared_* ones now
            return _DEPRECATED[name]
        raise AttributeError(f"module 'synk' has no attribute {name!r}")
