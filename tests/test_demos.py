"""The demos run from a plain interpreter and succeed."""
import pathlib
import subprocess
import sys

import pytest

DEMOS = pathlib.Path(__file__).resolve().parent.parent / "demos"


SYNKHRONOS = ["synkhronos_functions.py", "synkhronos_shared.py", "synkhronos_batch.py"]


@pytest.mark.parametrize("name", ["intro.py", "data.py", *SYNKHRONOS])
def test_demo_runs(name):
    out = subprocess.run(
        [sys.executable, str(DEMOS / name)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "All assertions passed." in out.stdout


@pytest.mark.parametrize("name", SYNKHRONOS)
def test_synkhronos_demo_runs_on_3_ranks(name):
    out = subprocess.run(
        [sys.executable, str(DEMOS / name), "3"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "synk: 3 ranks" in out.stdout and "All assertions passed." in out.stdout


def test_call_overhead_demo_runs():
    out = subprocess.run(
        [sys.executable, str(DEMOS / "call_overhead.py"), "2", "200"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "synk no-op call (2 ranks)" in out.stdout and "ratio" in out.stdout


def test_train_mlp_demo_matches_single_process_sgd():
    out = subprocess.run([sys.executable, str(DEMOS / "train_mlp.py"), "2", "2"],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "The 2-rank run matches single-process SGD" in out.stdout


def test_kalman_demo_matches_single_process():
    out = subprocess.run([sys.executable, str(DEMOS / "kalman.py"), "120"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "matches the single-process one" in out.stdout
