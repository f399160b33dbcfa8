"""A torch module made shared (``synk.shared(module)``): a function that captures it, and
its optimizer, trains every rank's copy on that rank's replicas, and the result is the one
process's loop bit for bit where the ranks' mean is exact (checked against torch alone);
the master's changes between calls reach every rank; tied parameters and buffers; what is
refused. On 2 CPU ranks and 2 simulated GPUs (``two``)."""
import numpy as np
import pytest

import synk

torch = pytest.importorskip("torch", reason="the torch tests need torch: pip install 'synk[torch]'")
F = torch.nn.functional
pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(300)]

ROWS = 64  # even: each of 2 ranks takes 32, so the weighted mean of the means is exact


def _model(seed=0, norm=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 16)]
    if norm:
        layers.append(torch.nn.BatchNorm1d(16))
    layers += [torch.nn.ReLU(), torch.nn.Linear(16, 3)]
    return torch.nn.Sequential(*layers)


def _data():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((ROWS, 8)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 3, ROWS))
    return x, y


def _alone(model, steps: int):
    """The loop in one process: (losses, the parameters after)."""
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _train(model, opt, x, y):
    """One data-parallel step on this rank's rows: the gradients averaged over the ranks,
    weighted by their rows, then the optimizer's step."""
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    synk.comm.allreduce(grads, "mean", weight=len(x), out=grads)
    opt.step()
    return loss


class _Trainer:
    """A model and its optimizer held by an object, its step a bound method."""

    def __init__(self, model):
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(self, x, y):
        return _train(self.model, self.opt, x, y)


def _same_on_every_rank(model):
    for values in synk.shared_gather(model, concat=False):
        for other in values[1:]:
            np.testing.assert_array_equal(np.asarray(other), np.asarray(values[0]))


def test_a_captured_shared_module_and_its_optimizer_train_as_in_one_process(two):
    want_losses, want_params = _alone(_model(), 6)
    model = synk.shared(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):  # (model and opt: captured by the closure)
        return _train(model, opt, x, y)

    f = synk.function(step, inputs=["x", "y"])
    x, y = _data()
    xd, yd = synk.data(x), synk.data(y)
    losses = [float(f(xd, yd)) for _ in range(6)]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    for got, want in zip(model.parameters(), want_params):
        np.testing.assert_allclose(got.detach().cpu().numpy(), want.numpy(), rtol=1e-5,
                                   atol=1e-7)
    _same_on_every_rank(model)


def test_a_bound_method_of_an_object_holding_the_module_trains_it(two):
    want_losses, _ = _alone(_model(), 4)
    trainer = _Trainer(synk.shared(_model()))
    f = synk.function(trainer.step, inputs=["x", "y"])
    x, y = _data()
    xd, yd = synk.data(x), synk.data(y)
    step = f.bind(xd, yd)
    losses = [float(step()) for _ in range(4)]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    _same_on_every_rank(trainer.model)


def test_the_masters_changes_between_calls_reach_every_rank(two):
    model = synk.shared(_model())
    trainer = _Trainer(model)
    f = synk.function(trainer.step, inputs=["x", "y"])
    x, y = _data()
    xd, yd = synk.data(x), synk.data(y)
    for _ in range(2):
        f(xd, yd)
    fresh = _model(seed=5)
    model.load_state_dict(fresh.state_dict())  # rank 0's replicas, in place
    trainer.opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want_losses, _ = _alone(_model(seed=5), 2)
    losses = [float(f(xd, yd)) for _ in range(2)]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    _same_on_every_rank(model)
    synk.shared_broadcast(model)  # (rank 0's values to every rank: already theirs)
    _same_on_every_rank(model)


