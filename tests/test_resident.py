"""Data resident on the devices (Data.to_device) and local_batch=: replicate and shard modes
with every batch / local_batch form and num_slices, against numpy, on GPU ranks (2 and 3)
and on CPU ranks (the same calls, with the shared memory as the device); writes to a
resident Data are seen by the next call; a training loop on resident data moves no input
byte but the indices (asserted from the transfer counters). (That free() and to_host() drop
the ranks' device copies, read from synk's record of them, is test_call_insides.py's.)"""
import numpy as np
import pytest
from conftest import REAL, check_every, on_every_rank, use_devices

import synk
from synk import simulator as sim


def _bounds(n_rows: int, n_ranks: int) -> list:
    """Start of each rank's rows and the end, as numpy splits them (synk splits the same)."""
    sizes = [len(part) for part in np.array_split(np.arange(n_rows), n_ranks)]
    return [0, *(int(b) for b in np.cumsum(sizes))]


X = np.random.default_rng(0).standard_normal((23, 3))


def _sum(x):
    return x.sum(axis=0)


def _expected_rows(mode, n, batch=None, local=None):
    """The rows a call uses, in the order the ranks take them."""
    rows = np.arange(len(X))
    if batch is not None:
        rows = rows[:batch] if isinstance(batch, int) else rows[batch]
    bounds = _bounds(len(rows), n)
    picked = []
    for r in range(n):
        share = rows[bounds[r]:bounds[r + 1]]
        spec = local[r] if isinstance(local, list) else local
        if spec is None:
            picked.append(share)
        elif isinstance(spec, int):
            picked.append(share[:spec])
        else:
            picked.append(share[spec])
    return np.concatenate(picked)


BATCHES = [None, 9, slice(2, 20, 3), np.array([5, 0, 22, 7, 7, 13, 1]),
           np.random.default_rng(1).random(23) < 0.5]
LOCALS = [None, 2, slice(1, None, 2), np.array([0, -1]), "per rank"]


def _local(spec, n):
    if isinstance(spec, str):
        return [None, 1, np.array([1, 0])][:n] + [slice(0, 2)] * (n - 3)
    return spec


def test_replicated_data_with_every_batch_form(gpu_ranks_then_cpu):
    ranks = gpu_ranks_then_cpu
    check_every([(ranks, batch, num_slices) for batch in BATCHES for num_slices in (1, 3)],
                _replicated_with_batch)


def _replicated_with_batch(ranks, batch, num_slices):
    x = synk.data(X)
    x.to_device("replicate")
    assert x.on_device == "replicate"
    f = synk.function(_sum, reduce="sum")
    g = synk.function(lambda x: x * 2, reduce="gather")
    rows = _expected_rows("replicate", ranks, batch)
    np.testing.assert_allclose(f(x, batch=batch, num_slices=num_slices), X[rows].sum(axis=0))
    np.testing.assert_allclose(g(x, batch=batch, num_slices=num_slices), X[rows] * 2)


def test_local_batch_on_resident_and_plain_data(gpu_ranks_then_cpu):
    ranks = gpu_ranks_then_cpu
    check_every([(ranks, mode, local) for mode in ("replicate", "shard") for local in LOCALS],
                _local_batch_on)


def _local_batch_on(ranks, mode, local):
    x = synk.data(X)
    local = _local(local, ranks)
    rows = _expected_rows(mode, ranks, local=local)
    f = synk.function(lambda x: x * 1, reduce="gather")
    np.testing.assert_allclose(f(X, local_batch=local), X[rows])  # a plain array
    x.to_device(mode)
    for num_slices in (1, 2):
        np.testing.assert_allclose(f(x, local_batch=local, num_slices=num_slices), X[rows])
    mean = synk.function(lambda x: x.mean(axis=0), reduce="mean")(x, local_batch=local)
    np.testing.assert_allclose(mean, X[rows].mean(axis=0))


def test_local_batch_with_batch_picks_within_each_share_of_the_batch(gpu_ranks_then_cpu):
    ranks = gpu_ranks_then_cpu
    x = synk.data(X)
    x.to_device("replicate")
    batch = np.array([20, 3, 8, 11, 0, 14, 9, 2])
    f = synk.function(lambda x: x * 1, reduce="gather")
    got = f(x, batch=batch, local_batch=slice(0, 2))
    bounds = _bounds(len(batch), ranks)
    want = np.concatenate([X[batch[bounds[r]:bounds[r + 1]][:2]] for r in range(ranks)])
    np.testing.assert_allclose(got, want)


