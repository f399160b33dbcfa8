"""Host-to-device copies from page-locked memory on GPU ranks: every shared-memory block a
rank copies from is page-locked once (a second cudaHostRegister would raise CUDA's error
712 under the simulator) and unlocked when the block is freed or retired (an unknown
pointer would raise 713); plain arrays of rank 0 and rows picked by index go through
page-locked staging buffers. Checked on every rank through the simulator's own records."""
import numpy as np
import pytest
from conftest import REAL, on_every_rank

import synk
from synk import simulator as sim

# No public handle: whether the simulator counts a range as page-locked (locked, or CuPy's
# pinned memory), the rank's staging buffers (through its communicator), the mappings of
# shared-memory blocks, and the device layer's record of refused page-locks: this file
# checks them on every rank.
from synk._testing import comm_context as _context, cuda_host, shm, sim_core as _core
from synk.simulator import cupy as _cupy

runtime = _cupy.cuda.runtime

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(REAL, reason="reads the CUDA simulator's records")]


def _bounds(n_rows: int, n_ranks: int) -> list:
    """Start of each rank's rows and the end, as numpy splits them (synk splits the same)."""
    sizes = [len(part) for part in np.array_split(np.arange(n_rows), n_ranks)]
    return [0, *(int(b) for b in np.cumsum(sizes))]


def _state(data, rows=None):
    """On a rank: whether ``rows`` of ``data`` (the rank's share) are page-locked and how
    many bytes of ``data``'s block are, what is page-locked, ranges locked that are neither
    in a live mapping nor a staging buffer, and the bytes copied so far (all of them, and
    from page-locked memory)."""
    device = _context.current.device
    staging = {slot.base for slot in device._staging._slots}
    block = None if data is None else data.array
    found = None if block is None else shm.mapping_of(block.ctypes.data, block.nbytes)
    mine = None if rows is None else block[rows[synk.comm.rank()]:rows[synk.comm.rank() + 1]]
    locked = sim.page_locked()
    inside = [(b, n) for b, n in locked.items()
              if found is not None and found[0] <= b < found[0] + found[1]]
    chunks = [] if mine is None else cuda_host._chunks(found, mine.ctypes.data, mine.nbytes)
    return {
        "block_pinned": mine is not None and all(
            _core.is_pinned(mine.ctypes.data + lo, hi - lo)
            for lo, hi in cuda_host.pinned_pieces(mine)),
        "chunks_of_mine": sum(n for _, n in chunks),
        "block_locked_bytes": sum(n for _, n in inside),
        "registered": locked,
        "stale": [b for b in locked if shm.mapping_of(b, 1) is None
                  and b not in staging],
        "problems": list(cuda_host.problems),
        "h2d": sim.transfer_counts()["h2d"],
        "pinned_h2d": sim.pinned_transfer_counts()["h2d"],
    }


def _states(data=None, rows=None):
    return on_every_rank(lambda arg: _state(*arg[0]), (data, rows))


def test_data_blocks_are_page_locked_once_and_unlocked_when_freed(gpus):
    x = synk.data(np.random.default_rng(0).standard_normal((4096, 8)))  # 256 KiB
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    before = _states()
    for _ in range(3):  # the same block every call: page-locked once (else error 712)
        assert np.allclose(f(x), x.array.sum(axis=0))
    bounds = _bounds(4096, gpus)
    after = _states(x, bounds)
    rows = np.diff(bounds) * 8 * 8
    for r in range(gpus):
        assert after[r]["block_pinned"] and not after[r]["problems"], after[r]
        # only the chunks of the block that hold the rank's share are locked (here, small,
        # the whole block: one chunk)
        assert after[r]["block_locked_bytes"] <= after[r]["chunks_of_mine"], after[r]
        copied = after[r]["pinned_h2d"] - before[r]["pinned_h2d"]
        assert copied >= 3 * rows[r]  # every call's rows came from page-locked memory
    x.free()
    f(synk.data(np.ones((6, 8))))  # the ranks hear of the freed block with this call
    freed = _states()
    for r in range(gpus):
        assert not freed[r]["problems"] and not freed[r]["stale"], freed[r]
        assert len(freed[r]["registered"]) <= len(after[r]["registered"])


