"""Run under mpiexec: ``python -m synk.bench.mpi_allreduce REPEAT SIZE...``; rank 0 prints
{bytes: median seconds of Allreduce(SUM) on float32} as JSON."""
import json
import sys

import numpy as np
from mpi4py import MPI

from synk.bench._timing import median_time


def main() -> None:
    comm = MPI.COMM_WORLD
    repeat, sizes = int(sys.argv[1]), [int(s) for s in sys.argv[2:]]
    times = {}
    for nbytes in sizes:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)

        def once():
            comm.Barrier()
            comm.Allreduce(src, dst, op=MPI.SUM)

        times[nbytes] = median_time(once, repeat)
        barrier_s = median_time(comm.Barrier, repeat)
        times[nbytes] = max(times[nbytes] - barrier_s, 1e-9)
    if comm.rank == 0:
        print(json.dumps(times))


if __name__ == "__main__":
    main()
