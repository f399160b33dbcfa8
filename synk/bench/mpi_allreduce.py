"""Run under mpiexec: ``python -m synk.bench.mpi_allreduce REPEAT SIZE...``; rank 0 prints
{bytes: seconds per Allreduce(SUM) on float32, slowest rank} as JSON (``collective_time``)."""
import json
import sys

import numpy as np
from mpi4py import MPI

from synk.bench._timing import collective_time


def main() -> None:
    comm = MPI.COMM_WORLD
    repeat, sizes = int(sys.argv[1]), [int(s) for s in sys.argv[2:]]
    times = {}
    for nbytes in sizes:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)

        mine = collective_time(lambda: comm.Allreduce(src, dst, op=MPI.SUM), comm.Barrier,
                               repeat, nbytes)
        times[nbytes] = comm.allreduce(mine, op=MPI.MAX)  # the slowest rank, as for synk
    if comm.rank == 0:
        print(json.dumps(times))


if __name__ == "__main__":
    main()
