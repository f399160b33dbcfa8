"""A data-parallel training step, and the gradient averaging it is made of, against the same
written by hand with mpi4py (``mpi_training``, under the ``mpiexec`` of the ``mpi`` extra) and
in one process.

The step is ``mlp``'s: an MLP of MNIST's sizes (784 -> 32 -> 10), float32, 20 rows a step out
of a ``synk.Data`` (``batch=``), in docs/training.md's three routes:

* route A (the wrapper): the weights go as broadcast inputs every step, the gradients come
  back combined with ``reduce="mean"``, the master updates;
* route B (shared variables): the weights are ``synk.shared`` replicas kept on the ranks,
  the step averages its gradient list with ``synk.comm.allreduce(grads, "mean",
  weight=len(x))`` and every rank updates its replica;
* route B bound (``step.bind(*replicas, x, y)``, called with ``batch=``), the same
  submitted without waiting (``bound.submit``, a run of steps, the last one's loss read),
  and the bound step on a group of ``fork(restarts=2)`` (what keeping each call's shared
  variables, in case a rank dies, costs a step that has no failure);
* route C (the steps on the ranks): route B's steps, many in one call, each rank taking its
  rows of every step as ``batch=`` would split them: the hand-written MPI loop's shape,
  with no call per step. Its figure is a call's time over its steps.

Then a fused weighted mean of a float32 gradient list (four arrays) of 100 KB, 4 MB and
32 MB inside a function, each rank's weight its rows of the call (as route B's step
weighs its gradients), against mpi4py's ``Allreduce`` of the same bytes. synk and mpi4py
run in turns (``ROUNDS`` of them) and each figure is the median of its rounds' medians, so
that a change of the machine's load falls on both."""
from __future__ import annotations

import statistics

import numpy as np

import synk

from .. import comm
from . import mlp
from ._timing import as_a_scripts, collective_time, median_time, result, size_label
from .mpi_baselines import run_baseline

BENCH = "training"
ROUNDS = 3
FUSED_SIZES = [100_000, 4 << 20, 32 << 20]


def train_step(W1, b1, W2, b2, x, y):
    """Route B's step on one rank: its rows' gradients, averaged over the ranks, applied to
    the rank's replicas in place."""
    params = (W1, b1, W2, b2)
    loss, grads = mlp.loss_and_grads(*params, x, y)
    grads = comm.allreduce(grads, "mean", weight=len(x))
    mlp.update(params, grads)
    return loss


def train_steps(W1, b1, W2, b2, x, y, batches):
    """Route C: the steps of ``batches`` (one row of indices each) in one call, on every
    rank its rows of each step (split as ``batch=`` splits a call's rows), averaged and
    applied as route B's step does; each step's loss over its batch (summed over the
    ranks: ``reduce="sum"``)."""
    params = (W1, b1, W2, b2)
    mine = np.array_split(batches, comm.size(), axis=1)[comm.rank()]
    losses = np.empty(len(mine))
    for step, rows in enumerate(mine):
        share = len(rows) / batches.shape[1]  # (the shares sum to 1, as a call's rows do:
        loss, grads = mlp.loss_and_grads(*params, x[rows], y[rows])  # route B's factors)
        grads = comm.allreduce(grads, "mean", weight=share)
        mlp.update(params, grads)
        losses[step] = loss * share
    return losses


