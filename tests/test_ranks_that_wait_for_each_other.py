"""Two ranks that wait for each other in a way neither can end (each receives before it
sends; one receives while the other waits in a collective the first calls only after its
receive; one refused its value of a collective the others wait in, and went on) raise
``ValueError`` within seconds rather than wait until the call's timeout; the
group goes on. Programs that only look alike (a peer that computes, or a thread of its own
that sends, before the message comes) are left to finish."""
import os
import threading
import time

import mpirun
import numpy as np
import pytest
from conftest import on_every_rank

import synk

pytestmark = pytest.mark.timeout(120)

# how long two ranks wait for each other before one raises, with room for a loaded machine
_WITHIN_S = 20.0


def _stuck(arg):
    (kind,) = arg
    comm = synk.comm
    r = comm.rank()
    peer = 1 - r if r < 2 else None
    if kind == "each receives first":
        if r < 2:
            comm.recv(peer, tag=3)
    elif kind == "each receives first, beside a daemon thread":  # (as a notebook's kernel
        done = threading.Event()  # runs)
        beside = threading.Thread(target=done.wait, daemon=True)
        beside.start()
        try:
            if r < 2:
                comm.recv(peer, tag=3)
        finally:
            done.set()
            beside.join()
    elif kind == "a rank skipped a collective, then receives":
        if r != 1:
            comm.allreduce(np.ones(4))
        if r < 2:
            comm.recv(peer)
    elif kind == "a large collective against a receive":
        if r != 1:
            comm.allreduce(np.ones(1 << 20))
        if r < 2:
            comm.recv(peer)
    elif kind == "a non-blocking collective waited for against a receive":
        if r == 1:
            comm.iallreduce(np.ones(3)).wait()
        else:
            if r == 0:
                comm.recv(1)
            else:
                comm.allreduce(np.ones(3))
    elif kind == "a non-blocking collective waited for late, against a receive":
        if r == 1:  # (its lane waits for rank 0 before this thread waits for the lane)
            handle = comm.iallreduce(np.ones(3))
            time.sleep(1.0)
            handle.wait()
        elif r == 0:
            comm.recv(1)
        else:
            comm.allreduce(np.ones(3))
    elif kind == "a sub-group's collective against the call's":
        group = comm.split(r % 2)
        if r != 0:
            comm.allreduce(1.0)
        group.allreduce(np.ones(3))
        comm.allreduce(2.0)
    elif kind == "a receive from any tag against a collective":
        if r != 1:
            comm.allreduce(np.ones(4))
        if r < 2:
            comm.recv(peer, comm.ANY_TAG)
    return "no error"  # (never: each kind waits for ever without its error)


KINDS = ["each receives first", "each receives first, beside a daemon thread",
         "a rank skipped a collective, then receives",
         "a large collective against a receive",
         "a non-blocking collective waited for against a receive",
         "a non-blocking collective waited for late, against a receive",
         "a sub-group's collective against the call's",
         "a receive from any tag against a collective"]


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_that_wait_for_each_other_raise(ranks3, kind):
    start = time.monotonic()
    with pytest.raises(ValueError, match="neither can go on"):
        on_every_rank(_stuck, kind, timeout=90)
    assert time.monotonic() - start < _WITHIN_S
    assert on_every_rank(lambda arg: synk.comm.allreduce(1), timeout=30) == [3, 3, 3]


def test_the_error_says_what_each_rank_waits_for(ranks2):
    with pytest.raises(ValueError) as raised:
        on_every_rank(_stuck, "a rank skipped a collective, then receives", timeout=90)
    said = str(raised.value)
    assert ("rank 0 waits in its collective #1 (allreduce) for rank 1, which waits for a "
            "message from rank 0 and has called 0 collective(s) of this call" in said
            or "rank 1 waits for a message from rank 0, which waits in its collective #1 "
            "(allreduce) for rank 1, which has called 0 collective(s)" in said), said
    with pytest.raises(ValueError, match="each receives before it sends"):
        on_every_rank(_stuck, "each receives first", timeout=90)


def _late(arg):
    """Correct programs whose ranks wait for each other longer than the check's wait."""
    (kind,) = arg
    comm = synk.comm
    r = comm.rank()
    if kind == "a peer computes before it sends":
        if r == 1:
            time.sleep(4)
            comm.send(np.ones(2), 0)
        if r == 0:
            comm.recv(1)
    elif kind == "a thread of the peer's sends":  # (rank 0 waits in the collective meanwhile)
        if r == 0:
            sender = threading.Thread(target=lambda: (time.sleep(4), comm.send(np.ones(2), 1)))
            sender.start()
            comm.allreduce(1.0)
            sender.join()
            return "done"
        comm.recv(0)
    elif kind == "a non-blocking receive waited for later":
        if r == 0:
            handle = comm.irecv(1)
            comm.allreduce(1.0)
            handle.wait()
            return "done"
        time.sleep(4)
        comm.send(np.ones(2), 0)
    comm.allreduce(1.0)
    return "done"


