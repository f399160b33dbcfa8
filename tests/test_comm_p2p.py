"""Point-to-point messages as MPI users know them: wildcard receives (``ANY_SOURCE``,
``ANY_TAG``) with a ``Status``, probes, messages to oneself and the non-blocking barrier, on
CPU ranks (3 and 4) and simulated GPUs (2 ranks on 2 devices, 4 ranks on 2)."""
import time

import numpy as np
import pytest
from conftest import PEER_LAYOUTS, layout_group

import synk

comm = synk.comm
LAYOUTS = PEER_LAYOUTS


@pytest.fixture(params=list(LAYOUTS))
def group(request, monkeypatch):
    with layout_group(monkeypatch, *LAYOUTS[request.param]) as n:
        yield n


def _run(fn, *inputs):
    """``fn(marker, *inputs)`` on every rank: each rank's result."""
    names = ["marker"] + [f"in{i}" for i in range(len(inputs))]
    return synk.function(fn, bcast_inputs=names, reduce=None, timeout=60)(np.zeros(1),
                                                                         *inputs)


def _host(v):
    return np.asarray(v.get() if hasattr(v, "get") else v)


def _wildcards(marker):
    """Every other rank sends rank 0 five messages, tags out of order; rank 0 takes them
    all with ANY_SOURCE and ANY_TAG."""
    xp = synk.xp(marker)
    r, n = comm.rank(), comm.size()
    tags = [5, 3, 9, 3, 7]
    if r:
        for i, tag in enumerate(tags):
            comm.send(xp.full((2, r), float(100 * r + i), dtype=xp.float32), 0, tag=tag)
        comm.barrier()
        return None
    comm.barrier()  # (every message is in, or on its way)
    got = []
    for _ in range((n - 1) * len(tags)):
        status = comm.Status()
        v = comm.recv(comm.ANY_SOURCE, comm.ANY_TAG, status=status)
        got.append((status.source, status.tag, status.shape, str(status.dtype), status.count,
                    int(_host(v).ravel()[0]), tuple(v.shape), synk.xp(v) is xp))
    return got


def test_any_source_any_tag_takes_every_message_once_in_the_order_each_rank_sent(group):
    n = group
    got = _run(_wildcards)[0]
    tags = [5, 3, 9, 3, 7]
    want = sorted((s, tags[i], (2, s), "float32", 2 * s, 100 * s + i, (2, s), True)
                  for s in range(1, n) for i in range(len(tags)))
    assert sorted(got) == want
    for s in range(1, n):  # from one rank: in the order sent, whatever the tags
        assert [g[5] for g in got if g[0] == s] == [100 * s + i for i in range(len(tags))]


def _tag_filter(marker):
    xp = synk.xp(marker)
    r, n = comm.rank(), comm.size()
    if r:
        comm.send(xp.full(1, 10 * r + 1), 0, tag=1)
        comm.send(xp.full(1, 10 * r + 2), 0, tag=2)
        return None
    out = []
    for tag in (2, 1):  # the tag-2 messages first, though each rank sent them second
        for _ in range(n - 1):
            status = comm.Status()
            v = comm.recv(tag=tag, status=status)  # (source: ANY_SOURCE, the default)
            out.append((tag, status.source, status.tag, int(_host(v)[0])))
    return out


def test_a_tag_with_any_source_takes_only_that_tag(group):
    n = group
    got = _run(_tag_filter)[0]
    assert sorted(got) == sorted((tag, s, tag, 10 * s + tag) for tag in (2, 1)
                                 for s in range(1, n))
    assert [g[0] for g in got] == [2] * (n - 1) + [1] * (n - 1)


def _probes(marker):
    xp = synk.xp(marker)
    r = comm.rank()
    out = {}
    if r == 0:
        out["iprobe before"] = comm.iprobe()  # nothing can have been sent yet
    comm.barrier()
    if r == 1:
        comm.send(xp.arange(12, dtype=xp.float32).reshape(3, 4), 0, tag=8)
        comm.send(xp.ones((200, 100)), 0, tag=9)  # 160 KB: by shared memory on CPU ranks
    if r == 0:
        status = comm.probe()
        out["probed"] = (status.source, status.tag, status.shape, str(status.dtype))
        v = comm.recv(status.source, status.tag)
        out["received"] = (tuple(v.shape), str(v.dtype), float(_host(v).sum()),
                           synk.xp(v) is xp)
        while (status := comm.iprobe(1, 9)) is None:
            time.sleep(1e-3)
        out["iprobed"] = (status.source, status.tag, status.shape, str(status.dtype),
                          status.count)
        again = comm.probe(1, 9)  # probing again finds the same message
        v = comm.recv(1, 9)
        out["again"] = (again.tag, float(_host(v).sum()), synk.xp(v) is xp)
        out["iprobe after"] = comm.iprobe(comm.ANY_SOURCE, 9)  # received: gone
    return out


def test_probe_then_recv_gets_the_probed_message(group):
    out = _run(_probes)[0]
    assert out["iprobe before"] is None and out["iprobe after"] is None
    assert out["probed"] == (1, 8, (3, 4), "float32")
    assert out["received"] == ((3, 4), "float32", 66.0, True)
    assert out["iprobed"] == (1, 9, (200, 100), "float64", 20000)
    assert out["again"] == (9, 20000.0, True)