def _gradient_list(nbytes: int) -> list:
    """Four float32 arrays of ``nbytes`` in all, shaped as a model's gradients are."""
    n = nbytes // 4
    big = n - 3 * (n // 64)
    return [np.ones(big, np.float32), np.ones(n // 64, np.float32),
            np.ones((n // 64,), np.float32), np.ones(n // 64, np.float32)]


def fused_times(rows, sizes: list, repeat: int) -> list:
    """On every rank: seconds per fused weighted mean of a gradient list of each size,
    weighted as a training step weighs it (``route B``): by the rows of the call this rank
    took (``rows``, scattered)."""
    out = []
    weight = len(rows)
    for nbytes in sizes:
        grads = _gradient_list(nbytes)
        got = comm.allreduce(grads, "mean", weight=weight)
        assert got[0][0] == 1.0 and got[-1][-1] == 1.0
        out.append(collective_time(lambda: comm.allreduce(grads, "mean", weight=weight),
                                   comm.barrier, repeat, nbytes))
    return out


def _synk_round(ranks: int, steps: int, repeat: int, sizes: list) -> dict:
    x, y = mlp.data()
    batches = mlp.batches(steps)
    synk.fork(ranks)
    try:
        xd, yd = synk.data(x), synk.data(y)
        params = mlp.params()
        grads_of = synk.function(as_a_scripts(mlp.loss_and_grads), inputs=["x", "y"],
                                 reduce="mean")
        turn = iter(range(1 << 62))

        def step_a():
            _, grads = grads_of(*params, xd, yd, batch=batches[next(turn) % steps])
            mlp.update(params, grads)

        a = median_time(step_a, steps, warmup=20)
        shared = [synk.shared(p) for p in mlp.params()]
        step = synk.function(as_a_scripts(train_step), inputs=["x", "y"], reduce="mean")
        b = median_time(lambda: step(*shared, xd, yd, batch=batches[next(turn) % steps]),
                        steps, warmup=20)
        bound = step.bind(*shared, xd, yd)
        b_bound = median_time(lambda: bound(batch=batches[next(turn) % steps]), steps,
                              warmup=20)

        def submitted() -> None:  # a run of steps submitted, the last one's loss read
            futures = [bound.submit(batch=batches[next(turn) % steps]) for _ in range(steps)]
            futures[-1].result()

        b_submitted = median_time(submitted, max(repeat, 5), warmup=1) / steps
        steps_of = synk.function(as_a_scripts(train_steps), bcast_inputs=["x", "y", "batches"],
                                 reduce="sum")
        every = np.array(batches)
        c = median_time(lambda: steps_of(*shared, xd, yd, every), max(repeat, 5)) / steps
        fused = synk.function(fused_times, inputs=["rows"], reduce="max")(
            np.zeros(mlp.BATCH), sizes, repeat)  # the slowest rank's
    finally:
        synk.close()
    return {"route_a": a, "route_b": b, "route_b_bound": b_bound,
            "route_b_submitted": b_submitted, "route_c": c,
            "route_b_restarts": _with_restarts(ranks, steps, x, y, batches),
            "fused": dict(zip(sizes, np.atleast_1d(fused)))}


def _with_restarts(ranks: int, steps: int, x, y, batches) -> float:
    """Route B's bound step on a group of ``fork(restarts=2)``: each call keeps a copy of
    its shared variables, in case a rank dies (none does here)."""
    synk.fork(ranks, restarts=2)
    try:
        shared = [synk.shared(p) for p in mlp.params()]
        step = synk.function(as_a_scripts(train_step), inputs=["x", "y"], reduce="mean")
        bound = step.bind(*shared, synk.data(x), synk.data(y))
        turn = iter(range(1 << 62))
        return median_time(lambda: bound(batch=batches[next(turn) % steps]), steps,
                           warmup=20)
    finally:
        synk.close()


def _mpi_round(ranks: int, steps: int, repeat: int, sizes: list) -> dict:
    return run_baseline("synk.bench.mpi_training", ranks, [steps, repeat, *sizes],
                        "mpi4py training baseline")


def _one_process(steps: int) -> float:
    x, y = mlp.data()
    params, batches = mlp.params(), mlp.batches(steps)
    turn = iter(range(1 << 62))

    def step():
        idx = batches[next(turn) % steps]
        _, grads = mlp.loss_and_grads(*params, x[idx], y[idx])
        mlp.update(params, grads)

    return median_time(step, steps, warmup=20)


def run(ranks: int, steps: int, repeat: int, sizes: list | None = None,
        rounds: int = ROUNDS) -> list[dict]:
    sizes = FUSED_SIZES if sizes is None else sorted(set(sizes))
    synk_runs, mpi_runs = [], []
    for _ in range(rounds):  # in turns, so that the machine's load falls on both
        synk_runs.append(_synk_round(ranks, steps, repeat, sizes))
        got = _mpi_round(ranks, steps, repeat, sizes)
        if got:
            mpi_runs.append(got)
    alone = _one_process(steps)

    def med(runs, key, size=None):
        return statistics.median(r[key] if size is None else r[key][size] for r in runs)

    rows = []
    for key, name, theirs in (
            ("route_a", "route A (broadcast weights, reduce='mean')", "route_a"),
            ("route_b", "route B (shared weights, comm mean)", "route_b"),
            ("route_b_bound", "route B as a bound step", "route_b"),
            ("route_b_submitted", "route B as a bound step submitted", "route_b"),
            ("route_b_restarts", "route B as a bound step, fork(restarts=2)", "route_b"),
            ("route_c", "route C (route B's steps, many in a call)", "route_b")):  # (its loop)
        mine = med(synk_runs, key)
        if mpi_runs:
            mpi = med(mpi_runs, theirs)
            rows.append(result(BENCH, f"synk {name}, {ranks} ranks", mine, "mpi4py by hand",
                               mpi, ranks=ranks, vs_mpi=mpi / mine,
                               target=f"<= 1.0x the mpi4py {theirs.replace('_', ' ')} step",
                               alone_s=alone))
            if theirs == key:
                rows.append(result(BENCH, f"mpi4py {key.replace('_', ' ')}, {ranks} ranks",
                                   mpi, "mpi4py by hand", mpi, ranks=ranks))
        else:
            rows.append(result(BENCH, f"synk {name}, {ranks} ranks", mine,
                               "the step in one process", alone, ranks=ranks))
    rows.append(result(BENCH, "the step in one process", alone, "the step in one process",
                       alone))
    for nbytes in sizes:
        mine = med(synk_runs, "fused", nbytes)
        label = size_label(nbytes)
        if mpi_runs:
            mpi = med(mpi_runs, "allreduce", nbytes)
            rows.append(result(BENCH, f"synk.comm fused weighted mean, {label}", mine,
                               "mpi4py Allreduce", mpi, ranks=ranks, bytes=nbytes,
                               vs_mpi=mpi / mine,
                               target="<= 1.5x mpi4py at 100 KB, <= 1.0x from 4 MB"))
            rows.append(result(BENCH, f"mpi4py Allreduce, {label}", mpi, "mpi4py Allreduce",
                               mpi, ranks=ranks, bytes=nbytes))
        else:
            rows.append(result(BENCH, f"synk.comm fused weighted mean, {label}", mine,
                               "itself", mine, ranks=ranks, bytes=nbytes))
    return rows
