"""Overlap on GPU ranks: with num_slices > 1 the rows of piece k + 1 are being copied (on the
copy stream) while piece k computes, and synk.comm's non-blocking forms on device arrays run
on NCCL's own stream, waited for on a CUDA event, while the rank's stream computes. The
simulator orders every stream by events: any missing ordering raises RaceError, so these
tests also show that none is missing (and one that is missing in user code is caught)."""
import time

import numpy as np
import pytest
from conftest import REAL

import synk
from synk.simulator import RaceError, queued

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(REAL, reason="reads the CUDA simulator's streams")]


def _queued_copies() -> int:
    """Copies launched on this rank's copy stream that have not run yet."""
    return queued("copy")


@pytest.mark.parametrize("num_slices", [2, 5])
def test_the_next_piece_is_copied_while_this_one_computes(gpus, num_slices):
    x = synk.data(np.random.default_rng(0).standard_normal((400, 16)))

    def piece(x):
        xp = synk.xp(x)
        total = x.sum(axis=0)  # (this piece's own copy has run: the kernel needed it)
        queued = _queued_copies()  # piece k + 1's rows, on their way meanwhile
        return total, xp.asarray([queued])

    got, queued = synk.function(piece, reduce=("sum", "gather"))(x, num_slices=num_slices)
    np.testing.assert_allclose(got, x.array.sum(axis=0))
    per_rank = np.split(queued, gpus)
    for rank_queued in per_rank:
        assert list(rank_queued[:-1]) == [1] * (num_slices - 1)  # every piece but the last
        assert rank_queued[-1] == 0  # nothing left to copy during the last


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_non_blocking_collectives_on_device_arrays_overlap_compute(gpus, op):
    def step(x):
        xp = synk.xp(x)
        grad = x.sum(axis=0)
        if synk.comm.rank() == 1:
            time.sleep(0.3)  # rank 0 goes on meanwhile: its broadcast cannot have finished
        root = synk.comm.ibroadcast(xp.arange(3.0) if synk.comm.rank() == 0 else None)
        launched = queued("nccl")  # (rank 0's: queued on NCCL's stream)
        handle = synk.comm.iallreduce(grad, op)
        other = (x ** 2).sum()  # the rank's stream computes meanwhile
        gathered = synk.comm.iallgather(x[:1] * (synk.comm.rank() + 1))
        scattered = synk.comm.ireduce_scatter(xp.arange(6.0) + synk.comm.rank(), "sum")
        return (handle.wait(), gathered.wait(), scattered.wait(), root.wait(),
                xp.asarray([launched]), other)

    x = np.random.default_rng(1).standard_normal((12, 4))
    out = synk.function(step, reduce=(None, None, None, None, "gather", "sum"))(x)
    reduced, gathered, scattered, rooted, launched, other = out
    parts = np.array_split(x, gpus)
    sums = np.stack([p.sum(axis=0) for p in parts])
    want = {"sum": sums.sum(0), "mean": sums.mean(0), "max": sums.max(0)}[op]
    whole = sum(np.arange(6.0) + r for r in range(gpus))
    bounds = np.cumsum([0] + [len(p) for p in np.array_split(np.arange(6), gpus)])
    for r in range(gpus):
        np.testing.assert_allclose(reduced[r], want)
        np.testing.assert_allclose(gathered[r], np.concatenate(
            [p[:1] * (k + 1) for k, p in enumerate(parts)]))
        np.testing.assert_allclose(scattered[r], whole[bounds[r]:bounds[r + 1]])
        np.testing.assert_allclose(rooted[r], np.arange(3.0))
    # ibroadcast returned on the root before the broadcast could finish (iallreduce first
    # checks the ranks' shapes, and a mean agrees on the weights, over the host, which
    # waits for every rank: its reduction may have finished when it returns)
    assert launched[0] == 1
    assert np.isclose(other, (x ** 2).sum())


def test_changing_an_array_being_reduced_is_caught(gpus2):
    def careless(x):
        grad = x.sum(axis=0)
        handle = synk.comm.iallreduce(grad, "sum")
        grad *= 2  # before wait(): on a GPU the reduction may read either value
        return handle.wait()

    with pytest.raises(RaceError, match="race"):
        synk.function(careless, reduce=None, timeout=60)(np.ones((4, 2)))
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones((4, 2))) == 8.0
