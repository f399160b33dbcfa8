"""PyTorch through synk: tensors in and out of functions, synk.comm on tensors and its
gradients (each rank's gradient of the sum of every rank's loss, checked against the same
computation in one process), the data-parallel training loop, and what is refused.

Each test runs many cases in one call: a group's workers import torch once per group."""
import warnings

import numpy as np
import pytest
from conftest import REAL, on_every_rank, use_devices
from framework_cases import CASES, coefficients, inputs, ranked, whole

import synk

torch = pytest.importorskip("torch", reason="the torch tests need torch: pip install 'synk[torch]'")
pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(300),
              pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]


def _ranks_gradients(arg):
    """Every case's gradients on this rank, as numpy (and its outputs' types)."""
    import torch

    from synk import comm

    r, n = comm.rank(), comm.size()
    got = {}
    for case in arg[0]:
        xs = [torch.tensor(x, requires_grad=True) for x in inputs(case, r, n)]
        outs = ranked(comm, case, xs, r, n)
        loss = torch.zeros((), dtype=torch.float64)
        for i, out in enumerate(outs):
            if out is None:
                continue
            assert isinstance(out, torch.Tensor), (case, type(out))
            c = coefficients(r, i, tuple(out.shape))
            loss = loss + (out * torch.tensor(c, dtype=out.dtype)).sum()
        loss.backward()
        got[case] = [None if x.grad is None else x.grad.numpy() for x in xs]
    return got


def _reference(case: str, n: int) -> list:
    """Every rank's gradients of the sum of every rank's loss, in one process."""
    X = [[torch.tensor(x, requires_grad=True) for x in inputs(case, r, n)] for r in range(n)]
    outs = whole(case, X, n, (lambda parts: torch.cat(parts),
                              lambda shape: torch.zeros(shape, dtype=torch.float64)))
    total = torch.zeros((), dtype=torch.float64)
    for r in range(n):
        for i, out in enumerate(outs[r]):
            if out is not None:
                total = total + (out * torch.tensor(coefficients(r, i, tuple(out.shape)))).sum()
    total.backward()
    return [[None if x.grad is None else x.grad.numpy() for x in xr] for xr in X]


@pytest.fixture(params=[2, 3, "gpu2"])
def group(request, monkeypatch):
    """A group of 2, then 3 CPU ranks, then of 2 simulated GPUs."""
    n, backend = (2, "gpu") if request.param == "gpu2" else (request.param, "cpu")
    if backend == "gpu":
        use_devices(monkeypatch, n)
    synk.fork(n, backend=backend)
    yield n
    synk.close()


def test_every_gradient_against_one_process(group):
    n = group
    got = on_every_rank(_ranks_gradients, CASES)
    for case in CASES:
        want = _reference(case, n)
        for r in range(n):
            for g, w in zip(got[r][case], want[r]):
                if w is None:
                    assert g is None or not g.any(), (case, r)
                else:
                    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12,
                                               err_msg=f"{case}, rank {r}")


