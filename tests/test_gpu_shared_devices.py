"""Several ranks on one GPU (3 ranks on 2 simulated devices): ranks are placed round-robin;
NCCL (from 2.30, with NCCL_MULTI_RANK_GPU_ENABLE=1, which synk sets in the workers and around
the master's first communicator) joins them, and where NCCL cannot or must not (an NCCL
before 2.30, the variable set to 0 by the user, NCCL_NVLS_ENABLE=1, more than 2 ranks on a
GPU without NCCL_MAX_CTAS) the transport that stages device arrays through host memory is
chosen up front, saying why. The simulator follows NCCL's rules by version, so every path
runs here, and gives the same answers."""
import numpy as np
import pytest
from conftest import REAL, check_every, fresh_nccl_process, nccl_env, use_devices

import synk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(REAL, reason="chooses the simulated NCCL's version")]

PATHS = {
    "nccl": ({}, "NCCL with NCCL_MULTI_RANK_GPU_ENABLE"),  # the installed NCCL (2.32)
    "nccl-2.30.3": ({"SYNK_SIM_NCCL_VERSION": "23003"}, "NCCL with NCCL_MULTI_RANK_GPU"),
    "staged": ({"SYNK_SIM_NCCL_VERSION": "22803"},
               "staged through host memory: NCCL 2.28.3 refuses ranks that share a GPU"),
    "disabled": ({"NCCL_MULTI_RANK_GPU_ENABLE": "0"},
                 "staged through host memory: NCCL_MULTI_RANK_GPU_ENABLE is 0"),
}


@pytest.fixture(params=list(PATHS))
def shared_gpus(request, monkeypatch):
    env, described = PATHS[request.param]
    nccl_env(monkeypatch, **env)
    use_devices(monkeypatch, 2)
    assert synk.fork(3, backend="gpu") == 3
    yield request.param, described
    synk.close()
    fresh_nccl_process()


X = np.random.default_rng(0).standard_normal((17, 4))


def test_ranks_go_round_robin_and_the_transport_is_said(shared_gpus):
    path, described = shared_gpus
    assert synk.devices() == [0, 1, 0]
    assert described in synk.backend() and "3 ranks on 2 GPU(s)" in synk.backend()
    got = synk.function(lambda x: x.device.id, reduce=None)(np.ones((3, 1)))
    assert got == [0, 1, 0]


FNS = {"mean": lambda x: x.mean(axis=0), "sum": lambda x: x.sum(axis=0),
       "prod": lambda x: x.max(axis=0), "max": lambda x: x.max(axis=0),
       "min": lambda x: x.min(axis=0), "gather": lambda x: x * 2, None: lambda x: x[:1]}


def test_every_reduce_op_matches_numpy(shared_gpus):
    check_every([(op,) for op in FNS], _reduce_op_matches)


def _reduce_op_matches(op):
    fn = FNS[op]
    got = synk.function(fn, reduce=op)(X)
    outs = [fn(p) for p in np.array_split(X, 3)]
    if op is None:
        assert all(np.allclose(g, o) for g, o in zip(got, outs))
    elif op == "gather":
        np.testing.assert_allclose(got, X * 2)
    elif op == "prod":
        np.testing.assert_allclose(got, np.prod(outs, axis=0))
    else:
        np.testing.assert_allclose(got, getattr(np, op)(X, axis=0))


def test_synk_comm_and_shared_variables_on_shared_gpus(shared_gpus):
    def collectives(x):
        xp = synk.xp(x)
        r = synk.comm.rank()
        total = synk.comm.allreduce(x.sum(axis=0), "sum")
        handle = synk.comm.iallreduce(xp.full(2, r + 1.0), "max")
        joined = synk.comm.allgather(x[:1])
        part = synk.comm.reduce_scatter(xp.arange(6.0) * (r + 1), "sum")
        root = synk.comm.broadcast(xp.arange(4.0) if r == 0 else None)
        synk.comm.barrier()
        return [total.get(), handle.wait().get(), joined.get(), part.get(), root.get()]

    got = synk.function(collectives, reduce=None)(X)
    parts = np.array_split(X, 3)
    whole = np.arange(6.0) * 6
    for r, (total, high, joined, part, root) in enumerate(got):
        np.testing.assert_allclose(total, X.sum(axis=0))
        assert high.tolist() == [3.0, 3.0]
        np.testing.assert_allclose(joined, np.stack([p[0] for p in parts]))
        np.testing.assert_allclose(part, whole[2 * r:2 * r + 2])
        assert root.tolist() == [0.0, 1.0, 2.0, 3.0]
    v = synk.shared(np.zeros(4))
    synk.function(lambda x, v: v.__iadd__(x.sum(axis=0)), reduce=None)(X, v)
    synk.shared_all_reduce(v, "sum")
    np.testing.assert_allclose(v.get_value(2), X.sum(axis=0))