class _Tied(torch.nn.Module):
    """A model whose output layer is its input layer's transpose (one parameter, twice)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 16, bias=False)
        self.norm = torch.nn.BatchNorm1d(16)
        self.out = torch.nn.Linear(16, 8, bias=False)
        self.out.weight = torch.nn.Parameter(self.embed.weight.T.contiguous())
        self.back = self.embed  # (the same module under a second name)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.back(x))))


def test_tied_parameters_are_one_variable_and_buffers_are_shared(two):
    model = _Tied()
    assert synk.shared(model, name="net") is model

    def forward(x):
        model.train()
        return model(x).sum()

    x, _ = _data()
    synk.function(forward, inputs=["x"], reduce="sum")(synk.data(x))
    # the parameters once each (embed's weight once: back is embed), then the buffers
    values = synk.shared_gather(model, concat=False)
    assert len(values) == 4 + 3
    # each rank's batch-norm statistics are of its own rows: they differ between the ranks
    running_mean = [np.asarray(v) for v in values[4]]
    assert running_mean[0].shape == (16,)
    assert not np.array_equal(running_mean[0], running_mean[1])
    assert [int(np.asarray(v)) for v in values[6]] == [1, 1]  # num_batches_tracked


def test_a_shared_module_passed_as_an_argument_is_refused(two):
    model = synk.shared(_model())
    f = synk.function(lambda m, x: x.sum(), bcast_inputs=["m"], reduce="sum")
    with pytest.raises(TypeError, match="shared torch module"):
        f(model, np.ones((4, 2)))
    assert f(None, np.ones((4, 2))) == 8.0  # (the group is usable)
    with pytest.raises(TypeError, match="shared torch module"):
        f.bind(model)  # (bound, it would be a stale copy of its own)
    with pytest.raises(TypeError, match="shared torch module"):
        f.bind(m=[model])


@pytest.mark.parametrize("change", ["float", "to double", "data"])
def test_a_module_given_other_memory_after_sharing_is_refused_until_shared_again(two,
                                                                              change):
    """``model.float()`` (and the like) after ``synk.shared(model)`` gives its tensors other
    memory, which the ranks' replicas do not follow: the next call says so, rather than the
    ranks computing on different dtypes; shared again, the module works on every rank."""
    model = synk.shared(_model().double())
    f = synk.function(lambda x: model(x).detach(), reduce="gather")
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 8)))
    assert torch.allclose(f(x), model(x))
    if change == "float":
        model.float()
    elif change == "to double":
        model.to(torch.float16).double()
    else:
        model[0].weight.data = model[0].weight.data * 2
    with pytest.raises(TypeError, match="shared variable '0.weight'.*given other memory"):
        f(x)
    synk.shared(model)
    x = x.to(model[0].weight.dtype)
    got = f(x)
    assert got.dtype == x.dtype and torch.allclose(got, model(x))


def test_a_module_that_is_not_shared_is_refused_by_the_collectives(two):
    with pytest.raises(TypeError, match="not shared"):
        synk.shared_broadcast(_model())


MPI_TRAINING = """
import torch
import torch.nn.functional as F

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
alone = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
alone.load_state_dict(model.state_dict())
rng = np.random.default_rng(0)
x = torch.from_numpy(rng.standard_normal((64, 8)).astype(np.float32))
y = torch.from_numpy(rng.integers(0, 3, 64))
want = []
opt1 = torch.optim.SGD(alone.parameters(), lr=0.1, momentum=0.9)
for _ in range(4):
    opt1.zero_grad(); loss = F.cross_entropy(alone(x), y); loss.backward(); opt1.step()
    want.append(loss.item())

synk.shared(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

def step(x, y):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    synk.comm.allreduce(grads, "mean", weight=len(x), out=grads)
    opt.step()
    return loss

f = synk.function(step, inputs=["x", "y"])
got = [float(f(x, y)) for _ in range(4)]
assert np.allclose(got, want, rtol=1e-5), (got, want)
for values in synk.shared_gather(model, concat=False):
    assert all(np.array_equal(np.asarray(v), np.asarray(values[0])) for v in values)
print("MODULE OK", flush=True)
"""


@pytest.mark.timeout(240)
def test_a_shared_module_trains_across_pretend_hosts_under_mpi(tmp_path):
    """Under mpiexec, 2 ranks on 2 pretend hosts: every rank's copy trains on its replicas,
    installed on the other host when the step is shipped (each rank's 32 rows)."""
    import mpirun

    run = mpirun.run(tmp_path, MPI_TRAINING, hosts=("a", "b"), timeout=180)
    assert run.rc == 0 and "MODULE OK" in run.out, run
