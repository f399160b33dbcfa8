"""``python -m synk selftest``: check the GPU code path on this machine through synk's public
API only, printing each step as it starts and its verdict as it ends::

    the CUDA devices (two ranks on one GPU, so synk.comm goes through NCCL), else the
    simulator's two (said on every line that matters)
      -> CHECKS, FRAMEWORK_CHECKS (torch, JAX; skipped where they cannot run)
      -> a short timing -> pytest -m gpu in a source checkout (streamed)
      -> a last line naming what failed; exit status 1 when anything did
"""
from __future__ import annotations

import codecs
import contextlib
import functools
import importlib
import importlib.util
import os
import pathlib
import shlex
import subprocess
import sys
import time
import traceback
from typing import Any

import numpy as np

import synk

from . import _settings
from ._arrays import framework_settings
from ._devices import discovery
from ._devices.report import cuda_lines, info_lines


class _Failed(AssertionError):
    pass


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise _Failed(what)


def _reduce_ops(n: int) -> None:
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4 * n + 3, 5)), rng.standard_normal(5)

    def row_means(x, w):
        return synk.xp(x).mean(synk.xp(x).tanh(x @ w))

    for op in ("mean", "sum", "prod", "max", "min"):
        got = synk.function(row_means, bcast_inputs=["w"], reduce=op)(x, w)
        parts = [np.mean(np.tanh(p @ w)) for p in np.array_split(x, n)]
        want = np.mean(np.tanh(x @ w)) if op == "mean" else getattr(np, op)(parts)
        _check(np.allclose(got, want), f"reduce {op!r}: {got} != {want}")
    gathered = synk.function(lambda x, w: x @ w, bcast_inputs=["w"], reduce="gather")
    for batch in (None, 5, slice(1, None, 2), rng.permutation(len(x))[:7]):
        rows = x if batch is None else x[:batch] if isinstance(batch, int) else x[batch]
        _check(np.allclose(gathered(x, w, batch=batch, num_slices=2), rows @ w),
               f"gather with batch={batch!r}")
    kinds = synk.function(lambda x: type(x).__module__, reduce=None)(x)
    _check(all("cupy" in k for k in kinds), f"inputs are not device arrays: {kinds}")


def _comm(n: int) -> None:
    def body(x):
        xp, r = synk.xp(x), synk.comm.rank()
        total = synk.comm.allreduce(x.sum(axis=0), "sum")
        every = synk.comm.allgather(xp.full(r + 1, r, xp.float32))
        root = synk.comm.broadcast(xp.arange(4.0) if r == 0 else None, root=0)
        synk.comm.send(xp.full(3, r), (r + 1) % n)
        left = synk.comm.recv((r - 1) % n)
        return [total.get(), every.get(), root.get(), left.get()]

    x = np.arange(6.0 * n).reshape(2 * n, 3)
    for r, (total, every, root, left) in enumerate(synk.function(body, reduce=None)(x)):
        _check(np.allclose(total, x.sum(axis=0)), f"allreduce on rank {r}")
        _check(np.allclose(every, np.concatenate([np.full(k + 1, k) for k in range(n)])),
               f"allgather on rank {r}")
        _check(np.allclose(root, np.arange(4.0)), f"broadcast on rank {r}")
        _check(np.allclose(left, (r - 1) % n), f"send/recv on rank {r}")


def _shared(n: int) -> None:
    v = synk.shared(np.zeros(3))
    x = np.ones((2 * n, 3))

    def step(x, v):
        v += x.sum(axis=0)

    synk.function(step, reduce=None)(x, v)
    synk.shared_all_reduce(v, "sum")
    _check(np.allclose(v.get_value(n - 1), x.sum(axis=0)), "shared variable all_reduce")


def _resident(n: int) -> None:
    x = synk.data(np.random.default_rng(1).standard_normal((40 * n, 4)))
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum", profile=True)
    _check(np.allclose(f(x, batch=slice(0, 8 * n)), x.array[:8 * n].sum(axis=0)),
           "a Data before it is resident")
    x.to_device("replicate")
    idx = np.random.default_rng(2).permutation(len(x))[:10 * n]
    f(x, batch=idx)  # the first call copies the data to the devices
    profile = f.profile
    assert profile is not None  # profile=True
    before = [profile.transfers(r)["h2d"] for r in range(n)]
    _check(np.allclose(f(x, batch=idx), x.array[idx].sum(axis=0)), "replicated, batch=")
    moved = [profile.transfers(r)["h2d"] - before[r] for r in range(n)]
    _check(moved == [10 * 8] * n, f"resident data moved {moved} bytes, not only the indices")
    x[0] = 1e3
    _check(np.allclose(f(x), x.array.sum(axis=0)), "a write to resident data was not seen")
    x.to_device("shard")
    got = synk.function(lambda x: x * 1, reduce="gather")(x, local_batch=slice(0, 3))
    want = np.concatenate([p[:3] for p in np.array_split(x.array, n)])
    _check(np.allclose(got, want), "shard mode with local_batch=")
    x.free()


