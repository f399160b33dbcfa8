"""Sequences of calls give the one-process model's answers, or the error documented for
them, whatever happens around them (the harness: ``call_sequences``).

Hypothesis draws each sequence: calls plain, bound and submitted, their function raising,
exiting or stalling on one rank before or after its update; workers killed from outside
between calls; groups with restarts and without; futures read in random orders, waited
for with ``concurrent.futures.wait`` and ``as_completed``, and left to complete on their
own (every done-callback must fire); shared variables and the Data changed between calls
by master-side operations; the allreduce inside ``jax.jit``, or a ring of sendrecvs
inside it, as its ways where JAX is installed. Each step's outcome, every rank's state and
every future's outcome are checked against the model; a step that hangs fails. A failure
is shrunk to a short sequence; the ones found are kept below as plain tests.

A short run takes part in every test run. ``--hypothesis-profile=soak`` runs for
``SYNK_SOAK_MINUTES`` (default 30) in all, shared by the tests of this file:

    SYNK_SOAK_MINUTES=60 pytest tests/test_call_sequences.py --hypothesis-profile=soak
"""
from __future__ import annotations

import os
import time

import pytest
from call_sequences import CallSequences
from conftest import use_devices
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

_TESTS = 5  # the tests below that share a soak's minutes
_SOAK_S = float(os.environ.get("SYNK_SOAK_MINUTES", "30")) * 60 / _TESTS
_SOAKING = "soak" in os.environ.get("PYTEST_ADDOPTS", "") or os.environ.get(
    "SYNK_SOAK_MINUTES") is not None
_TIMEOUT = int(_SOAK_S + 900) if _SOAKING else 900
_EXAMPLES = int(os.environ.get("SYNK_SEQUENCES", "6"))  # sequences per test in a short run
_STEPS = 14  # steps per sequence at most


# (SYNK_SEQUENCES_SHRINK=0: a failure is reported as found, with its steps, not shrunk)
_PHASES = tuple(Phase) if os.environ.get("SYNK_SEQUENCES_SHRINK", "1") != "0" else (
    Phase.explicit, Phase.generate)


def _soak(request) -> bool:
    return request.config.getoption("hypothesis_profile", None) == "soak"


def _machine(n: int, backend: str = "cpu", deaths: bool = True, stalls: bool = True):
    class Sequences(CallSequences):
        pass

    Sequences.n, Sequences.backend = n, backend
    Sequences.deaths, Sequences.stalls = deaths, stalls
    Sequences.tally = {}
    return Sequences


def _run(request, machine) -> None:
    """The machine's sequences once, or, soaking, again and again for this test's share of
    ``SYNK_SOAK_MINUTES``; prints what ran, by kind."""
    soak = _soak(request)
    stop = time.monotonic() + _SOAK_S
    rounds = 0
    while True:
        run_state_machine_as_test(machine, settings=settings(
            max_examples=100 if soak else _EXAMPLES, stateful_step_count=_STEPS * (2 if soak
                                                                                 else 1),
            deadline=None, database=None, suppress_health_check=list(HealthCheck),
            phases=_PHASES))
        rounds += 1
        if not soak or time.monotonic() > stop:
            break
    print(f"{request.node.name}: {rounds} round(s); " + ", ".join(
        f"{kind}: {count}" for kind, count in sorted(machine.tally.items())))


@pytest.mark.timeout(_TIMEOUT)
@pytest.mark.parametrize("n", [2, 3])
def test_call_sequences_on_cpu_ranks(request, n):
    _run(request, _machine(n))


@pytest.mark.frameworks
@pytest.mark.timeout(_TIMEOUT)
def test_call_sequences_with_allreduces_under_jax_jit(request):
    """The sequences on 2 CPU ranks where JAX is installed (CI's step of the frameworks),
    whose allreduce runs inside ``jax.jit``, or as a ring of sendrecvs inside it, as two
    of its ways (``via``)."""
    pytest.importorskip("jax")
    _run(request, _machine(2))


@pytest.mark.gpu
@pytest.mark.timeout(_TIMEOUT)
def test_call_sequences_on_simulated_gpus(request, monkeypatch):
    use_devices(monkeypatch, 2)
    _run(request, _machine(2, "gpu"))


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_a_call_behind_a_failure_not_read_on_gpu_ranks_may_fail_before_its_stall(monkeypatch):
    """A sequence the soak found: on GPU ranks, a submitted call that raised on rank 1
    aborted the NCCL communicators, which are made anew once its failure is read; a call
    submitted behind it may fail in its allreduce before rank 0 stalls (after it), and gives
    ``EarlierCallFailedError`` with the group still up, or stalls and gives the timeout."""
    use_devices(monkeypatch, 2)
    for _ in range(3):
        state = _machine(2, "gpu")()
        state.start(restarts=2)
        state.call(batch=None, form="plain", plan=None, via="persistent")
        state.call(batch=None, form="submitted", via="persistent",
                   plan={"what": "raise", "step": 0, "when": "before", "rank": 1})
        state.call(batch=None, form="bound submitted", plan=None, via="persistent")
        state.call(batch=None, form="bound submitted", via="persistent",
                   plan={"what": "stall", "step": 0, "when": "after", "rank": 0})
        state.fork_again(restarts=2)
        state.teardown()


_MPI_JOB = """
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from call_sequences import CallSequences

class Sequences(CallSequences):
    n, deaths, stalls, forks = synk.size(), False, False, False
    tally = {{}}

stop = time.monotonic() + {seconds}
while True:
    run_state_machine_as_test(Sequences, settings=settings(
        max_examples={examples}, stateful_step_count={steps}, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))
    if time.monotonic() > stop:
        break
print("SEQUENCES", dict(sorted(Sequences.tally.items())), flush=True)
synk.close()
"""


@pytest.mark.timeout(_TIMEOUT)
def test_call_sequences_across_pretend_hosts_under_mpi(request, tmp_path):
    """Three ranks on two pretend hosts under mpiexec (no deaths or stalls: a job's
    processes are fixed, and its timeout ends it): calls plain, bound, submitted and of
    many steps, failures, futures and master-side operations, on the job's one group."""
    import mpirun

    soak = _soak(request)
    body = _MPI_JOB.format(examples=20 if soak else _EXAMPLES, steps=_STEPS,
                           seconds=_SOAK_S if soak else 0)
    tests = os.path.dirname(os.path.abspath(__file__))
    run = mpirun.run(tmp_path, body, hosts=("a", "b", "b"),
                     timeout=_SOAK_S + 500 if soak else 500, env={"PYTHONPATH": tests})
    assert run.rc == 0, run.text[-12000:]
    print(next(line for line in run.out.splitlines() if line.startswith("SEQUENCES")))