_LATE = ["a peer computes before it sends", "a thread of the peer's sends",
         "a non-blocking receive waited for later"]


@pytest.mark.parametrize("kind", _LATE)
def test_ranks_that_only_wait_long_finish(ranks2, kind):
    assert on_every_rank(_late, kind, timeout=60) == ["done", "done"]


def _refuses_then(arg):
    """Rank 1 refuses its value of a collective, catches the error and goes on to wait for
    something else of rank 0; the others wait in that collective for its part."""
    (then,) = arg
    comm = synk.comm
    r = comm.rank()
    pair = comm.split(0 if r < 2 else 1)  # (ranks 0 and 1; rank 2 alone)
    if r == 1:
        try:
            comm.iallreduce(np.array([1, "a"], dtype=object))
        except TypeError:
            pass
        if then == "a message":
            comm.recv(0)
        elif then == "a sub-group's collective":
            pair.allreduce(np.ones(3))
        elif then == "a thread's sub-group collective":
            beside = threading.Thread(target=lambda: pair.allreduce(np.ones(3)))
            beside.start()
            try:
                comm.recv(0)
            finally:
                beside.join()
        return "no error"
    got = comm.iallreduce(np.ones(3)).wait()
    if r == 0:  # (never reached: rank 1's part does not come)
        comm.send(got, 1)
        pair.allreduce(got)
    return "no error"


@pytest.mark.parametrize("then", ["a message", "a sub-group's collective",
                                  "a thread's sub-group collective"])
def test_a_rank_that_refused_its_value_and_went_on_is_named_at_once(ranks3, then):
    start = time.monotonic()
    with pytest.raises(ValueError, match="from rank 1, which refused its value of that "
                                         "collective"):
        on_every_rank(_refuses_then, then, timeout=90)
    assert time.monotonic() - start < _WITHIN_S
    assert on_every_rank(lambda arg: synk.comm.allreduce(1), timeout=30) == [3, 3, 3]


def _refuses_many_then_receives(arg):
    """Rank 1 refuses its value of 60 collectives in a row (more than its row names; of the
    call's, or of a sub-group's), catching each error, then waits for a message from rank 0,
    which comes late to the first of them and waits there for rank 1's part."""
    marker, where = arg
    comm = synk.comm
    xp = synk.xp(marker)  # (on GPU ranks, rank 0's part is a device array)
    group = comm if where == "the call's" else comm.split(0)
    try:
        if comm.rank() == 1:
            for _ in range(60):
                try:
                    group.allreduce(np.array([1, "a"], dtype=object))
                except TypeError:
                    pass
            comm.recv(0)
        else:
            time.sleep(0.3)
            group.allreduce(xp.ones(2))
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


@pytest.mark.parametrize("where, said", [
    ("the call's", "rank 0 waits in its collective #1 (allreduce) for rank 1, which has "
                   "called 60 collective(s) of this call, this one among them, without its "
                   "part of it reaching rank 0, and waits for a message from rank 0"),
    ("a sub-group's", "rank 0 waits for its part of a sub-group's collective from rank 1, "
                      "which waits for a message from rank 0")])
def test_a_rank_that_refused_many_collectives_in_a_row_and_went_on_is_named(
        two, where, said):
    """Not a wait until the call's timeout (for ever without one) once the refusals are
    more than the row names: the two ranks wait for each other, which ends as any such
    wait does."""
    start = time.monotonic()
    got = on_every_rank(_refuses_many_then_receives, np.zeros(1), where, timeout=60)
    assert time.monotonic() - start < _WITHIN_S
    assert got[0].startswith("ValueError: " + said), got
    assert got[1].startswith("ValueError: rank 1 waited for a message from rank 0"), got
    assert on_every_rank(lambda arg: synk.comm.allreduce(1), timeout=30) == [2, 2]


def _refuses_in_a_sub_group(arg):
    """Rank 2 refuses its value of a sub-group's collective (ranks 0 and 2), catches the
    error and goes on to the group's next one, which rank 0 never calls: it waits in the
    first for rank 2's part."""
    (kind,) = arg
    comm = synk.comm
    pair = comm.split(comm.rank() % 2)
    mine = np.full(4, float(comm.rank()))

    def run(value):
        if kind == "allreduce":
            return pair.allreduce(value)
        if kind == "allgather":
            return pair.allgather(value)
        if kind == "alltoall":
            return pair.alltoall(value)
        return pair.reduce_scatter(value)

    if comm.rank() == 2:
        try:
            run(np.array([1, "a", 2, 3], dtype=object))
        except TypeError:
            pass
        return repr(run(mine + 100))
    return repr(run(mine))