def _forward(arg):
    """synk.comm's results on tensors of several dtypes, as numpy, with their types."""
    import torch

    from synk import comm

    r, n = comm.rank(), comm.size()
    out = {}

    def seen(key, value):
        assert isinstance(value, torch.Tensor), (key, type(value))
        out[key] = (str(value.dtype).rpartition(".")[2],
                    value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy())

    x = torch.arange(6, dtype=torch.int32).reshape(2, 3) * (r + 1)
    for op in ("sum", "prod", "max", "min", "mean", "band", "lor"):
        seen(f"allreduce {op}", comm.allreduce(x, op))
    seen("bool sum", comm.allreduce(torch.tensor([True, r % 2 == 0])))
    seen("bf16 sum", comm.allreduce(torch.full((3,), 1.5 * (r + 1), dtype=torch.bfloat16)))
    seen("bf16 allgather", comm.allgather(torch.full((2,), r + 0.5, dtype=torch.bfloat16)))
    seen("f16 mean", comm.allreduce(torch.full((2,), r + 1.0, dtype=torch.float16), "mean"))
    seen("broadcast", comm.broadcast(x if r == 1 else None, 1))
    seen("scatter", comm.scatter([torch.full((p + 1,), p) for p in range(n)] if r == 0
                                 else None, 0))
    seen("gather", comm.gather(x, 0))
    seen("reduce", comm.reduce(x, "max", 0))
    seen("sendrecv", comm.sendrecv(x, (r + 1) % n, (r - 1) % n))
    values, ranks = comm.allreduce(torch.tensor([float(r), -float(r)]), "maxloc")
    seen("maxloc values", values)
    seen("maxloc ranks", ranks)
    seen("ibroadcast", comm.ibroadcast(None if r else torch.ones(2), 0).wait())
    seen("irecv", (comm.isend(x, r, 3), comm.irecv(r, 3).wait())[1])
    tree = comm.allreduce({"w": torch.ones(2, 2) * r, "b": [torch.ones(3, dtype=torch.float64)]})
    seen("tree w", tree["w"])
    seen("tree b", tree["b"][0])
    buf = torch.empty(2, 3, dtype=torch.int32)
    address = buf.data_ptr()
    back = comm.allreduce(x, out=buf)
    assert back is buf and buf.data_ptr() == address
    seen("out", buf)
    status = comm.Status()
    comm.send(torch.ones(2, dtype=torch.float64) * r, r, 9)
    seen("recv status", comm.recv(comm.ANY_SOURCE, 9, status=status))
    out["status"] = (status.source, str(status.dtype), status.shape)
    return out


def test_collectives_on_tensors_against_numpy(ranks3):
    n = ranks3
    got = on_every_rank(_forward, None)
    x = [np.arange(6, dtype=np.int32).reshape(2, 3) * (r + 1) for r in range(n)]
    want = {
        "allreduce sum": ("int32", np.sum(x, axis=0)),
        "allreduce prod": ("int32", np.prod(x, axis=0)),
        "allreduce max": ("int32", np.max(x, axis=0)),
        "allreduce min": ("int32", np.min(x, axis=0)),
        "allreduce mean": ("float64", np.mean(x, axis=0)),
        "allreduce band": ("int32", np.bitwise_and.reduce(x)),
        "allreduce lor": ("bool", np.logical_or.reduce(x)),
        "bool sum": ("int64", np.array([3, 2])),
        "bf16 sum": ("bfloat16", np.full(3, 1.5 * 6)),
        "f16 mean": ("float16", np.full(2, 2.0)),
        "broadcast": ("int32", x[1]),
        "gather": ("int32", np.concatenate(x)),
        "tree w": ("float32", np.ones((2, 2)) * 3),
        "tree b": ("float64", np.ones(3) * 3),
        "out": ("int32", np.sum(x, axis=0)),
        "maxloc values": ("float32", np.array([2.0, 0.0])),
        "maxloc ranks": ("int64", np.array([2, 0])),
        "ibroadcast": ("float32", np.ones(2)),
    }
    for r in range(n):
        mine = got[r]
        for key, (dtype, value) in want.items():
            if key == "gather" and r != 0:
                continue
            assert mine[key][0] == dtype, (key, r, mine[key][0])
            np.testing.assert_allclose(mine[key][1], value, err_msg=f"{key}, rank {r}")
        assert mine["bf16 allgather"][0] == "bfloat16"
        np.testing.assert_array_equal(mine["bf16 allgather"][1],
                                      np.repeat([0.5, 1.5, 2.5], 2))
        np.testing.assert_array_equal(mine["scatter"][1], np.full(r + 1, r))
        np.testing.assert_array_equal(mine["sendrecv"][1], x[(r - 1) % n])
        np.testing.assert_array_equal(mine["irecv"][1], x[r])
        assert mine["gather"][1].shape == (() if r else (6, 3))
        assert mine["status"] == (r, "float64", (2,))


