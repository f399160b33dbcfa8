"""The wire beneath synk, reached directly: the shared-memory message ring (no message
lost, duplicated, reordered or torn, within a process as a model and across processes under
stress, with readers that sleep and writers that must wake them) and its waits; synk.comm
and calls over the rings, with the rings faked full or missing to take the sockets, and the
host's collectives forced down each of the ways they take by size; what the host's
collectives pack and what crosses the control channel; the control channel's authentication,
attacked as a stranger would (no key, a wrong key, a forged or oversized message) and its
messages' fields; the comm mesh's progress thread failing; and the segments in /dev/shm: the
sweep of what dead owners left, the watcher of a rank's segments.

It reaches synk's internals (``synk._testing``) because none of these has a public handle:
the rings, segments, keys, control channels and size limits are synk's own, and the calls
and collectives built on them are tested through the public API elsewhere (test_comm*.py,
test_security.py, test_nothing_left_after_failures.py)."""
import logging
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import numpy as np
import pytest
from conftest import leaves, on_every_rank, synk_segments
from hypothesis import given, settings, strategies as st
from test_comm_fused import assert_same_structure, tree_of
from test_faults import PROMPT, assert_usable, sums
from test_shared import set_per_rank

import synk
from synk import comm
from synk._testing import (
    SHM_FROM,
    HostCommunicator,
    LocalLaunch,
    Plan,
    ReplyReader,
    ShareTask,
    Waiter,
    auth,
    channel,
    comm_board,
    comm_collectives,
    comm_mesh,
    control_rings,
    fused_layouts,
    protocol as P,
    ring,
    running_group,
    shm,
    waiting,
    worker_channel,
    worker_command,
    worker_process,
)
from synk.errors import ShmSpaceError


# ================================================ the shared-memory message ring
# (the ring and its waits, stressed between processes on their own)
@pytest.fixture
def owner():
    o = shm.Owner()
    yield o
    o.release()