def test_consecutive_batch_slices_lock_each_chunk_of_a_block_once(gpus):
    """Calls reading further into a 12 MiB Data (``batch=`` slices growing by 512 KiB): each
    rank locks each chunk its rows reach once, never again and never unlocked while the
    block lives: at most the block in all. (Growing one registration re-locked the union
    every call: a 4 MiB Data cost 66 MB of page-locking.)"""
    x = synk.data(np.random.default_rng(7).standard_normal((196608, 8)))  # 12 MiB
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    before = on_every_rank(lambda arg: sim.page_lock_counts(), None)
    for k in range(1, 25):
        batch = slice(0, k * 8192)
        assert np.allclose(f(x, batch=batch), x.array[batch].sum(axis=0))
    after = on_every_rank(lambda arg: sim.page_lock_counts(), None)
    states = _states(x, _bounds(196608, gpus))
    for r in range(gpus):
        locked = after[r]["bytes"] - before[r]["bytes"]
        assert 0 < locked <= x.nbytes + 2 * 4096, (before[r], after[r])
        assert after[r]["unregistered"] == before[r]["unregistered"]
        assert not states[r]["problems"]
    x.free()
    f(synk.data(np.ones((6, 8))))  # the ranks hear of the freed block with this call
    assert not any(s["stale"] for s in _states())


def test_a_locked_range_grows_when_a_call_reads_more_of_the_block(gpus):
    x = synk.data(np.random.default_rng(6).standard_normal((8192, 8)))  # 512 KiB
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    for batch in (slice(0, 2048), slice(1024, 6000), None):  # overlapping, then all rows
        want = x.array[batch if batch is not None else slice(None)].sum(axis=0)
        assert np.allclose(f(x, batch=batch), want)
        assert np.allclose(f(x, batch=batch, num_slices=3), want)
    bounds = _bounds(8192, gpus)
    after = _states(x, bounds)
    for r in range(gpus):  # no 712 (a second registration) nor 713 on the way
        assert after[r]["block_pinned"] and not after[r]["problems"], after[r]


def test_staging_blocks_are_page_locked_and_unlocked_when_regrown(gpus):
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    small = np.random.default_rng(1).standard_normal((2048, 8))  # 128 KiB: staged
    assert np.allclose(f(small), small.sum(axis=0))
    assert np.allclose(f(small * 2), small.sum(axis=0) * 2)  # the same staging block
    first = _states()
    big = np.random.default_rng(2).standard_normal((16384, 8))  # a larger block: regrown
    assert np.allclose(f(big), big.sum(axis=0))
    second = _states()
    for r in range(gpus):
        assert not first[r]["problems"] and not second[r]["problems"]
        assert not second[r]["stale"], second[r]  # the retired block is no longer locked
        assert second[r]["pinned_h2d"] - first[r]["pinned_h2d"] >= big.nbytes // gpus - 64


@pytest.mark.parametrize("num_slices", [1, 3])
def test_index_batches_and_strided_rows_go_through_page_locked_staging(gpus, num_slices):
    x = synk.data(np.random.default_rng(3).standard_normal((20000, 16)))  # pieces > 64 KiB
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    idx = np.random.default_rng(4).permutation(20000)[:12000]
    before = _states()
    assert np.allclose(f(x, batch=idx, num_slices=num_slices), x.array[idx].sum(axis=0))
    assert np.allclose(f(x, batch=slice(1, None, 3), num_slices=num_slices),
                       x.array[1::3].sum(axis=0))
    after = _states()
    for r in range(gpus):
        pinned = after[r]["pinned_h2d"] - before[r]["pinned_h2d"]
        total = after[r]["h2d"] - before[r]["h2d"]
        assert pinned >= 0.9 * total and total > 0, (pinned, total)
        assert not after[r]["problems"]


def test_a_one_rank_group_stages_plain_arrays_through_page_locked_buffers(monkeypatch):
    from conftest import use_devices

    use_devices(monkeypatch, 1)
    synk.fork(1, backend="gpu")
    x = np.random.default_rng(5).standard_normal((40000, 8))  # 2.4 MiB: copied in turns
    f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
    for _ in range(2):
        assert np.allclose(f(x), x.sum(axis=0))
    state = _states()[0]
    assert state["pinned_h2d"] >= 2 * x.nbytes and not state["problems"]
    synk.close()
    assert not sim.page_locked()  # everything unlocked when the group closed


def test_a_refused_page_lock_falls_back_to_pageable_copies_with_one_warning(gpus2):
    import warnings

    x = synk.data(np.arange(4096.0).reshape(512, 8))
    base, _ = shm.mapping_of(x.array.ctypes.data, x.nbytes)
    runtime.hostRegister(base, 4096, 0)  # someone else holds part of it: CUDA says 712
    cuda_host._warned.clear()
    try:
        f = synk.function(lambda x: x.sum(axis=0), reduce="sum")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                assert np.allclose(f(x), x.array.sum(axis=0))  # right, through pageable copies
        refused = [w for w in caught if "pageable" in str(w.message)]
        assert len(refused) == 1 and issubclass(refused[0].category, RuntimeWarning)
    finally:
        runtime.hostUnregister(base)