class _Boom(Exception):
    pass


def _exception(n: int) -> None:
    def fails(x):
        if synk.comm.rank() == n - 1:
            raise _Boom("on purpose")
        return synk.comm.allreduce(x.sum(), "sum")

    try:
        synk.function(fails, reduce=None, timeout=60)(np.ones((n, 2)))
    except _Boom:
        pass
    else:
        raise _Failed("an exception on the last rank did not reach the master")
    _check(synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4)) == 4,
           "the group is not usable after an exception")


def _timings(n: int) -> list[str]:
    noop = synk.function(lambda: None, reduce=None)  # (no input: nothing moves to a device)
    for _ in range(5):
        noop()
    start, calls = time.perf_counter(), 50
    for _ in range(calls):
        noop()
    per_call = (time.perf_counter() - start) / calls
    big = np.ones(16 << 18, np.float32)  # 16 MiB

    def reduce_big(x, big):
        out = synk.comm.allreduce(big, "sum")
        synk.xp(big).cuda.get_current_stream().synchronize()
        return out.shape

    f = synk.function(reduce_big, bcast_inputs=["big"], reduce=None)
    x = np.ones((n, 1))
    f(x, big)
    start = time.perf_counter()
    f(x, big)
    seconds = time.perf_counter() - start
    return [f"no-op call on {n} rank(s): {per_call * 1e6:.0f} us",
            f"call that moves 16 MiB to every device and allreduces it: {seconds * 1e3:.1f} ms"]


CHECKS = [("every reduce op and batch form against numpy", _reduce_ops),
          ("synk.comm on device arrays", _comm), ("shared variables", _shared),
          ("data resident on the devices, and the bytes moved", _resident),
          ("an exception on one rank", _exception)]


# -- torch and JAX on the GPU ranks ---------------------------------------------------------
# Each check below is one way torch or JAX gave wrong numbers on a real GPU while every test
# under the simulator passed (docs/frameworks.md, "What a tensor is on a GPU rank"); on a
# GPU each takes seconds. Under the simulator torch and JAX are their CPU builds, so there
# the checks run synk's plumbing for them, not their CUDA kernels.

class _Skipped(Exception):
    """A framework check that cannot run here; its text says why."""


def _simulated() -> bool:
    return bool(os.environ.get("SYNK_SIMULATE_GPUS"))


def _torch_gpu():
    """torch, if it can run here: with CUDA on GPUs, any build under the simulator."""
    if importlib.util.find_spec("torch") is None:
        raise _Skipped("torch is not installed")
    import torch

    if not _simulated() and not torch.cuda.is_available():
        raise _Skipped("torch has no CUDA here (a CPU build?)")
    return torch


def _jax_gpu():
    """JAX, if it can run here: with a GPU on GPUs, any build under the simulator. The
    self-test's own JAX does not preallocate the GPU (the master is rank 0 on it)."""
    if importlib.util.find_spec("jax") is None:
        raise _Skipped("JAX is not installed")
    if not any(var in os.environ for var in framework_settings.PREALLOCATION_VARS):
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    import jax

    if not _simulated():
        try:
            jax.devices("gpu")
        except RuntimeError:
            raise _Skipped("JAX has no GPU here (install jax[cuda12])") from None
    return jax


def _torch_out_mean(n: int) -> None:
    torch = _torch_gpu()
    words = 1 << (12 if _simulated() else 24)  # 64 MiB of float32 on a GPU

    def f(x):
        r, bad = synk.comm.rank(), 0
        g = torch.empty(words, dtype=torch.float32, device=x.device)
        other = torch.cuda.Stream(x.device) if x.is_cuda else None  # (the caller's own)
        with torch.cuda.stream(other) if other is not None else contextlib.nullcontext():
            for _ in range(5):
                g.fill_(float(r + 1))
                synk.comm.allreduce(g, "mean", out=g)
                bad += int((g != (n + 1) / 2).sum().item())  # (read on torch's stream)
        return np.array([bad])

    bad = int(np.asarray(synk.function(f, reduce="sum")(torch.ones(n, 1))).ravel()[0])
    _check(bad == 0, f"torch read {bad} elements after allreduce(g, 'mean', out=g) that "
                     "were not the mean (its stream not handed synk's writes)")


