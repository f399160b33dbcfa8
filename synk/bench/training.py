"""A data-parallel training step, and the gradient averaging it is made of, against the same
written by hand with mpi4py (``mpi_training``, under the ``mpiexec`` of the ``mpi`` extra) and
in one process.
"""
from __future__ import annotations

import statistics

import numpy as np

import synk

from .. import comm
from . import mlp
from ._timing import as_a_scripts, collective_time, group, median_time, result, size_label
from .mpi_baselines import run_baseline

BENCH = "training"
ROUNDS = 3
FUSED_SIZES = [100_000, 4 << 20, 32 << 20]
STEPS_PER_CALL = 50


def train_step(W1, b1, W2, b2, x, y):
    """Route B's step on one rank: its rows' gradients, averaged over the ranks, applied to
    the rank's replicas in place."""
    params = (W1, b1, W2, b2)
    loss, grads = mlp.loss_and_grads(*params, x, y)
    grads = comm.allreduce(grads, "mean", weight=len(x))
    mlp.update(params, grads)
    return loss


def persistent_step(W1, b1, W2, b2, x, y, state):
    """Route B's step with the gradients' mean a persistent allreduce, made at the call's
    first step (``state``: this rank's, for the call) over arrays the gradients go into."""
    params = (W1, b1, W2, b2)
    loss, grads = mlp.loss_and_grads(*params, x, y)
    if "mean" not in state:
        state["grads"] = [np.empty_like(g) for g in grads]
        state["mean"] = comm.allreduce_init(state["grads"], "mean")
    for into, g in zip(state["grads"], grads):
        into[...] = g
    mlp.update(params, state["mean"](weight=len(x)))
    return loss