def _refused(arg):
    import torch

    from synk import comm

    said = {}
    for op in ("max", "min", "prod", "band", "lxor"):
        x = torch.ones(3, dtype=torch.float64 if op in ("max", "min", "prod") else torch.int64)
        if x.is_floating_point():
            x.requires_grad_()
            y = comm.allreduce(x, op)
            try:
                y.sum().backward()
            except synk.SynkError as err:
                said[op] = str(err)
    try:
        comm.allreduce(torch.ones(2, dtype=torch.complex32))
    except TypeError as err:
        said["complex32"] = str(err)
    try:
        comm.allreduce(torch.ones(2, requires_grad=True), out=torch.empty(2))
    except TypeError as err:
        said["out grad"] = str(err)
    torch._synk_test_kept = comm.allreduce(torch.ones(2, requires_grad=True))
    return said


def _backward_later(arg):
    import torch

    try:
        torch._synk_test_kept.sum().backward()
    except synk.SynkError as err:
        return str(err)
    finally:
        del torch._synk_test_kept
    return "no error"


def test_what_has_no_gradient_raises_and_the_group_goes_on(ranks2):
    for said in on_every_rank(_refused, None):
        for op in ("max", "min", "prod"):
            assert f"op {op!r} has no gradient" in said[op]
        assert "torch.complex32" in said["complex32"] and "x.to(torch.complex64)" in said[
            "complex32"]
        assert "out= does not take part in autograd" in said["out grad"]
    for said in on_every_rank(_backward_later, None):
        assert "after the synk function call that ran it had ended" in said
    assert on_every_rank(lambda arg: float(synk.comm.allreduce(torch.ones(1))[0]), None) == \
        [2.0, 2.0]


# -- functions: tensors in, tensors out --------------------------------------------------
def _step_inputs(x, y, w, opts, shared_w):
    import torch

    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32
    assert isinstance(y, torch.Tensor) and y.dtype == torch.int64
    assert isinstance(w, torch.Tensor) and w.dtype == torch.float64
    assert isinstance(opts["scale"], torch.Tensor) and opts["scale"].dtype == torch.bfloat16
    assert isinstance(opts["bias"][0], torch.Tensor)
    assert isinstance(shared_w, torch.Tensor)
    shared_w += 1  # in place: the replica's memory itself
    loss = ((x.double() @ w) ** 2).mean() * opts["scale"].double()
    return loss, x.sum(0), y.bincount(minlength=3), [x.dtype is torch.float32]


@pytest.mark.filterwarnings("ignore:synk.function. w is a torch tensor that requires grad")
def test_tensors_in_and_out_of_functions(ranks3):
    rng = np.random.default_rng(0)
    x = torch.tensor(rng.standard_normal((23, 4)), dtype=torch.float32)
    y = torch.tensor(rng.integers(0, 3, 23))
    w = torch.tensor(rng.standard_normal(4), requires_grad=True)
    opts = {"scale": torch.tensor(2.0, dtype=torch.bfloat16), "bias": [torch.zeros(1)]}
    shared_w = synk.shared(torch.zeros(3))
    f = synk.function(_step_inputs, bcast_inputs=["w", "opts", "shared_w"],
                      reduce=("mean", "sum", "sum", None))

    def single(rows):
        xr = x[rows].double()
        return (((xr @ w) ** 2).mean() * 2.0, x[rows].sum(0), y[rows].bincount(minlength=3))

    for kwargs, rows in [({}, slice(None)), ({"batch": torch.tensor([3, 1, 4, 15, 9])},
                                              [3, 1, 4, 15, 9]),
                         ({"num_slices": 2}, slice(None)),
                         ({"batch": 17, "local_batch": torch.tensor([0, 1])}, None)]:
        loss, sums, counts, flags = f(synk.data(x) if "batch" in kwargs else x, y, w,
                                      opts, shared_w, **kwargs)
        assert isinstance(loss, torch.Tensor) and loss.dtype == torch.float64
        assert not loss.requires_grad
        assert sums.dtype == torch.float32 and counts.dtype == torch.int64
        if rows is None:  # local_batch: each rank's first two rows of its share of 17
            rows = [0, 1, 6, 7, 12, 13]
        want_loss, want_sums, want_counts = single(rows)
        torch.testing.assert_close(loss.detach(), want_loss.detach())
        torch.testing.assert_close(sums, want_sums)
        assert torch.equal(counts, want_counts)
        assert len(flags) == 3  # (reduce=None: each rank's value, as it was)
    for r in range(3):  # four calls, one of them in two pieces: five runs of the function
        value = shared_w.get_value(r)
        assert isinstance(value, torch.Tensor) and torch.equal(value, torch.full((3,), 5.0))
    assert torch.equal(f.local(x, y, w, opts, shared_w)[1], x.sum(0))


