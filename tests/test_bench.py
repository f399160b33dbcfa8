"""The benchmark runs end to end at tiny sizes and writes its table and JSON (no speed is
asserted: that is the benchmark's job, not the tests')."""
import json
import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_bench_runs_at_tiny_sizes(tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    run = subprocess.run(
        [sys.executable, "-m", "synk.bench", "--quick", "--ranks", "2", "--max-size", "256K",
         "--out", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    benches = {r["bench"] for r in results["results"]}
    assert {"call overhead", "scatter", "allreduce", "training", "scaling"} <= benches
    for row in results["results"]:
        assert row["median_s"] > 0 and row["ratio"] > 0
    cases = {r["case"] for r in results["results"]}
    assert {"synk tiny call, 2 ranks", "synk, 2 ranks, one busy core",
            "synk polling off, 2 ranks, one busy core", "synk.comm barrier",
            "synk.comm, 8 B", "small training step, 2 ranks", "the step in one process",
            "synk route A (broadcast weights, reduce='mean'), 2 ranks",
            "synk route B (shared weights, comm mean), 2 ranks"} <= cases
    assert any(c.startswith("synk.comm fused weighted mean") for c in cases)
    assert results["machine"]["cores"] >= 1
    assert "call overhead" in run.stdout and "ratio" in run.stdout
    if "gpu" in results["skipped"]:
        assert "gpu: skipped" in run.stdout


def test_bench_refuses_unknown_names():
    run = subprocess.run([sys.executable, "-m", "synk.bench", "--only", "bogus"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown benchmarks ['bogus']" in run.stderr


def test_the_many_host_bench_runs_under_mpiexec(tmp_path):
    import mpirun

    mpirun.require_mpi()
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "synk.bench", "--mpi", "--quick", "--ranks", "2",
         "--max-size", "64K", "--out", str(out), "--plot", str(tmp_path / "bench.png")],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, **mpirun.job_files(tmp_path)),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["results"]
    cases = {r["case"].rsplit(",", 1)[0] for r in rows}
    assert {"synk call overhead", "mpi4py bcast+gather", "synk outputs", "synk.comm.allreduce",
            "mpi4py Allreduce", "synk call, Data input kept on the hosts",
            "synk call, numpy input sent each call", "mpi4py Scatter"} <= cases, cases
    assert all(r["bench"] == "many hosts" and r["median_s"] > 0 for r in rows)


def test_the_gpu_section_runs_on_the_simulator_and_says_so(tmp_path):
    import os

    out = tmp_path / "bench.json"
    env = dict(os.environ, SYNK_SIMULATE_GPUS="2")
    run = subprocess.run(
        [sys.executable, "-m", "synk.bench", "--only", "gpu", "--quick", "--out", str(out),
         "--plot", str(tmp_path / "bench.png")],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(out.read_text())["results"]
    cases = [r["case"] for r in rows]
    assert rows and all(case.startswith("simulated, ") for case in cases)
    for kind in ("H2D synk Data", "H2D numpy pageable", "H2D CuPy pinned", "direct CuPy call",
                 "synk call, 1 rank", "allreduce synk.comm, 2 GPUs", "allreduce bare NCCL",
                 "small training step, 2 ranks"):
        assert any(kind in case for case in cases), kind
    assert all(r["median_s"] > 0 for r in rows)
    assert all("bus_gb_per_s" in r for r in rows if "allreduce" in r["case"])


@pytest.mark.frameworks
@pytest.mark.timeout(240)
def test_the_shallow_water_row_times_synk_against_mpi4jax_or_one_process():
    pytest.importorskip("jax")
    from synk.bench import frameworks

    (row,) = frameworks.jax_shallow_rows(2, calls=2, rounds=1)
    assert row["case"].startswith("shallow-water model step under jit")
    assert row["baseline"] in ("mpi4jax's, under mpiexec", "one process")
    assert row["median_s"] > 0 and row["baseline_s"] > 0
