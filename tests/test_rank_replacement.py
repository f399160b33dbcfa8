"""``fork(restarts=N)``: a call during which a worker dies (or its GPU fails) is run again on
a new group, from the state every rank had when it began, and the loop goes on with the
bits of a run in which nothing died; what cannot be replaced ends as without it. Each test
kills a worker at a chosen point (a marker file says it already happened, so that the call
run again does not die again) and compares with the same loop uninterrupted."""
import os
import signal
import time
import warnings

import numpy as np
import pytest
from conftest import REAL, use_devices

import synk

pytestmark = pytest.mark.timeout(180)


def _route_b_step(x, w, k, kill_at, marker, where):
    """Route B's shape: a gradient of this rank's rows, averaged with synk.comm, applied to
    the replica in place; rank 1 dies once at step ``kill_at``, ``where`` in the step."""
    dies = synk.rank() == 1 and k == kill_at and not os.path.exists(marker)
    if dies and where == "before the collective":
        open(marker, "w").close()
        os._exit(9)
    g = x.mean(axis=0) * (k + 1) - w * 0.01
    g = synk.comm.allreduce(g, "mean", weight=len(x))
    if dies and where == "after the collective":
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    w -= 0.1 * g
    return float(np.abs(w).sum())


def _loop(steps: int, kill_at: int, marker: str, where: str, restarts: int):
    synk.fork(2, restarts=restarts)
    try:
        x = synk.data(np.random.default_rng(0).standard_normal((64, 5)))
        w = synk.shared(np.ones(5))
        f = synk.function(_route_b_step, bcast_inputs=["w", "k", "kill_at", "marker",
                                                       "where"], reduce="mean")
        losses = [f(x, w, k, kill_at, marker, where) for k in range(steps)]
        return [w.get_value(r).copy() for r in range(2)], losses, synk.restarts_left()
    finally:
        synk.close()


@pytest.mark.parametrize("where", ["before the collective", "after the collective"])
def test_a_worker_killed_in_a_step_is_replaced_with_the_same_bits(tmp_path, where):
    marker = str(tmp_path / "died")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        replicas, losses, left = _loop(8, 3, marker, where, restarts=2)
        took = time.monotonic() - start
    said = [str(w.message) for w in caught if issubclass(w.category,
                                                           synk.RankReplacedWarning)]
    assert len(said) == 1 and "worker rank 1" in said[0] and "_route_b_step" in said[0], said
    assert ("exited with code 9" if where.startswith("before") else "SIGKILL") in said[0]
    assert left == 1
    assert os.path.exists(marker)
    # the same loop, nothing killed (the marker is there)
    want_replicas, want_losses, _ = _loop(8, 3, marker, where, restarts=0)
    assert losses == want_losses
    for got, want in zip(replicas, want_replicas):
        assert np.array_equal(got, want)
    assert took < 30


def _pids():
    return synk.function(lambda: os.getpid(), reduce=None)()


def test_a_worker_found_dead_between_calls_is_replaced_before_the_next(tmp_path):
    synk.fork(3, restarts=1)
    try:
        pids = _pids()
        f = synk.function(lambda x: x.sum(), reduce="sum")
        step = f.bind(np.arange(12.0))
        assert step() == 66.0
        os.kill(pids[2], signal.SIGKILL)
        time.sleep(0.5)
        with pytest.warns(synk.RankReplacedWarning, match="rank 2 was killed by SIGKILL"):
            assert step() == 66.0  # (the bound step carries over to the new group)
        assert synk.restarts_left() == 0 and set(_pids()).isdisjoint(pids[1:])
        os.kill(_pids()[1], signal.SIGKILL)  # no restart left: today's typed error
        time.sleep(0.5)
        with pytest.raises(synk.WorkerDiedError, match="rank 1 was killed by SIGKILL"):
            f(np.ones(3))
    finally:
        synk.close()


def _dies_every_time(x):
    if synk.rank() == 1:
        os._exit(5)
    return x.sum()


def test_restarts_exhausted_give_the_worker_died_error(tmp_path):
    synk.fork(2, restarts=2)
    try:
        f = synk.function(_dies_every_time, reduce="sum")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(synk.WorkerDiedError, match="exited with code 5"):
                f(np.ones(4))
        assert sum(issubclass(w.category, synk.RankReplacedWarning) for w in caught) == 2
        assert synk.restarts_left() == 0
    finally:
        synk.close()


