"""Per-call profiling: the parts add up, the right parts grow, and off means no timing (that
no module of a call's hot path reads the clock is test_call_insides.py's)."""
import time

import numpy as np
import pytest

import synk
from synk import simulator as sim


def nap(x, seconds):
    time.sleep(seconds)
    return x.sum()


def test_master_parts_add_up_to_the_measured_total(ranks3):
    f = synk.function(nap, bcast_inputs=["seconds"], reduce="sum", profile=True)
    x = synk.data(np.ones(30))
    f(x, 0.0)  # ships the function: the first call's input transfer includes that
    f.profile.reset()
    calls, nap_s = 20, 0.005
    start = time.perf_counter()
    for _ in range(calls):
        assert f(x, nap_s) == 30
    measured = time.perf_counter() - start
    p = f.profile
    assert p.calls == calls
    parts = sum(p.total(0, part) for part in synk.Profile.PARTS)
    assert parts == pytest.approx(p.wall, rel=1e-9)
    assert 0 < p.wall <= measured  # the rest is the loop and call entry
    for rank in (0, 1, 2):  # (no upper bounds: a loaded machine may stretch any part)
        assert p.total(rank, "compute") >= calls * nap_s, rank  # fn sleeps that long
        assert p.total(rank, "compute") <= p.total(rank)


def test_large_outputs_show_collectives_on_every_rank(monkeypatch):
    monkeypatch.setenv("SYNK_INLINE_OUTPUT_BYTES", "1")
    monkeypatch.setenv("SYNK_PARALLEL_REDUCE_RANKS", "2")
    synk.fork(3)
    try:
        f = synk.function(lambda x: np.ones(50_000) * x.sum(), reduce="sum", profile=True)
        for _ in range(3):
            assert np.array_equal(f(np.ones(9)), np.full(50_000, 9.0))
        for rank in (0, 1, 2):
            assert f.profile.counts[(rank, "collectives")] == 3
            assert f.profile.total(rank, "collectives") > 0
            assert f.profile.total(rank, "output gathering") > 0
    finally:
        synk.close()


def test_index_batches_count_as_input_transfer(ranks2):
    f = synk.function(lambda x: x.sum(), reduce="sum", profile=True)
    x = synk.data(np.ones((4000, 64)))
    f(x)
    f.profile.reset()
    idx = np.arange(0, 4000, 2)
    for _ in range(5):
        f(x, batch=idx)
    assert f.profile.total(1, "input transfer") > 0


def test_summary_table(ranks2):
    f = synk.function(lambda x: x.sum(), reduce="sum", profile=True)
    assert "no calls recorded" in str(f.profile)
    for _ in range(4):
        f(np.ones(10))
    text = f.profile.summary()
    assert "4 calls" in text and "per call" in text
    for label in ("input transfer", "compute", "output gathering", "collectives", "idle"):
        assert label in text
    lines = [line.split()[0] for line in text.splitlines()[3:]]
    assert {"0", "1", "all"} <= set(lines)
    f.profile.reset()
    assert f.profile.calls == 0 and f.profile.total() == 0


def test_global_switch(monkeypatch):
    monkeypatch.setenv("SYNK_PROFILE", "1")
    assert synk.function(lambda x: x).profile is not None
    assert synk.function(lambda x: x, profile=False).profile is None
    monkeypatch.setenv("SYNK_PROFILE", "0")
    assert synk.function(lambda x: x).profile is None


@pytest.mark.gpu
def test_bytes_moved_per_rank_are_the_device_layers_and_the_simulators(gpus):
    from conftest import REAL, on_every_rank

    if REAL:
        pytest.skip("compares with the simulator's counters")

    def counters(arg):
        return sim.transfer_counts()

    x = synk.data(np.random.default_rng(0).standard_normal((6000, 8)))  # outputs large
    f = synk.function(lambda x, w: x @ w, bcast_inputs=["w"], reduce="gather", profile=True)
    w = np.ones(8)
    before = on_every_rank(counters)
    for batch in (None, slice(0, 4000, 2), np.arange(1800)):
        f(x, w, batch=batch, num_slices=2)
    after = on_every_rank(counters)
    for rank in range(gpus):
        want = {k: after[rank][k] - before[rank][k] for k in ("h2d", "d2h")}
        assert f.profile.transfers(rank) == {**want, "net": 0}  # one host: nothing sent
        assert want["h2d"] > 0
    # the gathered results, and 1 byte per piece of rows of the Data x (its write-back's
    # check: none for rows picked by an index, which are copies on CPU ranks too)
    checks = 2 + 2
    assert f.profile.transfers(0)["d2h"] == (6000 + 2000 + 1800) * 8 + checks
    assert all(f.profile.transfers(r)["d2h"] == checks for r in range(1, gpus))
    table = str(f.profile)
    assert "host->device" in table and "device->host" in table and "kB" in table
    assert parts_add_up(f.profile)


def parts_add_up(p) -> bool:
    return sum(p.total(0, part) for part in synk.Profile.PARTS) == pytest.approx(p.wall)


def test_cpu_profiles_show_no_bytes(ranks2):
    f = synk.function(lambda x: x.sum(), reduce="sum", profile=True)
    f(np.ones(10))
    assert f.profile.transfers() == {"h2d": 0, "d2h": 0, "net": 0}
    assert "host->device" not in str(f.profile) and "inputs to host" not in str(f.profile)
