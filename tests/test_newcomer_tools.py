"""``python -m synk selftest`` and ``python -m synk info`` as a new user meets them: the
self-test says what it runs as it runs it and fails (exit status 1, and a final line saying
what failed) when one of its checks or its ``pytest -m gpu`` run fails; ``info`` finds the
``mpiexec`` the ``mpi`` extra put beside this Python although that directory is not on PATH.

The self-test runs in a subprocess on two simulated GPUs; the failing paths replace its checks
(``synk._selftest.CHECKS``) or point its pytest run (``synk._selftest.TESTS``) at a tiny fake
checkout, so that every test takes seconds.

It reaches synk's internals (``synk._testing``: the self-test's table of checks) because
staging the self-test's failures has no public handle."""
import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

# No public handle: the self-test's table of checks, replaced to stage its failures.
from synk._testing import CHECKS, FRAMEWORK_CHECKS

SECONDS = 50  # under the suite's 60 s per test


def environment(**extra) -> dict:
    env = dict(os.environ, **{"SYNK_SIMULATE_GPUS": "2", **extra})
    env.pop("SYNK_SIM_FAULTS", None)
    return env


def run(args, cwd, env=None, timeout=SECONDS) -> tuple[int, str]:
    """Run ``args``; (exit status, stdout and stderr together). The whole process group is
    killed past ``timeout``, so that a pytest started by the self-test does not outlive it."""
    proc = subprocess.Popen(args, cwd=cwd, env=env or environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{args} did not finish within {timeout} s; its output:\n{out}")
    return proc.returncode, out


def selftest_script(tmp_path, body: str, run_pytest: bool = False) -> list[str]:
    """A command running ``synk._selftest.main`` after ``body`` (which may replace its checks
    or its ``TESTS`` directory: ``st`` is the module)."""
    script = tmp_path / "selftest_with.py"
    script.write_text("import os, sys, time\nimport numpy as np\nimport synk\n"
                      "from synk._testing import selftest as st\n\n"
                      "st.FRAMEWORK_CHECKS = []\n" + textwrap.dedent(body)
                      + f"\nsys.exit(st.main(run_pytest={run_pytest}))\n")
    return [sys.executable, str(script)]


def fake_checkout(tmp_path, test_source: str):
    """A directory laid out as a source checkout: tests/test_gpu.py holding ``test_source``."""
    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: the GPU code path\n")
    (root / "tests" / "test_gpu.py").write_text(
        "import pytest\n\n" + textwrap.dedent(test_source))
    return root / "tests"


PASSING_CHECK = """
def sums(n):
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4)) == 4
"""


def lines_with(out: str, text: str) -> list[str]:
    return [line for line in out.splitlines() if text in line]


def test_selftest_prints_each_check_as_it_starts(tmp_path):
    """The name of a check is on the output while it runs (not held in a buffer until the
    end), and its verdict follows it on the same line."""
    go = tmp_path / "go"
    command = selftest_script(tmp_path, PASSING_CHECK + f"""
def waits(n):
    deadline = time.monotonic() + 2 * {SECONDS}
    while not os.path.exists({str(go)!r}):
        assert time.monotonic() < deadline, "the test never said go"
        time.sleep(0.02)

st.CHECKS = [("a check that sums", sums), ("a check that waits for the test", waits)]
""")
    proc = subprocess.Popen(command, cwd=tmp_path, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(
        lambda: os.read(proc.stdout.fileno(), 65536), b"")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + SECONDS / 2
        while b"a check that waits for the test" not in b"".join(chunks):
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("the self-test did not say which check it was running while it ran; "
                            f"it printed:\n{b''.join(chunks).decode()}")
            time.sleep(0.05)
        shown = b"".join(chunks).decode()
        go.touch()
        assert proc.wait(timeout=SECONDS / 2) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    out = b"".join(chunks).decode()
    assert "selftest: SIMULATED" in shown and "[1/2] a check that sums ... ok" in shown
    assert lines_with(out, "[2/2] a check that waits for the test ... ok (")
    assert "time  no-op call on 2 rank(s)" in out
    assert out.splitlines()[-2] == ("selftest passed on the simulator: 2 of 2 checks passed; "
                                    "pytest -m gpu not run (--no-pytest)")


def test_selftest_real_checks_pass_and_show_progress(tmp_path):
    code, out = run([sys.executable, "-m", "synk", "selftest", "--no-pytest",
                     "--no-frameworks"], cwd=tmp_path)
    assert code == 0, out
    assert lines_with(out, "start the GPU ranks ... ok (")
    for i, (name, _) in enumerate(CHECKS):
        assert lines_with(out, f"[{i + 1}/{len(CHECKS)}] {name} ... ok ("), out
    assert out.splitlines()[-2] == (f"selftest passed on the simulator: {len(CHECKS)} of "
                                    f"{len(CHECKS)} checks passed; torch and JAX not checked "
                                    "(--no-frameworks); pytest -m gpu not run "
                                    "(--no-pytest)"), out
    assert out.rstrip().endswith("```")


def test_selftest_on_one_gpu_runs_two_ranks_on_it(tmp_path):
    """With one GPU, one rank would make synk.comm a collective with itself (never NCCL):
    the self-test runs two ranks on the one GPU."""
    code, out = run([sys.executable, "-m", "synk", "selftest", "--no-pytest",
                     "--no-frameworks"], cwd=tmp_path, env=environment(SYNK_SIMULATE_GPUS="1"))
    assert code == 0, out
    assert lines_with(out, "one GPU: start two ranks on it instead ... ok ("), out
    assert lines_with(out, "time  no-op call on 2 rank(s)"), out


def test_selftest_without_a_gpu_says_it_chose_the_simulator(tmp_path):
    """Without CuPy (hidden here, so that the test reads the same where it is installed) and
    without SYNK_SIMULATE_GPUS, the self-test runs on the simulator it chose: the report
    says so, reports the machine as the user's own fork() finds it (no CUDA, CPU ranks),
    and marks every figure of the simulator simulated."""
    script = tmp_path / "selftest_without_cupy.py"
    script.write_text("import sys\nsys.modules['cupy'] = None  # (import cupy fails)\n"
                      "from synk.__main__ import main\n"
                      "sys.exit(main(['selftest', '--no-pytest', '--no-frameworks']))\n")
    env = environment()
    del env["SYNK_SIMULATE_GPUS"]
    code, out = run([sys.executable, str(script)], cwd=tmp_path, env=env)
    assert code == 0, out
    lines = out.splitlines()
    assert "CUDA: not used (CuPy is not installed" in out, out
    assert lines_with(out, "synk.fork(backend='auto') here: backend 'cpu': no GPU (CuPy is "
                           "not installed"), out
    chosen = lines_with(out, "selftest: SIMULATED: the self-test chose synk's CUDA simulator")
    assert chosen and "no GPU is usable here: CuPy is not installed" in chosen[0], out
    assert "SYNK_SIMULATE_GPUS" not in out, out  # (the user set nothing)
    first = lines.index(chosen[0]) + 1
    figures = lines[first:next(i for i, line in enumerate(lines) if line.startswith("start "))]
    assert [f.split(":")[0].strip() for f in figures[:3]] == ["CUDA runtime", "CUDA driver",
                                                              "NCCL"], out
    assert len(figures) == 5 and all(f.endswith(" (simulated)") for f in figures), out
    times = lines_with(out, "time  ")
    assert len(times) == 2 and all(t.endswith("(simulated: not a GPU figure)") for t in times)
    assert lines[-2].startswith("selftest passed on the simulator: "), out


@pytest.mark.frameworks
@pytest.mark.timeout(3 * SECONDS)
def test_selftest_checks_torch_and_jax_where_they_run(tmp_path):
    """Each torch and JAX check runs (under the simulator: synk's plumbing for them, with
    their CPU builds) and passes; where one is not installed, its checks say skip."""
    code, out = run([sys.executable, "-m", "synk", "selftest", "--no-pytest"], cwd=tmp_path,
                    timeout=3 * SECONDS - 10)
    assert code == 0, out
    total = len(CHECKS) + len(FRAMEWORK_CHECKS)
    for i, (name, _) in enumerate(FRAMEWORK_CHECKS):
        assert lines_with(out, f"[{len(CHECKS) + i + 1}/{total}] {name} ... ok (") or \
            lines_with(out, f"[{len(CHECKS) + i + 1}/{total}] {name} ... skip ("), out
    installed = [importlib.util.find_spec(m) is not None for m in ("torch", "jax")]
    if all(installed):
        assert "skip (" not in out, out


def test_selftest_fails_when_a_check_fails(tmp_path):
    command = selftest_script(tmp_path, PASSING_CHECK + """
def wrong(n):
    raise st._Failed("the answer is wrong on purpose")

st.CHECKS = [("a check that sums", sums), ("a check that is wrong", wrong),
             ("a check after it", sums)]
""")
    code, out = run(command, cwd=tmp_path)
    assert code == 1, out
    assert lines_with(out, "[1/3] a check that sums ... ok (")
    failed = lines_with(out, "[2/3] a check that is wrong ... FAIL (")
    assert failed and failed[0].endswith("_Failed: the answer is wrong on purpose"), out
    assert lines_with(out, "[3/3] a check after it ... ok (")
    assert "time  " not in out  # no timing after a failure
    assert out.splitlines()[-2] == ("selftest FAILED on the simulator: 2 of 3 checks passed; "
                                    "pytest -m gpu not run (--no-pytest)"), out


def test_selftest_fails_when_the_timing_fails(tmp_path):
    command = selftest_script(tmp_path, PASSING_CHECK + """
def broken_timing(n):
    raise RuntimeError("the clock broke")

st.CHECKS = [("a check that sums", sums)]
st._timings = broken_timing
""")
    code, out = run(command, cwd=tmp_path)
    assert code == 1, out
    failed = lines_with(out, "timing: a no-op call and a 16 MiB allreduce ... FAIL (")
    assert failed and failed[0].endswith("RuntimeError: the clock broke"), out
    assert out.splitlines()[-2] == ("selftest FAILED on the simulator: 1 of 1 checks passed; "
                                    "the timing failed; pytest -m gpu not run (--no-pytest)")


def test_selftest_fails_when_the_gpu_ranks_do_not_start(tmp_path):
    command = selftest_script(tmp_path, PASSING_CHECK + """
def no_gpus(*args, **kwargs):
    raise synk.WorkerStartError("no rank started, on purpose")

st.CHECKS = [("a check that sums", sums)]
synk.fork = no_gpus
""")
    code, out = run(command, cwd=tmp_path)
    assert code == 1, out
    failed = lines_with(out, "start the GPU ranks ... FAIL (")
    assert failed and failed[0].endswith("WorkerStartError: no rank started, on purpose"), out
    assert "a check that sums" not in out
    assert out.splitlines()[-2] == ("selftest FAILED on the simulator: 0 of 1 checks passed, "
                                    "1 did not run (the GPU ranks did not start); pytest -m gpu "
                                    "not run (--no-pytest)"), out


GPU_TESTS = """
@pytest.mark.gpu
def test_adds():
    assert 1 + 1 == 2

def test_not_gpu():
    raise AssertionError("pytest -m gpu must not run this")
"""


def test_selftest_runs_pytest_gpu_and_streams_it(tmp_path):
    tests = fake_checkout(tmp_path, GPU_TESTS)
    command = selftest_script(tmp_path, PASSING_CHECK + f"""
st.CHECKS = [("a check that sums", sums)]
st.TESTS = st.pathlib.Path({str(tests)!r})
""", run_pytest=True)
    code, out = run(command, cwd=tmp_path)
    assert code == 0, out
    running = lines_with(out, "pytest -m gpu: running ")
    assert running and f"-m pytest -m gpu -p no:cacheprovider --tb=line -rfE {tests}" in running[0]
    assert "test_gpu.py ." in out  # pytest's own progress, streamed
    assert lines_with(out, "pytest -m gpu: ok (1 passed, 1 deselected in ")
    assert lines_with(out, "selftest passed on the simulator: 1 of 1 checks passed; pytest -m gpu "
                           "passed (1 passed, 1 deselected in ")


def test_selftest_fails_when_pytest_gpu_fails(tmp_path):
    tests = fake_checkout(tmp_path, GPU_TESTS + """
@pytest.mark.gpu
def test_broken():
    assert 2 + 2 == 5, "broken on purpose"
""")
    command = selftest_script(tmp_path, PASSING_CHECK + f"""
st.CHECKS = [("a check that sums", sums)]
st.TESTS = st.pathlib.Path({str(tests)!r})
""", run_pytest=True)
    code, out = run(command, cwd=tmp_path)
    assert code == 1, out
    assert lines_with(out, "[1/1] a check that sums ... ok (")
    assert lines_with(out, "pytest -m gpu: running ")
    assert lines_with(out, "FAILED tests/test_gpu.py::test_broken")
    verdict = lines_with(out, "pytest -m gpu: FAIL (1 failed, 1 passed, 1 deselected in ")
    assert verdict and verdict[0].endswith("; exit status 1)"), out
    final = out.splitlines()[-2]
    assert final.startswith("selftest FAILED on the simulator: 1 of 1 checks passed; pytest -m "
                            "gpu failed (exit status 1: 1 failed, 1 passed"), out


def test_info_finds_the_mpiexec_beside_python_off_path(tmp_path):
    """The mpi extra installs mpiexec in the virtualenv's bin/, which is on PATH only while the
    virtualenv is activated: info must find it there all the same."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.isfile(here):
        pytest.skip("no mpiexec beside this Python: install the mpi extra")
    bin_dir = os.path.dirname(sys.executable)
    path = os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and os.path.realpath(d) != os.path.realpath(bin_dir))
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    code, out = run([sys.executable, "-m", "synk", "info"], cwd=tmp_path,
                    env=dict(env, PATH=path or os.defpath))
    assert code == 0, out
    assert f"mpiexec: {here} (beside this Python; not on PATH)" in out.splitlines(), out
    code, out = run([sys.executable, "-m", "synk", "info"], cwd=tmp_path,
                    env=dict(env, PATH=os.pathsep.join([bin_dir, path])))
    assert code == 0, out
    assert f"mpiexec: {here}" in out.splitlines(), out


@pytest.mark.parametrize("variable, value", [("SYNK_SIMULATE_GPUS", "two"),
                                             ("SYNK_SPIN_US", "inf")])
def test_selftest_refuses_a_bad_synk_variable_as_fork_does(tmp_path, variable, value):
    """A bad SYNK_SIMULATE_GPUS (``two``) makes the self-test refuse with exit status 2, as
    the user's own fork() raises ValueError; it never simulates and reports a pass."""
    code, out = run([sys.executable, "-m", "synk", "selftest", "--no-pytest"], cwd=tmp_path,
                    env={**environment(), variable: value})
    assert code == 2, out
    assert f"environment variable {variable}={value!r} is not valid" in out, out
    assert "passed" not in out and "[1/" not in out, out
