"""Run under mpiexec (by ``python -m synk.bench --mpi``): ``python -m synk.bench.mpi_hosts
synk|mpi CALLS REPEAT SIZE...``. World rank 0 prints one JSON line:
``{"call": seconds, "outputs": {bytes: s}, "comm": {bytes: s}, "data_in": {bytes: s},
"numpy_in": {bytes: s}}`` for ``synk`` (a group over the job's processes: a no-op call, a
function's outputs reduced with ``"sum"``, ``synk.comm.allreduce`` inside a function, and a
call whose scattered input is a ``Data``, kept on the other host between calls, or a numpy
array, sent with every call), or ``{"call": s, "allreduce": {bytes: s}, "scatter": {bytes:
s}}`` for ``mpi`` (mpi4py alone: the same round trip a call makes — rank 0 sends every rank a
small message and waits for each one's answer, ``bcast`` then ``gather`` — ``Allreduce``,
and ``Scatter`` from rank 0)."""
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
    first = synk.function(first_value, reduce="sum")
    out["data_in"], out["numpy_in"] = {}, {}
    for nbytes in sizes:
        x = np.ones((max(nbytes // 512, n), 64))
        d = synk.data(x)
        assert first(d) == n and first(x) == n
        out["data_in"][nbytes] = median_time(lambda: first(d), repeat)  # noqa: B023
        out["numpy_in"][nbytes] = median_time(lambda: first(x), repeat)  # noqa: B023
        d.free()
    synk.close()
    return out


def first_value(x) -> float:
    """A function that reads one value of its rows: the call costs what moving them does."""
    return float(x[0, 0])


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
    times, scatter = {}, {}
    for nbytes in sizes:
        src = np.ones(nbytes // 4, np.float32)
        dst = np.empty_like(src)
        mine = collective_time(lambda: comm.Allreduce(src, dst, op=MPI.SUM), comm.Barrier,
                               repeat, nbytes)
        times[nbytes] = comm.allreduce(mine, op=MPI.MAX)
        whole = np.ones((max(nbytes // 512, comm.size) // comm.size * comm.size, 64))
        part = np.empty((len(whole) // comm.size, 64))
        mine = collective_time(lambda: comm.Scatter(whole, part, root=0), comm.Barrier,
                               repeat, nbytes)
        scatter[nbytes] = comm.allreduce(mine, op=MPI.MAX)
    return ({"call": call_s, "allreduce": times, "scatter": scatter} if comm.rank == 0
            else None)


def main() -> None:
    kind, calls, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(s) for s in sys.argv[4:]]
    out = _synk(calls, repeat, sizes) if kind == "synk" else _mpi(calls, repeat, sizes)
    if out is not None:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