def _to_self(marker):
    xp = synk.xp(marker)
    r = comm.rank()
    x = xp.arange(4.0) + r
    comm.send(x, r, tag=3)
    x[:] = -1  # the message was copied: this does not change it
    blocking = comm.recv(r, tag=3)
    pending = comm.irecv(r, tag=4)  # started before the send it takes
    y = xp.full(2, 7 * r)
    comm.isend(y, r, tag=4).wait()
    y[:] = -1
    later = pending.wait()
    comm.send(xp.full(3, r), r, tag=6)
    status = comm.Status()
    wild = comm.recv(comm.ANY_SOURCE, 6, status=status)  # nobody else sends tag 6
    return {"blocking": [float(v) for v in _host(blocking)],
            "non-blocking": [int(v) for v in _host(later)],
            "wildcard": (status.source, status.tag, [int(v) for v in _host(wild)]),
            "where x is": all(synk.xp(v) is xp for v in (blocking, later, wild))}


def test_send_to_oneself(group):
    for r, got in enumerate(_run(_to_self)):
        assert got == {"blocking": [0.0 + r, 1.0 + r, 2.0 + r, 3.0 + r],
                       "non-blocking": [7 * r, 7 * r], "wildcard": (r, 6, [r, r, r]),
                       "where x is": True}


def _from_self_unsent(marker):
    if comm.rank() == 1:
        comm.recv(1, tag=2)  # nobody can ever send it
    return comm.rank()


def _sum_of_ranks(marker):
    return int(comm.allreduce(np.array([comm.rank()]))[0])


def test_recv_from_oneself_with_nothing_sent_raises_and_the_group_goes_on(group):
    n = group
    with pytest.raises(ValueError, match="rank 1 waits for a message from itself, with tag 2"):
        _run(_from_self_unsent)
    assert _run(_sum_of_ranks) == [n * (n - 1) // 2] * n


def _barriers(marker):
    xp = synk.xp(marker)
    r, n = comm.rank(), comm.size()
    if r == 0:
        time.sleep(0.2)
    entered = time.time()
    first = comm.ibarrier()
    total = comm.iallreduce(xp.ones(3) * r)
    second = comm.ibarrier()
    comm.send(xp.full(1, r), (r + 1) % n, tag=1)  # the rank goes on meanwhile
    left = comm.recv((r - 1) % n, tag=1)
    results = (first.wait(), second.wait())
    return {"entered": entered, "done": time.time(), "results": results,
            "total": float(_host(total.wait())[0]), "left": int(_host(left)[0])}


def test_ibarrier(group):
    n = group
    got = _run(_barriers)
    entered_last = max(g["entered"] for g in got)
    for r, g in enumerate(got):
        assert g["results"] == (None, None)
        assert g["done"] >= entered_last  # no rank is through before every rank entered
        assert g["total"] == n * (n - 1) / 2 and g["left"] == (r - 1) % n


def _one_fails(marker):
    r = synk.comm.rank()
    if r == 1:
        time.sleep(0.2)
        raise RuntimeError("rank 1 fails")
    if r == 0:
        comm.recv()  # from any rank, any tag: none comes
    else:
        comm.probe(comm.ANY_SOURCE, 5)


def test_wildcard_waits_end_when_a_rank_fails(group):
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 fails"):
        _run(_one_fails)
    assert time.monotonic() - start < 30  # (the call's timeout is 60 s)


def _alone(marker):
    x = np.arange(3)
    comm.send(x, 0, tag=1)
    x[:] = 0
    status = comm.Status()
    got = comm.recv(status=status)  # ANY_SOURCE: only this rank can send
    try:
        comm.recv()
    except ValueError as err:
        said = str(err)
    return {"got": got.tolist(), "status": (status.source, status.tag, status.count),
            "iprobe": comm.iprobe(), "ibarrier": comm.ibarrier().wait(), "said": said}


def test_a_group_of_one_rank():
    synk.fork(1)
    try:
        out = _run(_alone)[0]
    finally:
        synk.close()
    assert out["got"] == [0, 1, 2] and out["status"] == (0, 1, 3)
    assert out["iprobe"] is None and out["ibarrier"] is None
    assert "from any rank, and it is the only one here, with any tag" in out["said"]


def _posted_order(marker):
    xp = synk.xp(marker)
    r = comm.rank()
    if r == 0:
        for i in range(6):
            comm.send(xp.full(2, i), 1, tag=3)
        return None
    if r != 1:
        return None
    handles = [comm.irecv(0, tag=3) for _ in range(6)]
    got = [None] * 6
    for i in (5, 2, 0, 4, 1, 3):  # waited out of order
        got[i] = int(_host(handles[i].wait())[0])
    return got


def test_receives_match_messages_in_the_order_they_were_posted(group):
    """MPI's rule: receives from one rank with one tag match its messages in the order the
    receives were posted, whatever order they are waited in (mpi4py's Irecv, torch's
    irecv)."""
    assert _run(_posted_order)[1] == [0, 1, 2, 3, 4, 5]


def _zero_d(marker):
    xp = synk.xp(marker)
    r, n = comm.rank(), comm.size()
    got = comm.sendrecv(xp.asarray(float(r)), (r + 1) % n, (r - 1) % n, tag=2)
    return tuple(got.shape), float(_host(got))


def test_a_0d_array_arrives_0d(group):
    """Found by the randomized harness: a 0-d device array sent through the host arrived
    as a 1-element array (numpy's ascontiguousarray makes 0-d arrays 1-d)."""
    for r, (shape, value) in enumerate(zip(*_run(_zero_d))):
        assert shape == () and value == float((r - 1) % group)