def _raises_or_sleeps(x, how):
    if synk.rank() == 1:
        if how == "raise":
            raise ValueError("the function's own error")
        time.sleep(30)
    return x.sum()


@pytest.mark.parametrize("how", ["raise", "timeout"])
def test_the_functions_own_errors_and_timeouts_are_not_run_again(how):
    synk.fork(2, restarts=3)
    try:
        f = synk.function(_raises_or_sleeps, bcast_inputs=["how"], reduce="sum",
                          timeout=1.0 if how == "timeout" else None)
        with warnings.catch_warnings():
            warnings.simplefilter("error", synk.RankReplacedWarning)
            with pytest.raises(ValueError if how == "raise" else synk.CallTimeoutError):
                f(np.ones(4), how)
        assert synk.restarts_left() == 3
    finally:
        synk.close()


def _two_die(x, marker):
    if synk.rank() in (1, 2) and not os.path.exists(marker + str(synk.rank())):
        open(marker + str(synk.rank()), "w").close()
        os._exit(3)
    return x.sum()


def test_two_ranks_dying_at_once_cost_one_replacement(tmp_path):
    synk.fork(3, restarts=1)
    try:
        f = synk.function(_two_die, bcast_inputs=["marker"], reduce="sum")
        d = synk.data(np.arange(9.0))
        with pytest.warns(synk.RankReplacedWarning):
            assert f(d, str(tmp_path / "m")) == 36.0
        assert synk.restarts_left() == 0
    finally:
        synk.close()


def _dies_twice(x, w, marker):
    for n in (1, 2):  # rank 1 of the first group, then of the replacement, die once each
        if synk.rank() == 1 and not os.path.exists(f"{marker}{n}"):
            open(f"{marker}{n}", "w").close()
            os._exit(4)
    w += x.sum()
    return float(w[0])


def test_a_rank_that_dies_again_during_the_call_run_again_is_replaced_again(tmp_path):
    synk.fork(2, restarts=2)
    try:
        w = synk.shared(np.zeros(2))
        f = synk.function(_dies_twice, bcast_inputs=["w", "marker"], reduce="max")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # each rank adds its 3 rows' sum once (rank 0's share ran three times; its
            # replica was given back its value at the call's start each time)
            assert f(np.ones(6), w, str(tmp_path / "m")) == 3.0
        assert sum(issubclass(w.category, synk.RankReplacedWarning) for w in caught) == 2
        assert [float(w.get_value(r)[0]) for r in range(2)] == [3.0, 3.0]
    finally:
        synk.close()


def test_restarts_are_checked():
    with pytest.raises(ValueError, match="restarts"):
        synk.fork(2, restarts=-1)
    with pytest.raises(ValueError, match="restarts"):
        synk.fork(2, restarts=True)
    assert synk.restarts_left() == 0


def test_under_mpi_restarts_are_refused_with_a_warning(tmp_path):
    """mpiexec's processes are fixed: ``restarts=`` is refused with a warning, and a death
    ends the job as without it (test_mpi_faults)."""
    import mpirun

    body = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    synk.fork(restarts=2)
print("WARNED", any("not available under MPI" in str(w.message) for w in caught), flush=True)
print("LEFT", synk.restarts_left(), flush=True)
synk.close()
"""
    preamble = "import json, os, sys, time\nimport numpy as np\nimport synk\n"
    run = mpirun.run(tmp_path, body, hosts=(None, None), preamble=preamble)
    assert run.rc == 0 and "WARNED True" in run.out and "LEFT 0" in run.out, run


def _sums_on_device(x):
    xp = synk.xp(x)
    return synk.comm.allreduce(xp.asarray(x).sum(axis=0), "sum")


@pytest.mark.skipif(REAL, reason="the fault is the simulator's")
def test_a_gpu_that_fails_is_replaced_under_the_simulator(monkeypatch):
    """A sticky CUDA error on rank 1's device (the simulator's ``cuda_error`` fault, at its
    third NCCL operation after set-up) breaks the group with ``DeviceFailedError``; the
    new group's rank 1 is a new process with a new context, and the call runs again."""
    from conftest import first_op

    use_devices(monkeypatch, 2)
    monkeypatch.setenv("SYNK_SIM_FAULTS", f"cuda_error:rank=1:collective={first_op(2) + 2}")
    synk.fork(2, backend="gpu", restarts=1)
    try:
        f = synk.function(_sums_on_device, reduce=None)
        x = np.arange(12.0).reshape(6, 2)
        want = x.sum(axis=0)
        for _ in range(2):
            assert all(np.array_equal(np.asarray(r), want) for r in f(x))
        with pytest.warns(synk.RankReplacedWarning, match="GPU of rank 1 failed"):
            got = f(x)  # (its third operation: the fault)
        assert all(np.array_equal(np.asarray(r), want) for r in got)
        assert synk.restarts_left() == 0
    finally:
        synk.close()


