"""A scaled-down endurance run (the full one: ``python tests/endurance.py``)."""
import endurance


def test_many_calls_leak_nothing():
    before, after, _ = endurance.calls(400, 3)
    assert not endurance.growth(before, after, 3), (before, after)


def test_many_fork_close_cycles_leak_nothing():
    before, after, _ = endurance.cycles(8, 2)
    assert not endurance.growth(before, after), (before, after)


def test_full_script_runs_and_reports():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(endurance.__file__)
    out = subprocess.run([sys.executable, str(script), "50", "2", "2"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no growth" in out.stdout and "open fds" in out.stdout
