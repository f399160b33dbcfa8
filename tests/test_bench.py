"""The benchmark runs end to end at tiny sizes and writes its table and JSON (no speed is
asserted: that is the benchmark's job, not the tests')."""
import json
import subprocess
import sys


def test_bench_runs_at_tiny_sizes(tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    run = subprocess.run(
        [sys.executable, "-m", "synk.bench", "--quick", "--ranks", "2", "--max-size", "256K",
         "--out", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    benches = {r["bench"] for r in results["results"]}
    assert {"call overhead", "scatter", "allreduce", "scaling"} <= benches
    for row in results["results"]:
        assert row["median_s"] > 0 and row["ratio"] > 0
    cases = {r["case"] for r in results["results"]}
    assert {"synk tiny call, 2 ranks", "synk, 2 ranks, one busy core",
            "synk polling off, 2 ranks, one busy core", "synk.comm barrier",
            "synk.comm, 8 B"} <= cases
    assert results["machine"]["cores"] >= 1
    assert "call overhead" in run.stdout and "ratio" in run.stdout
    if "gpu" in results["skipped"]:
        assert "gpu: skipped" in run.stdout


def test_bench_refuses_unknown_names():
    run = subprocess.run([sys.executable, "-m", "synk.bench", "--only", "bogus"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "unknown benchmarks ['bogus']" in run.stderr
