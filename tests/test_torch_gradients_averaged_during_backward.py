"""``synk.comm.average_gradients``: a torch model's gradients averaged in buckets while the
backward pass runs (DistributedDataParallel's overlap), against the same step in one
process on all the rows: uneven shares, a parameter backward never reaches, one bucket and
one bucket a parameter; and what it refuses."""
import numpy as np
import pytest
from conftest import REAL, on_every_rank, use_devices

import synk

torch = pytest.importorskip("torch", reason="the torch tests need torch: pip install 'synk[torch]'")
pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(300)]

ROWS = 23  # split unevenly over 2 and 3 ranks


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 3)
        self.unused = torch.nn.Parameter(torch.ones(5))  # (backward never reaches it)
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _data():
    rng = np.random.default_rng(3)
    x = torch.tensor(rng.standard_normal((ROWS, 6)), dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 3, ROWS))
    return x, y


def _averaged(arg):
    """This rank's averaged gradients after two steps (each with its own block), on the
    rank's CUDA device where ``on_gpu``."""
    import torch.nn.functional as F

    bucket_mb, bounds, on_gpu = arg
    r = synk.comm.rank()
    where = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    x, y = _data()
    x, y = x[bounds[r]:bounds[r + 1]].to(where), y[bounds[r]:bounds[r + 1]].to(where)
    model = Net().to(where)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        with synk.comm.average_gradients(model, weight=len(x), bucket_mb=bucket_mb):
            F.cross_entropy(model(x), y, reduction="mean").backward()
        opt.step()
    return {name: (None if p.grad is None else p.grad.cpu().numpy().copy(),
                   p.detach().cpu().numpy().copy())
            for name, p in model.named_parameters()}


def _alone():
    """The same two steps in one process on all the rows."""
    import torch.nn.functional as F

    x, y = _data()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y, reduction="mean").backward()
        opt.step()
    return dict(model.named_parameters())


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("bucket_mb", [25.0, 0.0004])  # one bucket; a bucket a parameter
def test_gradients_averaged_during_backward_are_one_process_gradients(size, bucket_mb):
    synk.fork(size)
    try:
        got = on_every_rank(_averaged, bucket_mb, _bounds(size), False, timeout=120)
    finally:
        synk.close()
    _check(got)


@pytest.mark.gpu
@pytest.mark.skipif(not (REAL and torch.cuda.is_available()),
                    reason="CUDA tensors on GPU ranks: needs a GPU and torch's CUDA build")
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("bucket_mb", [25.0, 0.0004])
def test_cuda_gradients_averaged_during_backward_are_one_process_gradients(
        size, bucket_mb, monkeypatch):
    """On GPU ranks torch runs the backward pass (and so the hooks that launch each
    bucket's allreduce) in its autograd thread for the device, not the function's."""
    use_devices(monkeypatch, size)
    synk.fork(size, backend="gpu")
    try:
        got = on_every_rank(_averaged, bucket_mb, _bounds(size), True, timeout=120)
    finally:
        synk.close()
    _check(got)


def _bounds(size: int) -> list:
    return [0, 5, ROWS] if size == 2 else [0, 4, 15, ROWS]


def _check(got) -> None:
    want = _alone()
    for rank, grads in enumerate(got):
        for name, (grad, value) in grads.items():
            if name == "frozen":
                assert grad is None
                continue
            expected = want[name].grad
            if name == "unused":  # (a zero gradient on every rank; one process: none)
                np.testing.assert_array_equal(grad, np.zeros(5, np.float32))
                continue
            np.testing.assert_allclose(grad, expected.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank}, {name}")
            np.testing.assert_allclose(value, want[name].detach().numpy(), rtol=1e-5,
                                       atol=1e-6, err_msg=f"rank {rank}, {name}")


def _refusals(arg):
    import torch.nn.functional as F

    said = []
    model = Net()
    x, y = _data()
    for bad in (lambda: synk.comm.average_gradients([np.ones(2)]),
                lambda: synk.comm.average_gradients(model, bucket_mb=0)):
        try:
            bad()
        except (TypeError, ValueError) as err:
            said.append(str(err))
    try:  # a second backward inside one block
        with synk.comm.average_gradients(model):
            loss = F.cross_entropy(model(x), y)
            loss.backward(retain_graph=True)
            loss.backward()
    except RuntimeError as err:
        said.append(str(err))
    # the hooks are gone with the block: a backward after it averages nothing
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    model.zero_grad()
    with synk.comm.average_gradients(model):  # and a later block still works
        F.cross_entropy(model(x), y).backward()
    once = model.a.weight.grad.clone()
    model.zero_grad()  # a parameter named twice (a tied weight) is averaged once
    with synk.comm.average_gradients(list(model.parameters()) * 2):
        F.cross_entropy(model(x), y).backward()
    said.append(bool(torch.equal(once, model.a.weight.grad)))
    return said


def test_what_average_gradients_refuses(ranks2):
    for said in on_every_rank(_refusals, timeout=120):
        assert "takes a torch module or its parameters" in said[0]
        assert "bucket_mb must be > 0" in said[1]
        assert "a second backward pass reached a parameter" in said[2]
        assert said[3] is True
