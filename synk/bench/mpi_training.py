"""Run under mpiexec: ``python -m synk.bench.mpi_training STEPS REPEAT SIZE...``; rank 0
prints, as JSON, the hand-written mpi4py forms of what the ``training`` benchmark times, each
the slowest rank's median seconds: ``route_a`` and ``route_b`` (a step), and ``allreduce``
({bytes: seconds per ``Allreduce`` (sum) of float32}, as synk.comm's fused mean of a gradient
list of those bytes is compared with).
"""
import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from . import mlp
from ._timing import mpi_allreduce_times


def _rows(comm, idx):
    lo, hi = len(idx) * comm.rank // comm.size, len(idx) * (comm.rank + 1) // comm.size
    return idx[lo:hi]


def route_a(comm, x, y, steps: int) -> float:
    """A step as a master-driven loop writes it by hand: rank 0 ``Bcast``s the weights,
    every rank computes its rows' gradients, they are ``Reduce``d (sum of row-weighted
    gradients) to rank 0, which divides and updates."""
    params, times = mlp.params(), []
    flat = [np.empty_like(p) for p in params]
    for i, idx in enumerate(mlp.batches(steps + 20)):
        comm.Barrier()
        start = time.perf_counter()
        for p in params:
            comm.Bcast(p, root=0)
        rows = _rows(comm, idx)
        loss, grads = mlp.loss_and_grads(*params, x[rows], y[rows])
        for g, out in zip(grads, flat):
            g *= len(rows)
            comm.Reduce(g, out, op=MPI.SUM, root=0)
        if comm.rank == 0:
            mlp.update(params, [g / len(idx) for g in flat])
        if i >= 20:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def route_b(comm, x, y, steps: int) -> float:
    """Every rank keeps the weights, computes its rows' gradients, and one ``Allreduce`` of
    them packed in one buffer (each pre-scaled by its rows / the batch's) gives the mean,
    which every rank applies."""
    params, times = mlp.params(), []
    sizes = [p.size for p in params]
    send = np.empty(sum(sizes), mlp.DTYPE)
    recv = np.empty_like(send)
    for i, idx in enumerate(mlp.batches(steps + 20)):
        comm.Barrier()
        start = time.perf_counter()
        rows = _rows(comm, idx)
        loss, grads = mlp.loss_and_grads(*params, x[rows], y[rows])
        at, scale = 0, mlp.DTYPE(len(rows) / len(idx))
        for g in grads:
            np.multiply(g.reshape(-1), scale, out=send[at:at + g.size])
            at += g.size
        comm.Allreduce(send, recv, op=MPI.SUM)
        at = 0
        for p in params:
            p -= mlp.LR * recv[at:at + p.size].reshape(p.shape)
            at += p.size
        if i >= 20:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    comm = MPI.COMM_WORLD
    steps, repeat, sizes = int(sys.argv[1]), int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
    x, y = mlp.data()
    a = comm.allreduce(route_a(comm, x, y, steps), op=MPI.MAX)
    b = comm.allreduce(route_b(comm, x, y, steps), op=MPI.MAX)
    times = mpi_allreduce_times(comm, sizes, repeat)
    if comm.rank == 0:
        print(json.dumps({"route_a": a, "route_b": b, "allreduce": times}))


if __name__ == "__main__":
    main()
