"""Run under mpiexec: ``python -m synk.bench.mpi_allreduce REPEAT CALLS SIZE...``; rank 0
prints, as JSON, mpi4py's times for what synk's rows measure, each the slowest rank's:
``allreduce`` {bytes: seconds per Allreduce(SUM) on float32} and ``barrier`` (seconds per
Barrier), timed as ``collective_time`` times synk.comm; ``call``: the median seconds of the
MPI form of a tiny call (rank 0 broadcasts the arguments, every rank sums its share of the
array, the results are reduced to rank 0), over CALLS of them, as synk's call rows."""
import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from ._timing import collective_time, mpi_allreduce_times


def tiny_call_times(comm, calls: int) -> float:
    x, y = (np.arange(16.0), 3.0) if comm.rank == 0 else (None, None)
    times = []
    comm.Barrier()
    for i in range(calls + 50):  # back to back, as synk's calls are timed
        start = time.perf_counter()
        xs, ys = comm.bcast((x, y), root=0)
        lo, hi = len(xs) * comm.rank // comm.size, len(xs) * (comm.rank + 1) // comm.size
        total = comm.reduce(xs[lo:hi].sum() * ys, op=MPI.SUM, root=0)
        if i >= 50:
            times.append(time.perf_counter() - start)
        if comm.rank == 0:
            assert total == np.arange(16.0).sum() * 3.0
    return statistics.median(times)


def main() -> None:
    comm = MPI.COMM_WORLD
    repeat, calls, sizes = int(sys.argv[1]), int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
    times = mpi_allreduce_times(comm, sizes, repeat)
    barrier = comm.allreduce(collective_time(comm.Barrier, comm.Barrier, repeat, 0), op=MPI.MAX)
    call = comm.allreduce(tiny_call_times(comm, calls), op=MPI.MAX)
    if comm.rank == 0:
        print(json.dumps({"allreduce": times, "barrier": barrier, "call": call}))


if __name__ == "__main__":
    main()
