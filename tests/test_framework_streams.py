"""torch's work on a GPU rank is ordered with synk's (docs/gpu.md, "torch and JAX on GPU
ranks"): while the function runs, torch's current stream is the rank's own, and synk's
stream waits for whatever stream the function left current in torch; where synk writes a
CUDA tensor given as ``out=``, torch's current stream waits for synk's before it goes on.

No CUDA here: torch is its CPU build, and the simulator's devices are not torch's. These
tests stand a recording stand-in for ``torch.cuda``'s stream API in (the one part of torch
synk's ordering uses: ``is_available``, ``current_stream``, ``stream``, ``ExternalStream``,
``Stream.wait_stream``) and check the hand-offs synk makes through it; that torch's real
kernels land where these say is for a real GPU (``python -m synk selftest``)."""
import contextlib

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.frameworks


class _Stream:
    def __init__(self, ptr: int, log: list, device: str = "cuda:0") -> None:
        self.cuda_stream, self.log, self.device = ptr, log, device

    def wait_stream(self, other) -> None:
        self.log.append(("wait", self.cuda_stream, other.cuda_stream))


class _Cuda:
    """torch.cuda's stream API, recording what synk asks of it."""

    def __init__(self) -> None:
        self.log: list = []
        self.current = _Stream(7, self.log)  # (torch's legacy default stream, say)

    def is_available(self) -> bool:
        return True

    def current_stream(self, device=None):
        return self.current

    def ExternalStream(self, ptr, device=None):  # noqa: N802 (torch's name)
        return _Stream(ptr, self.log)

    @contextlib.contextmanager
    def stream(self, s):
        before, self.current = self.current, s
        self.log.append(("current", s.cuda_stream))
        try:
            yield
        finally:
            self.current = before
            self.log.append(("current", before.cuda_stream))


@pytest.fixture
def cuda(monkeypatch):
    from synk._arrays import _torch

    fake = _Cuda()
    monkeypatch.setattr(_torch.torch, "cuda", fake)  # (torch's CUDA API: no public seam)
    return fake


def test_the_function_runs_with_torch_on_the_ranks_stream(cuda):
    from synk._arrays import _torch

    with _torch.on_stream(42, 0):
        assert cuda.current.cuda_stream == 42  # torch's kernels land on synk's stream
    assert cuda.current.cuda_stream == 7
    assert cuda.log == [("current", 42), ("current", 7)]  # (nothing to wait for)


def test_synk_waits_for_a_stream_the_function_left_current_in_torch(cuda):
    from synk._arrays import _torch

    with _torch.on_stream(42, 0):
        cuda.current = _Stream(99, cuda.log)  # fn: torch.cuda.set_stream(its own)
    assert ("wait", 42, 99) in cuda.log  # synk's stream after the function's own


def test_torch_waits_for_synks_writes_into_out(cuda):
    from synk._arrays import _torch

    class _Tensor:
        device = torch.device("cuda", 0)

    _torch.written([_Tensor(), _Tensor()], 42)
    assert cuda.log == [("wait", 7, 42)]  # once per device: torch's stream after synk's
    cuda.log.clear()
    cuda.current = _Stream(42, cuda.log)
    _torch.written([_Tensor()], 42)
    assert cuda.log == []  # (the same stream: ordered already)