def _slow_step(x, w, k):
    time.sleep(0.01)  # (so that kills land inside calls, collectives included, as well as
    g = x.mean(axis=0) * (k + 1) - w * 0.01  # between them)
    g = synk.comm.allreduce(g, "mean", weight=len(x))
    w -= 0.1 * g
    return float(np.abs(w).sum())


def _route_b(steps: int, restarts: int) -> tuple:
    synk.fork(2, restarts=restarts)
    try:
        x = synk.data(np.random.default_rng(1).standard_normal((32, 5)))
        w = synk.shared(np.ones(5))
        step = synk.function(_slow_step, bcast_inputs=["w", "k"], reduce="mean").bind(x, w)
        losses = []
        for k in range(steps):
            losses.append(step(k))
        return losses, [w.get_value(r).copy() for r in range(2)]
    finally:
        synk.close()


@pytest.mark.parametrize("form", ["blocking", "submitted"])
def test_random_kills_in_a_loop_give_the_losses_of_the_loop_uninterrupted(tmp_path, form):
    """The soak at CI's size (``SYNK_KILL_SOAK_STEPS``, ``SYNK_KILL_SOAK_KILLS``: 1,000 and
    50 for the long run): a thread kills a worker of the running group at random moments
    (inside a call, inside its collective, between calls, while a new group starts), and
    every step's loss is the uninterrupted loop's: blocking calls run again, submitted ones
    undone and submitted again by the loop (``_submitted_loop``). The test reaches the
    group's worker processes (``PROCESS.group.processes``): no public handle names them
    while a call runs."""
    import random
    import threading

    from synk._process import PROCESS

    steps = int(os.environ.get("SYNK_KILL_SOAK_STEPS", "80"))
    kills = int(os.environ.get("SYNK_KILL_SOAK_KILLS", "4"))
    marker = str(tmp_path / "never")  # (_submitted_loop's step kills nothing itself)

    def loop(restarts: int) -> tuple:
        if form == "blocking":
            return _route_b(steps, restarts)
        losses, replicas, _ = _submitted_loop(steps, restarts, marker)
        return losses, replicas

    want_losses, want_replicas = loop(0)
    rng = random.Random(7)
    done = threading.Event()
    killed: list = []

    def killer() -> None:
        while len(killed) < kills and not done.wait(rng.uniform(0.05, 0.3)):
            group = PROCESS.group
            procs = [] if group is None else list(group.processes.procs.values())
            if procs:
                proc = rng.choice(procs)
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
                except (ProcessLookupError, AttributeError):
                    pass

    thread = threading.Thread(target=killer, name="test-killer")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        thread.start()
        try:
            losses, replicas = loop(3 * kills)
        finally:
            done.set()
            thread.join()
    assert killed, "no worker was killed: the loop ended first"
    print(f"{len(killed)} kills in {steps} steps")
    assert losses == want_losses
    for got, want in zip(replicas, want_replicas):
        assert np.array_equal(got, want)


