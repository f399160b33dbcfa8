"""Run under mpiexec (by ``python -m synk.bench --mpi``): ``python -m synk.bench.mpi_hosts
synk|mpi CALLS REPEAT SIZE...``. World rank 0 prints one JSON line:
``{"call": seconds, "outputs": {bytes: s}, "comm": {bytes: s}}`` for ``synk`` (a group
over the job's processes: a no-op call, a function's outputs reduced with ``"sum"``, and
``synk.comm.allreduce`` inside a function), or ``{"call": s, "allreduce": {bytes: s}}`` for
``mpi`` (mpi4py alone: the same round trip a call makes — rank 0 sends every rank a small
message and waits for each one's answer, ``bcast`` then ``gather`` — and ``Allreduce``)."""
import json
import sys

import numpy as np

from synk.bench._timing import collective_time, median_time


def _synk(calls: int, repeat: int, sizes: list[int]) -> dict:
    import synk

    from .allreduce import comm_times as comm_allreduce_times, held_array
    from .calls import noop

    n = synk.fork()  # the workers serve inside fork() and exit at close()
    f = synk.function(noop, reduce=None)
    out = {"call": median_time(f, calls, warmup=50), "outputs": {}}
    g = synk.function(held_array, bcast_inputs=["n"], reduce="sum")
    for nbytes in sizes:
        result = g(nbytes // 4)
        assert result[0] == n and result[-1] == n
        out["outputs"][nbytes] = median_time(lambda: g(nbytes // 4), repeat)
    in_fn = synk.function(comm_allreduce_times, bcast_inputs=["sizes", "repeat"], reduce="max")
    out["comm"] = dict(zip(sizes, map(float, in_fn(sizes, repeat))))
    synk.close()
    return out


def _mpi(calls: int, repeat: int, sizes: list[int]) -> dict | None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    request = ("call", 1)

    def call():  # what a synk call does: a message to every rank, an answer from each
        comm.bcast(request, root=0)
        comm.gather(None, root=0)

    if comm.rank == 0:
        call_s = median_time(call, calls, warmup=50)
        comm.bcast(None, root=0)
    else:
        while comm.bcast(None, root=0) is not None:
            comm.gather(None, root=0)
        call_s = 0.0
    times = {}
    for nbytes in sizes:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        mine = collective_time(lambda: comm.Allreduce(src, dst, op=MPI.SUM), comm.Barrier,
                               repeat, nbytes)
        times[nbytes] = comm.allreduce(mine, op=MPI.MAX)
    return {"call": call_s, "allreduce": times} if comm.rank == 0 else None


def main() -> None:
    kind, calls, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(s) for s in sys.argv[4:]]
    out = _synk(calls, repeat, sizes) if kind == "synk" else _mpi(calls, repeat, sizes)
    if out is not None:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
