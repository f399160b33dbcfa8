"""Many hosts (``--mpi``): synk under mpiexec with its ranks split over pretend hosts
(``SYNK_HOST_ID``), against mpi4py alone on the same processes. The pretend hosts share this
machine, so MPI moves their bytes through shared memory, as between the ranks of one real
host; synk takes its cross-host paths all the same.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from ._timing import result, size_label
from .mpi_baselines import mpiexec

BENCH = "many hosts"


def _run(kind: str, ranks: int, calls: int, repeat: int, sizes: list[int],
         hosts: int = 2) -> dict:
    launcher = mpiexec()
    assert launcher is not None  # (these figures are skipped without one)
    cmd = [launcher]
    if ranks > len(os.sched_getaffinity(0)):
        cmd.append("--oversubscribe")  # (Open MPI's option: more ranks than cores)
    counts = [len(part) for part in np.array_split(np.arange(ranks), hosts)]
    for i, count in enumerate(counts):
        cmd += ([":"] if i else []) + ["-n", str(count), "-x", f"SYNK_HOST_ID=h{i}",
                                       sys.executable, "-m", "synk.bench.mpi_hosts", kind,
                                       str(calls), str(repeat), *map(str, sizes)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"mpiexec failed ({kind}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def available() -> str | None:
    """None when the many-host benchmark can run, else why not."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return 'mpi4py is not installed (pip install "synk[mpi]")'
    return None if mpiexec() else "no mpiexec"


def run(ranks: int, calls: int, sizes: list[int], repeat: int) -> list[dict]:
    """The rows on two pretend hosts. Per-call overhead: a no-op synk call, against the same
    round trip in mpi4py (rank 0 sends every rank a small message and waits for each
    answer). Allreduce: a function's outputs reduced with ``"sum"`` (a whole call: inputs,
    control messages, the other host's outputs in its replies) and ``synk.comm.allreduce``
    inside a function, against mpi4py's ``Allreduce``, as algorithm bandwidth, S / time.
    Inputs: a call whose scattered input (S bytes) is a ``Data``, whose rows the other host
    keeps between calls, or a numpy array, whose rows go with every call, against mpi4py's
    ``Scatter`` of S bytes from rank 0."""
    ranks = max(ranks, 2)
    synk_t = _run("synk", ranks, calls, repeat, sizes)
    mpi_t = _run("mpi", ranks, calls, repeat, sizes)
    where = f"{ranks} ranks on 2 pretend hosts"
    base = "mpi4py alone"
    rows = [result(BENCH, f"synk call overhead, {where}", synk_t["call"], base,
                   mpi_t["call"], ranks=ranks),
            result(BENCH, f"mpi4py bcast+gather, {where}", mpi_t["call"], base,
                   mpi_t["call"], ranks=ranks)]
    by_size = (("allreduce", "mpi4py Allreduce", base,
                (("synk outputs", "outputs"), ("synk.comm.allreduce", "comm"))),
               ("scatter", "mpi4py Scatter", "mpi4py Scatter",
                (("synk call, Data input kept on the hosts", "data_in"),
                 ("synk call, numpy input sent each call", "numpy_in"))))
    for mpi_key, mpi_case, baseline, synk_cases in by_size:
        for nbytes in sizes:
            key = str(nbytes)
            mpi_s = mpi_t[mpi_key][key]
            for case, seconds in [*((c, synk_t[k][key]) for c, k in synk_cases),
                                  (mpi_case, mpi_s)]:
                rows.append(result(BENCH, f"{case}, {size_label(nbytes)}", seconds, baseline,
                                   mpi_s, ranks=ranks, bytes=nbytes,
                                   gb_per_s=nbytes / seconds / 1e9))
    return rows


#: (ranks, pretend hosts) of the combine's scaling figures
COMBINE_LAYOUTS = ((2, 2), (4, 2), (8, 2), (4, 4), (8, 4))


def run_combine(sizes: list[int], repeat: int, calls: int,
                layouts=COMBINE_LAYOUTS) -> list[dict]:
    """How combining every rank's output scales with ranks and hosts: synk's call (each
    rank's S-byte float64 output summed) against mpi4py's ``Reduce`` to rank 0, flat and
    by host, in runs of the same layout; ratios against the faster of the two (mpi4py's
    best). And a no-op synk call in each layout: the part of the combine's call that is
    the call's own."""
    rows = []
    for ranks, hosts in layouts:
        synk_t = _run("synk-combine", ranks, calls, repeat, sizes, hosts)
        mpi_t = _run("mpi-combine", ranks, 0, repeat, sizes, hosts)
        where = f"{ranks} ranks on {hosts} pretend hosts"
        base = "mpi4py best Reduce"
        for nbytes in sizes:
            key, label = str(nbytes), size_label(nbytes)
            best = min(mpi_t["reduce"][key], mpi_t["reduce_by_host"][key])
            for case, seconds in (("synk outputs combined (sum)", synk_t["combine"][key]),
                                  ("mpi4py Reduce", mpi_t["reduce"][key]),
                                  ("mpi4py Reduce by host", mpi_t["reduce_by_host"][key])):
                rows.append(result(BENCH, f"{case}, {where}, {label}", seconds, base, best,
                                   ranks=ranks, hosts=hosts, bytes=nbytes,
                                   gb_per_s=nbytes / seconds / 1e9))
        rows.append(result(BENCH, f"synk no-op call, {where}", synk_t["call"],
                           "synk no-op call", synk_t["call"], ranks=ranks, hosts=hosts))
    return rows