def _gradient_list(nbytes: int) -> list:
    """Four float32 arrays of ``nbytes`` in all, shaped as a model's gradients are."""
    n = nbytes // 4
    big = n - 3 * (n // 64)
    return [np.ones(big, np.float32), np.ones(n // 64, np.float32),
            np.ones((n // 64,), np.float32), np.ones(n // 64, np.float32)]


def fused_times(rows, sizes: list, repeat: int) -> list:
    """On every rank: seconds per fused weighted mean of a gradient list of each size,
    weighted as a training step weighs it (``route B``): by the rows of the call this rank
    took (``rows``, scattered); then the same by a persistent allreduce of the list."""
    out = []
    weight = len(rows)
    for nbytes in sizes:
        grads = _gradient_list(nbytes)
        got = comm.allreduce(grads, "mean", weight=weight)
        assert got[0][0] == 1.0 and got[-1][-1] == 1.0
        out.append(collective_time(lambda: comm.allreduce(grads, "mean", weight=weight),
                                   comm.barrier, repeat, nbytes))
    for nbytes in sizes:
        mean = comm.allreduce_init(_gradient_list(nbytes), "mean")
        out.append(collective_time(lambda: mean(weight=weight), comm.barrier, repeat,
                                   nbytes))
        mean.free()
    return out


def _synk_round(ranks: int, steps: int, repeat: int, sizes: list) -> dict:
    """synk's figures: seconds per step of ``mlp``'s step (an MLP of MNIST's sizes, float32, 20 rows
    a step out of a ``synk.Data``, ``batch=``) in docs/training.md's routes, and ``fused_times``'s
    seconds per mean: route A (broadcast weights, gradients combined with ``reduce="mean"``, the
    master updates); route B (``synk.shared`` replicas, gradients by ``synk.comm.allreduce(grads,
    "mean", weight=len(x))``); route B bound, submitted, and on a ``fork(restarts=2)`` group
    (``_with_restarts``); and the loop on the ranks (``bound.steps``, ``STEPS_PER_CALL`` steps a
    call), also with a persistent allreduce (``allreduce_init``): a call's time over its steps."""
    x, y = mlp.data()
    batches = mlp.batches(steps)
    with group(ranks):
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
        calls = [batches[k:k + STEPS_PER_CALL] for k in range(0, steps, STEPS_PER_CALL)]
        c = median_time(lambda: bound.steps(calls[next(turn) % len(calls)]),
                        max(repeat, 5)) / len(calls[0])
        persistent = synk.function(as_a_scripts(persistent_step), inputs=["x", "y"],
                                   bcast_inputs=["state"], reduce="mean").bind(*shared, xd, yd)
        c_persistent = median_time(
            lambda: persistent.steps(calls[next(turn) % len(calls)], state={}),
            max(repeat, 5)) / len(calls[0])
        fused = np.atleast_1d(synk.function(fused_times, inputs=["rows"], reduce="max")(
            np.zeros(mlp.BATCH), sizes, repeat))  # the slowest rank's
    return {"route_a": a, "route_b": b, "route_b_bound": b_bound,
            "route_b_submitted": b_submitted, "route_b_steps": c,
            "route_b_steps_persistent": c_persistent,
            "route_b_restarts": _with_restarts(ranks, steps, x, y, batches),
            "fused": dict(zip(sizes, fused[:len(sizes)])),
            "persistent": dict(zip(sizes, fused[len(sizes):]))}


def _with_restarts(ranks: int, steps: int, x, y, batches) -> float:
    """Route B's bound step on a group of ``fork(restarts=2)``: each call keeps a copy of
    its shared variables, in case a rank dies (none does here)."""
    with group(ranks, restarts=2):
        shared = [synk.shared(p) for p in mlp.params()]
        step = synk.function(as_a_scripts(train_step), inputs=["x", "y"], reduce="mean")
        bound = step.bind(*shared, synk.data(x), synk.data(y))
        turn = iter(range(1 << 62))
        return median_time(lambda: bound(batch=batches[next(turn) % steps]), steps,
                           warmup=20)


def _one_process(steps: int) -> float:
    x, y = mlp.data()
    params, batches = mlp.params(), mlp.batches(steps)
    turn = iter(range(1 << 62))

    def step():
        idx = batches[next(turn) % steps]
        _, grads = mlp.loss_and_grads(*params, x[idx], y[idx])
        mlp.update(params, grads)

    return median_time(step, steps, warmup=20)


def run(ranks: int, steps: int, repeat: int, sizes: list, rounds: int = ROUNDS) -> list[dict]:
    """The rows: the step's routes (``_synk_round``), and a fused weighted mean of a float32
    gradient list (four arrays) of each of ``sizes`` (``FUSED_SIZES``: 100 KB, 4 MB and 32 MB,
    at most ``--max-size``) inside a function, each rank's weight its rows of the call (as
    route B's step weighs its gradients), and the same as a persistent allreduce, against
    mpi4py's ``Allreduce`` of the same bytes. synk and mpi4py run in turns (``rounds`` of
    them) and each figure is the median of its rounds' medians, so that a change of the
    machine's load falls on both."""
    sizes = sorted(set(sizes))
    synk_runs, mpi_runs = [], []
    for _ in range(rounds):  # in turns, so that the machine's load falls on both
        synk_runs.append(_synk_round(ranks, steps, repeat, sizes))
        got = run_baseline("synk.bench.mpi_training", ranks, [steps, repeat, *sizes],
                           "mpi4py training baseline")
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
            ("route_b_steps", f"route B as step.steps(...), {STEPS_PER_CALL} steps a call",
             "route_b"),
            ("route_b_steps_persistent", f"route B as step.steps(...), {STEPS_PER_CALL} steps "
             "a call, persistent mean", "route_b")):
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
        label = size_label(nbytes)
        for key, name in (("fused", "synk.comm fused weighted mean"),
                          ("persistent", "synk.comm persistent fused weighted mean")):
            mine = med(synk_runs, key, nbytes)
            if mpi_runs:
                mpi = med(mpi_runs, "allreduce", nbytes)
                rows.append(result(BENCH, f"{name}, {label}", mine, "mpi4py Allreduce", mpi,
                                   ranks=ranks, bytes=nbytes, vs_mpi=mpi / mine,
                                   target="<= 1.0x mpi4py's Allreduce"))
            else:
                rows.append(result(BENCH, f"{name}, {label}", mine, "itself", mine,
                                   ranks=ranks, bytes=nbytes))
        if mpi_runs:
            rows.append(result(BENCH, f"mpi4py Allreduce, {label}", mpi, "mpi4py Allreduce",
                               mpi, ranks=ranks, bytes=nbytes))
    return rows