def _product(x, w):
    return (x @ w).sum()


def test_a_tensor_that_requires_grad_given_to_a_call_warns_once_where_it_is_given(ranks2):
    """The result has no gradient path back to it: said once per line of the program that
    gives it (Python's rule for warnings), naming the argument; not for a detached tensor
    or under torch.no_grad()."""
    w = torch.ones(3, requires_grad=True)
    f = synk.function(_product, bcast_inputs=["w"], reduce="sum")
    x = torch.ones((4, 3))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        for _ in range(3):
            out = f(x, w)
    ours = [m for m in seen if "requires grad" in str(m.message)]
    assert len(ours) == 1, [str(m.message) for m in seen]
    assert ours[0].filename == __file__ and "pass w.detach()" in str(ours[0].message)
    assert not out.requires_grad and float(out) == 12.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(x, w.detach())
        with torch.no_grad():
            f(x, w)


def _compiled_step(x, w):
    return (torch.tanh(x @ w) ** 2).mean(), torch.compiler.is_compiling()


def test_a_torch_compiled_function_ships_and_is_compiled_on_every_rank(ranks2):
    """synk.function(torch.compile(step, ...)): each rank compiles step with the same backend
    and options (the function torch.compile returns does not pickle)."""
    w, x = torch.randn(4, dtype=torch.float64), torch.randn(10, 4, dtype=torch.float64)
    f = synk.function(torch.compile(_compiled_step, backend="aot_eager", fullgraph=True),
                      bcast_inputs=["w"], reduce=("mean", None))
    loss, compiled = f(x, w)
    torch.testing.assert_close(loss, _compiled_step(x, w)[0])
    assert compiled == [True, True]


def test_a_compiled_function_captured_by_the_function_says_what_to_do(ranks2):
    inner = torch.compile(_compiled_step, backend="eager")

    def step(x, w):
        return inner(x, w)[0]

    with pytest.raises(TypeError, match="give the compiled function to synk.function itself"):
        synk.function(step, bcast_inputs=["w"])(torch.ones(4, 2), torch.ones(2))
    assert float(synk.function(_product, bcast_inputs=["w"], reduce="sum")(
        torch.ones(4, 2), torch.ones(2))) == 8.0  # (the group goes on)


def _write_rows(x):
    x *= 2  # a Data's rows, through the tensor: shared memory, no copy
    return x.sum()


def test_a_data_made_from_a_tensor_is_viewed_without_a_copy(ranks2):
    base = torch.arange(10, dtype=torch.float64)
    d = synk.data(base)
    assert d.frame is not None and d.array.dtype == np.float64
    f = synk.function(_write_rows, reduce="sum")
    total = f(d)
    assert float(total) == 2 * 45.0
    np.testing.assert_array_equal(d.array, 2 * base.numpy())
    b16 = synk.data(torch.ones(4, dtype=torch.bfloat16))
    assert b16.array.dtype == np.uint16  # its 16 bits, as they are
    seen = synk.function(lambda d: [str(d.dtype), float(d.float().sum())], bcast_inputs=["d"],
                         reduce=None)(b16)
    assert seen == [["torch.bfloat16", 4.0], ["torch.bfloat16", 4.0]]