def _sleep_on_gpu(torch, x) -> None:
    """Keep torch's current stream busy for a while (on a GPU), so that work queued after
    it runs long after synk's own stream went on."""
    if x.is_cuda:
        torch.cuda._sleep(100_000_000)


def _torch_pieces(n: int) -> None:
    torch = _torch_gpu()
    x = torch.arange(256 * n * 4, dtype=torch.float64).reshape(256 * n, 4)

    def f(x):
        _sleep_on_gpu(torch, x)
        return x.sum(0)

    got = synk.function(f, reduce="sum")(x, num_slices=4)
    got = np.asarray(got.cpu() if hasattr(got, "cpu") else got)
    want = x.sum(0).numpy()
    _check(np.array_equal(got, want), f"num_slices=4 gave {got}, numpy {want} (a piece's "
                                      "rows reused while torch still read them)")


def _torch_in_place(n: int) -> None:
    torch = _torch_gpu()
    w = synk.shared(torch.zeros(4))
    d = synk.data(torch.ones((2 * n, 4), dtype=torch.float64))  # (rows reach fn as tensors)

    def step(x, w):
        _sleep_on_gpu(torch, w)
        w.add_(1.0)
        x.mul_(2.0)

    synk.function(step, bcast_inputs=["w"], reduce=None)(d, w)
    replicas = [np.asarray(w.get_value(r)).tolist() for r in range(n)]
    smallest = float(np.asarray(d.array).min())
    d.free()
    _check(all(v == [1.0] * 4 for v in replicas) and smallest == 2.0,
           f"after w.add_(1) and x.mul_(2) the replicas were {replicas} and the Data's "
           f"smallest element {smallest} (want 2.0): read before torch's update landed")


def _settings_reach_workers(n: int) -> None:
    torch: Any = None
    jax: Any = None
    if importlib.util.find_spec("torch") is not None:
        torch = importlib.import_module("torch")
    if importlib.util.find_spec("jax") is not None:
        jax = _jax_gpu()
    if torch is None and jax is None:
        raise _Skipped("neither torch nor JAX is installed")
    x = np.random.default_rng(3).standard_normal((8 * n, 3)) * 1e8 + 0.123456789
    if jax is not None:
        import jax.numpy as jnp

        x64 = jax.config.jax_enable_x64
        jax.config.update("jax_enable_x64", True)
        try:
            rows = jnp.asarray(x)

            def total(x):
                return jnp.sum(x, axis=0)

            got = np.asarray(synk.function(total, reduce="sum")(rows))
        finally:
            jax.config.update("jax_enable_x64", x64)
        parts = sum(p.sum(axis=0) for p in np.array_split(x, n))
        _check(str(got.dtype) == "float64" and np.allclose(got, parts, rtol=1e-15, atol=0),
               f"a float64 sum of JAX rows with jax_enable_x64 gave {got.dtype} {got}, "
               f"numpy {parts} (the workers' JAX in 32 bits)")
    if torch is not None:
        was = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            seen = synk.function(lambda x: str(torch.get_default_dtype()), reduce=None)(x)
        finally:
            torch.set_default_dtype(was)
        _check(all(s == "torch.float64" for s in seen),
               f"torch's default dtype on the ranks was {seen}, the master's torch.float64")


def _jax_memory(n: int) -> None:
    _jax_gpu()
    mine = [v for v in framework_settings.PREALLOCATION_VARS if v in os.environ
            and v != "XLA_PYTHON_CLIENT_PREALLOCATE"]
    if mine:
        raise _Skipped(f"{mine[0]} is set: JAX's memory is as you asked")
    simulated = _simulated()

    def f(x):
        import jax.numpy as jnp

        float(jnp.ones(1 << 20).sum())  # (JAX's GPU client started)
        free = 1.0
        if not simulated:
            got, total = synk.xp(x).cuda.runtime.memGetInfo()  # (x: a CuPy array here)
            free = got / total
        return f"{os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')} {free:.2f}"

    seen = synk.function(f, reduce=None)(np.ones((n, 1)))[1:]  # (one string per rank)
    _check(all(s.split()[0] == "false" and float(s.split()[1]) > 0.5 for s in seen),
           f"the workers' XLA_PYTHON_CLIENT_PREALLOCATE and the share of the GPU free "
           f"after their JAX ran: {seen}")


