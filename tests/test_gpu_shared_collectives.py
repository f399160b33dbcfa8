"""The master-side collectives on shared variables in GPU groups run on NCCL with one fused
buffer per dtype (counted as NCCL operations on every rank under the simulator), and give
numpy's answers, also with a shape of its own on each rank."""
import numpy as np
import pytest
from conftest import REAL, on_every_rank

import synk

pytestmark = pytest.mark.gpu


def _nccl_ops(arg):
    return synk.simulator.nccl_communicator().operations


def _ops_during(fn):
    if REAL:
        fn()
        return None
    before = on_every_rank(_nccl_ops)
    fn()
    after = on_every_rank(_nccl_ops)
    return [a - b for a, b in zip(after, before)]


def test_every_collective_is_one_nccl_operation_per_dtype(gpus):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((4, 3)), rng.standard_normal(5), rng.random(6).astype("f4")]
    a, b, c = (synk.shared(v, name=n) for v, n in zip(values, "abc"))
    for rank in range(gpus):  # every rank a value of its own (the same shapes)
        for v, base in zip((a, b, c), values):
            v.set_value(base * (rank + 1), rank=rank)
    ops = _ops_during(lambda: synk.shared_all_reduce([a, b, c], "sum"))
    factor = sum(range(1, gpus + 1))
    for v, base in zip((a, b, c), values):
        for rank in range(gpus):
            np.testing.assert_allclose(v.get_value(rank), base * factor, rtol=1e-5)
    assert ops is None or ops == [2] * gpus  # float64 and float32: two fused buffers

    for rank in range(gpus):
        a.set_value(values[0] * (rank + 1), rank=rank)
        c.set_value(values[2] * (rank + 1), rank=rank)
    ops = _ops_during(lambda: synk.shared_reduce([a, c], "mean", root=1))
    mean = sum(range(1, gpus + 1)) / gpus
    np.testing.assert_allclose(a.get_value(1), values[0] * mean)
    np.testing.assert_allclose(c.get_value(1), values[2] * mean, rtol=1e-5)
    np.testing.assert_allclose(a.get_value(0), values[0])  # not the root: unchanged
    assert ops is None or ops == [2] * gpus

    for rank in range(gpus):  # shapes of their own: rank r holds r + 1 rows of a
        a.set_value(np.full((rank + 1, 3), float(rank)), rank=rank)
    ops = _ops_during(lambda: synk.shared_gather([a, b, c]))
    gathered = synk.shared_gather([a, b, c], concat=False)
    assert [g.shape for g in gathered[0]] == [(r + 1, 3) for r in range(gpus)]
    assert all((g == r).all() for r, g in enumerate(gathered[0]))
    # per dtype: a send from each rank, and rank 0 receives them in one NCCL group
    assert ops is None or ops == [2 * (gpus - 1)] + [2] * (gpus - 1)

    ops = _ops_during(lambda: synk.shared_all_gather([a, c]))
    want = np.concatenate([np.full((r + 1, 3), float(r)) for r in range(gpus)])
    for rank in range(gpus):
        np.testing.assert_allclose(a.get_value(rank), want)
    assert ops is None or ops == [2] * gpus

    parts = [np.arange(10.0).reshape(5, 2), np.arange(7, dtype="f4")]
    ops = _ops_during(lambda: synk.shared_scatter([a, c], parts))
    for rank in range(gpus):
        bounds = np.cumsum([0] + [len(p) for p in np.array_split(np.arange(5), gpus)])
        np.testing.assert_allclose(a.get_value(rank), parts[0][bounds[rank]:bounds[rank + 1]])
        assert c.get_value(rank).dtype == np.float32
    np.testing.assert_allclose(synk.shared_gather(c), parts[1])
    # per dtype: the master sends every rank its parts in one NCCL group
    assert ops is None or ops == [2 * (gpus - 1)] + [2] * (gpus - 1)


def test_all_gather_refuses_shapes_that_cannot_be_joined(gpus2):
    v = synk.shared(np.zeros((2, 3)))
    v.set_value(np.zeros((2, 4)), rank=1)
    with pytest.raises(ValueError, match="other dimensions"):
        synk.shared_all_gather(v)
    assert synk.shared_gather(v, concat=False)[1].shape == (2, 4)  # the group stays usable


def test_the_simulators_records_of_a_rank_are_read_inside_a_function(gpus2):
    """``synk.simulator.nccl_communicator`` and ``queued`` read the running rank's records:
    inside a synk function on simulated GPUs only, with a clear error elsewhere."""
    if REAL:
        pytest.skip("reads the simulator's records")

    def step(x):
        xp = synk.xp(x)
        before = synk.simulator.nccl_communicator()
        synk.comm.allreduce(xp.ones(5, xp.float32))
        after = synk.simulator.nccl_communicator()
        return (after.operations - before.operations,
                after.bytes_given["allReduce"] - before.bytes_given.get("allReduce", 0),
                after.name == before.name, synk.simulator.queued("copy"),
                synk.simulator.queued("nccl") >= 0)

    x = synk.data(np.zeros((4, 1)))
    got = synk.function(step, reduce=None)(x)  # (each output: every rank's, in rank order)
    assert got == ([1, 1], [20, 20], [True, True], [0, 0], [True, True])
    with pytest.raises(RuntimeError, match="inside a synk function"):
        synk.simulator.nccl_communicator()
    with pytest.raises(ValueError, match="'copy' or 'nccl'"):
        synk.simulator.queued("compute")


def test_the_simulators_rank_records_are_refused_on_cpu_ranks():
    synk.fork(2, backend="cpu")  # (CPU ranks, SYNK_SIMULATE_GPUS set or not)
    try:
        with pytest.raises(RuntimeError, match="SYNK_SIMULATE_GPUS"):
            synk.function(lambda x: synk.simulator.nccl_communicator(), reduce=None)(np.ones(2))
        with pytest.raises(RuntimeError, match="SYNK_SIMULATE_GPUS"):
            synk.function(lambda x: synk.simulator.queued(), reduce=None)(np.ones(2))
    finally:
        synk.close()