def _submitted_loop(steps: int, restarts: int, marker: str, kill_at: int = -1,
                    between: tuple = (), backend: str = "cpu") -> tuple:
    """``_loop`` with its steps submitted 4 at a time, each window's results read after it:
    rank 1 dies once after the collective of step ``kill_at`` (its share ran to the end but
    for its update and its reply; rank 0's share of that step and the next ones ran), and
    the master kills a worker after reading each window of ``between`` (the next submit
    finds the death). Where a window's call fails, the loop submits again from the first
    step that gave no loss. Each step's loss, every rank's replica and the replacements'
    warnings."""
    from synk._process import PROCESS

    synk.fork(2, restarts=restarts, backend=backend)
    try:
        x = synk.data(np.random.default_rng(0).standard_normal((64, 5)))
        w = synk.shared(np.ones(5))
        step = synk.function(_route_b_step, bcast_inputs=["w", "k", "kill_at", "marker",
                                                          "where"], reduce="mean").bind(x, w)
        losses: dict = {}
        window = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while len(losses) < steps:
                first = min(set(range(steps)) - set(losses))
                futures = []
                try:
                    for k in range(first, min(first + 4, steps)):
                        futures.append((k, step.submit(k, kill_at, marker,
                                                       "after the collective")))
                except synk.WorkerDiedError:  # (the submit found the death: it ran nowhere)
                    pass
                for k, future in futures:
                    try:
                        losses[k] = future.result()
                    except (synk.WorkerDiedError, synk.EarlierCallFailedError):
                        break  # (this one and the later ones: submitted again)
                if window in between:
                    os.kill(next(iter(PROCESS.group.processes.procs.values())).pid,
                            signal.SIGKILL)
                    time.sleep(0.2)
                window += 1
        said = [str(c.message) for c in caught if c.category is synk.RankReplacedWarning]
        return [losses[k] for k in range(steps)], \
            [w.get_value(r).copy() for r in range(2)], said
    finally:
        synk.close()


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_submitted_calls_a_death_failed_are_undone_and_submitted_again_give_the_same_bits(
        tmp_path, monkeypatch, backend):
    """Rank 1 dies after the collective of a submitted step, whose share of rank 0 and of
    the steps submitted after it had run (each rank's replica updated there); then a worker
    is killed between two windows (the next submit finds the death). The failed calls'
    futures raise, the group is replaced at the next call, and the shared variables are as
    they were before the first failed call: submitting the failed steps again ends with the
    uninterrupted loop's losses and replicas, where keeping the failed calls' updates
    applied those steps twice."""
    if backend == "gpu":
        use_devices(monkeypatch, 2)
    marker = str(tmp_path / "died")
    want_losses, want_replicas, _ = _submitted_loop(12, 0, marker, backend=backend)
    losses, replicas, said = _submitted_loop(12, 2, marker, kill_at=5, between=(0,),
                                             backend=backend)
    assert len(said) == 2, said
    assert any("the submitted calls that failed were undone" in s for s in said), said
    assert losses == want_losses
    for got, want in zip(replicas, want_replicas):
        assert np.array_equal(got, want)


def _jax_step(x, w, k, marker):
    import jax
    import jax.numpy as jnp

    def loss(w):
        return jnp.mean((x @ w) ** 2)

    value, g = jax.value_and_grad(loss)(w)
    g = synk.comm.allreduce(g, "mean", weight=len(x))
    if synk.rank() == 1 and k == 2 and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(6)
    synk.assign(w, w - 0.1 * g)
    return value


@pytest.mark.frameworks
def test_jax_replicas_updated_with_assign_come_back_with_the_same_bits(tmp_path):
    jnp = pytest.importorskip("jax.numpy")
    marker = str(tmp_path / "died")

    def run(restarts):
        synk.fork(2, restarts=restarts)
        try:
            rng = np.random.default_rng(3)
            x = synk.data(jnp.asarray(rng.standard_normal((24, 4)), jnp.float32))
            w = synk.shared(jnp.asarray(rng.standard_normal((4, 2)), jnp.float32))
            f = synk.function(_jax_step, bcast_inputs=["w", "k", "marker"], reduce="mean")
            losses = [float(f(x, w, k, marker)) for k in range(5)]
            return losses, [np.asarray(w.get_value(r)) for r in range(2)]
        finally:
            synk.close()

    with pytest.warns(synk.RankReplacedWarning, match="exited with code 6"):
        losses, replicas = run(1)
    want_losses, want_replicas = run(0)  # (the marker is there: nothing dies)
    assert losses == want_losses
    for got, want in zip(replicas, want_replicas):
        assert np.array_equal(got, want)


def _torch_step(model, opt, marker):
    def train_step(x, y, k, *replicas):
        import torch.nn.functional as F

        for p, r in zip(model.parameters(), replicas):
            p.data = r  # this rank's replicas are the model's parameters
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        synk.comm.allreduce(grads, "mean", weight=len(x), out=grads)
        if synk.rank() == 1 and k == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        return loss

    return train_step