def _jax_device(n: int) -> None:
    jax = _jax_gpu()
    import jax.numpy as jnp

    def where(x):
        made = next(iter(jnp.zeros(1).devices()))
        given = next(iter(x.devices()))
        return f"{made}|{given}|{len(jax.devices())}"

    seen = synk.function(where, reduce=None)(jnp.ones((n, 1)))[1:]  # (one string per rank)
    _check(all(s.split("|")[0] == s.split("|")[1] and s.split("|")[2] == "1" for s in seen),
           "the workers' JAX (the device of an array it made | of its input | how many "
           f"devices it sees): {seen}")


def _jax_bfloat16(n: int) -> None:
    _jax_gpu()
    import jax.numpy as jnp

    def f(x):
        return jnp.ones(4, jnp.bfloat16) * (synk.comm.rank() + 1)

    got = synk.function(f, reduce="sum")(jnp.ones((n, 1)))
    want = [n * (n + 1) / 2] * 4
    values = np.asarray(got, dtype=np.float32).tolist()
    _check(str(got.dtype) == "bfloat16" and values == want,
           f"a bfloat16 JAX output summed gave {got.dtype} {values}, want bfloat16 {want}")


FRAMEWORK_CHECKS = [
    ("torch: allreduce(g, 'mean', out=g) read by torch at once", _torch_out_mean),
    ("torch: num_slices=4 under a busy torch stream", _torch_pieces),
    ("torch: an in-place update of a shared replica", _torch_in_place),
    ("the master's JAX x64 and torch default dtype on every rank", _settings_reach_workers),
    ("JAX in the workers leaves the GPU's memory to CuPy", _jax_memory),
    ("JAX in the workers uses its rank's GPU alone", _jax_device),
    ("JAX: a bfloat16 output summed", _jax_bfloat16)]


#: The source checkout's tests beside this synk (absent in an installed synk).
TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def _say(text: str = "", end: str = "\n") -> None:
    """Print now: a pipe or a file would otherwise hold the progress until the end."""
    print(text, end=end, flush=True)


def _step(label: str, run):
    """Say ``label``, run ``run()``, and say its verdict on the same line (a traceback on the next
    ones); (True, its value), (False, None), or (None, None) when it raised ``_Skipped``."""
    _say(f"{label} ... ", end="")
    start = time.perf_counter()
    try:
        value = run()
    except _Skipped as why:
        _say(f"skip ({why})")
        return None, None
    except Exception as err:
        _say(f"FAIL ({time.perf_counter() - start:.1f} s): {type(err).__name__}: {err}")
        traceback.print_exc(file=sys.stdout)
        sys.stdout.flush()
        return False, None
    _say(f"ok ({time.perf_counter() - start:.1f} s)")
    return True, value


def _run_pytest(tests: pathlib.Path) -> tuple[bool, str]:
    """Run ``pytest -m gpu`` over ``tests``, its output streamed into the report: (whether it
    failed, what became of it for the report's last line)."""
    if not (tests / "test_gpu.py").is_file():
        what = "pytest -m gpu skipped (no source checkout beside this synk)"
        _say(what)
        return False, what
    if importlib.util.find_spec("pytest") is None:
        what = "pytest -m gpu skipped (pytest is not installed: pip install -e \".[test]\")"
        _say(what)
        return False, what
    # --tb=line and -rfE keep the report short: one line per failure, then their list
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider",
               "--tb=line", "-rfE", str(tests)]
    _say(f"pytest -m gpu: running {shlex.join(command)} (in {tests.parent}); "
         "this takes minutes, its output follows")
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # its progress as it happens
    start = time.perf_counter()
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=tests.parent, env=env)
    except OSError as err:
        _say(f"pytest -m gpu: FAIL: it did not start: {err}")
        return True, f"pytest -m gpu did not start ({err})"
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    output = []
    with proc:
        while chunk := os.read(proc.stdout.fileno(), 65536):  # type: ignore[union-attr]
            text = decoder.decode(chunk)
            output.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()
    text = "".join(output) + decoder.decode(b"", final=True)
    if text and not text.endswith("\n"):
        _say()
    lines = [line.strip("= ") for line in text.splitlines() if line.strip("= ")]
    summary = lines[-1] if lines else "no output"
    if proc.returncode == 0:
        _say(f"pytest -m gpu: ok ({summary}; {time.perf_counter() - start:.0f} s)")
        return False, f"pytest -m gpu passed ({summary})"
    _say(f"pytest -m gpu: FAIL ({summary}; exit status {proc.returncode})")
    return True, f"pytest -m gpu failed (exit status {proc.returncode}: {summary})"