def test_resident_data_on_shared_gpus(shared_gpus):
    x = synk.data(X)
    x.to_device("shard")
    f = synk.function(lambda x: x * 1, reduce="gather")
    np.testing.assert_allclose(f(x, local_batch=slice(0, 2)),
                               np.concatenate([p[:2] for p in np.array_split(X, 3)]))


@pytest.mark.parametrize("env, devices, n, described", [
    ({"NCCL_NVLS_ENABLE": "1"}, 2, 3, "NCCL_NVLS_ENABLE=1"),
    ({}, 1, 3, "3 ranks share GPU 0, and with its default resources NCCL runs at most 2"),
    ({"NCCL_MAX_CTAS": "2"}, 1, 3, "NCCL with NCCL_MULTI_RANK_GPU_ENABLE"),
])
def test_nccl_is_chosen_only_where_it_can_run(monkeypatch, env, devices, n, described):
    nccl_env(monkeypatch, **env)
    use_devices(monkeypatch, devices)
    try:
        synk.fork(n, backend="gpu")
        assert described in synk.backend()
        f = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0), "sum"), reduce="mean")
        np.testing.assert_allclose(f(X), X.sum(axis=0))
    finally:
        synk.close()
        fresh_nccl_process()


def test_nccl_reads_its_variables_once_per_process(monkeypatch):
    """NCCL reads NCCL_MULTI_RANK_GPU_ENABLE at this process's first communicator: once that
    read 0, later groups that share GPUs cannot use NCCL here, and synk says so instead of
    letting NCCL refuse (or hang)."""
    nccl_env(monkeypatch, NCCL_MULTI_RANK_GPU_ENABLE="0")
    use_devices(monkeypatch, 2)
    try:
        synk.fork(2, backend="gpu")  # one rank per GPU: NCCL, reading the variable (0)
        synk.close()
        monkeypatch.delenv("NCCL_MULTI_RANK_GPU_ENABLE")
        synk.fork(3, backend="gpu")
        assert "read NCCL_MULTI_RANK_GPU_ENABLE=0 when it made its first communicator" in \
            synk.backend()
        assert synk.function(lambda x: x.sum(axis=0), reduce="sum")(X).tolist() == \
            pytest.approx(X.sum(axis=0).tolist())
    finally:
        synk.close()
        fresh_nccl_process()
    import os

    assert "NCCL_MULTI_RANK_GPU_ENABLE" not in os.environ  # the master's, never written


@pytest.mark.parametrize("version", [None, "23007"], ids=["installed", "2.30.7"])
def test_groups_that_share_gpus_turn_nvls_off_in_every_rank(monkeypatch, version):
    """NCCL 2.30.7 turns NVLink SHARP off for ranks sharing a GPU only when its last two
    ranks share one (hasMultiRankNvml, src/init.cc line 1053): round-robin ([0, 1, 0]) NVLS
    would be set up over the shared GPU. synk has every rank's NCCL read
    NCCL_NVLS_ENABLE=0 (the master's around its first communicator only), and NCCL runs."""
    nccl_env(monkeypatch, **({"SYNK_SIM_NCCL_VERSION": version} if version else {}))
    use_devices(monkeypatch, 2)
    try:
        synk.fork(3, backend="gpu")
        assert "NCCL with NCCL_MULTI_RANK_GPU_ENABLE" in synk.backend()
        read = synk.function(lambda: synk.simulator.nccl_communicator().settings[
            "NCCL_NVLS_ENABLE"], reduce=None)()
        assert read == [0, 0, 0]
        f = synk.function(lambda x: synk.comm.allreduce(x.sum(axis=0)), reduce="mean")
        np.testing.assert_allclose(f(X), X.sum(axis=0))
    finally:
        synk.close()
        fresh_nccl_process()
    import os

    assert "NCCL_NVLS_ENABLE" not in os.environ  # the master's, never written


def test_a_process_whose_nccl_read_nvls_on_stages_later_groups_that_share_gpus(monkeypatch):
    """The master's NCCL read NCCL_NVLS_ENABLE (unset: on) at its first communicator, for a
    group with one rank per GPU: a later group sharing GPUs cannot turn NVLS off in this
    process, so it is staged through the host, saying why (NCCL would set NVLS up over the
    shared GPU). NCCL_NVLS_ENABLE=0 set before the first group keeps NCCL for both."""
    nccl_env(monkeypatch)
    use_devices(monkeypatch, 2)
    try:
        synk.fork(2, backend="gpu")
        synk.close()
        synk.fork(3, backend="gpu")
        assert "read NCCL_NVLS_ENABLE as on" in synk.backend()
        np.testing.assert_allclose(synk.function(lambda x: x.sum(axis=0), reduce="sum")(X),
                                   X.sum(axis=0))
        synk.close()
        nccl_env(monkeypatch, NCCL_NVLS_ENABLE="0")
        for n in (2, 3):
            synk.fork(n, backend="gpu")
            assert "staged" not in synk.backend()
            assert n == 2 or "NCCL with NCCL_MULTI_RANK_GPU_ENABLE" in synk.backend()
            synk.close()
    finally:
        synk.close()
        fresh_nccl_process()
