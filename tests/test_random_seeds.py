"""``synk.fork(seed=...)``: every rank's process-wide generators (Python's ``random``,
numpy's global one, torch's, CuPy's on GPU ranks) seeded from the seed and the rank, so
that two runs give the same bits and no two ranks draw the same numbers; rank 0, the
master, included. On CPU ranks, simulated GPUs and MPI."""
import json
import random

import mpirun
import numpy as np
import pytest
from conftest import use_devices

import synk


def _draws(x):
    """What a function draws from the process-wide generators on its rank."""
    xp = synk.xp(x)
    on_device = xp.random.random_sample(3)
    on_device = on_device.get() if hasattr(on_device, "get") else on_device
    return np.concatenate([[random.random()], np.random.random_sample(3), on_device])


def _run(n: int, backend: str, seed, monkeypatch) -> np.ndarray:
    """Each rank's draws in a fresh group of ``n`` ranks forked with ``seed`` (the
    master's generators scrambled first: fork's seed decides rank 0's too)."""
    if backend == "gpu":
        use_devices(monkeypatch, n)
    random.seed()
    np.random.seed()
    synk.fork(n, backend=backend, seed=seed)
    try:
        f = synk.function(_draws, reduce=None)
        return np.array([f(np.zeros((n, 1))), f(np.zeros((n, 1)))])
    finally:
        synk.close()


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_two_runs_with_one_seed_draw_the_same_bits_on_every_rank(backend, monkeypatch):
    first = _run(3, backend, 1234, monkeypatch)
    again = _run(3, backend, 1234, monkeypatch)
    assert np.array_equal(first, again)
    calls, ranks = first.shape[:2]
    for call in range(calls):  # no two ranks draw the same numbers
        rows = {tuple(first[call, r]) for r in range(ranks)}
        assert len(rows) == ranks
    assert not np.array_equal(first[0], first[1])  # generators go on across calls
    other = _run(3, backend, 1235, monkeypatch)
    assert not np.any(first == other)


def test_without_a_seed_the_ranks_draw_from_fresh_seeds(monkeypatch):
    """The default stays as it was: each worker seeds itself from the OS."""
    first, again = _run(2, "cpu", None, monkeypatch), _run(2, "cpu", None, monkeypatch)
    assert not np.any(first[:, 1] == again[:, 1])


@pytest.mark.parametrize("seed", [-1, 1.5, "7", True])
def test_a_seed_that_is_not_a_non_negative_int_is_refused_before_anything_starts(seed):
    with pytest.raises(ValueError, match="seed must be None or a non-negative int"):
        synk.fork(2, seed=seed)
    assert synk.size() == 1


def _torch_draws(x):
    import torch  # (imported here first on the workers: seeded as it loads)

    return torch.rand(4).numpy()


@pytest.mark.frameworks
def test_torch_imported_by_the_function_is_seeded_from_the_seed_and_the_rank():
    pytest.importorskip("torch")
    runs = []
    for _ in range(2):
        synk.fork(3, seed=99)
        try:
            runs.append(np.array(synk.function(_torch_draws, reduce=None)(np.zeros((3, 1)))))
        finally:
            synk.close()
    assert np.array_equal(runs[0], runs[1])
    assert len({tuple(r) for r in runs[0]}) == 3


def test_under_mpi_the_ranks_are_seeded_by_the_same_rule(tmp_path):
    """Under mpiexec the workers are the script's processes, started before fork(): its
    seed reaches them all the same."""
    run = mpirun.run(tmp_path, """
runs = [synk.function(lambda: np.random.random_sample(2).tolist(), reduce=None)()]
print("DRAWS", json.dumps(runs), flush=True)
synk.close()
""", hosts=("a", "a", "b"), preamble=mpirun.PREAMBLE.replace("synk.fork()",
                                                             "synk.fork(seed=5)"))
    assert run.rc == 0, run
    line = next(x for x in run.out.splitlines() if x.startswith("DRAWS "))
    draws = np.array(json.loads(line[6:])[0])
    local = []
    synk.fork(3, seed=5)
    try:
        local = np.array(synk.function(lambda: np.random.random_sample(2), reduce=None)())
    finally:
        synk.close()
    assert np.array_equal(draws, local)
