"""synk.comm's reliability: every reducing collective refuses arrays that are not numbers
with the same TypeError (data movement still takes any fixed-size dtype), and a large
message that is never received leaves no shared-memory segment behind its call."""
import time

import numpy as np
import pytest
from conftest import synk_segments

import synk
from synk import comm

# docs/api/comm.md, "Transport (CPU)": from 128 KiB up (on 2 ranks; 64 KiB in larger groups), an
# array travels through shared memory
SHM_FROM = 128 * 1024

REFUSED = r"reductions take numbers \(bool, integers, floats, complex\)"
REDUCING = ["allreduce", "iallreduce", "reduce_scatter", "ireduce_scatter", "allreduce mean",
            "allreduce fused", "iallreduce fused"]
BIG = 1 << 20  # float64 elements: 8 MiB, through a shared-memory segment


@pytest.fixture(params=[2, 3], ids=["2ranks", "3ranks"])
def cpu_ranks(request):
    n = synk.fork(request.param, backend="cpu")
    yield n
    synk.close()


def run(fn, *arg, timeout=60):
    """fn(arg) on every rank, as a list in rank order."""
    return synk.function(fn, bcast_inputs=["arg"], reduce=None, timeout=timeout)(arg)


def reduce_with(how: str, x):
    """``x`` through the reducing collective ``how`` (one of REDUCING)."""
    if how == "allreduce":
        return comm.allreduce(x)
    if how == "iallreduce":
        return comm.iallreduce(x).wait()
    if how == "reduce_scatter":
        return comm.reduce_scatter(x)
    if how == "ireduce_scatter":
        return comm.ireduce_scatter(x).wait()
    if how == "allreduce mean":
        return comm.allreduce(x, "mean", weight=1)
    if how == "allreduce fused":
        return comm.allreduce({"w": np.ones(3), "x": [x]})["x"][0]
    assert how == "iallreduce fused"
    return comm.iallreduce((np.ones(3), x)).wait()[1]


def not_numbers(kind: str, rows: int) -> np.ndarray:
    """``rows`` rows of dtype kind ``kind``: strings, bytes, objects or records."""
    if kind == "U":
        return np.array(["ab"] * rows)
    if kind == "S":
        return np.array([b"ab"] * rows)
    if kind == "O":
        return np.array([1] * rows, dtype=object)  # numbers inside, but Python objects
    assert kind == "V"
    return np.zeros(rows, [("a", "<i4"), ("b", "<f8")])


def refuse(how: str, kind: str, rows: int):
    """Every rank reduces ``not_numbers(kind, rows)``: the call must raise TypeError."""
    with pytest.raises(TypeError, match=REFUSED) as err:
        run(lambda arg: reduce_with(arg[0], not_numbers(arg[1], arg[2])), how, kind, rows)
    assert str(not_numbers(kind, 1).dtype) in str(err.value)
    assert f"synk.comm.{how.split()[0]}:" in str(err.value)


def numbers_work(how: str, n: int) -> None:
    """The group still reduces numbers with ``how``, to the right answer."""
    got = run(lambda arg: reduce_with(arg[0], np.full(6, comm.rank() + 1.0)), how)
    want = n * (n + 1) / 2 / (n if how == "allreduce mean" else 1)
    assert all(np.all(g == want) for g in got), got


# -- bug 4: reductions of strings, bytes, objects, records ----------------------------------
@pytest.mark.parametrize("how", REDUCING)
def test_every_reduction_refuses_non_numbers_and_the_group_goes_on(cpu_ranks, how):
    for kind in "USOV":
        for rows in (6, SHM_FROM):  # small (inline), large (through shared memory)
            refuse(how, kind, rows)
            numbers_work(how, cpu_ranks)


@pytest.mark.parametrize("how", REDUCING)
def test_0d_arrays_and_python_scalars_follow_the_same_rule(cpu_ranks, how):
    for value in ["ab", b"ab", np.array("ab"), np.bytes_(b"ab"), None,
                  np.array(None, dtype=object), np.datetime64("2024-01-01")]:
        with pytest.raises(TypeError, match=REFUSED):
            run(lambda arg: reduce_with(arg[0], arg[1]), how, value)
    if "scatter" not in how:  # (reduce_scatter needs an axis 0)
        for value, want in [(2, 2 * cpu_ranks), (True, cpu_ranks), (1.5, 1.5 * cpu_ranks),
                            (np.float32(2), 2 * cpu_ranks), (1j, 1j * cpu_ranks)]:
            if how == "allreduce mean":
                want = value
            got = run(lambda arg: reduce_with(arg[0], arg[1]), how, value)
            assert all(g == want for g in got), (value, got)


def test_one_rank_passing_strings_fails_the_call_without_hanging(cpu_ranks):
    def fn(arg):
        x = np.ones(4) if comm.rank() else np.array(["a"] * 4)
        return comm.allreduce(x)

    with pytest.raises(TypeError, match=REFUSED):
        run(fn, timeout=30)
    numbers_work("allreduce", cpu_ranks)


