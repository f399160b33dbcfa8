"""MPI's own collectives for synk's exchanges between hosts, on communicators made once per
group: every rank (a ``COMM_WORLD`` duplicate apart from synk.comm's), each host's ranks, and
the hosts' first ranks (*leaders*), from ``Split`` by host.

::

    reduce   each host's ranks -> its leader (``host``) -> rank 0 (``leaders``)
    gather   every rank's rows -> rank 0, in rank order (``Gatherv`` on ``whole``)
"""
from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence

import numpy as np

from .mpi_mesh import Backoff, mpi_errors

# synk's op names -> MPI's
_OPS = {"sum": "SUM", "prod": "PROD", "max": "MAX", "min": "MIN", "band": "BAND",
        "bor": "BOR", "bxor": "BXOR", "land": "LAND", "lor": "LOR", "lxor": "LXOR"}
# the dtypes MPI reduces, and their MPI datatypes (fixed-size types: the same on every host)
_KEPT, _SHAPES = 2, 16  # result arrays kept for reuse: of each shape and dtype, and shapes
_TYPES = {np.dtype(t): name for t, name in (
    (np.int8, "INT8_T"), (np.int16, "INT16_T"), (np.int32, "INT32_T"), (np.int64, "INT64_T"),
    (np.uint8, "UINT8_T"), (np.uint16, "UINT16_T"), (np.uint32, "UINT32_T"),
    (np.uint64, "UINT64_T"), (np.float32, "FLOAT"), (np.float64, "DOUBLE"),
    (np.complex64, "C_FLOAT_COMPLEX"), (np.complex128, "C_DOUBLE_COMPLEX"))}


def exact(dtype: np.dtype, op: str) -> bool:
    """Whether MPI's built-in ``op`` on arrays of ``dtype`` gives numpy's answer (callers
    gather and combine with numpy what it refuses). Integers: every op but sums of 8- and
    16-bit ones (in any order, the same bits). Floats: ``sum`` and ``prod`` (in MPI's order:
    the last bits may differ), not ``max``/``min`` (MPI compares with ``>``; numpy
    propagates NaN, keeps the first of equal values). Complex: ``sum`` only."""
    if dtype not in _TYPES or not dtype.isnative:
        return False
    if dtype.kind in "iu":  # (Open MPI's AVX sums of 8- and 16-bit integers saturate rather
        # than wrap: open-mpi/ompi#8045, wontfix; seen in 5.0.11, uint8 250 + 10 gave 255)
        return op in _OPS and not (op == "sum" and dtype.itemsize < 4)
    return op in (("sum", "prod") if dtype.kind == "f" else ("sum",))


class HostCollectives:
    """This rank's end of the group's collectives by host, made by every rank at once
    (``Dup``, ``Split``); ``host_of[r]``: rank r's host. Its calls block the calling thread
    (releasing the GIL). A rank waiting for a peer that is gone may never return: the job
    ends then (``_engine.mpi_job``; the master's watchdog where the master waits:
    ``Group.watched(blocking=True)``)."""

    def __init__(self, MPI, world, host_of: tuple, rank: int) -> None:
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
        self._results: dict = {}  # rank 0: (shape, dtype) -> arrays handed out as results
        self._units: dict = {}  # bytes -> a contiguous MPI datatype of that many bytes

    # -- the collectives (blocking) --------------------------------------------------------
    def arrive(self, flags: Sequence[bool] = ()) -> list:
        """Return once every rank has called it, waiting with a ``Backoff`` rather than in
        MPI's busy loop: the first rank there leaves its core to the others, the watchdog's
        interrupt lands on the master, and the blocking collectives after wait on no one.
        ``flags`` (as many on every rank): each, whether set on some rank."""
        MPI = self.MPI
        mine = np.array(flags, np.uint8)
        anywhere = np.zeros_like(mine)
        with mpi_errors(MPI):
            if mine.size:
                request = self.whole.Iallreduce(mine, anywhere, op=MPI.MAX)
            else:
                request = self.whole.Ibarrier()
            backoff = Backoff()
            while not request.Test():
                backoff.wait()
        return anywhere.astype(bool).tolist()

    def reduce(self, part: np.ndarray, op: str, out: np.ndarray | None) -> None:
        """Every rank's ``part`` (C-contiguous, one shape, a dtype ``exact`` takes) combined
        with ``op`` into ``out`` on rank 0 (None elsewhere): by host, then the leaders, so
        the bytes cross between hosts once per host (as MPI's hierarchical collectives)."""
        MPI = self.MPI
        kind = getattr(MPI, _TYPES[part.dtype])
        mpi_op = getattr(MPI, _OPS[op])
        with mpi_errors(MPI):
            if self.by_host and self.host.Get_size() > 1:
                if not self.leader:
                    self.host.Reduce([part, kind], None, op=mpi_op, root=0)
                    return
                into = out if self.rank == 0 else self._partial(part)
                assert into is not None  # (rank 0 passes its result)
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
        into = None if out is None else [out.reshape(-1).view(np.uint8), (counts, starts), kind]
        with mpi_errors(MPI):
            self.whole.Gatherv([mine, counts[self.rank], kind], into, root=0)

    def result(self, shape: tuple, dtype) -> np.ndarray:
        """Rank 0: an array to receive into, one handed out before that nobody holds any more
        (the last ``_KEPT`` per shape and dtype), else new: Open MPI receives 7 to 40 times
        faster into memory it received into before (a Reduce of 1 MiB on 2 ranks)."""
        key = (tuple(shape), np.dtype(dtype))
        kept = self._results.setdefault(key, [])
        for i in range(len(kept)):
            # (held by the list, by getrefcount's argument, and by nothing else)
            if sys.getrefcount(kept[i]) == 2:
                return kept[i]
        array = np.empty(shape, dtype)
        kept.insert(0, array)
        del kept[_KEPT:]
        if len(self._results) > _SHAPES:
            del self._results[next(iter(self._results))]
        return array

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
