"""How fork() tells an MPI launch, and the pure parts of the many-host code (no mpiexec)."""
import subprocess
import sys

import numpy as np
import pytest

import synk

# No public handle without mpiexec: the launcher's variables read as a table (fork() under a
# real launcher is test_mpi.py's), and the pure parts of the many-host code (hosts, the rows
# a host reads, the names of mirrored blocks), checked here on their own.
from synk._testing import (
    Hosts,
    mirror_name,
    rows_of_runs as _rows,
    runs_of_ranks as _runs,
    settings as _settings,
)

_LAUNCH_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
                "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "PMIX_RANK", "PMI_RANK", "SYNK_MPI")


@pytest.fixture
def clean_env(monkeypatch):
    for var in _LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, expected", [
    ({}, None),
    ({"OMPI_COMM_WORLD_SIZE": "4"}, ("OMPI_COMM_WORLD_SIZE", 4)),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"PMI_SIZE": "3"}, ("PMI_SIZE", 3)),
    ({"SLURM_STEP_NUM_TASKS": "8"}, None),  # a batch script's environment, not a step's task
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "2"}, ("SLURM_STEP_NUM_TASKS", 8)),
    ({"PMIX_RANK": "0"}, ("PMIX_RANK", None)),  # PMIx (srun --mpi=pmix): ask MPI the size
])
def test_the_launcher_is_told_by_its_environment(clean_env, env, expected):
    for var, value in env.items():
        clean_env.setenv(var, value)
    assert _settings.mpi_launcher() == expected


def test_synk_mpi_0_turns_detection_off(tmp_path):
    """Under a launcher's variables, SYNK_MPI=0 forks a group of this process's own, without
    mpi4py (which fork() would otherwise import, and raise: "one of 4 tasks")."""
    import mpirun

    out = _python("import sys, synk\n"
                  "synk.fork(2)\n"
                  "assert synk.function(lambda x: x.sum(), reduce='sum')([1.0, 2.0]) == 3\n"
                  "synk.close()\n"
                  "print('mpi4py' in sys.modules)\n",
                  {"OMPI_COMM_WORLD_SIZE": "4", "SYNK_MPI": "0", **mpirun.job_files(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_bad_synk_mpi_value_is_refused(clean_env):
    clean_env.setenv("SYNK_MPI", "yes")
    with pytest.raises(ValueError, match="SYNK_MPI='yes' is not valid"):
        synk.fork(2)
    assert synk.size() == 1  # no group started


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    import os

    full = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(full, **env))


def test_without_a_launcher_mpi4py_is_not_imported(tmp_path):
    out = _python("import sys, synk\n"
                  "synk.fork(2)\n"
                  "assert synk.function(lambda x: x.sum(), reduce='sum')([1.0, 2.0]) == 3\n"
                  "synk.close()\n"
                  "print('mpi4py' in sys.modules)\n", {})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_launcher_without_an_mpi_world_is_a_clear_error(tmp_path):
    """srun -n 8 without --mpi=pmix: every task is a world of one. (Open MPI started as a
    singleton leaves its sm_segment file behind even after MPI_Finalize: in tmp_path.)"""
    pytest.importorskip("mpi4py")
    import mpirun

    out = _python("import synk\n"
                  "try:\n"
                  "    synk.fork(2)\n"
                  "except synk.SynkError as err:\n"
                  "    print(err)\n", {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0",
                                       **mpirun.job_files(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "one of 4 tasks" in out.stdout and "srun --mpi=pmix" in out.stdout, out.stdout


def test_hosts_are_numbered_by_their_first_rank():
    hosts = Hosts.from_keys([(("id", "x"), "x"), (("id", "y"), "y"), (("id", "x"), "x"),
                             (("node", 3), "n3")])
    assert hosts.of_rank == (0, 1, 0, 2) and hosts.labels == ("x", "y", "n3")
    assert hosts.ranks(0) == [0, 2] and hosts.leader(1) == 1 and hosts.local_index(2) == 1
    assert hosts.label(3) == "n3"
    assert hosts.describe() == "host 'x': ranks [0, 2]; host 'y': ranks [1]; host 'n3': ranks [3]"


def test_the_rows_a_host_reads():
    bounds = (0, 3, 6, 8, 10)  # 4 ranks
    assert _runs(bounds, [1, 2]) == [(3, 8)]  # adjacent ranks: one run
    assert _runs(bounds, [0, 2]) == [(0, 3), (6, 8)]
    assert _runs((0, 2, 2, 4), [1]) == []  # a rank with no rows
    x = np.arange(40).reshape(20, 2)
    for selection in (None, (2, 3), np.array([7, 1, 1, 19, 0, 4, 4, 5, 9, 2])):
        for a, b in ((0, 3), (3, 5), (5, 5)):
            rows = _rows(selection, a, b)
            if selection is None:
                want = x[a:b]
            elif isinstance(selection, tuple):
                want = x[selection[0] + a * selection[1]:selection[0] + b * selection[1]:
                         selection[1]]
            else:
                want = x[selection[a:b]]
            assert np.array_equal(x[rows], want)


def test_a_mirror_name_is_the_same_on_every_rank_and_under_the_leaders_prefix():
    a = mirror_name("synk-1-aaaa-", "synk-9-bbbb-d1-cccc")
    assert a == mirror_name("synk-1-aaaa-", "synk-9-bbbb-d1-cccc")
    assert a.startswith("synk-1-aaaa-m") and a != mirror_name("synk-1-aaaa-", "synk-9-x")
