"""A data-parallel training step of torch and of JAX through synk, against their own way
(torch DDP on gloo; mpi4jax under ``mpiexec``), the two taking turns so that both see the same
machine.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

import synk

from ._timing import as_a_scripts, group, result
from .mpi_baselines import launch

BENCH = "frameworks"
ROWS, FEATURES, HIDDEN, CLASSES, BATCH = 10_000, 784, 32, 10, 20
ROUNDS, STEPS = 4, 100

# A baseline's processes, once started: steps in turns of the count read from rank 0's
# stdin (0 ends them), each turn's step times printed by rank 0 on a line.
_TURNS = r'''
while True:
    n = {count}
    if n == 0:
        break
    for _ in range(min(n, 10)):
        step()
    {barrier}
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    {barrier}
    if {prints}:
        print(" ".join(f"{{t:.9f}}" for t in times), flush=True)
'''

_DDP = r'''
import os, sys, time
import numpy as np, torch, torch.distributed as dist
torch.set_num_threads(1)
rank, size = int(sys.argv[1]), int(sys.argv[2])
kind, spec, batch = sys.argv[3], sys.argv[4], int(sys.argv[5])
dist.init_process_group("gloo", rank=rank, world_size=size)
torch.manual_seed(0)
rng = np.random.default_rng(0)
if kind == "mlp":
    widths = [int(w) for w in spec.split(",")]
    layers = []
    for i, o in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(i, o), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    X = torch.tensor(rng.standard_normal((10000, widths[0])), dtype=torch.float32)
    Y = torch.tensor(rng.integers(0, widths[-1], 10000))
    def train(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        return loss
else:  # minGPT, float32 or AMP (spec "amp")
    from synk.bench import gpt
    model, opt = gpt.make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    X, Y = gpt.tokens()
    def train(x, y):
        opt.zero_grad(set_to_none=True)
        loss = gpt.forward_loss(ddp, x, y, spec == "amp")
        loss.backward()
        gpt.update(ddp, opt)
        return loss
order = rng.integers(0, len(X), (1000, batch))
k = 0
def step():
    global k
    idx = order[k % len(order)]
    k += 1
    mine = idx[rank * len(idx) // size:(rank + 1) * len(idx) // size]
    return train(X[mine], Y[mine])
print("ready", flush=True)
''' + _TURNS.format(count="int(sys.stdin.readline() or 0)", barrier="dist.barrier()",
                    prints="True") + "dist.destroy_process_group()\n"


# An mpi4jax script's turns: rank 0 reads the count and prints its step times
_MPI4JAX_TURNS = r'''
def count():
    # (the other ranks wait asleep, not in MPI's busy polling, while synk takes its turn;
    # waking each 5 ms, not more often, so as not to take the cores from synk's ranks)
    n = np.array([int(sys.stdin.readline() or 0) if rank == 0 else 0])
    request = comm.Ibcast(n, root=0)
    while not request.Test():
        time.sleep(0.005)
    return int(n[0])
if rank == 0:
    print("ready", flush=True)
''' + _TURNS.format(count="count()", barrier="comm.Barrier()", prints="rank == 0")

_MPI4JAX = r'''
import sys, time
import numpy as np, jax, jax.numpy as jnp, mpi4jax
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
rng = np.random.default_rng(0)
X = rng.standard_normal((10000, 784)).astype(np.float32)
Y = rng.integers(0, 10, 10000)
params = [rng.standard_normal((784, 32)).astype(np.float32) * 0.05, np.zeros(32, np.float32),
          rng.standard_normal((32, 10)).astype(np.float32) * 0.05, np.zeros(10, np.float32)]
params = [jnp.asarray(p) for p in params]
order = rng.integers(0, 10000, (1000, 20))
def loss(params, x, y):
    w1, b1, w2, b2 = params
    z = jnp.maximum(x @ w1 + b1, 0) @ w2 + b2
    return -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(len(x)), y])
@jax.jit
def update(params, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    grads = [mpi4jax.allreduce(g, op=MPI.SUM, comm=comm) / size for g in grads]
    return value, [p - 0.05 * g for p, g in zip(params, grads)]
k = 0
def step():
    global k, params
    idx = order[k % len(order)]
    k += 1
    mine = idx[rank * len(idx) // size:(rank + 1) * len(idx) // size]
    value, params = update(params, jnp.asarray(X[mine]), jnp.asarray(Y[mine]))
    return comm.reduce(float(value), root=0)
''' + _MPI4JAX_TURNS

_MPI4JAX_TINY = r'''
import sys, time
import numpy as np, jax, jax.numpy as jnp, mpi4jax
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank = comm.rank
@jax.jit
def ten(x):
    for _ in range(10):
        x = mpi4jax.allreduce(x, op=MPI.SUM, comm=comm) * 0.5
    return x
x = jnp.ones(2, jnp.float32)
def step():
    global x
    x = jax.block_until_ready(ten(x))
''' + _MPI4JAX_TURNS


_MPI4JAX_SHALLOW = r'''
import sys, time
import numpy as np, jax, jax.numpy as jnp, mpi4jax
from mpi4py import MPI
from synk.bench.frameworks import shallow_water
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
def halo(fields):
    left, right = (rank - 1) % size, (rank + 1) % size
    from_right = mpi4jax.sendrecv(fields[:, :1], fields[:, :1], right, left, sendtag=0,
                                  recvtag=0, comm=comm)
    from_left = mpi4jax.sendrecv(fields[:, -1:], fields[:, -1:], left, right, sendtag=1,
                                 recvtag=1, comm=comm)
    return jnp.concatenate([from_left, fields, from_right], axis=1)
chunk, state = shallow_water(halo, rank, size)
def step():
    global state
    state = jax.block_until_ready(chunk(state))
''' + _MPI4JAX_TURNS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pipes(proc: subprocess.Popen[str]) -> tuple:
    """(stdin, stdout) of a process started with both piped."""
    assert proc.stdin is not None and proc.stdout is not None
    return proc.stdin, proc.stdout


class _Baseline:
    """A baseline's processes (one per command, in ``env``), each saying "ready", run
    ``steps`` at a time (``_TURNS``: each reads the count, 0 ends them); rank 0's (the first
    process's) step times are returned. ``what`` names the baseline in errors."""

    def __init__(self, commands: list, env: dict, what: str) -> None:
        self.what = what
        self.procs = [subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       env=env, text=True) for command in commands]
        for p in self.procs:
            if _pipes(p)[1].readline().strip() != "ready":
                self.close()
                raise RuntimeError(f"{what} did not start")

    def steps(self, n: int) -> list:
        try:
            for p in self.procs:
                _pipes(p)[0].write(f"{n}\n")
                _pipes(p)[0].flush()
            lines = [_pipes(p)[1].readline().split() for p in self.procs]
        except OSError as err:
            raise RuntimeError(f"{self.what} stopped: {err}") from err
        times = [float(t) for t in lines[0]]  # (rank 0's: its steps wait for the others')
        if len(times) != n:
            raise RuntimeError(f"{self.what} stopped (see its output above)")
        return times

    def close(self) -> None:
        for p in self.procs:
            try:
                _pipes(p)[0].write("0\n")
                _pipes(p)[0].flush()
                p.wait(timeout=60)
            except Exception:
                p.kill()
                p.wait()