def test_bfloat16_moves_as_16_bits_and_means_round_once(ranks2):
    x = torch.tensor([1.0, 3.0, 1e-3, 256.0], dtype=torch.bfloat16)
    f = synk.function(lambda x: (x, x.float().sum()), reduce=("gather", "sum"))
    joined, total = f(x)
    assert joined.dtype == torch.bfloat16 and torch.equal(joined, x)
    assert total.dtype == torch.float32 and float(total) == float(x.float().sum())


# -- the data-parallel training loop -----------------------------------------------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _data_parallel(model, opt):
    """The step of docs/training.md: the model and optimizer go with the function (each rank
    keeps its own), the parameters are synk replicas, gradients averaged by synk.comm."""
    def train_step(x, y, *replicas):
        import torch.nn.functional as F

        for p, r in zip(model.parameters(), replicas):
            p.data = r  # this rank's replicas are the model's parameters
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        synk.comm.allreduce(grads, "mean", weight=len(x), out=grads)
        opt.step()
        return loss

    return train_step


@pytest.fixture(params=[(2, "cpu"), (3, "cpu"), (2, "gpu")], ids=["cpu2", "cpu3", "gpu2"])
def backend_group(request, monkeypatch):
    """Groups of 2 and 3 CPU ranks, and of 2 simulated GPUs."""
    n, backend = request.param
    if backend == "gpu":
        use_devices(monkeypatch, n)
    synk.fork(n, backend=backend)
    yield n
    synk.close()


