"""Run under mpiexec by ``cluster`` (``python -m synk.bench --mpi``): ``python -m
synk.bench.mpi_hosts KIND CALLS REPEAT SIZE...``. World rank 0 prints one JSON line, the
figures of KIND (``_KINDS``: synk's, or mpi4py's alone, of ``cluster.run``'s rows; synk's or
mpi4py's combine, of ``cluster.run_combine``'s), each seconds or {bytes: seconds}."""
import json
import sys
from typing import Any

import numpy as np

from ._timing import collective_time, median_time, mpi_allreduce_times


def _synk(calls: int, repeat: int, sizes: list[int]) -> dict:
    import synk

    from .allreduce import comm_times as comm_allreduce_times, held_array
    from .calls import noop

    n = synk.fork()  # the workers serve inside fork() and exit at close()
    f = synk.function(noop, reduce=None)
    out: dict[str, Any] = {"call": median_time(f, calls, warmup=50), "outputs": {}}
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
    times, scatter = mpi_allreduce_times(comm, sizes, repeat), {}
    for nbytes in sizes:
        whole = np.ones((max(nbytes // 512, comm.size) // comm.size * comm.size, 64))
        part = np.empty((len(whole) // comm.size, 64))
        mine = collective_time(lambda: comm.Scatter(whole, part, root=0), comm.Barrier,
                               repeat, nbytes)
        scatter[nbytes] = comm.allreduce(mine, op=MPI.MAX)
    return ({"call": call_s, "allreduce": times, "scatter": scatter} if comm.rank == 0
            else None)


_held: dict = {}


def held_f64(n: int) -> np.ndarray:
    """Each rank's own output: ``n`` float64 ones, made once (not part of the timing)."""
    if n not in _held:
        _held.clear()
        _held[n] = np.ones(n)
    return _held[n]


def _synk_combine(calls: int, repeat: int, sizes: list[int]) -> dict:
    """A call whose only work is combining every rank's output of S bytes with "sum"; and a
    no-op call in the same layout (what a call costs without outputs)."""
    import synk

    from .calls import noop

    n = synk.fork()
    g = synk.function(held_f64, bcast_inputs=["n"], reduce="sum")
    times = {}
    for nbytes in sizes:
        assert g(nbytes // 8)[0] == n
        times[nbytes] = median_time(lambda: g(nbytes // 8), repeat)  # noqa: B023
    call = median_time(synk.function(noop, reduce=None), max(calls, 10 * repeat), warmup=20)
    synk.close()
    return {"combine": times, "call": call}


def _mpi_combine(calls: int, repeat: int, sizes: list[int]) -> dict | None:
    """mpi4py's ``Reduce`` to rank 0 of S bytes from every rank: flat, and by host (each host's
    ranks to its first, over the host's communicator; then the hosts' first ranks to rank 0)."""
    import os

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    hosts = comm.allgather(os.environ.get("SYNK_HOST_ID", ""))
    color = sorted(set(hosts), key=hosts.index).index(hosts[comm.rank])
    host = comm.Split(color, comm.rank)
    leaders = comm.Split(0 if host.rank == 0 else MPI.UNDEFINED, comm.rank)
    flat, by_host = {}, {}
    for nbytes in sizes:
        src = np.ones(nbytes // 8)
        part, dst = np.empty_like(src), np.empty_like(src)

        def two_level():
            host.Reduce(src, part, op=MPI.SUM, root=0)
            if leaders != MPI.COMM_NULL:
                leaders.Reduce(part, dst, op=MPI.SUM, root=0)

        mine = collective_time(lambda: comm.Reduce(src, dst, op=MPI.SUM, root=0),  # noqa: B023
                               comm.Barrier, repeat, nbytes)
        flat[nbytes] = comm.allreduce(mine, op=MPI.MAX)
        mine = collective_time(two_level, comm.Barrier, repeat, nbytes)
        by_host[nbytes] = comm.allreduce(mine, op=MPI.MAX)
    return {"reduce": flat, "reduce_by_host": by_host} if comm.rank == 0 else None


_KINDS = {"synk": _synk, "mpi": _mpi, "synk-combine": _synk_combine,
          "mpi-combine": _mpi_combine}


def main() -> None:
    kind, calls, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sizes = [int(s) for s in sys.argv[4:]]
    out = _KINDS[kind](calls, repeat, sizes)
    if out is not None:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
