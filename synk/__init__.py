"""synk: run one Python function on many CPU cores (or GPUs) at once, data-parallel.

    synk.fork()                                 # start the ranks
    f = synk.function(fn, bcast_inputs=["y"])   # wrap a plain function
    synk.distribute()                           # ship functions (optional)
    x = synk.data(array)                        # shared-memory input
    result = f(x, y)                            # run on every rank, reduce the outputs
    synk.close()
"""
from . import comm
from ._call.profile import Profile
from .api import close, fork, rank, size, xp
from .data import Data, data
from .errors import (
    CallTimeoutError,
    DistributeError,
    GroupBrokenError,
    NotForkedError,
    RemoteError,
    SynkError,
    WorkerDiedError,
    WorkerStartError,
)
from .function import Function, distribute, function
from .shared import Shared, all_gather, all_reduce, broadcast, gather, reduce, scatter, shared

__version__ = "0.1.0"

__all__ = [
    "fork", "close", "function", "distribute", "data", "xp", "rank", "size", "comm",
    "shared", "Shared", "broadcast", "all_reduce", "reduce", "gather", "all_gather", "scatter",
    "Function", "Data", "Profile",
    "SynkError", "NotForkedError", "GroupBrokenError", "WorkerDiedError", "WorkerStartError",
    "CallTimeoutError", "DistributeError", "RemoteError",
]