def test_writes_to_resident_data_are_seen_by_the_next_call(gpu_ranks_then_cpu):
    x = synk.data(X.copy())
    f = synk.function(_sum, reduce="sum")
    for mode in ("replicate", "shard"):
        x.to_device(mode)
        want = x.array.sum(axis=0)
        np.testing.assert_allclose(f(x), want)
        x[3] = 100.0  # item assignment
        np.testing.assert_allclose(f(x), x.array.sum(axis=0))
        x.set_value(X * 2)  # same size
        np.testing.assert_allclose(f(x), (X * 2).sum(axis=0))
        x.resize((30, 3))  # a larger block: the data moves
        np.testing.assert_allclose(f(x), x.array.sum(axis=0))
        x.set_value(X)
        with pytest.raises(ValueError, match="read-only"):
            x.array[0] = 7.0  # would go unseen by the device copies: refused
        version = x.version
        x.touch()
        assert x.version > version
        np.testing.assert_allclose(f(x), X.sum(axis=0))
        x.to_host()
        x.array[0] = 7.0  # writable again
        np.testing.assert_allclose(f(x), x.array.sum(axis=0))
        x.set_value(X)


def test_a_view_taken_before_to_device_is_made_read_only(gpu_ranks_then_cpu):
    x = synk.data(X.copy())
    view = x.array
    x.to_device("replicate")
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 1.0


def test_resident_data_as_a_broadcast_input(gpu_ranks_then_cpu):
    x, w = synk.data(X), synk.data(np.arange(3.0))
    w.to_device("replicate")
    f = synk.function(lambda x, w: x @ w, bcast_inputs=["w"], reduce="gather")
    np.testing.assert_allclose(f(x, w), X @ np.arange(3.0))
    w.to_device("shard")
    with pytest.raises(ValueError, match="cannot be broadcast whole"):
        f(x, w)


def test_bad_local_batch_and_batch_on_shards_are_refused(gpu_ranks_then_cpu):
    ranks = gpu_ranks_then_cpu
    x = synk.data(X)
    f = synk.function(_sum, reduce="sum")
    with pytest.raises(ValueError, match="one entry per rank"):
        f(x, local_batch=[1] * (ranks + 1))
    with pytest.raises(ValueError, match="out of range"):
        f(x, local_batch=100)
    with pytest.raises(IndexError, match="positions must lie"):
        f(x, local_batch=np.array([0, 50]))
    with pytest.raises(ValueError, match="negative step"):
        f(x, local_batch=slice(None, None, -1))
    with pytest.raises(ValueError, match="no input .* is scattered"):
        synk.function(lambda: 1, reduce="sum")(local_batch=1)
    x.to_device("shard")
    with pytest.raises(ValueError, match="shard mode"):
        f(x, batch=slice(0, 4))
    with pytest.raises(ValueError, match="mode must be"):
        x.to_device("everywhere")
    assert np.allclose(f(x), X.sum(axis=0))  # the group stays usable


@pytest.mark.gpu
def test_a_training_loop_on_resident_data_moves_only_the_indices(monkeypatch):
    if REAL:
        pytest.skip("reads the simulator's transfer counters")
    use_devices(monkeypatch, 2)
    synk.fork(2, backend="gpu")
    rng = np.random.default_rng(2)
    x, y = synk.data(rng.standard_normal((1000, 8))), synk.data(rng.standard_normal(1000))
    w = synk.shared(np.zeros(8))
    x.to_device("replicate")
    y.to_device("replicate")

    def step(x, y, w, lr):
        xp = synk.xp(x)
        grad = x.T @ (x @ w - y)
        grad = synk.comm.allreduce(grad, "sum")
        w -= lr * grad / 1000
        return xp.mean((x @ w - y) ** 2)

    f = synk.function(step, inputs=["x", "y"], bcast_inputs=["lr"], reduce="mean")

    def counters(arg):
        return sim.transfer_counts()

    batches = [rng.permutation(1000)[:100] for _ in range(4)]
    f(x, y, w, 0.1, batch=batches[0])  # the first step copies the data to the devices
    for idx in batches[1:]:
        before = on_every_rank(counters)
        f(x, y, w, 0.1, batch=idx)
        after = on_every_rank(counters)
        moved = [(a["h2d"] - b["h2d"], a["d2h"] - b["d2h"]) for a, b in zip(after, before)]
        per_rank = [len(part) * 8 for part in np.array_split(idx, 2)]
        # h2d: only each rank's indices (once for x and y); d2h: each rank's loss (8 bytes:
        # a small output, combined on rank 0's host)
        assert moved == [(per_rank[0], 8), (per_rank[1], 8)], moved
    synk.close()