@pytest.mark.parametrize("kind", ["allreduce", "allgather", "alltoall", "reduce_scatter"])
def test_a_rank_that_refused_its_value_in_a_sub_group_and_went_on_is_named_at_once(
        ranks3, kind):
    """Never the refusing rank's next collective's data for the refused one's, nor a wait
    until the call's timeout: the sub-group's other rank raises ``ValueError`` naming it."""
    start = time.monotonic()
    with pytest.raises(ValueError, match="waits for its part of a sub-group's collective "
                                         "from rank 2, which refused its value of that "
                                         "collective"):
        on_every_rank(_refuses_in_a_sub_group, kind, timeout=90)
    assert time.monotonic() - start < _WITHIN_S
    assert on_every_rank(lambda arg: synk.comm.allreduce(1), timeout=30) == [3, 3, 3]


_ACROSS_HOSTS = """
from test_ranks_that_wait_for_each_other import KINDS, _stuck

for kind in KINDS:
    began = time.monotonic()
    try:
        synk.function(_stuck, bcast_inputs=["arg"], reduce=None, timeout=90)((kind,))
        print("OUTCOME", json.dumps([kind, 0.0, "no error"]), flush=True)
    except Exception as err:
        print("OUTCOME", json.dumps([kind, time.monotonic() - began,
                                     f"{type(err).__name__}: {err}"]), flush=True)
assert synk.function(lambda: synk.comm.allreduce(1), reduce=None)() == [3] * 3
print("USABLE", flush=True)
"""


def test_under_mpi_ranks_on_two_hosts_that_wait_for_each_other_raise(tmp_path):
    """The same programs under mpiexec, ranks 0 and 1 on two hosts (neither has the other's
    row to read): each asks the other where it is, and raises as on one host."""
    run = mpirun.run(tmp_path, _ACROSS_HOSTS, hosts=("a", "b", "b"), timeout=400,
                     env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))})
    assert run.rc == 0 and "USABLE" in run.out, run
    outcomes = run.printed("OUTCOME")
    assert [kind for kind, _, _ in outcomes] == KINDS, run
    for kind, seconds, error in outcomes:
        assert error.startswith("ValueError") and "neither can go on" in error, (kind, error)
        assert seconds < _WITHIN_S, (kind, seconds)


_LATE_ACROSS_HOSTS = """
from test_ranks_that_wait_for_each_other import _late

for kind in LATE:
    print("OUTCOME", json.dumps(synk.function(_late, bcast_inputs=["arg"], reduce=None,
                                              timeout=60)((kind,))), flush=True)
"""


def test_under_mpi_ranks_on_two_hosts_that_only_wait_long_finish(tmp_path):
    """Under mpiexec, where the ranks judge each other by asking, as well as on one host:
    a peer that computes, a thread of its own that sends, a receive waited for later."""
    run = mpirun.run(tmp_path, f"LATE = {_LATE!r}\n" + _LATE_ACROSS_HOSTS, hosts=("a", "b"),
                     timeout=200,
                     env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))})
    assert run.rc == 0, run
    outcomes = run.printed("OUTCOME")
    assert outcomes == [["done", "done"]] * len(_LATE), run


def _answer_goes_stale():
    """A correct program in which rank 1 waits for rank 0 when rank 0 asks where it is (in
    a receive from any rank, which rank 2's message ends), then computes for longer than
    the check's wait while rank 0 waits for it: what rank 1 said is no longer so."""
    comm = synk.comm
    r = comm.rank()
    if r == 0:
        comm.recv()
        comm.send(np.ones(2), 1)
        comm.recv(1)
    elif r == 1:
        comm.recv(0)
        time.sleep(5)
        comm.send(np.ones(2), 0)
    else:
        time.sleep(1.5)
        comm.send(np.ones(2), 0)
    return "done"


def test_a_peer_that_computes_after_it_waited_for_this_rank_is_left_to_finish(ranks3):
    assert on_every_rank(lambda arg: _answer_goes_stale(), timeout=60) == ["done"] * 3


_STALE_ACROSS_HOSTS = """
from test_ranks_that_wait_for_each_other import _answer_goes_stale

print("OUTCOME", json.dumps(synk.function(_answer_goes_stale, reduce=None, timeout=60)()),
      flush=True)
"""


def test_under_mpi_a_peers_answer_is_judged_only_until_it_is_asked_again(tmp_path):
    """Across hosts a rank judges a peer by its answers (``mpi_mesh._answered_row``): one
    given before the last ask is stale, and the peer, computing now, gives no other until
    it sends. Judged as fresh, rank 1's answer from its receive ("waits for rank 0") made
    rank 0 raise "neither can go on" in a correct program."""
    run = mpirun.run(tmp_path, _STALE_ACROSS_HOSTS, hosts=("a", "b", "b"), timeout=200,
                     env={"PYTHONPATH": os.path.dirname(os.path.abspath(__file__))})
    assert run.rc == 0, run
    assert run.printed("OUTCOME") == [["done", "done", "done"]], run