def test_data_movement_still_takes_any_fixed_size_dtype(cpu_ranks):
    def fn(arg):
        r, n = comm.rank(), comm.size()
        x = not_numbers(arg[0], arg[1])
        got = [comm.broadcast(x if r == 0 else None), comm.allgather(x),
               comm.ibroadcast(x if r == 0 else None).wait(), comm.iallgather(x).wait()]
        comm.send(x, dest=(r + 1) % n)
        got.append(comm.recv(source=(r - 1) % n))
        return got

    for kind in "USV":
        for rows in (6, SHM_FROM):
            x = not_numbers(kind, rows)
            for bcast, gathered, ibcast, igathered, received in run(fn, kind, rows):
                assert np.array_equal(bcast, x) and np.array_equal(ibcast, x)
                assert np.array_equal(received, x) and received.dtype == x.dtype
                for joined in (gathered, igathered):
                    assert np.array_equal(joined, np.concatenate([x] * cpu_ranks))


# -- bug 5: large messages never received ----------------------------------------------------
def send_to_all(arg):
    """Rank 0 sends every other rank 8 MiB; what happens next is ``arg[0]``: they receive
    it ("received"), raise first ("receiver raises"), wait for something else until rank 0
    raises ("sender raises"), or return without receiving it ("ignored")."""
    r, case = comm.rank(), arg[0]
    if r == 0:
        for dest in range(1, comm.size()):
            comm.send(np.full(BIG, float(dest)), dest=dest)
        if case == "sender raises":
            raise RuntimeError("rank 0 fails after sending")
        return None
    if case == "receiver raises":
        raise RuntimeError("fails before receiving")
    if case == "sender raises":
        comm.recv(source=0, tag=9)  # never sent: CommAborted once rank 0 fails
    if case == "received":
        got = comm.recv(source=0)
        return bool(got.shape == (BIG,) and np.all(got == r))
    return None


@pytest.mark.parametrize("case", ["receiver raises", "sender raises", "ignored"])
def test_unreceived_large_sends_leave_no_segments(cpu_ranks, case):
    assert run(send_to_all, "received")[1:] == [True] * (cpu_ranks - 1)
    before = synk_segments()  # the group's, with each pair's message segment in its pool
    for _ in range(20):
        if case == "ignored":
            run(send_to_all, case)
        else:
            with pytest.raises(RuntimeError):
                run(send_to_all, case)
    # (a message's segment is freed once its receiver is done with the call: one may still
    # be in use when the next call's message to that rank is sent, which takes another)
    grown = synk_segments() - before
    assert len(grown) <= cpu_ranks - 1, f"{len(grown)} segment(s) left by 20 calls: {sorted(grown)}"
    assert run(send_to_all, "received")[1:] == [True] * (cpu_ranks - 1)
    assert len(synk_segments() - before) <= cpu_ranks - 1


def test_messages_of_a_later_call_are_not_affected(cpu_ranks):
    def later(arg):
        """Rank 0 sends rank 1 four large arrays; rank 1 takes the third first (past any
        stale message from a failed call), and the fourth is sent only after that."""
        r = comm.rank()
        if r == 0:
            for tag in (1, 2, 3):
                comm.send(np.full(BIG, float(tag)), dest=1, tag=tag)
            comm.recv(source=1, tag=8)
            comm.send(np.full(BIG, 4.0), dest=1, tag=4)
            return True
        if r == 1:
            time.sleep(0.2)  # (so that rank 0's first three are in before this reads any)
            got = {3: comm.recv(source=0, tag=3)}
            comm.send(np.zeros(1), dest=0, tag=8)
            got.update({tag: comm.recv(source=0, tag=tag) for tag in (1, 2, 4)})
            return all(np.all(a == tag) for tag, a in got.items())
        return True

    for _ in range(5):
        with pytest.raises(RuntimeError):
            run(send_to_all, "receiver raises")
        assert run(later) == [True] * cpu_ranks
    assert run(send_to_all, "received")[1:] == [True] * (cpu_ranks - 1)


def _dict_refused(arg):
    said = []
    for name, form in (("reduce", lambda v: comm.reduce(v, root=0)),
                       ("reduce", lambda v: comm.ireduce(v, root=1).wait()),
                       ("scan", comm.scan), ("exscan", comm.exscan),
                       ("reduce_scatter", comm.reduce_scatter)):
        try:
            form({"w": np.ones(4), "b": 2})
            said.append(f"{name}: no error")
        except TypeError as err:
            said.append(str(err))
    return said, comm.allreduce(1)  # (the group goes on)


def test_a_dict_to_a_collective_of_one_array_is_refused_on_every_rank(cpu_ranks):
    """``reduce``, the scans and ``reduce_scatter`` take one array: a dict (which
    ``allreduce`` takes whole) raises the same TypeError on every rank before anything
    travels, where the root waited for the others' refusal of an object array."""
    saids, afters = run(_dict_refused)
    assert afters == [cpu_ranks] * cpu_ranks
    for said in saids:
        assert [s.split(":")[0] for s in said] == [
            "synk.comm.reduce", "synk.comm.reduce", "synk.comm.scan", "synk.comm.exscan",
            "synk.comm.reduce_scatter"], said
        assert all("x is a dict, which is no array" in s for s in said), said