def main(run_pytest: bool = True, frameworks: bool = True) -> int:
    """Run the self-test, printing the report; returns the exit status: 0 when every check that
    could run, the timing and pytest passed, 1 otherwise, 2 for an invalid ``SYNK_*`` variable.
    ``frameworks``: the torch and JAX checks too (skipped, saying why, where they cannot run)."""
    try:
        _settings.read()  # every SYNK_* variable, as fork() checks them
    except ValueError as err:
        _say(f"synk selftest: not run: {err}")
        return 2
    status = discovery.gpu_status()
    _say("synk selftest report (paste it into an issue)")
    _say("```")
    for line in info_lines():  # (this machine, as the user's own fork() finds it)
        _say(line)
    simulated = _say_devices(status)
    checks = CHECKS + (FRAMEWORK_CHECKS if frameworks else [])
    timing_failed = False
    try:
        n, ran, passed, skipped = _run_checks(checks)
        failed = passed < len(checks) - skipped
        if not failed:
            ok, lines = _step("timing: a no-op call and a 16 MiB allreduce", lambda: _timings(n))
            for line in lines or []:
                _say(f"time  {line}" + (" (simulated: not a GPU figure)" if simulated else ""))
            timing_failed = not ok
    finally:
        synk.close()
    verdicts = [_checks_verdict(len(checks), ran, passed, skipped)]  # for the last line
    if not frameworks:
        verdicts.append("torch and JAX not checked (--no-frameworks)")
    if timing_failed:
        verdicts.append("the timing failed")
    failed = failed or timing_failed
    if run_pytest:
        pytest_failed, what = _run_pytest(TESTS)
        failed = failed or pytest_failed
        verdicts.append(what)
    else:
        verdicts.append("pytest -m gpu not run (--no-pytest)")
    _say(f"selftest {'FAILED' if failed else 'passed'}"
         f"{' on the simulator' if simulated else ''}: " + "; ".join(verdicts))
    _say("```")
    return 1 if failed else 0


def _say_devices(status) -> bool:
    """Say what the self-test runs on (the simulator if no GPU is usable); whether simulated."""
    if not status.available:  # no GPU: the self-test chooses the simulator itself
        os.environ["SYNK_SIMULATE_GPUS"] = "2"
        discovery._probed.clear()
        _say("selftest: SIMULATED: the self-test chose synk's CUDA simulator (2 simulated "
             f"devices; no GPU is used), as no GPU is usable here: {status.reason}")
        for line in cuda_lines():
            _say(f"  {line}")
        return True
    if status.kind == "sim":
        _say("selftest: SIMULATED (the CUDA simulator, as SYNK_SIMULATE_GPUS asks): no GPU "
             "is used")
        return True
    _say("selftest: on the CUDA devices above")
    return False


def _run_checks(checks) -> tuple:
    """Start the GPU ranks and run ``checks``, restarting the ranks where a failure left
    them unusable: (the number of ranks, how many checks ran, passed, were skipped)."""
    ran = passed = skipped = 0
    started, n = _step("start the GPU ranks", lambda: synk.fork(backend="gpu"))
    if started and n == 1:  # (so that synk.comm goes through NCCL, not to itself)
        synk.close()
        started, n = _step("one GPU: start two ranks on it instead",
                           lambda: synk.fork(2, backend="gpu"))
    for i, (name, check) in enumerate(checks if started else []):
        ok, _ = _step(f"[{i + 1}/{len(checks)}] {name}", functools.partial(check, n))
        if ok is None:
            skipped += 1
            continue
        ran, passed = ran + 1, passed + ok
        if not ok and (synk.size() == 1 or not _usable()):
            synk.close()
            started, n = _step("restart the GPU ranks",
                               functools.partial(synk.fork, n, backend="gpu"))
            if not started:
                break
    return n, ran, passed, skipped


def _checks_verdict(total: int, ran: int, passed: int, skipped: int) -> str:
    """What became of the checks, for the report's last line."""
    return f"{passed} of {total - skipped} checks passed" + (
        f", {skipped} skipped" if skipped else "") + (
        f", {total - skipped - ran} did not run (the GPU ranks did not start)"
        if ran < total - skipped else "")


def _usable() -> bool:
    try:
        return synk.function(lambda x: x.sum(), reduce="sum")(np.ones(2)) == 2
    except Exception:
        return False
