"""Sub-groups of a call's ranks (``synk.comm.split``, ``new_group``), as MPI's
``Comm.Split`` and torch.distributed's ``new_group`` make them, on CPU ranks and simulated
GPUs, checked against numpy."""
import numpy as np
import pytest
from conftest import PEER_LAYOUTS, layout_group

import synk

LAYOUTS = PEER_LAYOUTS


@pytest.fixture(params=list(LAYOUTS))
def group(request, monkeypatch):
    with layout_group(monkeypatch, *LAYOUTS[request.param]) as n:
        yield n


def _host(v):
    return v if v is None or isinstance(v, (int, float)) else np.asarray(
        v.get() if hasattr(v, "get") else v)


def _in_groups(marker):
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    g = synk.comm.split(r % 2, key=-r)  # even and odd ranks, numbered from the highest
    out = {"rank": g.rank(), "size": g.size(),
           "allreduce": g.allreduce(xp.ones(3) * (r + 1))}
    pending = g.iallreduce(xp.full(2, r), "max")
    out["world, meanwhile"] = synk.comm.allreduce(xp.ones(1) * r)
    out["allgather"] = g.allgather(xp.full((1, 2), r))
    out["imax"] = pending.wait()
    out["broadcast"] = g.broadcast(xp.full(2, r) if g.rank() == 0 else None, root=0)
    out["reduce_scatter"] = g.reduce_scatter(xp.arange(4.0) * (r + 1))
    out["alltoall"] = g.alltoall([xp.full(1, 10 * r + p) for p in range(g.size())])
    out["objects"] = g.allgather_object(("r", r))
    if g.size() > 1:  # messages within the group, numbered in it
        if g.rank() == 0:
            g.send(xp.arange(3) + r, 1, tag=4)
        elif g.rank() == 1:
            out["recv"] = g.recv(0, tag=4)
    pair = synk.comm.new_group([n - 1, 0])
    out["new_group"] = None if pair is None else (pair.rank(), pair.allreduce(r + 1, "prod"))
    out["nested"] = g.split(0).allgather(xp.full(1, r))
    out["device"] = synk.xp(out["allreduce"]) is xp and synk.xp(out["alltoall"][0]) is xp
    return {k: [_host(p) for p in v] if isinstance(v, list) and k != "objects" else
            v if k in ("objects", "new_group") else _host(v) for k, v in out.items()}


def test_split_and_new_group_against_numpy(group):
    n = group
    for r, got in enumerate(synk.function(_in_groups, bcast_inputs=["marker"],
                                          reduce=None)(np.zeros(1))):
        mates = sorted((k for k in range(n) if k % 2 == r % 2), reverse=True)  # key=-rank
        assert (got["rank"], got["size"]) == (mates.index(r), len(mates))
        np.testing.assert_array_equal(got["allreduce"], np.ones(3) * sum(k + 1 for k in mates))
        np.testing.assert_array_equal(got["world, meanwhile"], [sum(range(n))])
        np.testing.assert_array_equal(got["allgather"], np.array([[k, k] for k in mates]))
        np.testing.assert_array_equal(got["imax"], np.full(2, max(mates)))
        np.testing.assert_array_equal(got["broadcast"], np.full(2, mates[0]))
        whole = sum(np.arange(4.0) * (k + 1) for k in mates)
        np.testing.assert_array_equal(got["reduce_scatter"], np.array_split(
            whole, len(mates))[mates.index(r)])
        np.testing.assert_array_equal(np.concatenate(got["alltoall"]),
                                      [10 * k + mates.index(r) for k in mates])
        assert got["objects"] == [("r", k) for k in mates]
        if len(mates) > 1 and mates.index(r) == 1:
            np.testing.assert_array_equal(got["recv"], np.arange(3) + mates[0])
        if r in (0, n - 1):
            assert got["new_group"] == ([n - 1, 0].index(r), n)  # (a number stays one)
            assert isinstance(got["new_group"][1], int)
        else:
            assert got["new_group"] is None
        np.testing.assert_array_equal(got["nested"], np.array(mates))
        assert got["device"]


def _concurrent(marker, rounds):
    """Disjoint groups run their own collectives, as many as they like, at the same time:
    one group's ranks never wait for the other's."""
    xp = synk.xp(marker)
    r = synk.comm.rank()
    g = synk.comm.split("low" if r < 2 else "high")
    total = 0.0
    for i in range(rounds if r < 2 else 1):  # the low group does many more
        total += float(g.allreduce(xp.full(1, float(i + r)))[0])
    handles = [g.iallreduce(xp.full(1, float(r)), "sum") for _ in range(50)]
    return total, [float(h.wait()[0]) for h in handles], float(
        synk.comm.allreduce(xp.ones(1))[0])


def test_disjoint_groups_run_concurrently(group):
    n = group
    if n < 3:
        pytest.skip("needs two groups of ranks")
    totals = synk.function(_concurrent, bcast_inputs=["marker", "rounds"], reduce=None,
                           timeout=60)(np.zeros(1), 200)
    for r, (total, pending, world) in enumerate(zip(*totals)):
        mates = [0, 1] if r < 2 else list(range(2, n))
        rounds = 200 if r < 2 else 1
        assert total == sum(sum(i + k for k in mates) for i in range(rounds))
        assert pending == [float(sum(mates))] * 50
        assert world == n


