"""The shared-memory message ring: no message lost, duplicated, reordered or torn, within a
process (every interleaving of puts and gets, as a model) and across processes under
stress, with readers that sleep and writers that must wake them."""
import os
import select
import socket
import subprocess
import sys
import textwrap
import zlib

import pytest
from hypothesis import given, settings, strategies as st

# No public handle: the shared-memory ring and its waits, stressed here between processes
# on their own (the calls and collectives that use them are tested through the API).
from synk import _testing
from synk._testing import Waiter, ring, shm


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
    monkeypatch.setattr(_testing.waiting, "_clock", lambda: next(clock) * 1e-6)
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
