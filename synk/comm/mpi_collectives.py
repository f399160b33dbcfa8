"""MPI's own collectives for synk's exchanges between hosts, on communicators made once per
group: every rank (a duplicate of ``COMM_WORLD`` of their own, apart from synk.comm's), the
ranks of each host, and the hosts' first ranks (their *leaders*), from ``Split`` by host.

``reduce`` combines one array of every rank into rank 0 *by host* where a host runs several
ranks (each host's ranks into its leader over the host's communicator, then the leaders into
rank 0: the bytes cross between hosts once per host, as MPI's hierarchical collectives
do), else in one ``Reduce`` of the leaders (one rank per host: every rank). ``gather``
joins every rank's rows on rank 0 in rank order (``Gatherv``).

MPI's built-in ops give numpy's answer only for some dtypes (``exact``): integers wrap as
numpy's do (but for Open MPI's sums of 8- and 16-bit ones) and every integer op is
associative and commutative, so any order of the terms gives numpy's bits; floating-point
sums and products are added in MPI's own order (numpy's up to rounding: the last bits may
differ from a sum in rank order), and the maximum and minimum of floats are not numpy's
where NaN or signed zeros meet (MPI compares with ``>``, numpy propagates NaN and keeps
the first of equal values), nor is MPI's product of complex numbers promised to be
numpy's. Callers gather what ``exact`` refuses and combine it with numpy.

These calls block. A rank that waits here for a peer that is gone never returns: the group
breaks and the job ends (``_engine.mpi``). So the master makes them in a helper thread of
its own (``run``) and waits on it in short slices, which the watchdog can interrupt (a
death, the call's deadline); a worker makes them in its own thread (MPI's blocking calls
release the GIL: its watch thread still runs).
"""
from __future__ import annotations

import queue
import threading
from collections import Counter
from typing import Any

import numpy as np

from .mpi import mpi_errors

# synk's op names -> MPI's
_OPS = {"sum": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN", "band": "BAND",
        "bor": "BOR", "bxor": "BXOR", "land": "LAND", "lor": "LOR", "lxor": "LXOR"}
# the dtypes MPI reduces, and their MPI datatypes (fixed-size types: the same on every host)
_TYPES = {np.dtype(t): name for t, name in (
    (np.int8, "INT8_T"), (np.int16, "INT16_T"), (np.int32, "INT32_T"), (np.int64, "INT64_T"),
    (np.uint8, "UINT8_T"), (np.uint16, "UINT16_T"), (np.uint32, "UINT32_T"),
    (np.uint64, "UINT64_T"), (np.float32, "FLOAT"), (np.float64, "DOUBLE"),
    (np.complex64, "C_FLOAT_COMPLEX"), (np.complex128, "C_DOUBLE_COMPLEX"))}
_WAIT_SLICE = 0.02  # the master's wait on its helper thread, in slices: an interrupt lands


def exact(dtype: np.dtype, op: str) -> bool:
    """Whether MPI's built-in ``op`` on arrays of ``dtype`` gives numpy's answer (see the
    module: integers for every op, but sums of 8- and 16-bit ones; floats' ``sum`` and
    ``prod``, complex ``sum``, in MPI's order)."""
    if dtype not in _TYPES or not dtype.isnative:
        return False
    if dtype.kind in "iu":  # (Open MPI's AVX sums of 8- and 16-bit integers saturate rather
        # than wrap: open-mpi/ompi#8045, wontfix; seen in 5.0.11, uint8 250 + 10 gave 255)
        return op in _OPS and not (op == "sum" and dtype.itemsize < 4)
    return op in (("sum", "prod") if dtype.kind == "f" else ("sum",))


