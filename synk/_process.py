"""What synk keeps per process, in one object, ``PROCESS``: every layer reads and writes the
same ``Process``.
"""
from __future__ import annotations

import os
import weakref
from typing import Any

from .errors import NotForkedError, ReentrantCallError


class Process:
    """synk's state in this process. Nothing of synk's lives in a module global besides it and the
    caches that only speed things up (mapped segments). A group starts and ends through
    ``group_started`` and ``group_ended``, and a child made by ``os.fork()`` drops its parent's part
    in ``forget_parent``, all here, so no piece of a past group survives in another module."""

    def __init__(self) -> None:
        self.rank, self.size, self.worker = 0, 1, False
        self.group: Any = None  # the master's running group (_engine.group.Group), or None
        self.generation = 0  # bumped by every fork(), so functions know where they were shipped
        self.functions: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.forgotten: list[int] = []  # fids of collected functions, for the workers to drop
        self.replicas: dict[int, Any] = {}  # shared variable id -> this rank's replica
        self.dropped: list[int] = []  # master: ids of collected shared variables
        self.resident: dict[int, Any] = {}  # Data key -> this rank's device copy
        self.released: list[str] = []  # master: blocks freed or replaced, to unmap
        self.moved: dict[int, tuple] = {}  # master: key -> ref of each Data that moved
        self.left_devices: list[int] = []  # master: keys of Data that left the devices
        self.data_places: dict[int, tuple] = {}  # rank: key -> latest ref of a changed Data
        self.staging_dropped: list[int] = []  # fids (and bound steps' -numbers) whose
        # staging blocks go at the next call
        self.steps_dropped: list[int] = []  # master: numbers of bound steps closed or
        # collected, whose values the workers forget with the next call
        self.scattering: list = []  # master: the values of the running synk.shared_scatter
        self.live_data: weakref.WeakSet = weakref.WeakSet()  # every Data not yet freed
        self.data_prefix: Any = None  # the name prefix (a _wire.shm.Owner) of Data's blocks
        self.host_copies: Any = None  # under MPI, off the master's host: _engine.hosts.Remote
        self.spans_hosts = False  # under MPI: the job's ranks span several hosts
        self.mpi_job: Any = None  # under MPI: this process's job (_engine.mpi.Job), once seen
        # the running call's replicas handed to fn as torch tensors or JAX arrays (``synk.assign``
        # finds them here): id(what fn got) -> (variable id, what fn got, whether it is a copy)
        self.replica_views: dict[int, tuple] = {}
        # variable id -> the JAX array it was last handed over or assigned as, handed over
        # again while the replica holds exactly its bytes (instead of a new copy)
        self.replica_arrays: dict[int, Any] = {}
        self.replica_tensors: dict[int, Any] = {}  # id -> the entry of a torch tensor over a
        # replica (a shared module's parameter or buffer: ``_call.replica_tensors``)
        self.touched: set[int] = set()  # a worker: the replicas its running request may
        # change (their copies are kept after it: ``_call.rank_copies``)
        self.variables: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # master:
        # id -> every live ``synk.Shared``

    def require_group(self) -> Any:
        """The running group, or a clear error saying how to get one."""
        if self.worker:
            raise ReentrantCallError(
                f"a synk function (or distribute, a collective...) was called on rank "
                f"{self.rank}, inside a synk function: the ranks are busy with that call. "
                "Call synk functions from the master only, or use synk.comm inside the "
                "function to talk to the other ranks"
            )
        if self.group is None:
            raise NotForkedError(
                "no synk group is running: call synk.fork() before calling or distributing "
                "synk functions" + (" (the last group was closed)" if self.generation else "")
            )
        return self.group

    def group_started(self, group: Any, size: int) -> None:
        """``fork()`` started ``group`` of ``size`` ranks in this process (rank 0)."""
        self.group = group
        self.rank, self.size = 0, size

    def next_generation(self) -> int:
        """Number the group about to start."""
        self.generation += 1
        return self.generation

    def became_worker(self, rank: int, size: int) -> None:
        """This process is rank ``rank`` of a group of ``size``, serving the master."""
        self.rank, self.size, self.worker = rank, size, True

    def group_ended(self) -> None:
        """``close()``: no group runs in this process any more."""
        self.group = None
        self.rank, self.size = 0, 1
        self.resident.clear()  # the device copies went with the group's devices
        self.replica_arrays.clear()

    def forget_parent(self) -> None:
        """In a child made by ``os.fork()``: the parent's group, its ``Data`` (which it may
        still read, but not free), their pending updates and device copies are not this
        process's to use or stop; its own blocks take a name prefix of their own."""
        self.group_ended()
        self.forget_updates()
        self.live_data.clear()
        if self.data_prefix is not None:
            self.data_prefix.forget()  # (the parent's lock stays the parent's)
            self.data_prefix = None

    def forget_updates(self) -> None:
        """Drop every pending update of ``Data`` for the ranks (taken, or a parent's)."""
        del self.released[:]
        self.moved.clear()
        del self.left_devices[:]


PROCESS = Process()
os.register_at_fork(after_in_child=PROCESS.forget_parent)