def payload(i: int, n: int) -> bytes:
    """Message ``i`` of ``n`` bytes: its content tells where it came from."""
    seed = i.to_bytes(8, "little")
    return (seed * (n // 8 + 1))[:n]


@pytest.mark.parametrize("checked", [False, True])
@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(0, 1100)), max_size=300))
def test_any_interleaving_of_puts_and_gets_keeps_order_and_content(checked, ops):
    o = shm.Owner()
    try:
        name = ring.create(o.prefix, "model", 2048)
        writer, reader = ring.attach(name, 0, 2048, checked), ring.attach(name, 1, 2048, checked)
        model, count = [], 0
        for is_put, n in ops:
            if is_put:
                n = min(n, writer.out.max_payload)
                data = payload(count, n)
                if writer.out.put([data[: n // 2], data[n // 2:]]):
                    model.append(data)
                    count += 1
                else:  # refused only when it cannot fit: after draining, it does
                    assert model
            else:
                got = reader.inbox.get()
                if model:
                    assert got == (ring.DATA, model.pop(0))
                else:
                    assert got is None and not reader.inbox.pending()
        while model:
            assert reader.inbox.get() == (ring.DATA, model.pop(0))
        assert reader.inbox.get() is None
        writer.close()
        reader.close()
    finally:
        o.release()


def test_a_record_larger_than_the_limit_never_fits_and_the_limit_always_does(owner):
    name = ring.create(owner.prefix, "limit", 4096)
    a, b = ring.attach(name, 0, 4096), ring.attach(name, 1, 4096)
    for offset in range(0, 4096, 24):  # every position of the ring, wrap records included
        assert a.out.put([b"x" * (offset % 100)])
        assert b.inbox.get()[1] == b"x" * (offset % 100)
        assert a.out.put([b"y" * a.out.max_payload])
        assert b.inbox.get()[1] == b"y" * a.out.max_payload
    a.close()
    b.close()


_PEER = textwrap.dedent("""
    import os, select, socket, sys, random, zlib
    from synk._testing import ring
    name, capacity, checked, count, fd = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", \\
        int(sys.argv[4]), int(sys.argv[5])
    sock = socket.socket(fileno=fd)
    r = ring.attach(name, 1, capacity, checked)
    rnd = random.Random(7)
    wakes = 0
    for i in range(count):
        n = rnd.choice([0, 1, 7, 8, 9, 63, 64, 200, r.out.max_payload])
        body = (i.to_bytes(8, "little") * (n // 8 + 1))[:n]
        while not r.out.put([body]):
            pass  # full: the reader frees room
        if r.out.reader_sleeping():
            sock.send(b"w")
            wakes += 1
    # then echo what comes back the other way, until an empty message
    while True:
        got = r.inbox.get()
        if got is None:
            continue
        if not got[1]:
            break
        while not r.out.put([got[1]]):
            pass
    print(wakes, flush=True)
    r.close()
""")


@pytest.mark.parametrize("checked", [False, True])
def test_stress_across_processes_with_sleeping_reader(owner, checked):
    """A writer process sends 20000 messages of awkward sizes as fast as it can into a small
    ring (full most of the time, wrapping constantly); the reader here checks each one and
    often goes to sleep on the socket, to be woken by the writer. Then messages go back and
    forth (every byte echoed)."""
    capacity, count = 4096, 20000
    name = ring.create(owner.prefix, "stress", capacity)
    ours, theirs = socket.socketpair()
    peer = subprocess.Popen(
        [sys.executable, "-c", _PEER, name, str(capacity), "1" if checked else "0", str(count),
         str(theirs.fileno())], pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, text=True)
    theirs.close()
    r = ring.attach(name, 0, capacity, checked)
    poller = select.poll()
    poller.register(ours.fileno(), select.POLLIN)
    sleeps = timeouts = 0
    try:
        for i in range(count):
            while True:
                got = r.inbox.get()
                if got is not None:
                    break
                if i % 7 == 0:  # sleep until woken (a lost wake-up shows as a timeout)
                    r.inbox.set_sleeping(True)
                    if not r.inbox.pending():
                        sleeps += 1
                        if not poller.poll(2000):
                            timeouts += 1
                        else:
                            ours.recv(4096)
                    r.inbox.set_sleeping(False)
            kind, data = got
            assert kind == ring.DATA
            assert len(data) in (0, 1, 7, 8, 9, 63, 64, 200, r.out.max_payload), i
            assert data == payload(i, len(data)), f"message {i} torn or out of order"
        assert r.inbox.get() is None
        for i in range(2000):  # round trips, checked by content
            body = zlib.crc32(i.to_bytes(4, "little")).to_bytes(4, "little") * (1 + i % 50)
            assert r.out.put([body])
            while (got := r.inbox.get()) is None:
                pass
            assert got == (ring.DATA, body)
        assert r.out.put([b""])
        out, _ = peer.communicate(timeout=30)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        r.close()
        ours.close()
    assert peer.returncode == 0
    assert sleeps > 0 and int(out.split()[-1]) > 0  # the wake-up path ran
    if ring.ORDERED:  # the fences make a lost wake-up impossible here
        assert timeouts == 0


def test_checked_lane_refuses_a_record_whose_stores_have_not_all_arrived(owner):
    """What a weakly ordered machine can show a reader: ``head`` moved but the record's
    bytes not yet there. A checked lane reads nothing until they are."""
    name = ring.create(owner.prefix, "torn", 4096)
    a, b = ring.attach(name, 0, 4096, True), ring.attach(name, 1, 4096, True)
    try:
        assert a.out.put([b"hello world!"])
        data = b.inbox._data
        start = 8 + 16
        saved = bytes(data[start:start + 12])
        data[start:start + 12] = b"\0" * 12  # as if the payload's stores were late
        assert b.inbox.get() is None and b.inbox.pending()
        data[start:start + 12] = saved  # they arrive
        assert b.inbox.get() == (ring.DATA, b"hello world!")
    finally:
        a.close()
        b.close()


def test_waiter_stops_polling_when_waits_end_after_the_budget():
    """A peer that answers later than the polling limit: polling is wasted, so after a few
    such waits the waiter sleeps at once, and probes again after a back-off."""
    w = Waiter(300e-6)
    for _ in range(10):
        assert w.poll(lambda: False) is False
    assert not w.polling
    assert w.poll(lambda: True) is False  # paused: the caller sleeps at once
    w.resume_at = 0.0
    assert w.poll(lambda: True) is True  # the probe finds the message while polling
    assert w.polling


def test_waiter_budget_follows_how_long_waits_take():
    """Waits that end asleep after 500 us stretch the budget to cover them (up to the
    limit); short waits shrink it back to the least."""
    w = Waiter(2e-3)
    assert w.budget == pytest.approx(200e-6)
    for _ in range(20):
        w.slept(500e-6)
    assert w.budget == pytest.approx(1e-3, rel=0.05)
    for _ in range(30):
        w.poll(lambda: True)
    assert w.budget == pytest.approx(200e-6)
    for _ in range(20):
        w.slept(0.1)  # far past the limit
    assert w.budget == pytest.approx(2e-3)


def test_waiter_stops_polling_when_it_loses_its_core(monkeypatch):
    """Looks far apart (another process ran on this core) pause polling."""
    clock = iter(range(0, 10**9, 1000))  # each look 1 ms after the one before
    monkeypatch.setattr(waiting, "_clock", lambda: next(clock) * 1e-6)
    w = Waiter(200e-6)
    calls = 0

    def ready():
        nonlocal calls
        calls += 1
        return calls % 3 == 0

    for _ in range(4):
        w.poll(ready)
    assert not w.polling


def test_polling_off_never_polls():
    w = Waiter(0.0)
    looks = []
    assert w.poll(lambda: looks.append(1)) is False and not looks


def test_ring_segments_are_named_under_the_group_prefix_and_swept(owner):
    name = ring.create(owner.prefix, "swept", 4096)
    assert name.startswith(owner.prefix) and os.path.exists(f"/dev/shm/{name}")
    owner.release()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_wake_up_costs_nothing_while_the_reader_polls(owner):
    name = ring.create(owner.prefix, "nowake", 4096)
    a, b = ring.attach(name, 0, 4096), ring.attach(name, 1, 4096)
    assert a.out.put([b"x"]) and not a.out.reader_sleeping()
    b.inbox.set_sleeping(True)
    assert a.out.put([b"y"]) and a.out.reader_sleeping()
    b.inbox.set_sleeping(False)
    assert b.inbox.get()[1] == b"x" and b.inbox.get()[1] == b"y"
    a.close()
    b.close()


# ================================================ synk.comm and calls over the rings
# (messages that take the ring, overflow to the socket when it
# is full, or go by reference through shared memory all arrive once, whole and in order;
# groups without rings (no room in /dev/shm, or a pair of ranks that has none, as ranks on
# other hosts will) work the same. The control rings are faked full or missing, and the
# sizes at which a message or an allreduce changes its way are synk's own.)
SIZES = [0, 1, 7, 100, 3000, 20000, SHM_FROM // 8 + 5]  # float64 counts: ring, ring, ..., shm


def message(i: int, seed: int) -> np.ndarray:
    n = SIZES[(i * 7 + seed) % len(SIZES)]
    return np.arange(n, dtype=np.float64) + i * 1000.0 + seed


def _flood(arg):
    """Every rank sends ``count`` messages to every other rank with one tag before reading
    any (the rings fill and the rest overflow to the sockets), then reads them all."""
    count = arg[0]
    me, n = comm.rank(), comm.size()
    handles = [comm.isend(message(i, me), peer, tag=5)
               for i in range(count) for peer in range(n) if peer != me]
    bad = []
    for peer in range(n):
        if peer == me:
            continue
        for i in range(count):
            got = comm.recv(peer, tag=5)
            if not np.array_equal(got, message(i, peer)):
                bad.append((peer, i, got.shape))
            got[...] = -1  # what arrives is the receiver's own, writable array
    for h in handles:
        h.wait()
    return bad


def test_many_messages_with_one_tag_arrive_in_order_whole_and_once(ranks3):
    for bad in on_every_rank(_flood, 300, timeout=60):
        assert bad == []


def test_small_collectives_many_times_against_numpy(ranks3):
    def fn(arg):
        r, out = comm.rank(), []
        rng = np.random.default_rng(r)
        for i in range(300):
            x = rng.random(i % 40 + 1)
            comm.barrier()
            out.append((comm.allreduce(x, "sum"), comm.allreduce(x, "max"),
                        comm.allgather(x[:1]), comm.broadcast(x if r == i % 3 else None,
                                                              root=i % 3)))
        return out

    results = on_every_rank(fn, timeout=60)
    rngs = [np.random.default_rng(r) for r in range(3)]
    for i in range(300):
        xs = [g.random(i % 40 + 1) for g in rngs]
        for r in range(3):
            total, top, firsts, root = results[r][i]
            np.testing.assert_allclose(total, xs[0] + xs[1] + xs[2], rtol=1e-12)
            assert np.array_equal(top, np.maximum(np.maximum(xs[0], xs[1]), xs[2]))
            assert np.array_equal(firsts, [x[0] for x in xs])
            assert np.array_equal(root, xs[i % 3])


def _calls_and_comm_work():
    def fn(x, y):
        return comm.allreduce(x.sum() * y, "sum") + np.zeros(2)

    f = synk.function(fn, bcast_inputs=["y"], reduce="gather")
    x = np.arange(12.0)
    for _ in range(20):
        out = f(x, 2.0)
        assert np.array_equal(out, np.full(2 * synk.size(), x.sum() * 2))
    assert on_every_rank(lambda arg: comm.rank()) == list(range(synk.size()))


def test_a_group_without_room_for_rings_uses_the_sockets(monkeypatch):
    def full(prefix, tag, capacity):
        raise ShmSpaceError("a synk message ring", capacity, 0)

    monkeypatch.setattr(ring, "create", full)
    synk.fork(3)
    try:
        assert control_rings() == {}
        _calls_and_comm_work()
        assert on_every_rank(_flood, 50, timeout=60) == [[], [], []]
    finally:
        synk.close()


def test_a_group_with_room_for_its_rings_but_not_its_board_keeps_the_rings(monkeypatch):
    """Where /dev/shm has no room for the board, the collectives take the rings' messages,
    with the same answers."""
    def full(prefix, size):
        raise ShmSpaceError("the synk.comm board", comm_board.segment_bytes(size), 0)

    monkeypatch.setattr(comm_board, "create", full)
    synk.fork(3)
    try:
        made = {name.split("-")[3] for name in synk_segments()}  # (synk-pid-group-what-...)
        assert "board" not in made and "ring" in made, made
        _calls_and_comm_work()
        assert on_every_rank(_flood, 50, timeout=60) == [[], [], []]
    finally:
        synk.close()


def test_pairs_without_a_ring_mix_with_pairs_that_have_one(monkeypatch):
    """As ranks on another host will: rank 2 has rings with nobody (sockets only)."""
    made = LocalLaunch._make_rings

    def some(self, group):
        control, mesh, board = made(self, group)  # (no rank has the board: not all on rings)
        control.pop(2, None)
        return control, {k: v for k, v in mesh.items() if 2 not in k}, board

    monkeypatch.setattr(LocalLaunch, "_make_rings", some)
    synk.fork(3)
    try:
        assert sorted(control_rings()) == [1]
        _calls_and_comm_work()
        assert on_every_rank(_flood, 50, timeout=60) == [[], [], []]
    finally:
        synk.close()


@pytest.mark.parametrize("spin_us", ["0", "50"])
def test_calls_and_messages_with_polling_off_or_short(monkeypatch, spin_us):
    """Readers that sleep at once must be woken by every message (a lost wake-up would
    show as a hang, cut by the timeout)."""
    monkeypatch.setenv("SYNK_SPIN_US", spin_us)
    synk.fork(3)
    try:
        _calls_and_comm_work()
        assert on_every_rank(_flood, 50, timeout=60) == [[], [], []]
    finally:
        synk.close()


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_both_allreduce_algorithms_agree_with_numpy_at_every_size(ranks3, op):
    """One round (whole arrays) and two rounds (reduce-scatter, allgather), forced by the
    size limit, at sizes that take the ring, the socket and shared memory."""
    def fn(arg):
        out = []
        for limit in (0, 1 << 62):
            comm_collectives.ONE_SHOT_BYTES = limit
            for n in (1, 5, 1000, SHM_FROM // 8 * 3 + 7):
                x = np.random.default_rng(comm.rank() * 7 + n).random(n)
                out.append(comm.allreduce(x, arg[0]))
        comm_collectives.ONE_SHOT_BYTES = 4 << 20
        return out

    results = on_every_rank(fn, op)
    numpy_op = {"sum": np.sum, "mean": np.mean, "max": np.max}[op]
    i = 0
    for _limit in (0, 1):
        for n in (1, 5, 1000, SHM_FROM // 8 * 3 + 7):
            want = numpy_op([np.random.default_rng(r * 7 + n).random(n) for r in range(3)], axis=0)
            for r in range(3):
                np.testing.assert_allclose(results[r][i], want, rtol=1e-12)
                assert np.array_equal(results[r][i], results[0][i])
            i += 1


# ================================================ the host's allreduce of structures, both ways
# (from test_comm_fused.py: the size past which allreduce leaves its one-round exchange has
# no public setting: the "per-buffer" cases lower it to take that path with small (and
# empty) chunks too)
@pytest.mark.parametrize("size_limit", [4 << 20, 0], ids=["one-round", "per-buffer"])
@pytest.mark.parametrize("op", ["sum", "max", "mean"])
def test_structures_reduce_like_numpy_leaf_by_leaf(ranks3, op, size_limit):
    def fn(arg):
        comm_collectives.ONE_SHOT_BYTES = arg[1]
        try:
            return comm.allreduce(tree_of(comm.rank()), arg[0])
        finally:
            comm_collectives.ONE_SHOT_BYTES = 4 << 20

    results = on_every_rank(fn, op, size_limit)
    numpy_op = {"sum": np.sum, "max": np.max, "mean": np.mean}[op]
    want = [numpy_op(np.stack([np.asarray(x) for x in xs]), axis=0)
            for xs in zip(*(leaves(tree_of(r)) for r in range(3)))]
    for got in results:
        assert_same_structure(got, tree_of(0))
        for g, w in zip(leaves(got), want):
            np.testing.assert_allclose(g, w, rtol=1e-6)
            assert np.asarray(g).shape == w.shape
        for g, w in zip(leaves(got), leaves(results[0])):
            assert np.array_equal(g, w), "every rank must get the same bits"
    # dtypes as numpy gives them (booleans sum to counts; means of ints are floats)
    if op == "sum":
        assert got["mask"].dtype == np.arange(1).dtype and got["mask"].tolist() == [2, 3]
    if op == "mean":
        assert got["counts"].dtype == np.float64


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "mean", "exact_mean", "bxor"])
def test_one_dtype_in_two_rounds_gives_one_rounds_bits(ranks3, op):
    """A structure of one dtype (one buffer) past the one-round limit: its reduce-scatter
    carries the heads, its reduced chunks go straight into the allgather's messages. The
    same bits on every rank as the one round's, and numpy's answer."""
    def tree(r):
        g = np.random.default_rng(r)
        if op == "bxor":
            return {"a": g.integers(0, 1 << 20, 100_001), "b": g.integers(0, 9, (7, 3))}
        return {"a": g.standard_normal(100_001).astype(np.float32) + 2,
                "b": g.standard_normal((7, 3)).astype(np.float32)}

    def fn(arg):
        weight = {"weight": comm.rank() + 1} if arg[0] in ("mean", "exact_mean") else {}
        got = []
        for limit in (4 << 20, 0):
            comm_collectives.ONE_SHOT_BYTES = limit
            try:
                got.append(comm.allreduce(tree(comm.rank()), arg[0], **weight))
            finally:
                comm_collectives.ONE_SHOT_BYTES = 4 << 20
        return got

    results = on_every_rank(fn, op)
    for key in ("a", "b"):
        parts = np.stack([tree(r)[key] for r in range(3)]).astype(np.float64)
        if op in ("mean", "exact_mean"):
            want = np.tensordot([1 / 6, 2 / 6, 3 / 6], parts, axes=1)
        elif op == "bxor":
            want = np.bitwise_xor.reduce(np.stack([tree(r)[key] for r in range(3)]))
        else:
            want = {"sum": np.sum, "prod": np.prod, "max": np.max, "min": np.min}[op](
                parts, axis=0)
        for one, two in results:
            assert two[key].dtype == one[key].dtype == tree(0)[key].dtype
            assert np.array_equal(two[key], one[key]), "two rounds: other bits than one"
            assert np.array_equal(two[key], results[0][1][key])
            np.testing.assert_allclose(two[key], want, rtol=1e-6, atol=1e-6)  # (float32)


@pytest.mark.parametrize("size_limit", [4 << 20, 0], ids=["one-round", "per-buffer"])
def test_weighted_mean_of_uneven_shares_equals_the_mean_over_all_rows(ranks3, size_limit):
    """What a training step needs: each rank's mean gradient over its rows, averaged with
    its row count as weight, is the gradient over all the rows (one process's answer)."""
    data = np.random.default_rng(0).random((10, 4))
    split = [0, 1, 7, 10]  # uneven: 1, 6 and 3 rows

    def fn(arg):
        comm_collectives.ONE_SHOT_BYTES = arg[0]
        try:
            r = comm.rank()
            rows = data[split[r]:split[r + 1]]
            grads = [rows.mean(axis=0), (rows ** 2).mean(axis=0).astype(np.float32)]
            return comm.allreduce(grads, "mean", weight=len(rows))
        finally:
            comm_collectives.ONE_SHOT_BYTES = 4 << 20

    for mean, squares in on_every_rank(fn, size_limit):
        np.testing.assert_allclose(mean, data.mean(axis=0), rtol=1e-12)
        np.testing.assert_allclose(squares, (data ** 2).mean(axis=0), rtol=1e-6)
        assert squares.dtype == np.float32


@pytest.mark.parametrize("size_limit", [4 << 20, 0], ids=["one-round", "per-buffer"])
def test_a_weighted_mean_of_megabytes_is_within_the_bound_of_float64_numpy(ranks3, size_limit):
    """3 MiB of float32 a rank: on three ranks that is past one array's one-round limit
    and within the fused one's (twice it); the limit 0 forces the per-buffer rounds. The
    mean is within the documented bound, (n + 2) * eps * sum_r |w_r / W * x_r|, of float64
    numpy's, with the same bits on every rank."""
    n = 3 << 18

    def parts(r):
        g = np.random.default_rng(r)
        return [g.standard_normal(n, dtype=np.float32), g.standard_normal(5, dtype=np.float32)]

    def fn(arg):
        comm_collectives.ONE_SHOT_BYTES = arg[0]
        try:
            return comm.allreduce(parts(comm.rank()), "mean", weight=comm.rank() + 1)
        finally:
            comm_collectives.ONE_SHOT_BYTES = 4 << 20

    results = on_every_rank(fn, size_limit)
    for i in range(2):
        terms = [(r + 1) / 6 * parts(r)[i].astype(np.float64) for r in range(3)]
        bound = 5 * np.finfo(np.float32).eps * np.sum(np.abs(terms), axis=0)
        for got in results:
            assert got[i].dtype == np.float32
            assert np.all(np.abs(got[i] - np.sum(terms, axis=0)) <= bound)
            assert np.array_equal(got[i], results[0][i])


def _into_swapped(arg):
    """``out=`` naming the inputs in another order: a sum reads its inputs while it writes
    (the result is written after), a mean only while it packs them (written straight in).
    ``limit``: the one-round exchange's, to take the per-buffer path too."""
    op, n, limit = arg
    comm_collectives.ONE_SHOT_BYTES = limit
    try:
        r = comm.rank()
        a = np.arange(n, dtype=np.float32) + r
        b = np.arange(n, dtype=np.float32) * (r + 2)
        c = np.ones(3) * r
        kept = (a.copy(), b.copy(), c.copy())
        got = comm.allreduce([a, b, c], op, out=[b, a, c])
        return [g is o for g, o in zip(got, (b, a, c))], [x.copy() for x in got], kept
    finally:
        comm_collectives.ONE_SHOT_BYTES = 4 << 20


@pytest.mark.parametrize("op", ["sum", "mean", "max"])
@pytest.mark.parametrize("limit", [4 << 20, 64])
def test_out_naming_the_inputs_in_another_order_gets_the_numpy_answer(ranks3, op, limit):
    results = on_every_rank(_into_swapped, op, 1000, limit, timeout=60)
    inputs = [kept for *_, kept in results]
    fold = {"sum": np.sum, "mean": np.mean, "max": np.max}[op]
    want = [fold([k[i] for k in inputs], axis=0) for i in range(3)]
    for same, got, _ in results:
        assert same == [True] * 3
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-6)


# ================================================ what the host's collectives pack
# (from test_shared.py: the host's allreduce, counted to see one buffer per dtype; from
# test_mean_in_dtype.py: the fused allreduce's cache of layouts, whose one rule this checks)
def test_many_variables_travel_as_one_buffer_per_dtype(ranks3, monkeypatch):
    a, b = synk.shared(np.zeros(3)), synk.shared(np.zeros((2, 2)))
    c = synk.shared(np.zeros(2, dtype=np.int64))
    for var in (a, b, c):
        set_per_rank(var, lambda r: r + 1)
    calls = []
    real = HostCommunicator.allreduce
    monkeypatch.setattr(HostCommunicator, "allreduce", lambda self, x, op, **kw: calls.append(
        x.size) or real(self, x, op, **kw))
    synk.shared_all_reduce([a, b, c], "sum")
    assert sorted(calls) == [2, 7]  # rank 0's view: one float64 buffer, one int64 buffer
    assert a.value.tolist() == [6.0] * 3 and b.get_value(2).tolist() == [[6.0] * 2] * 2
    assert c.get_value(1).tolist() == [6, 6] and c.dtype == np.int64


def _packed_twice(arg):
    grads = [np.ones((30, 4), np.float32), np.ones(7, np.float32), np.ones(3)]
    before = len(fused_layouts())
    first = synk.comm.allreduce(grads, "mean", weight=2.0)
    layouts = dict(fused_layouts())
    messages = {k: dict(v.messages) for k, v in layouts.items()}
    for _ in range(3):
        again = synk.comm.allreduce(grads, "mean", weight=2.0)
    after = fused_layouts()
    same = all(after[k] is layouts[k] and {m: id(b) for m, b in after[k].messages.items()}
               == {m: id(b) for m, b in messages[k].items()} for k in layouts)
    return len(after) - before, same, [float(g.sum()) for g in first], \
        [float(g.sum()) for g in again]


def test_a_structure_is_laid_out_once_and_its_message_reused(ranks2):
    for new, same, first, again in on_every_rank(_packed_twice):
        assert new <= 1 and same  # one layout for the structure, the same message each call
        assert first == again == [120.0, 7.0, 3.0]


# ================================================ what crosses the control channel
# (from test_synkhronos_parity.py: the size of the replies the master receives, to tell that
# shapes() moves only the shapes; from test_faults.py: a stray request on the group's
# control channel)
@pytest.fixture(params=["ranks2", "ranks3"])
def ranks(request):
    """A running group of 2, then of 3 ranks."""
    return request.getfixturevalue(request.param)


def test_shapes_move_only_the_shapes(ranks, monkeypatch):
    big = synk.shared(np.zeros(500_000))  # 4 MB on every rank
    big.shapes()  # installs it (that moves the value once)
    group = running_group()
    received = []
    real_recv = group.recv

    def recv(ranks_, during, deadline=None, rid=None):
        replies = real_recv(ranks_, during, deadline, rid)
        received.append(len(pickle.dumps(replies)))
        return replies

    monkeypatch.setattr(group, "recv", recv)
    assert big.shapes() == [(500_000,)] * ranks
    assert received and max(received) < 2_000, received
    received.clear()
    big.get_value(1)  # by contrast, a value comes back whole
    assert max(received) > 4_000_000


def test_replies_carry_the_id_of_their_request(ranks2):
    group = running_group()
    assert_usable()
    # A request whose reply nobody reads: the next call would read it as its own.
    group.send([1], P.request(P.SHARED, [], ()), "in a test", group.clock.next_round())
    with pytest.raises(synk.GroupBrokenError, match="wrong requests|out of step"):
        synk.function(sums, reduce="sum")(np.ones(4))
    synk.fork(2)
    assert_usable()


def test_a_body_read_after_its_header_is_the_message_whatever_its_first_bytes():
    """The master's end of a control socket, given a message's length header alone, then its
    body, whose first four bytes read as the length of the bytes after them: the body is the
    message, not taken for a message of its own with a header of its own."""
    master_end, worker_end = socket.socketpair()
    reader = channel.Channel(master_end)
    body = struct.pack("!i", 8) + b"12345678"
    try:
        worker_end.sendall(struct.pack("!i", len(body)))
        select.select([master_end], [], [], 10)
        assert reader.read() is None  # (the header, kept)
        worker_end.sendall(body)
        select.select([master_end], [], [], 10)
        assert reader.read() == body
    finally:
        master_end.close()
        worker_end.close()


# ================================================ the control channel against strangers
# (from test_security.py: a worker's control channel and key, which these tests forge and
# read as an attacker would, and the fields of the messages on it)
def test_control_channel_is_a_local_socket_without_address(ranks2):
    conn = worker_channel(1)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        assert sock.family == socket.AF_UNIX
        assert sock.getsockname() in ("", b"", None) and sock.getpeername() in ("", b"", None)
    finally:
        sock.close()


def test_the_key_is_not_on_the_command_line_or_in_the_environment(ranks2):
    proc = worker_process(1)
    key = running_group().key
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    with open(f"/proc/{proc.pid}/environ", "rb") as f:
        environ = f.read()
    for blob in (cmdline, environ):
        assert key not in blob and key.hex().encode() not in blob


class _Marker:
    """Unpickling this creates a file: the proof that a process unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _start_worker(key: bytes):
    ours, theirs = socket.socketpair()
    watch_r, watch_w = os.pipe()
    root = os.path.dirname(os.path.dirname(os.path.abspath(synk.__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.Popen(  # the command line synk starts its workers with
        worker_command(theirs.fileno(), watch_r, 0),
        pass_fds=(theirs.fileno(), watch_r), env=env, stderr=subprocess.PIPE,
    )
    theirs.close()
    os.close(watch_r)
    os.write(watch_w, key)
    from multiprocessing.connection import Connection

    return proc, Connection(ours.detach()), watch_w


def _finish(proc, conn, watch_w):
    try:
        code = proc.wait(timeout=30)
        err = proc.stderr.read().decode()
    finally:
        proc.stderr.close()
        conn.close()
        os.close(watch_w)
    return code, err


def test_worker_refuses_a_peer_that_skips_authentication(tmp_path):
    marker = tmp_path / "unpickled"
    proc, conn, watch_w = _start_worker(auth.new_key())
    conn.send_bytes(pickle.dumps(_Marker(str(marker))))  # straight to a pickle, no challenge
    code, err = _finish(proc, conn, watch_w)
    assert code == 2 and "refused its control channel" in err
    assert "authentication challenge" in err
    assert not marker.exists(), "the worker unpickled data from an unauthenticated peer"


def test_worker_refuses_a_peer_with_the_wrong_key(tmp_path):
    marker = tmp_path / "unpickled"
    proc, conn, watch_w = _start_worker(auth.new_key())
    with pytest.raises(auth.AuthenticationError, match="without this group's key"):
        auth.handshake(conn.send_bytes, conn.recv_bytes, auth.new_key(), first=True)
    try:
        conn.send_bytes(pickle.dumps(_Marker(str(marker))))
    except OSError:
        pass  # already gone
    code, err = _finish(proc, conn, watch_w)
    assert code == 2 and "rejected this process's key" in err
    assert not marker.exists()


def test_worker_accepts_the_right_key_then_serves():
    key = auth.new_key()
    proc, conn, watch_w = _start_worker(key)
    auth.handshake(conn.send_bytes, conn.recv_bytes, key, first=True)
    init = P.Init(rank=1, size=2, sys_path=list(sys.path), prefix=shm.session_prefix(),
                  inline_output_bytes=1 << 20, spin_s=0.0, peers={}, backend="cpu",
                  device_id=None)
    conn.send_bytes(P.RID.pack(0) + pickle.dumps((P.INIT, init)))
    reply = conn.recv_bytes()
    assert P.RID.unpack_from(reply) == (0,)
    assert pickle.loads(reply[P.RID.size:]) == (P.OK, proc.pid)
    conn.send_bytes(P.RID.pack(1) + pickle.dumps((P.EXIT,)))
    code, err = _finish(proc, conn, watch_w)
    assert code == 0, err


def test_master_refuses_a_worker_without_the_key(monkeypatch):
    monkeypatch.setattr(
        LocalLaunch, "_give_key",
        staticmethod(lambda key, fd: os.write(fd, auth.new_key())),
    )
    start = time.monotonic()
    with pytest.raises(synk.WorkerStartError, match="rank 1 failed authentication"):
        synk.fork(2)
    assert time.monotonic() - start < 30
    monkeypatch.undo()
    synk.fork(2)
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(3)) == 3
    synk.close()


def test_oversized_handshake_message_is_refused_unread():
    proc, conn, watch_w = _start_worker(auth.new_key())
    try:
        conn.send_bytes(b"#SYNK-CHALLENGE#" + b"x" * 10_000_000)
    except BrokenPipeError:
        pass  # it stopped reading after the length
    code, err = _finish(proc, conn, watch_w)
    assert code == 2 and "refused its control channel" in err


def test_a_call_request_carries_every_field_of_its_task():
    """A CALL carries a rank's ShareTask as a plain tuple (ShareTask.wire and from_wire are
    the one place its fields are packed in order), its call number as the request's id:
    each field must arrive as itself, or a worker would read one field as another."""
    task = ShareTask(fid=3, args=("a", 1.5), kwargs={"k": 2}, spos=(0,), skeys=("k",),
                     plan=Plan((1, 2), (0, 3, 6), 2, None, 6), call_id=9, profile=True)
    updates = (("block",), (), (7,))
    message = P.RID.pack(9) + P.call("a test", task.wire(), updates)
    tag, wire, got_updates, plan, keep = P.read(message)
    back = ShareTask.from_wire(wire, P.rid_of(message))
    assert tag == P.CALL and got_updates == updates and plan is None and keep is None
    for name in ShareTask.__slots__:
        assert getattr(back, name) == getattr(task, name), name
    assert type(back.plan) is Plan


def test_a_call_reply_carries_its_fields_in_their_order():
    """P.call_reply builds a CALL's answer by keyword, and the master unpacks it in
    CallReply's order: the two must agree."""
    import inspect

    params = [p.name for p in inspect.signature(P.call_reply).parameters.values()]
    assert params == list(P.CallReply._fields)
    fields = {name: i for i, name in enumerate(P.CallReply._fields)}
    tag, sent = P.read(P.reply(3, P.call_reply(**fields)))
    assert tag == P.OK and P.CallReply(*sent) == P.CallReply(**fields)


# ================================================ the comm mesh's progress thread
# (from test_faults.py: a failure injected into it)
def test_a_failed_progress_thread_ends_waits_instead_of_hanging(monkeypatch):
    import socket

    a, b = socket.socketpair()
    meshes = [comm_mesh.Mesh(0, 2, {1: a}), comm_mesh.Mesh(1, 2, {0: b})]
    try:
        real = comm_mesh.Mesh._deliver

        def deliver(self, source, *message):
            if self.rank == 0 and threading.current_thread().name == "synk-comm":
                raise RuntimeError("injected failure in the progress thread")
            real(self, source, *message)

        monkeypatch.setattr(comm_mesh.Mesh, "_deliver", deliver)
        meshes[0].begin(1)
        meshes[1].begin(1)
        meshes[1].wait_sent(meshes[1].post(0, (1, "x"), np.ones(3)))
        deadline = time.monotonic() + PROMPT
        while meshes[0]._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # the message reaches rank 0's progress thread, which fails
        start = time.monotonic()
        with pytest.raises(comm_mesh.CommError, match="progress thread failed: RuntimeError"):
            meshes[0].take(1, (1, "y"))
        assert time.monotonic() - start < PROMPT
    finally:
        for m in meshes:
            m.stop()


# ================================================ segments in /dev/shm
# (from test_security.py: the sweep of /dev/shm, judged in a private stand-in; from
# test_nothing_left_after_failures.py: the watcher of a rank's segments, run on a segment of
# its own)
def _no_such_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1000  # above every pid this machine can give


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A private stand-in for /dev/shm, which other synk programs on the machine do not
    sweep, for the sweep to judge."""
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    return tmp_path


def _make(folder, name: str) -> str:
    os.close(os.open(f"{folder}/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    return name


def test_sweep_judges_owners_by_their_lock_not_their_pid(shm_dir):
    """A master in another pid namespace (sharing /dev/shm, e.g. docker --ipc=host) has a
    pid that means nothing here: its segments survive while it holds its lock."""
    pid = _no_such_pid()
    live, dead, legacy = (f"synk-{pid}-{os.urandom(8).hex()}-" for _ in range(3))
    made = [_make(shm_dir, live + "lock"), _make(shm_dir, live + "d0-" + "a" * 16),
            _make(shm_dir, dead + "lock"), _make(shm_dir, dead + "d0-" + "b" * 16),
            _make(shm_dir, legacy + "d0-" + "c" * 16)]  # a version without locks: by pid
    holder = subprocess.Popen(  # the live owner, in some other process
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('locked', flush=True)\ntime.sleep(60)\n", f"{shm_dir}/{live}lock"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert sorted(shm.sweep_orphans()) == sorted(made[2:])
        assert sorted(os.listdir(shm_dir)) == sorted(made[:2])
        holder.kill()
        holder.wait()
        assert sorted(shm.sweep_orphans()) == sorted(made[:2])  # its owner is gone now
        assert os.listdir(shm_dir) == []
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_live_owner_in_this_process_is_kept(shm_dir):
    owner = shm.Owner()
    _make(shm_dir, owner.prefix + "d0-" + "a" * 16)
    assert shm.sweep_orphans() == []  # its lock is held, if from another descriptor
    owner.release()  # its blocks, then its lock file
    assert os.listdir(shm_dir) == []


def test_sweep_skips_what_it_may_not_remove(shm_dir, monkeypatch, caplog):
    pid = _no_such_pid()
    stale = _make(shm_dir, f"synk-{pid}-{os.urandom(8).hex()}-d0-" + "d" * 16)
    real_unlink = shm.unlink

    def unlink(name):
        if name == stale:
            raise PermissionError(1, "Operation not permitted", f"{shm_dir}/{name}")
        real_unlink(name)

    monkeypatch.setattr(shm, "unlink", unlink)
    caplog.set_level(logging.DEBUG, logger="synk")
    assert shm.sweep_orphans() == []  # another user's stale segment: no error
    assert shm.sweep_orphans() == []
    said = [r for r in caplog.records if stale in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG  # said once
    assert os.listdir(shm_dir) == [stale]


_WATCHED = """
import os, sys
from synk._testing import owner_watch, shm

shm.SHM_DIR = sys.argv[1]  # a private stand-in for /dev/shm
owner, other = shm.Owner(), shm.Owner()  # (other: the process's Data, say)
watcher = owner_watch.watch(owner.prefix)
for tag in ("mark", "m0123", "r3-out1-abcd"):  # what a rank on another host keeps there
    os.close(os.open(os.path.join(shm.SHM_DIR, owner.prefix + tag), os.O_CREAT | os.O_RDWR))
os.close(os.open(os.path.join(shm.SHM_DIR, other.prefix + "d0"), os.O_CREAT | os.O_RDWR))
print(watcher, flush=True)
sys.stdin.readline()
if sys.argv[2] == "release":
    owner.release()
    print("released", flush=True)
    sys.stdin.readline()
else:
    sys.stdin.read()  # until it is killed
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.parametrize("end", ["killed", "release"])
def test_a_watched_owner_leaves_nothing_however_its_process_ends(tmp_path, end):
    """The watcher of a rank (MPI): once the rank is killed (SIGKILL, no clean-up of its
    own) it removes the segments of the rank's owners, every lock file last, and exits;
    after a clean release it exits at once, removing nothing (the owner did; the process's
    other owner lives). It is detached (no one's child) and in a session of its own, out of
    the launcher's signals to the rank's process group."""
    import os
    import signal
    import time

    folder = tmp_path / "shm"
    folder.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _WATCHED, str(folder), end],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        watcher = int(proc.stdout.readline())
        assert os.getsid(watcher) != os.getsid(proc.pid)  # (a session of its own)
        with open(f"/proc/{watcher}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) != proc.pid  # no one's child
        assert len(os.listdir(folder)) == 6  # two locks and four segments
        proc.stdin.write("go\n")
        proc.stdin.flush()
        left: list = []
        if end == "killed":
            proc.kill()
        else:
            assert proc.stdout.readline().strip() == "released"
            left = sorted(os.listdir(folder))  # the other owner's block and lock
            assert [n.rsplit("-", 1)[1] for n in left] == ["d0", "lock"], left
        deadline = time.monotonic() + 10
        while not _gone(watcher) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _gone(watcher)
        assert sorted(os.listdir(folder)) == left
        if end == "release":
            proc.stdin.write("end\n")
            proc.stdin.flush()
        assert proc.wait(timeout=30) in (0, -signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def test_a_reply_read_ahead_of_its_request_is_kept_for_it():
    """While the master waits for the replies to one request (a submitted call's), a
    worker's socket may wake it with that worker's reply to the next request, sent
    meanwhile: the reply is kept for that request, not taken for this one's (which broke
    the group, "ranks answered the wrong requests", under load). Driven at the moment that
    matters, which a group of processes reaches only by chance."""
    reader = ReplyReader([1, 2])
    try:
        reader.write(1, P.reply(5, "rank 1's fifth"))
        later = [threading.Timer(0.1, reader.write, (1, P.reply(6, "rank 1's sixth"))),
                 threading.Timer(0.4, reader.write, (2, P.reply(5, "rank 2's fifth")))]
        for timer in later:
            timer.start()
        got = reader.recv([1, 2], 5, within_s=20)
        for timer in later:
            timer.join()
        assert got == {1: (P.OK, "rank 1's fifth"), 2: (P.OK, "rank 2's fifth")}
        reader.write(2, P.reply(6, "rank 2's sixth"))
        assert reader.recv([1, 2], 6, within_s=20) == {1: (P.OK, "rank 1's sixth"),
                                                      2: (P.OK, "rank 2's sixth")}
    finally:
        reader.close()