@pytest.mark.frameworks
def test_a_torch_module_on_shared_variables_comes_back_with_the_same_bits(tmp_path):
    """The model's parameters are shared variables, its optimizer (plain SGD) keeps no state
    of its own: a kill after the gradients' allreduce, before the update, ends with the
    uninterrupted loop's bits. (An optimizer's own buffers, momentum's, live in the object
    the function captured on each rank and are not restored: reliability.md.)"""
    torch = pytest.importorskip("torch")
    marker = str(tmp_path / "died")

    def run(restarts):
        synk.fork(2, restarts=restarts)
        try:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                        torch.nn.Linear(8, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.2)
            replicas = [synk.shared(p) for p in model.parameters()]
            rng = np.random.default_rng(1)
            xd = synk.data(torch.tensor(rng.standard_normal((40, 6)), dtype=torch.float32))
            yd = synk.data(torch.tensor(rng.integers(0, 3, 40)))
            step = synk.function(_torch_step(model, opt, marker), inputs=["x", "y"],
                                 bcast_inputs=["k"]).bind(xd, yd)
            losses = [float(step(k, *replicas, batch=np.arange(k, k + 20)))
                      for k in range(6)]
            return losses, [p.get_value(r).clone() for p in replicas for r in range(2)]
        finally:
            synk.close()

    with pytest.warns(synk.RankReplacedWarning, match="SIGKILL"):
        losses, replicas = run(1)
    want_losses, want_replicas = run(0)
    assert losses == want_losses
    for got, want in zip(replicas, want_replicas):
        assert torch.equal(got, want)


def test_a_rank_killed_while_the_new_group_starts_costs_one_more_restart(tmp_path):
    """The replacement's own start fails (a new worker killed as it starts: the start's
    WorkerStartError, nothing of it left running); while restarts are left it is started
    again, and the call runs."""
    import threading

    from conftest import child_pids

    marker = str(tmp_path / "died")
    synk.fork(2, restarts=3)
    try:
        first = child_pids()
        f = synk.function(_route_b_step, bcast_inputs=["w", "k", "kill_at", "marker",
                                                       "where"], reduce="mean")
        x, w = synk.data(np.ones((8, 5))), synk.shared(np.ones(5))
        killed: list = []
        done = threading.Event()

        def kill_the_first_new_worker() -> None:
            while not done.is_set() and not killed:
                if os.path.exists(marker):
                    for pid in child_pids() - first:
                        try:
                            os.kill(pid, signal.SIGKILL)
                            killed.append(pid)
                        except ProcessLookupError:
                            pass
                        break
                time.sleep(0.002)

        thread = threading.Thread(target=kill_the_first_new_worker)
        thread.start()
        try:
            with pytest.warns(synk.RankReplacedWarning):
                f(x, w, 0, 0, marker, "before the collective")
        finally:
            done.set()
            thread.join()
        assert killed
        assert synk.restarts_left() == 1  # (the kill landed in the start: two used)
        assert f(x, w, 1, -1, marker, "") > 0  # the group goes on
    finally:
        synk.close()


def _epoch(x, w, batches, marker):
    """Route C: an epoch's steps inside one call, each rank on its rows of each; rank 1
    dies once in the middle of the epoch."""
    rank, size = synk.comm.rank(), synk.comm.size()
    total = 0.0
    for s, idx in enumerate(batches):
        rows = np.array_split(idx, size)[rank]
        g = x[rows].mean(axis=0) - w * 0.01 if len(rows) else np.zeros_like(w)
        g = synk.comm.allreduce(g, "mean", weight=len(rows) / len(idx))
        if rank == 1 and s == 3 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(8)
        w -= 0.1 * g
        total += float(np.abs(w).sum())
    return total


def _gradient(w, x):
    """Route A: the gradient of this rank's rows; the master averages and updates."""
    return x.mean(axis=0) - w * 0.01


