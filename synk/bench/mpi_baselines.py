"""The mpi4py baselines: ``mpi_allreduce`` run under the ``mpiexec`` of the ``mpi`` extra
(Open MPI from pip) on the same number of ranks, when both are installed."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from .._devices.report import mpiexec


def mpi_times(ranks: int, sizes: list[int], repeat: int, calls: int = 200) -> dict:
    """mpi4py's figures (see ``mpi_allreduce``): {"allreduce": {bytes: s}, "barrier": s,
    "call": s}, or {} where MPI is not installed or fails."""
    return run_baseline("synk.bench.mpi_allreduce", ranks,
                        [repeat, calls, *sizes], "mpi4py baseline")


def launch(launcher: str, ranks: int) -> list[str]:
    """``launcher -n ranks`` as it runs by default (Open MPI binds each of 2 ranks to a core
    of its own, as synk does), with ``--oversubscribe`` where there are more ranks than cores
    (which Open MPI refuses, and which binds none)."""
    more = ["--oversubscribe"] if ranks > len(os.sched_getaffinity(0)) else []
    return [launcher, "-n", str(ranks), *more]


def run_baseline(module: str, ranks: int, args: list, what: str) -> dict:
    """The JSON dict ``python -m module *args`` prints last, run on ``ranks`` ranks under the
    ``mpiexec`` of the ``mpi`` extra, its "allreduce" keyed by bytes; {} (and a line saying
    why) where MPI is not installed or the run fails."""
    launcher = mpiexec()
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return {}
    if launcher is None:
        return {}
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [*launch(launcher, ranks), sys.executable, "-m", module, *map(str, args)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        print(f"  ({what} skipped: {err})")
        return {}
    if out.returncode != 0:
        print(f"  ({what} skipped: mpiexec failed: {out.stderr.strip()[-300:]})")
        return {}
    got = json.loads(out.stdout.strip().splitlines()[-1])
    got["allreduce"] = {int(k): v for k, v in got["allreduce"].items()}
    return got