class HostCollectives:
    """This rank's end of the group's collectives by host (see the module). Made by every
    rank of the job at once (``Dup`` and ``Split`` are collective): ``host_of[r]`` is rank
    r's host; ``in_thread``: make the blocking calls in a helper thread (the master)."""

    def __init__(self, MPI, world, host_of: tuple, rank: int, in_thread: bool) -> None:
        self.MPI = MPI
        self.rank, self.size = rank, len(host_of)
        with mpi_errors(MPI):
            self.whole = world.Dup()
            self.whole.Set_errhandler(MPI.ERRORS_RETURN)  # (Split's communicators inherit it)
            host = host_of[rank]
            self.host = self.whole.Split(host, rank)
            self.leader = host_of.index(host) == rank
            self.leaders = self.whole.Split(0 if self.leader else MPI.UNDEFINED, rank)
        per_host = Counter(host_of)
        self.by_host = len(per_host) > 1 and max(per_host.values()) > 1
        self._scratch = np.empty(0, np.uint8)  # a leader's host partial, reused
        self._units: dict = {}  # bytes -> a contiguous MPI datatype of that many bytes
        self._helper = _Helper() if in_thread else None

    # -- how the calls are made ------------------------------------------------------------
    def run(self, fn, *args):
        """``fn(*args)`` (which makes blocking MPI calls here), in the helper thread on the
        master; its result, or its exception."""
        if self._helper is None:
            return fn(*args)
        return self._helper.run(fn, args)

    def close(self) -> None:
        """Stop the helper thread (the communicators go with MPI's finalize)."""
        if self._helper is not None:
            self._helper.stop()

    # -- the collectives (blocking) --------------------------------------------------------
    def reduce(self, part: np.ndarray, op: str, out: np.ndarray | None) -> None:
        """Every rank's ``part`` (C-contiguous; one shape and a dtype that ``exact`` takes,
        the same on every rank) combined with ``op`` into ``out`` on rank 0 (None
        elsewhere), by host where a host runs several ranks."""
        MPI = self.MPI
        kind = getattr(MPI, _TYPES[part.dtype])
        mpi_op = getattr(MPI, _OPS[op])
        with mpi_errors(MPI):
            if self.by_host and self.host.Get_size() > 1:
                if not self.leader:
                    self.host.Reduce([part, kind], None, op=mpi_op, root=0)
                    return
                into = out if self.rank == 0 else self._partial(part)
                self.host.Reduce([part, kind], [into, kind], op=mpi_op, root=0)
                part = into
            if self.rank == 0:
                send = MPI.IN_PLACE if part is out else [part, kind]
                self.leaders.Reduce(send, [out, kind], op=mpi_op, root=0)
            else:
                self.leaders.Reduce([part, kind], None, op=mpi_op, root=0)

    def gather(self, part: np.ndarray, counts: list, out: np.ndarray | None,
               unit: int) -> None:
        """Every rank's ``part`` (C-contiguous bytes: ``counts[r]`` units of ``unit`` bytes
        from rank r) joined in rank order into ``out`` on rank 0 (None elsewhere)."""
        MPI = self.MPI
        if max(counts) >= 1 << 31:
            raise ValueError(f"an output of {max(counts) * unit} bytes on one rank is too "
                             "large for one MPI message; return it in smaller parts")
        kind = self._unit(unit)
        starts = np.cumsum([0, *counts[:-1]]).tolist()
        mine = part.reshape(-1).view(np.uint8)
        with mpi_errors(MPI):
            self.whole.Gatherv([mine, counts[self.rank], kind],
                               [out.reshape(-1).view(np.uint8), (counts, starts), kind]
                               if self.rank == 0 else None, root=0)

    def _partial(self, part: np.ndarray) -> np.ndarray:
        """A leader's buffer for its host's partial (the same memory every call)."""
        if self._scratch.nbytes < part.nbytes:
            self._scratch = np.empty(part.nbytes, np.uint8)
        return self._scratch[:part.nbytes].view(part.dtype).reshape(part.shape)

    def _unit(self, nbytes: int):
        """A committed MPI datatype of ``nbytes`` contiguous bytes (made once)."""
        kind = self._units.get(nbytes)
        if kind is None:
            if nbytes == 1:
                kind = self.MPI.BYTE
            else:
                kind = self.MPI.BYTE.Create_contiguous(nbytes)
                kind.Commit()
            self._units[nbytes] = kind
        return kind


class _Helper:
    """The master's thread for blocking MPI calls: ``run`` hands it one call at a time and
    waits for it in ``_WAIT_SLICE`` slices (the watchdog's interrupt lands between them).
    Interrupted, the caller leaves the call behind: the group is broken then, and the job
    ends with the thread in it."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def run(self, fn, args: tuple):
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="synk-mpi-collectives",
                                            daemon=True)
            self._thread.start()
        done = threading.Event()
        box: dict[str, Any] = {}
        self._jobs.put((fn, args, box, done))
        try:
            while not done.wait(_WAIT_SLICE):
                pass
        except BaseException:
            self._thread = None  # (it stays in MPI; a later call gets a new one)
            raise
        if "error" in box:
            raise box["error"]
        return box["result"]

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, box, done = job
            try:
                box["result"] = fn(*args)
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            finally:
                done.set()

    def stop(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=1.0)
            self._thread = None
