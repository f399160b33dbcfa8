"""Running a script under mpiexec with pretend hosts, for the MPI tests.

Each rank's host is set with ``SYNK_HOST_ID`` through mpiexec's ``-x`` in one part of an MPMD
command line per run of ranks with the same host, so that ranks on different pretend hosts
take the cross-host paths (copies of inputs, outputs in replies, MPI between them) although
they share this machine. mpiexec is Open MPI's from the ``mpi`` extra (next to this Python),
run with ``--oversubscribe`` (more ranks than cores) and, as root, ``--allow-run-as-root``:
options of the test harness, never of the library.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import synk_segments


def mpiexec() -> str | None:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.path.exists(here) else shutil.which("mpiexec")


def require_mpi() -> str:
    """The mpiexec to use; skips the test, saying why, where there is none."""
    launcher = mpiexec()
    if launcher is None:
        pytest.skip("no mpiexec: install the mpi extra (pip install -e \".[mpi]\") to run the "
                    "MPI tests")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed: pip install -e \".[mpi]\" to run the MPI tests")
    return launcher


#: The start of every test script: fork, and say every rank's pid (for the leak check).
PREAMBLE = """\
import json, os, sys, time
import numpy as np
import synk

n = synk.fork()
print("SYNK-PIDS", json.dumps(synk.function(lambda: os.getpid(), reduce=None)()), flush=True)
"""


def job_files(tmp_path) -> dict:
    """Environment that puts Open MPI's own shared-memory files in the test's directory:
    a job that ends by MPI_Abort can leave them behind (rank 0 killed before unlinking its
    ``sm_segment.*``), and /dev/shm must not collect them."""
    return {"OMPI_MCA_btl_sm_backing_directory": str(tmp_path)}


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, seconds: float) -> None:
        self.rc, self.seconds = proc.returncode, seconds
        self.out, self.err = proc.stdout, proc.stderr
        self.pids = []
        for line in self.out.splitlines():
            if line.startswith("SYNK-PIDS "):
                self.pids = json.loads(line.split(" ", 1)[1])

    @property
    def text(self) -> str:
        return self.out + self.err

    def printed(self, label: str) -> list:
        """The values the job printed as ``label`` and their JSON, a line each, in order."""
        return [json.loads(line.split(" ", 1)[1]) for line in self.out.splitlines()
                if line.startswith(label + " ")]

    def __repr__(self) -> str:
        return f"<mpiexec rc={self.rc} after {self.seconds:.1f} s>\n{self.text[-6000:]}"


def run(tmp_path, body: str, hosts=("a", "a", "b", "b"), timeout: float = 45,
        preamble: str = PREAMBLE, env: dict | None = None, script: str | None = None,
        rank_env: list | None = None) -> Run:
    """Run ``preamble + body`` under mpiexec, one rank per entry of ``hosts`` (its
    ``SYNK_HOST_ID``; None leaves it unset) and of ``rank_env`` (variables of that rank
    alone, as a launcher sets per task); check afterwards that none of the job's processes
    nor shared-memory segments are left."""
    launcher = require_mpi()
    if script is None:
        path = tmp_path / "job.py"
        path.write_text(preamble + body)
        script = str(path)
    cmd = [launcher, "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    parts = []
    for host, own in zip(hosts, rank_env or [{}] * len(hosts)):
        if parts and parts[-1][0] == host and parts[-1][2] == own:
            parts[-1][1] += 1  # consecutive ranks alike: one part of the MPMD line
        else:
            parts.append([host, 1, own])
    for i, (host, count, own) in enumerate(parts):
        if i:
            cmd.append(":")
        cmd += ["-n", str(count)]
        if host is not None:
            cmd += ["-x", f"SYNK_HOST_ID={host}"]
        for var, value in own.items():
            cmd += ["-x", f"{var}={value}"]
        cmd += [sys.executable, script]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **job_files(tmp_path), **(env or {}))
    full_env.pop("SYNK_HOST_ID", None)
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env,
                          cwd=tmp_path)
    result = Run(proc, time.monotonic() - start)
    _check_nothing_left(result)
    return result


def _check_nothing_left(result: Run) -> None:
    """No rank outlives the job, nor any segment of a job that ended cleanly. A job that
    ended by MPI_Abort had its processes killed by the launcher (SIGKILL, which nothing can
    catch): what they left must be orphans, which the next synk process on the host
    reclaims, as after a SIGKILL on one host."""
    deadline = time.monotonic() + 10
    while True:
        alive = [pid for pid in result.pids if _alive(pid)]
        segments = synk_segments(result.pids) if result.pids else set()
        if not (alive or segments) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not alive, f"ranks still running after the job: {alive}\n{result!r}"
    if segments and result.rc != 0:
        import synk

        synk.fork(1)  # (every fork() reclaims what dead processes left on its host)
        synk.close()
        segments = synk_segments(result.pids)
        assert not segments, f"segments of the killed job not reclaimable: {segments}\n{result!r}"
    assert not segments, f"segments left behind by the job: {segments}\n{result!r}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
