"""synk.comm behaves the same whichever communicator carries it: the host one (CPU ranks),
NCCL (one rank per simulated GPU), the host-staged one (ranks that share a GPU on an NCCL
that refuses them) and a GPU group of one rank. Every non-blocking form returns the one
``synk.comm.Handle``, whose ``wait()`` gives what the blocking form gives; device arrays
come back as device arrays; numbers match numpy's."""
from functools import partial

import numpy as np
import pytest
from conftest import REAL, fresh_nccl_process, nccl_env, use_devices

import synk

BACKENDS = ["cpu", "nccl", "staged", "one gpu"]


@pytest.fixture(params=BACKENDS)
def group(request, monkeypatch):
    kind = request.param
    if kind == "cpu":
        synk.fork(3)
    elif REAL and kind in ("staged",):
        pytest.skip("chooses the simulated NCCL's version")
    else:
        if kind == "staged":
            nccl_env(monkeypatch, SYNK_SIM_NCCL_VERSION="22803")  # refuses shared GPUs
        use_devices(monkeypatch, 1 if kind == "one gpu" else 2 if kind == "staged" else 3)
        synk.fork(1 if kind == "one gpu" else 3, backend="gpu")
    yield kind
    synk.close()
    if kind == "staged":
        fresh_nccl_process()


def _host(value):
    return np.asarray(value.get() if hasattr(value, "get") else value)


def _every_form(marker):
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    x = xp.arange(6.0).reshape(3, 2) * (r + 1)
    ints = xp.arange(4, dtype=xp.int32) + r
    forms = {
        "allreduce": (lambda: synk.comm.allreduce(x, "sum"),
                      lambda: synk.comm.iallreduce(x, "sum")),
        "mean of ints": (lambda: synk.comm.allreduce(ints, "mean"),
                         lambda: synk.comm.iallreduce(ints, "mean")),
        "fused": (lambda: synk.comm.allreduce({"x": x, "i": [ints]}, "max")["i"][0],
                  lambda: synk.comm.iallreduce({"x": x, "i": [ints]}, "max")),
        "broadcast": (lambda: synk.comm.broadcast(x if r == n - 1 else None, root=n - 1),
                      lambda: synk.comm.ibroadcast(x if r == n - 1 else None, root=n - 1)),
        "allgather": (lambda: synk.comm.allgather(x[:r + 1]),
                      lambda: synk.comm.iallgather(x[:r + 1])),
        "reduce_scatter": (lambda: synk.comm.reduce_scatter(x, "min"),
                           lambda: synk.comm.ireduce_scatter(x, "min")),
    }
    out, handles, kinds = {}, {}, {}
    for name, (blocking, non_blocking) in forms.items():
        value = blocking()
        handle = non_blocking()
        handles[name] = type(handle) is synk.comm.Handle
        later = handle.wait()
        assert handle.wait() is later  # the same result on every call
        if name == "fused":
            later = later["i"][0]
        kinds[name] = "same" if type(value) is type(later) is type(x) else (
            f"{type(value).__name__}, {type(later).__name__}")
        out[name] = (_host(value), _host(later))
    synk.comm.barrier()
    return {"out": out, "handles": handles, "kinds": kinds}


def test_every_form_on_every_communicator(group):
    n = 1 if group == "one gpu" else 3
    f = synk.function(_every_form, bcast_inputs=["marker"], reduce=None)
    per_rank = f(np.zeros(1))  # (a device array on GPU ranks: xp is cupy there)
    x = [np.arange(6.0).reshape(3, 2) * (r + 1) for r in range(n)]
    ints = [np.arange(4, dtype=np.int32) + r for r in range(n)]
    bounds = np.array_split(np.arange(3), n)
    want = {
        "allreduce": sum(x),
        "mean of ints": np.mean(np.array(ints, np.float64), axis=0),
        "fused": np.max(ints, axis=0),
        "broadcast": x[n - 1],
        "allgather": np.concatenate([x[r][:r + 1] for r in range(n)]),
    }
    for r, got in enumerate(per_rank):
        out, handles, kinds = got["out"], got["handles"], got["kinds"]
        assert all(handles.values()), handles
        assert set(kinds.values()) == {"same"}, kinds  # device arrays stay on the device
        expected = dict(want, reduce_scatter=np.min(x, axis=0)[bounds[r]])
        for name, (value, later) in out.items():
            # a mean is within its documented bound of numpy's (the rule in the dtype)
            check = (partial(np.testing.assert_allclose, rtol=(n + 2) * 2.0 ** -52, atol=0)
                     if name == "mean of ints" else np.testing.assert_array_equal)
            check(value, expected[name], err_msg=f"{name} on rank {r}")
            check(later, expected[name], err_msg=f"i{name} on rank {r}")
            assert value.dtype == later.dtype == np.asarray(expected[name]).dtype, name


def _reduce_scatter_0d(marker):
    xp = synk.xp(marker)
    said = []
    for form in (synk.comm.reduce_scatter, synk.comm.ireduce_scatter):
        for x in (xp.asarray(1.0), 3, 2.5):  # (a Python number is 0-d too)
            try:
                form(x, "sum")
            except ValueError as err:
                said.append(str(err))
    synk.comm.barrier()  # (the group is still usable after the refusals)
    return said


def test_a_0d_value_is_refused_by_reduce_scatter_on_every_communicator(group):
    """One rule, whichever communicator: a 0-d value has no axis 0 to split (the host-staged
    communicator of a group of one used to return it as it was)."""
    f = synk.function(_reduce_scatter_0d, bcast_inputs=["marker"], reduce=None)
    for said in f(np.zeros(1)):
        assert len(said) == 6 and all("needs at least 1 dimension" in s for s in said), said


def test_a_mix_of_device_and_host_arrays_is_refused(monkeypatch):
    use_devices(monkeypatch, 2)
    synk.fork(2, backend="gpu")
    try:
        def mixed(marker):
            xp = synk.xp(marker)
            synk.comm.allreduce([xp.ones(2), np.ones(2)])

        with pytest.raises(TypeError, match="mix of device and host arrays"):
            synk.function(mixed, bcast_inputs=["marker"])(np.zeros(1))
        ones = synk.function(lambda m: _host(synk.comm.allreduce(synk.xp(m).ones(2))),
                             bcast_inputs=["m"], reduce=None)
        assert ones(np.zeros(1))[1].tolist() == [2.0, 2.0]  # the group stays usable
    finally:
        synk.close()