def _undefined(marker):
    r = synk.comm.rank()
    g = synk.comm.split(None if r == 0 else 1)
    return "none" if g is None else f"{g.rank()} of {g.size()}"


def test_a_rank_outside_every_group_gets_none(group):
    n = group
    got = synk.function(_undefined, bcast_inputs=["marker"], reduce=None)(np.zeros(1))
    assert got == ["none"] + [f"{r - 1} of {n - 1}" for r in range(1, n)]


def test_group_mismatches_raise_on_every_rank(ranks3):
    def lists(x):
        try:
            synk.comm.new_group([0, 1] if synk.comm.rank() else [0, 2])
        except ValueError as err:
            return str(err)
        return "no error"

    said = synk.function(lists, reduce=None, timeout=30)(np.zeros(3))
    assert all("different lists" in s for s in said), said

    def bad(x):
        synk.comm.new_group([0, 0])

    with pytest.raises(ValueError, match="distinct ranks"):
        synk.function(bad, reduce=None, timeout=30)(np.zeros(3))


_KEPT: list = []


def _keep(x):
    if synk.comm.rank() == 0:
        _KEPT.append(synk.comm.split(0))
    else:
        synk.comm.split(0)
    return x


def _use_kept(x):
    return _KEPT[0].rank() if synk.comm.rank() == 0 else 0


def test_a_group_kept_past_its_call_raises(ranks3):
    synk.function(_keep, reduce=None)(np.zeros(3))
    with pytest.raises(synk.SynkError, match="can only be called inside"):
        _KEPT[0].allreduce(np.ones(1))
    with pytest.raises(synk.SynkError, match="belongs to another call"):
        synk.function(_use_kept, reduce=None, timeout=30)(np.zeros(3))
    _KEPT.clear()


def _methods_of_a_group(x):
    g = synk.comm.split(0)
    listed = [name for name in dir(g) if not name.startswith("_")]
    try:
        g.allreduce_init(x)
    except AttributeError as err:
        refused = str(err)
    return listed, refused, g.allreduce.__doc__ == synk.comm.allreduce.__doc__


def test_a_group_has_synk_comm_functions_as_methods_and_names_them_for_a_missing_one(ranks3):
    out = synk.function(_methods_of_a_group, reduce=None)(np.zeros(3))
    listed, refused, documented = (each_rank[0] for each_rank in out)  # (rank 0's)
    public = {name for name in synk.comm.__all__
              if callable(getattr(synk.comm, name)) and name[0].islower()}
    assert set(listed) == public - {"allreduce_init"}, set(listed) ^ public
    assert "has no method 'allreduce_init'" in refused, refused
    listing = refused.split("(", 1)[1]
    assert "allreduce_init" not in listing and "alltoall" in listing and documented


def _wildcards_in_groups(marker):
    """A group's wildcard receive sees the group's messages only, its sources numbered in
    the group; the call's own message with the same tag waits for the call's receive."""
    xp = synk.xp(marker)
    r, n = synk.comm.rank(), synk.comm.size()
    g = synk.comm.split(r % 2)
    got = {}
    if r == 0 and n > 1:
        synk.comm.send(xp.full(1, -1), 1, tag=3)  # the call's, to rank 1
    if g.size() > 1 and g.rank() > 0:
        g.send(xp.full(1, r), 0, tag=3)
    if g.rank() == 0:
        status = synk.comm.Status()
        got["group"] = [(int(g.recv(status=status)[0]), status.source, status.tag)
                        for _ in range(g.size() - 1)]
        g.send(xp.ones(1), 0, tag=9)  # (and one to itself)
        got["own"] = float(g.recv(0, 9)[0])
    if r == 1:
        got["call"] = float(synk.comm.recv(synk.comm.ANY_SOURCE, 3)[0])
    synk.comm.ibarrier().wait()
    return got


def test_wildcard_receives_stay_in_their_group(group):
    n = group
    for r, got in enumerate(synk.function(_wildcards_in_groups, bcast_inputs=["marker"],
                                          reduce=None)(np.zeros(1))):
        mates = [k for k in range(n) if k % 2 == r % 2]
        if r == mates[0]:
            assert sorted(got["group"]) == [(k, i, 3) for i, k in enumerate(mates) if i]
            assert got["own"] == 1.0
        if r == 1:
            assert got["call"] == -1.0


def _two_threads(marker):
    import threading

    g = synk.comm.split(0 if synk.comm.rank() < 2 else 1)
    out: dict = {}

    def on_the_group():
        out["group"] = [float(g.allreduce(np.ones(1))[0]) for _ in range(200)]

    thread = threading.Thread(target=on_the_group)
    thread.start()
    out["call"] = [float(synk.comm.allreduce(np.ones(1))[0]) for _ in range(200)]
    thread.join()
    return out["call"], out["group"], g.size()


def test_a_thread_on_a_group_and_one_on_the_call_never_mix_their_messages(ranks3):
    """A group's method runs in the group for its thread alone: the function's thread,
    meanwhile, stays in the call's own collectives."""
    f = synk.function(_two_threads, bcast_inputs=["marker"], reduce=None, timeout=60)
    for call, group, size in zip(*f(0)):  # (each output: a list of every rank's)
        assert call == [3.0] * 200
        assert group == [float(size)] * 200