@pytest.mark.parametrize("route", ["A", "C"])
def test_routes_a_and_c_come_back_with_the_same_bits(tmp_path, route):
    marker = str(tmp_path / "died")
    x_all = np.random.default_rng(4).standard_normal((60, 5))
    batches = np.random.default_rng(5).permutation(60).reshape(6, 10)

    def run(restarts):
        synk.fork(2, restarts=restarts)
        try:
            x = synk.data(x_all)
            if route == "C":
                w = synk.shared(np.ones(5))
                f = synk.function(_epoch, bcast_inputs=["x", "w", "batches", "marker"],
                                  reduce="sum")
                losses = [f(x, w, batches, marker) for _ in range(2)]
                return losses, [w.get_value(r) for r in range(2)]
            w = np.ones(5)
            grad = synk.function(_gradient, inputs=["x"], reduce="mean")
            pids = synk.function(lambda: os.getpid(), reduce=None)()
            for s, idx in enumerate(batches):
                if s == 3 and not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(pids[1], signal.SIGKILL)  # (between two steps)
                w = w - 0.1 * grad(w, x, batch=idx)
            return [], [w]
        finally:
            synk.close()

    with pytest.warns(synk.RankReplacedWarning):
        losses, params = run(1)
    want_losses, want_params = run(0)
    assert losses == want_losses
    for got, want in zip(params, want_params):
        assert np.array_equal(got, want)