def _ddp_group(size: int, widths: tuple = (FEATURES, HIDDEN, CLASSES), batch: int = BATCH,
               gpt: str = "") -> _Baseline:
    """``size`` processes training with torch DDP on gloo: an MLP of layers of ``widths``
    (ReLU between), ``batch`` rows a step; or with ``gpt`` ("float32" or "amp"), minGPT
    (``synk.bench.gpt``), ``batch`` sequences."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1")
    kind, spec = ("gpt", gpt) if gpt else ("mlp", ",".join(str(w) for w in widths))
    return _Baseline([[sys.executable, "-c", _DDP, str(r), str(size), kind, spec, str(batch)]
                      for r in range(size)], env, "torch DDP on gloo")


def _mpi4jax_group(size: int, script: str = _MPI4JAX) -> _Baseline | None:
    """An mpi4jax script's step (the MLP's: ``_MPI4JAX``) on ``size`` ranks under ``mpiexec``
    (rank 0 reads the count and prints its step times), or None (and a line saying why) where
    mpi4jax or ``mpiexec`` is missing, or the step does not start (an mpi4jax that fails to
    import)."""
    from .._devices.report import mpiexec

    if importlib.util.find_spec("mpi4jax") is None:  # (not imported here: importing it
        return None  # starts MPI in this process, whose segment Open MPI leaves in /dev/shm)
    launcher = mpiexec()
    if launcher is None:
        return None
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    try:
        return _Baseline([[*launch(launcher, size), sys.executable, "-c", script]], env,
                         "the mpi4jax step under mpiexec")
    except (OSError, RuntimeError) as err:
        print(f"  (the mpi4jax baseline skipped: {err})")
        return None


@contextlib.contextmanager
def _beside(ranks: int, baseline: _Baseline | None):
    """A synk group of ``ranks`` for the block, beside ``baseline`` (or None); both ended
    after it."""
    try:
        with group(ranks):
            yield
    finally:
        if baseline is not None:
            baseline.close()


def _in_turns(ranks: int, steps: int, rounds: int, baseline: _Baseline, makers: dict) -> tuple:
    """({"baseline" and each name of ``makers``: its median step}, the load average as they
    began): ``baseline``'s step and synk's (``makers``: name -> a function making, with the
    group of ``ranks`` running, a function of ``n`` steps' times) taking turns, ``rounds``
    windows of ``steps`` each; each figure the median of its windows' medians."""
    load = os.getloadavg()[0]
    with _beside(ranks, baseline):
        runs = {"baseline": baseline.steps, **{name: make() for name, make in makers.items()}}
        times: dict = {name: [] for name in runs}
        for _ in range(rounds):
            for name, run in runs.items():
                times[name].append(statistics.median(run(steps)))
    return {name: statistics.median(t) for name, t in times.items()}, load


def _torch_synk(ranks: int, widths: tuple = (FEATURES, HIDDEN, CLASSES), batch: int = BATCH,
                overlap: bool = False):
    """The synk step (docs/training.md) of an MLP of layers of ``widths`` (ReLU between;
    ``overlap``: its gradients averaged during backward, ``synk.comm.average_gradients``),
    and a function running ``n`` steps' timings."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    layers: list = []
    for i, o in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(i, o), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = [synk.shared(p) for p in model.parameters()]

    def train_step(x, y, *replicas):
        for p, r in zip(model.parameters(), replicas):
            p.data = r
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        synk.comm.allreduce(grads, "mean", weight=len(x), out=grads)
        opt.step()
        return loss

    def overlapped_step(x, y, *replicas):
        for p, r in zip(model.parameters(), replicas):
            p.data = r
        opt.zero_grad()
        with synk.comm.average_gradients(model, weight=len(x)):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        return loss

    rng = np.random.default_rng(0)
    X = torch.tensor(rng.standard_normal((ROWS, widths[0])), dtype=torch.float32)
    Y = torch.tensor(rng.integers(0, widths[-1], ROWS))
    order = rng.integers(0, ROWS, (1000, batch))
    step = synk.function(as_a_scripts(overlapped_step if overlap else train_step),
                         inputs=["x", "y"])
    return _timer(step, (synk.data(X), synk.data(Y), *params), order)


def _timer(step, args: tuple, order: np.ndarray):
    """A function running ``n`` calls ``step(*args, batch=...)`` (after up to 10 untimed),
    the mini-batches the rows of ``order`` in turn, and returning their times."""
    turn = iter(range(1 << 62))

    def steps(n: int) -> list:
        for _ in range(min(n, 10)):
            step(*args, batch=order[next(turn) % len(order)])
        times = []
        for _ in range(n):
            idx = order[next(turn) % len(order)]
            t = time.perf_counter()
            step(*args, batch=idx)
            times.append(time.perf_counter() - t)
        return times

    return steps


def _gpt_synk(ranks: int, batch: int, amp: bool, overlap: bool):
    """minGPT's step through synk, written as minGPT-ddp's trainer is with the model made replicas
    (``synk.shared(model)``) and its gradients averaged after backward, or during it (``overlap``:
    ``synk.comm.average_gradients``); a function running ``n`` steps' timings."""
    from . import gpt

    model, opt = gpt.make_model()
    synk.shared(model)

    def train_step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = gpt.forward_loss(model, x, y, amp)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        synk.comm.allreduce(grads, "mean", weight=len(x), out=grads)
        gpt.update(model, opt)
        return loss

    def overlapped_step(x, y):
        opt.zero_grad(set_to_none=True)
        with synk.comm.average_gradients(model, weight=len(x)):
            loss = gpt.forward_loss(model, x, y, amp)
            loss.backward()
        gpt.update(model, opt)
        return loss

    X, Y = gpt.tokens()
    order = np.random.default_rng(0).integers(0, len(X), (1000, batch))
    step = synk.function(as_a_scripts(overlapped_step if overlap else train_step),
                         inputs=["x", "y"])
    return _timer(step, (synk.data(X), synk.data(Y)), order)


def torch_rows(ranks: int = 2, steps: int = STEPS, rounds: int = ROUNDS,
               label: str = "") -> list[dict]:
    """The synk step and torch DDP's, taking turns; both medians in one run.

    An MLP of MNIST's sizes (784 -> 32 -> 10), 20 rows a step (10 per rank on 2 ranks),
    cross-entropy, SGD: the step of docs/training.md (the parameters synk replicas, the
    model and optimizer on every rank, the gradients averaged by ``synk.comm.allreduce``),
    against torch's ``DistributedDataParallel`` on gloo with the same number of CPU
    processes, the same model and rows. The DDP processes stay up, and the two take turns
    (``rounds`` windows each); each figure is the median step of its windows."""
    medians, load = _in_turns(ranks, steps, rounds, _ddp_group(ranks),
                              {"synk": lambda: _torch_synk(ranks)})
    seconds, base = medians["synk"], medians["baseline"]
    return [result(BENCH, f"{label}torch MLP step, synk, {ranks} ranks", seconds,
                   f"torch DDP gloo, {ranks} procs", base, ranks=ranks, load=load,
                   target="at most DDP's time (ratio >= 1)"),
            result(BENCH, f"{label}torch MLP step, DDP gloo, {ranks} procs", base,
                   f"torch DDP gloo, {ranks} procs", base, ranks=ranks, load=load)]


BIG_WIDTHS, BIG_BATCH = (1024, 4096, 4096, 10), 16  # an MLP of 21M parameters


def big_model_rows(ranks: int = 2, steps: int = 20, rounds: int = ROUNDS) -> list[dict]:
    """A model where overlap matters, an MLP of 21M parameters (``BIG_WIDTHS``, 16 rows a
    step): synk's step with its gradients averaged during backward
    (``synk.comm.average_gradients``), and without (after it), and torch DDP's on gloo,
    taking turns."""
    n = sum(i * o + o for i, o in zip(BIG_WIDTHS, BIG_WIDTHS[1:]))
    return _against_ddp(f"torch MLP of {n / 1e6:.0f}M parameters", ranks, steps, rounds,
                        _ddp_group(ranks, BIG_WIDTHS, BIG_BATCH),
                        lambda overlap: _torch_synk(ranks, BIG_WIDTHS, BIG_BATCH, overlap))


def gpt_rows(ranks: int = 2, steps: int = 5, rounds: int = ROUNDS,
             amp: bool = False) -> list[dict]:
    """minGPT's step (``synk.bench.gpt``: minGPT-ddp's model, 25M parameters, one sequence
    of 128 tokens a rank), float32 or AMP: synk's with the gradients averaged during
    backward and after it, and torch DDP's on gloo, taking turns."""
    precision = "AMP (bfloat16)" if amp else "float32"
    return _against_ddp(f"minGPT step, 25M parameters, {precision}", ranks, steps, rounds,
                        _ddp_group(ranks, batch=ranks, gpt="amp" if amp else "float32"),
                        lambda overlap: _gpt_synk(ranks, ranks, amp, overlap),
                        after_target="at most DDP's time (ratio >= 1)")


def _against_ddp(case: str, ranks: int, steps: int, rounds: int, ddp: _Baseline, synk_steps,
                 after_target: str | None = None) -> list[dict]:
    """The rows of ``case``: synk's step (``synk_steps(overlap)``, its gradients averaged
    during backward and after it) and DDP's (``ddp``), taking turns, ``rounds`` windows of
    ``steps`` each."""
    medians, load = _in_turns(ranks, steps, rounds, ddp,
                              {"after": lambda: synk_steps(False),
                               "during": lambda: synk_steps(True)})
    base = medians["baseline"]
    ddp_name = f"torch DDP gloo, {ranks} procs"
    after_extra = {} if after_target is None else {"target": after_target}
    return [result(BENCH, f"{case}, synk, averaged during backward, {ranks} ranks",
                   medians["during"], ddp_name, base, ranks=ranks, load=load,
                   target="at most 0.95x DDP's time (ratio >= 1.05)"),
            result(BENCH, f"{case}, synk, averaged after backward, {ranks} ranks",
                   medians["after"], ddp_name, base, ranks=ranks, load=load, **after_extra),
            result(BENCH, f"{case}, DDP gloo, {ranks} procs", base, ddp_name, base,
                   ranks=ranks, load=load)]


def _mlp_grads_numpy(x, y, w1, b1, w2, b2):
    """The MLP's cross-entropy gradients by hand (numpy), the hand-written baseline."""
    h = np.maximum(x @ w1 + b1, 0)
    z = h @ w2 + b2
    z = z - z.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = max(len(x), 1)
    loss = -np.log(p[np.arange(len(x)), y] + 1e-30).sum() / n
    dz = p
    dz[np.arange(len(x)), y] -= 1
    dz /= n
    dh = (dz @ w2.T) * (h > 0)
    return loss, [x.T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]


def _numpy_step(x, y, w1, b1, w2, b2):
    loss, grads = _mlp_grads_numpy(x, y, w1, b1, w2, b2)
    grads = synk.comm.allreduce(grads, "mean", weight=len(x))
    for p, g in zip((w1, b1, w2, b2), grads):
        p -= 0.05 * g
    return loss


def jax_rows(ranks: int = 2, steps: int = STEPS, rounds: int = ROUNDS) -> list[dict]:
    """The JAX step through synk, against mpi4jax's where it runs (else against the same
    step by hand in numpy through synk), and the numpy step.

    The model is ``torch_rows``'s, one jitted update (``jax.value_and_grad``, the gradients
    averaged by ``synk.comm.allreduce`` inside ``jax.jit``, a plain SGD update) stored with
    ``synk.assign``. mpi4jax's step does each gradient's ``mpi4jax.allreduce`` inside the
    jitted update and reduces the loss to rank 0, as synk's call returns it, under
    ``mpiexec``, the two taking turns. mpi4jax has no wheels: pip builds it against the MPI
    found (``pip install mpi4jax`` with the ``mpi`` extra)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    X = rng.standard_normal((ROWS, FEATURES)).astype(np.float32)
    Y = rng.integers(0, CLASSES, ROWS)
    init = [rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32) * 0.05,
            np.zeros(HIDDEN, np.float32),
            rng.standard_normal((HIDDEN, CLASSES)).astype(np.float32) * 0.05,
            np.zeros(CLASSES, np.float32)]
    order = rng.integers(0, ROWS, (1000, BATCH))

    def loss(params, x, y):
        w1, b1, w2, b2 = params
        z = jnp.maximum(x @ w1 + b1, 0) @ w2 + b2
        return -jnp.mean(jax.nn.log_softmax(z)[jnp.arange(len(x)), y])

    @jax.jit
    def update(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        grads = synk.comm.allreduce(grads, "mean", weight=len(x))  # (under jit: a callback)
        return value, [p - 0.05 * g for p, g in zip(params, grads)]

    def jax_step(x, y, w1, b1, w2, b2):
        params = (w1, b1, w2, b2)
        value, new = update(list(params), x, y)
        for p, value_p in zip(params, new):
            synk.assign(p, value_p)
        return value

    by_hand = _mpi4jax_group(ranks)
    with _beside(ranks, by_hand):
        pj = [synk.shared(jnp.asarray(p)) for p in init]
        pn = [synk.shared(p) for p in init]
        jax_steps = _timer(synk.function(as_a_scripts(jax_step), inputs=["x", "y"]),
                           (synk.data(jnp.asarray(X)), synk.data(jnp.asarray(Y)), *pj), order)
        numpy_steps = _timer(synk.function(as_a_scripts(_numpy_step), inputs=["x", "y"]),
                             (synk.data(X), synk.data(Y), *pn), order)
        jax_times, numpy_times, mpi4jax_times = [], [], []
        for _ in range(rounds):
            numpy_times.append(statistics.median(numpy_steps(steps)))
            jax_times.append(statistics.median(jax_steps(steps)))
            if by_hand is not None:
                try:
                    mpi4jax_times.append(statistics.median(by_hand.steps(steps)))
                except RuntimeError as err:
                    print(f"  (the mpi4jax baseline skipped: {err})")
                    by_hand.close()
                    by_hand, mpi4jax_times = None, []
    seconds, numpy_base = statistics.median(jax_times), statistics.median(numpy_times)
    rows = []
    if mpi4jax_times:
        base = statistics.median(mpi4jax_times)
        rows += [result(BENCH, f"JAX MLP step (jitted), synk, {ranks} ranks", seconds,
                        "mpi4jax by hand", base, ranks=ranks,
                        target="at most mpi4jax's time (ratio >= 1)"),
                 result(BENCH, f"JAX MLP step (jitted), mpi4jax, {ranks} ranks", base,
                        "mpi4jax by hand", base, ranks=ranks)]
    else:
        rows.append(result(BENCH, f"JAX MLP step (jitted), synk, {ranks} ranks", seconds,
                           "the numpy step, by hand", numpy_base, ranks=ranks))
    return rows + [result(BENCH, f"numpy MLP step by hand, synk, {ranks} ranks", numpy_base,
                          "the numpy step, by hand", numpy_base, ranks=ranks)]


GRADIENT_FLOATS = 1_850_000  # 7.4 MB of float32, in four arrays


def _gradient_allreduces(arg) -> dict:
    """On each rank: the median time of a gradient's mean under ``jax.jit`` and of the same
    bytes as numpy arrays, in turns (``rounds`` of ``reps`` each, ``_jax_median``'s)."""
    import jax

    reps, rounds = arg
    r = synk.comm.rank()
    grads = [np.full(GRADIENT_FLOATS // 4, i + r + 1.0, np.float32) for i in range(4)]
    as_jax = [jax.numpy.asarray(g) for g in grads]

    def numpy_mean(g):
        return synk.comm.allreduce([a * 1.5 for a in g], "mean")

    jax_mean = jax.jit(numpy_mean)  # (the arrays it averages are computed in the function)
    times: dict = {"numpy": [], "jax": []}
    for _ in range(rounds):
        for name, mean, g in (("numpy", numpy_mean, grads), ("jax", jax_mean, as_jax)):
            times[name].append(_jax_median(mean, g, reps))  # (each mean of the last's)
    return times


def jax_allreduce_rows(ranks: int = 2, reps: int = 30, rounds: int = ROUNDS) -> list[dict]:
    """The gradient's mean under ``jax.jit`` (four float32 arrays, 7.4 MB, computed in the
    jitted function and averaged) against the same bytes as numpy arrays through
    ``synk.comm``, the two taking turns inside one call."""
    with group(ranks):
        per_rank = synk.function(_gradient_allreduces, bcast_inputs=["arg"],
                                 reduce=None)((reps, rounds))
    slowest = {k: [max(t[k][i] for t in per_rank) for i in range(rounds)] for k in per_rank[0]}
    seconds, base = statistics.median(slowest["jax"]), statistics.median(slowest["numpy"])
    mb = GRADIENT_FLOATS * 4 / 1e6
    return [result(BENCH, f"JAX gradient mean under jit, {mb:.1f} MB, {ranks} ranks", seconds,
                   "the same bytes as numpy arrays", base, ranks=ranks,
                   target="at most 1.5x numpy's time (ratio >= 0.67)")]



def _tiny_allreduces(steps: int) -> tuple:
    """On each rank: the median time of a tiny ``allreduce`` inside a jitted function of
    ten of them, and of the same allreduce of a numpy array outside ``jax.jit``."""
    import jax
    import jax.numpy as jnp

    def ten(x):
        for _ in range(10):
            x = synk.comm.allreduce(x) * 0.5
        return x

    return tuple(_jax_median(f, x, steps) / 10 for f, x in (
        (jax.jit(ten), jnp.ones(2, jnp.float32)), (ten, np.ones(2, np.float32))))


def _jax_median(f, x, n: int, ranks: bool = True) -> float:
    """The median seconds of ``n`` calls ``x = f(x)``, after one that compiles ``f`` (and,
    on the ``ranks``, a barrier)."""
    import jax

    x = jax.block_until_ready(f(x))
    if ranks:
        synk.comm.barrier()
    took = []
    for _ in range(n):
        t = time.perf_counter()
        x = jax.block_until_ready(f(x))
        took.append(time.perf_counter() - t)
    return statistics.median(took)


def jax_tiny_rows(ranks: int = 2, steps: int = STEPS, rounds: int = ROUNDS) -> list[dict]:
    """A tiny ``synk.comm.allreduce`` under ``jax.jit``, ten to a jitted function, against
    mpi4jax's ``allreduce`` so, taking turns, where mpi4jax runs; and outside ``jit``."""
    by_hand = _mpi4jax_group(ranks, _MPI4JAX_TINY)
    with _beside(ranks, by_hand):
        tiny = synk.function(_tiny_allreduces, bcast_inputs=["steps"], reduce=("max", "max"))
        jitted, eager, theirs = [], [], []
        for _ in range(rounds):
            ours = tiny(steps)
            jitted.append(ours[0])
            eager.append(ours[1])
            if by_hand is not None:
                theirs.append(statistics.median(by_hand.steps(steps)) / 10)
    seconds, outside = statistics.median(jitted), statistics.median(eager)
    case = f"a tiny synk.comm.allreduce under jit (10 a jitted function), {ranks} ranks"
    if not theirs:
        return [result(BENCH, case, seconds, "the same outside jit", outside, ranks=ranks)]
    base = statistics.median(theirs)
    return [result(BENCH, case, seconds, "mpi4jax's allreduce under jit", base, ranks=ranks,
                   target="at most 2x mpi4jax's time (ratio >= 0.5)"),
            result(BENCH, f"the same allreduce outside jit, {ranks} ranks", outside,
                   "mpi4jax's allreduce under jit", base, ranks=ranks)]

SHALLOW_CHUNK = 50  # model steps in one jitted call


def shallow_water(halo, rank: int, size: int) -> tuple:
    """demos/shallow_water_jax.py's model (float32) on this rank's slab of a 96 x 48 channel: a
    jitted call of ``SHALLOW_CHUNK`` steps, each with two halo exchanges (``halo(fields)``: the
    fields with a column of each neighbour's along x), and the initial state."""
    import jax
    import jax.numpy as jnp

    nx, ny, dx, g, depth, f = 96, 48, 10e3, 9.81, 100.0, 1e-4
    dt = 0.1 * dx / (g * depth) ** 0.5
    nu = 0.02 * dx ** 2 / dt

    def padded(fields):
        return jnp.pad(halo(fields), ((0, 0), (0, 0), (1, 1)), mode="edge")

    def ddx(a):
        return (a[2:, 1:-1] - a[:-2, 1:-1]) / (2 * dx)

    def ddy(a):
        return (a[1:-1, 2:] - a[1:-1, :-2]) / (2 * dx)

    def lap(a):
        return (a[2:, 1:-1] + a[:-2, 1:-1] + a[1:-1, 2:] + a[1:-1, :-2]
                - 4 * a[1:-1, 1:-1]) / dx ** 2

    def step(h, u, v):
        hp, up, vp = padded(jnp.stack([h, u, v]))
        h = h - dt * (ddx(hp * up) + ddy(hp * vp))
        (hp,) = padded(h[None])
        u_new = u + dt * (-u * ddx(up) - v * ddy(up) + f * v - g * ddx(hp) + nu * lap(up))
        v_new = v + dt * (-u * ddx(vp) - v * ddy(vp) - f * u - g * ddy(hp) + nu * lap(vp))
        return h, u_new, v_new.at[:, 0].set(0.0).at[:, -1].set(0.0)

    x = (np.arange(nx) - nx / 2)[:, None] * dx
    y = (np.arange(ny) - ny / 2)[None, :] * dx
    rows = slice(rank * nx // size, (rank + 1) * nx // size)
    h = (depth + np.exp(-(x ** 2 + y ** 2) / (8 * dx) ** 2))[rows]
    state = tuple(jnp.asarray(a, jnp.float32) for a in (h, np.zeros_like(h), np.zeros_like(h)))
    chunk = jax.jit(lambda s: jax.lax.fori_loop(0, SHALLOW_CHUNK, lambda _, t: step(*t), s))
    return chunk, state


def _shallow_steps(calls: int) -> float:
    """On each rank: the median time of a model step of ``shallow_water``, its halos
    exchanged by ``synk.comm.sendrecv`` inside the jitted call (as the demo's are)."""
    import jax.numpy as jnp

    rank, size = synk.comm.rank(), synk.comm.size()

    def halo(fields):
        left, right = (rank - 1) % size, (rank + 1) % size
        from_right = synk.comm.sendrecv(fields[:, :1], dest=left, source=right, tag=0)
        from_left = synk.comm.sendrecv(fields[:, -1:], dest=right, source=left, tag=1)
        return jnp.concatenate([from_left, fields, from_right], axis=1)

    chunk, state = shallow_water(halo, rank, size)
    return _jax_median(chunk, state, calls) / SHALLOW_CHUNK


def jax_shallow_rows(ranks: int = 2, calls: int = 20, rounds: int = ROUNDS) -> list[dict]:
    """A shallow-water model step (``shallow_water``) under ``jax.jit``, its halos exchanged
    with ``synk.comm.sendrecv``, against the same model with ``mpi4jax.sendrecv`` under
    ``mpiexec``, taking turns, where mpi4jax runs; else against one process (the whole
    channel, its own far columns as halos)."""
    by_hand = _mpi4jax_group(ranks, _MPI4JAX_SHALLOW)
    with _beside(ranks, by_hand):
        steps = synk.function(_shallow_steps, bcast_inputs=["calls"], reduce="max")
        ours, theirs = [], []
        for _ in range(rounds):
            ours.append(steps(calls))
            if by_hand is not None:
                theirs.append(statistics.median(by_hand.steps(calls)) / SHALLOW_CHUNK)
    case = f"shallow-water model step under jit (sendrecv halos), {ranks} ranks"
    if theirs:
        return [result(BENCH, case, statistics.median(ours), "mpi4jax's, under mpiexec",
                       statistics.median(theirs), ranks=ranks,
                       target="at most 1.5x mpi4jax's time (ratio >= 0.67)")]
    import jax.numpy as jnp

    chunk, state = shallow_water(
        lambda a: jnp.concatenate([a[:, -1:], a, a[:, :1]], axis=1), 0, 1)
    return [result(BENCH, case, statistics.median(ours), "one process",
                   _jax_median(chunk, state, calls, ranks=False) / SHALLOW_CHUNK, ranks=ranks)]


def available() -> str | None:
    """None if torch (for its rows) is installed, else why not."""
    try:
        import torch.distributed as dist
    except ImportError:
        return "torch is not installed (pip install 'synk[torch]')"
    if not dist.is_available() or not dist.is_gloo_available():
        return "this torch has no gloo backend"
    return None


def run(ranks: int = 2, steps: int = STEPS, rounds: int = ROUNDS, loaded: bool = True) -> list:
    """The torch rows (as the machine is, the small MLP, one of 21M parameters and minGPT in
    float32 and AMP; with polling capped at 200 us, synk's setting for a machine whose cores
    are busy; with one core kept busy) and the JAX rows."""
    from ._load import busy_core, environment

    rows = torch_rows(ranks, steps, rounds)
    rows += big_model_rows(ranks, max(steps // 5, 4), rounds)
    rows += gpt_rows(ranks, max(steps // 20, 2), rounds)
    # (AMP's bfloat16 matmuls take a CPU without AVX-512 BF16 some 15x float32's time)
    rows += gpt_rows(ranks, 2, min(rounds, 2), amp=True)
    with environment(SYNK_SPIN_US="200"):
        rows += torch_rows(ranks, steps, rounds, label="SYNK_SPIN_US=200: ")
    if loaded:
        with busy_core():
            rows += torch_rows(ranks, steps, rounds, label="one busy core: ")
    try:
        import jax  # noqa: F401
    except ImportError:
        return rows
    return (rows + jax_rows(ranks, steps, rounds) + jax_allreduce_rows(ranks, rounds=rounds)
            + jax_tiny_rows(ranks, steps, rounds) + jax_shallow_rows(ranks, rounds=rounds))