def test_the_step_is_shipped_once_however_long_the_loop(ranks2):
    """The step captures the model and the optimizer, whose tensors every step changes on
    every rank alike: they are each rank's own, not shipped again at each step (which
    cost 10 ms a step; synk warns after 10 steps in a row that ship it)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    replicas = [synk.shared(p) for p in model.parameters()]
    X = torch.tensor(np.random.default_rng(2).standard_normal((40, 6)), dtype=torch.float32)
    xd, yd = synk.data(X), synk.data(torch.tensor(np.arange(40) % 3))
    step = synk.function(_data_parallel(model, opt), inputs=["x", "y"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(12):
            step(xd, yd, *replicas, batch=np.arange(k, k + 20))
    assert not [w for w in caught if "shipped to the workers again" in str(w.message)]
    for p in replicas:
        torch.testing.assert_close(p.get_value(0), p.get_value(1), rtol=0, atol=0)


def test_training_loop_matches_one_process(backend_group):
    n = backend_group
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    replicas = [synk.shared(p) for p in model.parameters()]
    alone = _model()
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.2, momentum=0.9)
    rng = np.random.default_rng(1)
    X = torch.tensor(rng.standard_normal((50, 6)), dtype=torch.float32)
    Y = torch.tensor(rng.integers(0, 3, 50))
    xd, yd = synk.data(X), synk.data(Y)
    step = synk.function(_data_parallel(model, opt), inputs=["x", "y"])
    for k in range(0, 50, 11):  # 11 rows a step, the last 6: uneven shares
        idx = np.arange(k, min(k + 11, 50))
        loss = step(xd, yd, *replicas, batch=idx)
        alone_opt.zero_grad()
        want = torch.nn.functional.cross_entropy(alone(X[idx]), Y[idx])
        want.backward()
        alone_opt.step()
        assert abs(float(loss) - float(want.detach())) < 1e-6
    for p, q in zip(replicas, alone.parameters()):
        for r in range(n):
            torch.testing.assert_close(p.get_value(r), q.detach(), rtol=0, atol=1e-6)


# -- GPU ranks (simulated): tensors stay torch CPU tensors, synk.comm carries them --------
def _on_gpu_rank(arg):
    import torch

    from synk import comm

    x = arg[0]
    assert isinstance(x, torch.Tensor) and x.device.type == "cpu"
    w = torch.ones(3, dtype=torch.float64, requires_grad=True)
    y = comm.allreduce(w * (comm.rank() + 1))
    y.sum().backward()
    return type(x).__name__, float(x.sum()), w.grad.tolist()


@pytest.fixture
def gpus2(monkeypatch):
    use_devices(monkeypatch, 2)
    synk.fork(2, backend="gpu")
    yield 2
    synk.close()


@pytest.mark.skipif(REAL, reason="real GPU ranks give CUDA tensors: "
                    "test_framework_values_on_real_gpus.py")
def test_simulated_gpu_ranks_give_torch_cpu_tensors(gpus2):
    got = on_every_rank(_on_gpu_rank, torch.arange(4.0))
    for r, (name, total, grad) in enumerate(got):
        assert name == "Tensor" and total == 6.0
        # the sum of both ranks' losses is 2 * (w_0 + 2 w_1), elementwise
        assert grad == [2.0 * (r + 1)] * 3


def _double_rows_and_count(x, counter):
    x *= 2  # a Data's rows, in place through the tensor
    counter += 1  # a shared variable's replica, in place
    return x.sum()


def test_in_place_writes_through_tensors_persist_on_gpu_ranks(gpus2):
    # torch cannot view a (simulated) device array: fn gets copies, whose updates in place
    # must reach the replica and the Data as a CPU rank's do, piece after piece
    base = torch.arange(10, dtype=torch.float64)
    d = synk.data(base)
    counter = synk.shared(torch.zeros(3))
    f = synk.function(_double_rows_and_count, bcast_inputs=["counter"], reduce="sum")
    assert float(f(d, counter)) == 2 * 45.0
    np.testing.assert_array_equal(d.array, 2 * base.numpy())
    assert float(f(d, counter, num_slices=2)) == 4 * 45.0  # two pieces on each rank
    np.testing.assert_array_equal(d.array, 4 * base.numpy())
    for r in range(2):  # three runs of fn on each rank
        assert torch.equal(counter.get_value(r), torch.full((3,), 3.0))


def _structures_groups_handles(arg):
    import torch

    from synk import comm

    r, n = comm.rank(), comm.size()
    out = {}
    group = comm.split(r % 2)  # ranks 0 and 2, and rank 1 alone
    x = torch.ones(2, requires_grad=True)
    group.allreduce(x * (r + 1)).sum().backward()  # the backward runs in the group too
    out["group"] = x.grad.tolist()
    x = torch.tensor(2.0, requires_grad=True)
    comm.allreduce(x).backward()
    out["0-d"] = float(x.grad)
    w = ({"a": torch.ones(2, requires_grad=True), "b": [torch.ones(3, requires_grad=True)]}
         if r == 0 else None)
    got = comm.broadcast(w, 0)  # the other ranks pass None: the root's frame tells them
    (got["a"].sum() + 2 * got["b"][0].sum()).backward()
    out["broadcast"] = [w["a"].grad.tolist(), w["b"][0].grad.tolist()] if r == 0 else []
    chunks = [torch.full((2,), float(p), requires_grad=True) for p in range(n)] if r == 0 \
        else None
    (comm.scatter(chunks, 0) * (r + 1)).sum().backward()
    out["scatter"] = [c.grad.tolist() for c in chunks] if r == 0 else []
    # mpi4torch's way: the root's rows are the chunks; the others pass a tensor that counts
    # for nothing (its gradient: zeros)
    whole = torch.zeros(n, 2, requires_grad=True) if r == 0 else torch.ones(1, requires_grad=True)
    (comm.scatter(whole, 0) * (r + 1)).sum().backward()
    out["scatter rows"] = whole.grad.tolist()
    x = torch.ones(2, requires_grad=True)
    comm.iallreduce(x * 2).wait().sum().backward()
    out["iallreduce"] = x.grad.tolist()
    mixed = comm.allreduce([torch.ones(2), 3.0])
    out["mixed"] = [type(mixed[0]).__name__, type(mixed[1]).__name__, mixed[1]]
    return out


def test_structures_groups_and_handles(ranks3):
    for r, got in enumerate(on_every_rank(_structures_groups_handles, None)):
        # groups {0, 2} (the sum of its losses: 2 (x_0 + 3 x_2)) and {1} (2 x_1)
        assert got["group"] == [[2.0, 2.0], [2.0, 2.0], [6.0, 6.0]][r]
        assert got["0-d"] == 3.0 and got["iallreduce"] == [6.0, 6.0]
        if r == 0:
            assert got["broadcast"] == [[3.0, 3.0], [6.0, 6.0, 6.0]]
            assert got["scatter"] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
        assert got["scatter rows"] == ([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]] if r == 0
                                       else [0.0])
        assert got["mixed"] == ["Tensor", "float", 9.0]  # a number in a structure stays one


# -- out= on the ranks that pass None --------------------------------------------------------
def _broadcast_into_buffers(arg):
    """Rank 1 broadcasts; every other rank passes None and a buffer (out=), in the forms a
    training loop uses: a tensor, the root's tensor into a numpy buffer and the other way
    round, a structure, the non-blocking form."""
    import torch

    from synk import comm

    r, root = comm.rank(), 1
    x = torch.arange(3.0) + 1 if r == root else None
    out, seen = {}, {}

    def kept(name, got, buf, before):
        seen[name] = (got is buf, buf.data_ptr() == before if hasattr(buf, "data_ptr")
                      else True, [float(v) for v in buf])

    buf = torch.zeros(3)
    before = buf.data_ptr()
    kept("both out", comm.broadcast(x, root, out=buf), buf, before)  # every rank: out=
    buf = torch.zeros(3)
    before = buf.data_ptr()
    got = comm.broadcast(x, root, out=None if r == root else buf)  # the root: none
    if r != root:
        kept("root plain", got, buf, before)
    buf = np.zeros(3, np.float32)
    got = comm.broadcast(x, root, out=None if r == root else buf)
    if r != root:
        kept("numpy out", got, buf, 0)
    buf = torch.zeros(3)
    before = buf.data_ptr()
    numpy_x = np.arange(3, dtype=np.float32) + 1 if r == root else None
    kept("numpy root", comm.broadcast(numpy_x, root, out=buf), buf, before)
    buf = torch.zeros(3)
    before = buf.data_ptr()
    kept("ibroadcast", comm.ibroadcast(x, root, out=buf).wait(), buf, before)
    bufs = [torch.zeros(3), torch.zeros(2, dtype=torch.float64)]
    tree = [x, torch.ones(2, dtype=torch.float64)] if r == root else None
    got = comm.broadcast(tree, root, out=bufs)
    out["structure"] = (got is bufs, [b.tolist() for b in bufs])
    out["seen"] = seen
    return out


def test_broadcast_from_none_into_a_tensor_buffer(two):
    """``broadcast(None, root, out=tensor)`` on the ranks other than the root fills the
    tensor in place (no StopIteration, nobody left waiting)."""
    for r, got in enumerate(on_every_rank(_broadcast_into_buffers, None)):
        for name, (same, kept_memory, values) in got["seen"].items():
            assert values == [1.0, 2.0, 3.0], (r, name, values)
            assert kept_memory and same, (r, name)
        assert got["structure"] == (True, [[1.0, 2.0, 3.0], [1.0, 1.0]]), r


def _into_buffer_while_the_root_follows_grad(arg):
    import torch

    from synk import comm

    r = comm.rank()
    x = torch.ones(2, requires_grad=True) if r == 0 else None
    return comm.broadcast(x, 0, out=None if r == 0 else torch.zeros(2))


def test_out_on_a_receiver_of_a_tensor_that_requires_grad_is_refused(ranks2):
    # out= drops the gradient, and the root's backward would wait for it: every rank raises
    with pytest.raises(TypeError, match="out= does not take part in autograd"):
        on_every_rank(_into_buffer_while_the_root_follows_grad, None)
    assert on_every_rank(lambda arg: float(synk.comm.allreduce(torch.ones(1))[0]), None) == \
        [2.0, 2.0]