# -- every rank's own state, and master-side operations, across a replacement ---------------
def _assign_dies_once(x, centers, labels, counter, marker, at):
    """k-means's assignment with each rank's labels and counter kept in its replicas;
    rank 1 dies once at iteration ``at``, after updating them."""
    distances = ((x[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2)
    new = distances.argmin(axis=1)
    moved = (new != labels).sum()
    labels[...] = new
    counter += 1 + synk.rank()
    if synk.rank() == 1 and counter[0] == 2 * at and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    members = (new[:, None] == np.arange(len(centers))).astype(x.dtype)
    return members.T @ x, members.sum(axis=0), moved


def _kmeans(points, first, marker: str, at: int, restarts: int):
    synk.fork(3, restarts=restarts)
    try:
        x = synk.data(points)
        labels, counter = synk.shared(np.zeros(0, np.int64)), synk.shared(np.zeros(1))
        synk.shared_scatter(labels, np.full(len(points), -1))
        step = synk.function(_assign_dies_once, bcast_inputs=["centers", "marker", "at"],
                             reduce="sum")
        centers, log = first, []
        for _ in range(6):
            sums, counts, moved = step(x, centers, labels, counter, marker, at)
            counts = counts[:, None]
            centers = np.where(counts > 0, sums / np.maximum(counts, 1), centers)
            log.append(int(moved))
        return log, synk.shared_gather(labels), [counter.get_value(r) for r in range(3)]
    finally:
        synk.close()


def test_each_ranks_own_state_comes_back_after_a_death(tmp_path):
    """The labels of each rank's own rows (``shared_scatter``) and a counter each rank
    counts its own way are given back to every rank as that rank had them, not as rank 0
    had them: the loop ends with the bits of the loop nothing interrupted."""
    rng = np.random.default_rng(1)
    points = rng.standard_normal((301, 3)) + rng.integers(0, 4, (301, 1)) * 4.0
    first = points[:4].copy()
    marker = str(tmp_path / "died")
    with pytest.warns(synk.RankReplacedWarning):
        got = _kmeans(points, first, marker, 3, restarts=2)
    assert os.path.exists(marker)
    want = _kmeans(points, first, marker, 3, restarts=0)
    assert got[0] == want[0]
    assert np.array_equal(got[1], want[1])
    assert [c.tolist() for c in got[2]] == [c.tolist() for c in want[2]] == [
        [6.0], [12.0], [18.0]]


def test_a_copy_its_rank_died_making_is_not_read():
    """A rank killed between making the segment of a copy of its replica and sizing it
    leaves an empty segment: the replacement reads the rank's newest whole copy, not that
    one."""
    from synk._wire import shm

    synk.fork(3, restarts=3)
    try:
        w = synk.shared(np.zeros(2))
        w.set_value(np.array([1.0, 2.0]), rank=1)
        f = synk.function(lambda w: w.copy(), reduce=None)
        assert [r.tolist() for r in f(w)] == [[0, 0], [1, 2], [0, 0]]
        copies = [n for n in os.listdir("/dev/shm")
                  if n.startswith(shm.process_prefix() + "g") and "r1-" in n]
        assert copies, "rank 1 keeps a copy of its replica"
        made = copies[0][:copies[0].index("r1-") + 2] + "-made"
        with open(os.path.join("/dev/shm", made), "wb"):
            pass  # (made, not sized: as a rank killed at that moment leaves it)
        os.kill(_pids()[1], signal.SIGKILL)
        time.sleep(0.3)
        with pytest.warns(synk.RankReplacedWarning, match="rank 1 was killed"):
            assert w.get_value(1).tolist() == [1, 2]
        assert [r.tolist() for r in f(w)] == [[0, 0], [1, 2], [0, 0]]
    finally:
        synk.close()


@pytest.mark.parametrize("operation", ["get_value", "set_value", "set_value(rank=)",
                                       "shared_all_reduce", "shared_broadcast", "distribute",
                                       "submit"])
def test_a_worker_dead_between_calls_is_replaced_before_a_master_side_operation(operation):
    """A master-side operation is a call too: a worker found dead before it (or during it)
    is replaced first, with each rank's replica as it was, and the operation runs."""
    synk.fork(3, restarts=3)
    try:
        w = synk.shared(np.zeros(2))
        w.set_value(np.array([1.0, 2.0]), rank=2)
        f = synk.function(lambda w: w.copy(), reduce=None)
        assert [r.tolist() for r in f(w)] == [[0, 0], [0, 0], [1, 2]]
        os.kill(_pids()[1], signal.SIGKILL)
        time.sleep(0.3)
        with pytest.warns(synk.RankReplacedWarning, match="rank 1 was killed"):
            if operation == "get_value":
                assert w.get_value(2).tolist() == [1, 2]
            elif operation == "set_value":
                w.set_value(np.ones(2))
            elif operation == "set_value(rank=)":
                w.set_value(np.ones(2), rank=1)
            elif operation == "shared_all_reduce":
                synk.shared_all_reduce(w, "sum")
            elif operation == "shared_broadcast":
                synk.shared_broadcast(w)
            elif operation == "distribute":
                synk.distribute()
                synk.function(lambda: 0)  # (a function made since ships now)
                synk.distribute()
            else:
                futures = [f.submit(w) for _ in range(3)]
                assert all(len(fut.result()) == 3 for fut in futures)
        assert synk.restarts_left() == 2
        want = {"set_value": [[1, 1]] * 3, "set_value(rank=)": [[0, 0], [1, 1], [1, 2]],
                "shared_all_reduce": [[1, 2]] * 3, "shared_broadcast": [[0, 0]] * 3}
        assert [r.tolist() for r in f(w)] == want.get(operation, [[0, 0], [0, 0], [1, 2]])
    finally:
        synk.close()


def _add_one_rank_2_slow_in_the_fourth(s):
    s += 1
    if synk.rank() == 2 and s[0] == 4:
        time.sleep(5)  # (killed here)
    return s.copy()


def test_rank_0s_value_read_while_a_failed_submitted_call_is_read_is_from_before_it(
        monkeypatch):
    """``get_value(0)`` while the settler thread reads the replies of the last submitted
    call, which a worker's death failed, waits for that reading: it gives the value from
    before the failed call (the replacement undid it), not rank 0's share of it. The
    reading is slowed to make the moment certain."""
    from synk import _testing
    from synk._call import master

    settle = master.MasterCall.settle

    def slow_settle(call):
        time.sleep(0.1)
        return settle(call)

    synk.fork(3, restarts=1)
    try:
        s = synk.shared(np.zeros(2))
        f = synk.function(_add_one_rank_2_slow_in_the_fourth, reduce=None)
        f(s)
        futures = [f.submit(s) for _ in range(3)]
        futures[1].result()  # (the first two read: the third is outstanding, rank 2 in it)
        monkeypatch.setattr(master.MasterCall, "settle", slow_settle)
        os.kill(_testing.worker_process(2).pid, signal.SIGKILL)
        assert _testing.seen_dead(2)
        time.sleep(0.05)  # (the settler is reading the third call's replies)
        with pytest.warns(synk.RankReplacedWarning, match="were undone"):
            assert s.get_value(0).tolist() == [3, 3]
        with pytest.raises(synk.WorkerDiedError):
            futures[2].result()
    finally:
        synk.close()
