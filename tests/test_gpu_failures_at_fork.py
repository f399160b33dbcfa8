"""A GPU that fails while ``fork()`` sets up NCCL is
reported at once, naming the rank and CUDA's status, not after the whole ``start_timeout``;
after the master's own GPU failed, the errors say that only a new process can use the GPUs
again (not "call synk.fork() again", then CuPy's raw error). Under the simulator's fault
injection (``SYNK_SIM_FAULTS``)."""
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
from conftest import REAL, first_op, use_devices

import synk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(REAL, reason="fault injection is the simulator's")]

@pytest.mark.parametrize("op", [1, 3], ids=["set-up's allreduce", "set-up's broadcast"])
def test_a_workers_gpu_failing_while_fork_sets_up_nccl_is_reported_at_once(monkeypatch, op):
    use_devices(monkeypatch, 2)
    monkeypatch.setenv("SYNK_SIM_HANG_TIMEOUT", "3")
    monkeypatch.setenv("SYNK_SIM_FAULTS", f"cuda_error:rank=1:collective={op}")
    start = time.monotonic()
    with pytest.raises(synk.WorkerStartError) as info:
        synk.fork(2, backend="gpu", start_timeout=50)
    waited = time.monotonic() - start
    # Rank 0's set-up thread may be inside NCCL's connecting collective when the set-up is
    # abandoned: NCCL cannot cancel it, so it stays until NCCL gives up (the simulator
    # gives up at SYNK_SIM_HANG_TIMEOUT); nothing else is left behind (the fixture checks)
    for thread in threading.enumerate():
        if thread.name.startswith("synk-nccl-init"):
            thread.join(10)
            assert not thread.is_alive(), "the set-up thread never ended"
    said = str(info.value)
    assert said.startswith("rank 1 could not join the device communicator (nccl): the GPU "
                           "of rank 1 failed with CUDA error 700 (cudaErrorIllegalAddress)"), said
    assert isinstance(info.value.__cause__, synk.DeviceFailedError)
    assert (info.value.__cause__.rank, info.value.__cause__.status) == (1, 700)
    assert waited < 40, f"fork() waited {waited:.0f} s, as if for its start_timeout"
    monkeypatch.delenv("SYNK_SIM_FAULTS")
    synk.fork(2, backend="gpu")  # nothing is left in the way of a new group
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones((4, 2))) == 8
    synk.close()


_MASTERS_GPU_FAILS = """
import os, sys
import numpy as np
import synk

try:
    synk.fork(2, backend="gpu", start_timeout=50)
    raise AssertionError("fork() started a group on a failed GPU")
except synk.DeviceFailedError as err:
    assert (err.rank, err.status) == (0, 700), err
    said = str(err)
    assert "call synk.fork() again" not in said, said
    assert "restart the program" in said, said
for _ in range(2):  # and so does every later fork() on the GPUs, in this process
    try:
        synk.fork(2, backend="gpu")
        raise AssertionError("fork() started a group on a failed GPU")
    except synk.GpuUnavailableError as err:
        said = str(err)
        assert "failed earlier with CUDA error 700 (cudaErrorIllegalAddress)" in said, said
        assert "restart the program" in said, said
synk.fork(2, backend="cpu")  # the CPU ranks still work
assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones((4, 2))) == 8
synk.close()
print("ok")
"""

_MASTERS_GPU_FAILS_IN_A_CALL = """
import numpy as np
import synk

synk.fork(2, backend="gpu")
try:
    synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce=None)(np.ones((4, 2)))
    raise AssertionError("the call went on on a failed GPU")
except synk.DeviceFailedError as err:
    assert (err.rank, err.status) == (0, 700), err
    said = str(err)
    assert "call synk.fork() again" not in said and "restart the program" in said, said
synk.close()
try:
    synk.fork(2, backend="gpu")
    raise AssertionError("fork() started a group on a failed GPU")
except synk.GpuUnavailableError as err:
    assert "restart the program" in str(err), err
print("ok")
"""


@pytest.mark.parametrize("when", ["at fork", "in a call"])
def test_after_the_masters_gpu_failed_the_errors_say_to_restart(tmp_path, monkeypatch, when):
    """In a process of its own: the master's CUDA context stays broken until it ends."""
    use_devices(monkeypatch, 2)
    op = 1 if when == "at fork" else first_op(2)
    monkeypatch.setenv("SYNK_SIM_FAULTS", f"cuda_error:rank=0:collective={op}")
    script = tmp_path / "masters_gpu_fails.py"
    script.write_text(textwrap.dedent(_MASTERS_GPU_FAILS if when == "at fork"
                                      else _MASTERS_GPU_FAILS_IN_A_CALL))
    out = subprocess.run([sys.executable, "-W", "ignore", str(script)], capture_output=True,
                         text=True, timeout=55)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
