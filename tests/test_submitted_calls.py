"""Calls that do not wait (``Function.submit``, ``Step.submit``): each future gives what the
blocking call would have given, in the order submitted, however many are outstanding and
whatever their outputs' sizes; a failure fails its call and every later one until it is
read; anything else the group does reads the outstanding calls first; a dead rank, Ctrl-C
and close() end them with the group's error and leave nothing behind. On 2 CPU ranks and 2
simulated GPUs (``two``) where the backend matters; checked against numpy."""
import concurrent.futures
import os
import signal
import threading
import time

import numpy as np
import pytest

import synk

pytestmark = pytest.mark.timeout(120)


def _scaled(x, s):
    return x * s


def test_many_outstanding_calls_give_their_own_results_in_order(two):
    x = np.arange(12.0).reshape(6, 2)
    small = synk.function(lambda x, s: (x * s).sum(), bcast_inputs=["s"], reduce="sum")
    futures = [small.submit(x, float(i)) for i in range(40)]  # (past the bound of 8)
    assert [f.result() for f in futures] == [x.sum() * i for i in range(40)]
    # outputs too large to ride a reply of a blocking call, and a Data written in between
    big = np.random.default_rng(0).standard_normal((50_000, 4))
    d = synk.data(big)
    gather = synk.function(_scaled, bcast_inputs=["s"], reduce="gather")
    futures = [gather.submit(d, float(i)) for i in range(5)]
    assert not futures[0].cancel()  # (sent already)
    for i, f in enumerate(futures):
        np.testing.assert_array_equal(f.result(), big * i)
    summed = synk.function(_scaled, bcast_inputs=["s"], reduce="sum")
    futures = [summed.submit(big[:1000], float(i)) for i in range(3)]  # (staged inputs)
    np.testing.assert_array_equal(futures[-1].result(),
                                  (big[:1000] * 2).reshape(2, 500, 4).sum(axis=0))


def test_a_bound_step_submitted_keeps_its_replicas_on_every_rank(two):
    w = synk.shared(np.zeros(3))

    def step(x, w):
        w[...] += x.sum(axis=0)  # each rank's replica, in place
        return w.copy()

    s = synk.function(step, bcast_inputs=["w"], reduce=None).bind(w=w)
    x = np.ones((4, 3))
    futures = [s.submit(x) for _ in range(10)]
    got = [f.result() for f in futures]
    for k, per_rank in enumerate(got, start=1):
        for replica in per_rank:
            np.testing.assert_array_equal(replica, np.full(3, 2.0 * k))


def _sent_late(i):  # rank 0 sends 400 KB (a shared-memory segment); rank 1 reads it late
    x = np.full(50_000, float(i))
    if synk.comm.rank() == 0:
        synk.comm.send(x, 1)
        return float(i)
    time.sleep(0.05)  # (rank 0's share is over: the master submits the next call)
    return float(synk.comm.recv(0)[-1])


def test_a_message_read_after_its_sender_moved_on_to_the_next_call_keeps_its_bytes(two):
    """The master's share of a submitted call begins while a worker still reads its
    messages of the call before: the segment of such a message stays the worker's until
    its share ends (it was freed at the next call's start, and that call's message
    overwrote it: the worker read the next call's values)."""
    f = synk.function(_sent_late, bcast_inputs=["i"], reduce=None)
    futures = [f.submit(i) for i in range(6)]
    assert [f.result() for f in futures] == [[float(i), float(i)] for i in range(6)]


def test_anything_else_the_group_does_reads_the_outstanding_calls_first(two):
    x = np.arange(8.0)
    f = synk.function(lambda x, s: x.sum() * s, bcast_inputs=["s"], reduce="sum")
    w = synk.shared(np.zeros(2))
    futures = [f.submit(x, 1.0), f.submit(x, 2.0)]
    assert f(x, 3.0) == 3 * x.sum()  # a blocking call
    assert all(fut.done() for fut in futures)
    futures = [f.submit(x, 1.0)]
    w.set_value(np.ones(2))  # a shared variable's value
    g = synk.function(lambda w: w.sum(), reduce="sum")  # shipped: another request
    assert futures[0].done() and g(w) == 4.0
    late = f.submit(x, 5.0)
    synk.close()  # the outstanding call ends as a blocking one would have
    assert late.result() == 5 * x.sum()


def _kill_a_worker() -> None:
    """SIGKILL to rank 1 (no public handle names a worker's process: ``PROCESS.group``)."""
    from synk._process import PROCESS

    os.kill(next(iter(PROCESS.group.processes.procs.values())).pid, signal.SIGKILL)


def _sleeps_on_rank_1(x):
    if synk.rank() == 1:
        time.sleep(0.3)  # (the calls submitted after it run there later)
    return 0.0


def test_a_data_changed_through_its_methods_is_read_by_the_outstanding_calls_as_it_was(two):
    """``set_value``, ``d[...] =``, ``resize`` and ``free`` of a Data that outstanding calls
    read wait for them first (rank 1 reads the Data after ``submit`` returned: it was still
    busy with an earlier call), so that each call gives the sum of the Data as it was when
    it was submitted."""
    base = np.arange(20.0).reshape(10, 2)
    slow = synk.function(_sleeps_on_rank_1, reduce="sum")
    total = synk.function(lambda x: x.sum(), reduce="sum")
    changes = [lambda d: d.set_value(-base), lambda d: d.__setitem__(slice(None), 0.0),
               lambda d: d.resize((4, 2)), lambda d: d.free()]
    for change in changes:
        d = synk.data(base)
        futures = [slow.submit(base), total.submit(d)]
        change(d)
        assert futures[1].result() == base.sum()
    d = synk.data(base)
    futures = [slow.submit(base), total.submit(d)]
    d.array[...] = 0.0  # (a write through the view is the caller's to order: not waited)
    futures[1].result()
    futures = [slow.submit(base), total.submit(d)]
    _kill_a_worker()  # (the calls fail with the group, unless they ended first; the change
    d.set_value(base)  # goes on all the same)
    np.testing.assert_array_equal(d.array, base)
    try:
        assert futures[1].result() == 0.0  # (the zeros of the Data when it was submitted)
    except synk.GroupBrokenError:
        pass


def _fails_at(x, i, bad):
    if i == bad and synk.rank() == 1:
        raise ValueError(f"call {i} failed on rank 1")
    return x.sum() + i


def test_a_failure_fails_its_call_and_every_later_one_until_it_is_read(two):
    x = np.ones(6)
    f = synk.function(_fails_at, bcast_inputs=["i", "bad"], reduce="sum")
    futures = [f.submit(x, i, 3) for i in range(7)]
    for i in range(3):
        assert futures[i].result() == 6.0 + 2 * i
    with pytest.raises(ValueError, match="call 3 failed on rank 1"):
        futures[3].result()
    for fut in futures[4:]:
        with pytest.raises(synk.EarlierCallFailedError) as err:
            fut.result()
        assert isinstance(err.value.__cause__, ValueError)
    assert f.submit(x, 0, 3).result() == 6.0  # read: calls submitted now count again
    # a failure not read yet: a later submit runs, and fails with EarlierCallFailedError
    failed = f.submit(x, 3, 3)
    assert f(x, 1, 3) == 8.0  # (a blocking call settles it, and runs)
    with pytest.raises(synk.EarlierCallFailedError):
        f.submit(x, 2, 3).result()
    assert isinstance(failed.exception(), ValueError)
    assert f.submit(x, 2, 3).result() == 10.0


def test_a_call_behind_a_failure_fails_so_even_when_the_group_broke_after_it_ran(ranks2):
    """The calls ran before a worker was killed, and their replies are read after: the one
    submitted behind the failure gives ``EarlierCallFailedError``, not the value it
    computed on what the failure left."""
    f = synk.function(_fails_at, bcast_inputs=["i", "bad"], reduce="sum")
    futures = [f.submit(np.ones(6), i, 1) for i in range(3)]
    time.sleep(0.5)  # (both ranks ran the three calls; their replies wait to be read)
    _kill_a_worker()
    time.sleep(0.5)  # (the master hears of the death before it reads them)
    outcomes = [fut.exception() or fut.result() for fut in futures]
    assert outcomes[0] == 6.0 or isinstance(outcomes[0], synk.GroupBrokenError), outcomes
    assert isinstance(outcomes[1], (ValueError, synk.GroupBrokenError)), outcomes
    assert isinstance(outcomes[2], (synk.EarlierCallFailedError, synk.GroupBrokenError)), \
        outcomes


def _counts(s, i, bad):
    """Rank 1 raises at call ``bad``; every other call adds 1 to each rank's replica."""
    if i == bad and synk.rank() == 1:
        raise ValueError(f"call {i} failed on rank 1")
    s += 1
    return float(s[0])


def test_calls_submitted_before_a_failure_was_read_fail_even_once_it_is(two):
    """Past the bound on outstanding calls the failure is read while later calls are
    submitted; reading the failed future afterwards lets only the calls submitted from then
    on count, never those already submitted (they ran on what the failure left)."""
    s = synk.shared(np.zeros(1))
    step = synk.function(_counts, bcast_inputs=["i", "bad"], reduce=None).bind(s)
    futures = [step.submit(i=i, bad=50) for i in range(100)]
    assert futures[49].result() == [50.0, 50.0]
    with pytest.raises(ValueError, match="call 50 failed"):
        futures[50].result()
    for fut in futures[51:]:
        with pytest.raises(synk.EarlierCallFailedError):
            fut.result()
    s.set_value(np.zeros(1))  # (the state they left: the caller's to restore)
    assert step.submit(i=0, bad=50).result() == [1.0, 1.0]


def test_reading_a_later_calls_error_lets_no_call_count_again(two):
    s = synk.shared(np.zeros(1))
    step = synk.function(_counts, bcast_inputs=["i", "bad"], reduce=None).bind(s)
    futures = [step.submit(i=i, bad=1) for i in range(5)]
    assert isinstance(futures[4].exception(), synk.EarlierCallFailedError)
    with pytest.raises(synk.EarlierCallFailedError):
        step.submit(i=5, bad=1).result()
    assert isinstance(futures[1].exception(), ValueError)  # the failed one, read
    s.set_value(np.zeros(1))
    assert step.submit(i=6, bad=1).result() == [1.0, 1.0]


def test_futures_complete_on_their_own(two):
    """``concurrent.futures.wait``, ``as_completed`` and done-callbacks work without anyone
    asking for a result (the group reads the replies as they arrive)."""
    f = synk.function(lambda x, i: x.sum() * i, bcast_inputs=["i"], reduce="sum")
    x = np.ones(6)
    futures = [f.submit(x, i) for i in range(12)]
    fired = []
    for fut in futures:
        fut.add_done_callback(fired.append)
    done, pending = concurrent.futures.wait(futures, timeout=30)
    assert not pending and len(done) == 12
    assert sorted(id(f) for f in fired) == sorted(id(f) for f in futures)
    later = [f.submit(x, i) for i in range(5)]
    got = [fut.result() for fut in concurrent.futures.as_completed(later, timeout=30)]
    assert sorted(got) == [6.0 * i for i in range(5)]
    failing = synk.function(_fails_at, bcast_inputs=["i", "bad"], reduce="sum")
    futures = [failing.submit(x, i, 1) for i in range(3)]
    concurrent.futures.wait(futures, timeout=30)
    assert all(fut.done() for fut in futures)
    assert isinstance(concurrent.futures.Future.exception(futures[1], 0), ValueError)


def _ends_after(x, seconds):
    if synk.rank() == 1:
        time.sleep(seconds)
    return x.sum()


@pytest.mark.parametrize("read", ["at once", "late"])
def test_a_submitted_calls_timeout_does_not_depend_on_when_it_is_read(ranks2, read):
    """A rank whose share ends past the call's deadline times it out, whether its reply is
    read while it runs or long after it came."""
    f = synk.function(_ends_after, bcast_inputs=["seconds"], reduce="sum")
    quick, slow = f.submit(np.ones(4), 0.0, timeout=1.0), f.submit(np.ones(4), 1.6,
                                                                  timeout=1.0)
    if read == "late":
        time.sleep(3.0)
    assert quick.result() == 4.0
    with pytest.raises(synk.CallTimeoutError) as err:
        slow.result()
    assert err.value.ranks == (1,)


def _stalls_on_rank_0(x):
    if synk.rank() == 0:
        for _ in range(200):
            time.sleep(0.05)
    return x.sum()


def test_submit_raises_only_its_arguments_errors(ranks2):
    """Rank 0's share timing out inside ``submit``, or a group that broke before it, fail
    the future; a bad argument raises from ``submit``."""
    f = synk.function(_stalls_on_rank_0, reduce="sum", timeout=1.0)
    fut = f.submit(np.ones(4))
    with pytest.raises(synk.CallTimeoutError):
        fut.result()
    with pytest.raises(synk.GroupBrokenError):
        f.submit(np.ones(4)).result()
    synk.fork(2)
    with pytest.raises(ValueError, match="num_slices"):
        f.submit(np.ones(4), num_slices=0)


def _dies(x, i):
    if i == 2 and synk.rank() == 1:
        os._exit(3)
    return x.sum()


def test_a_rank_that_dies_with_calls_outstanding_ends_each_with_the_groups_error(ranks2):
    f = synk.function(_dies, bcast_inputs=["i"], reduce="sum")
    futures = [f.submit(np.ones(4), i) for i in range(5)]
    assert futures[0].result() == 4.0 and futures[1].result() == 4.0
    with pytest.raises(synk.WorkerDiedError, match="exited with code 3"):
        futures[2].result()
    for fut in futures[3:]:
        with pytest.raises(synk.GroupBrokenError):
            fut.result()
    with pytest.raises(synk.GroupBrokenError):  # (its future's: submit raises no call's error)
        f.submit(np.ones(4), 0).result()


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here, as in a terminal (see test_faults)."""
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _slow_on_rank_1(x, seconds):
    if synk.rank() == 1:
        time.sleep(seconds)
    return x.sum()


def test_ctrl_c_while_waiting_for_a_submitted_call_stops_the_group(ranks2, ctrl_c_raises):
    f = synk.function(_slow_on_rank_1, bcast_inputs=["seconds"], reduce="sum")
    futures = [f.submit(np.ones(4), 30.0) for _ in range(3)]
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        futures[0].result()
    assert time.monotonic() - start < 10
    for fut in futures:  # (the interrupted one too: never left undone)
        with pytest.raises(synk.GroupBrokenError):
            fut.result()
    with pytest.raises(synk.GroupBrokenError):
        f(np.ones(4), 0.0)


def test_a_submitted_calls_timeout_counts_from_its_submit(ranks2):
    f = synk.function(_slow_on_rank_1, bcast_inputs=["seconds"], reduce="sum")
    fut = f.submit(np.ones(4), 30.0, timeout=1.0)
    with pytest.raises(synk.CallTimeoutError):
        fut.result()


@pytest.mark.parametrize("hosts", [(None, None, None), ("a", "a", "b")],
                         ids=["one host", "two hosts"])
def test_bound_steps_and_submitted_calls_under_mpiexec(tmp_path, hosts):
    """Under MPI on one host the calls go back to back as on local ranks; across hosts each
    submitted call runs to its end before ``submit`` returns (its large outputs are combined
    by MPI's collectives once the replies are in)."""
    import mpirun

    body = """
x = np.arange(3000.0).reshape(1000, 3)
d = synk.data(x)
w = synk.shared(np.ones(3))
f = synk.function(lambda x, w, s: (x * w * s), bcast_inputs=["w", "s"], reduce="gather")
step = f.bind(d, w)
futures = [step.submit(float(i)) for i in range(6)]
for i, fut in enumerate(futures):
    assert np.array_equal(fut.result(), x * i), i
w.set_value(np.full(3, 2.0))
assert np.array_equal(step(1.0), x * 2)

# the last rank slow: another rank's reply to the next call may arrive while the master
# waits for the last one's to this one; it is read for that call, not taken for this one's
def slow_last(s):
    if synk.rank() == synk.size() - 1:
        time.sleep(0.02)
    return np.full(2, s)


g = synk.function(slow_last, bcast_inputs=["s"], reduce="gather")
futures = []
for i in range(40):  # (each call's result read once the next is submitted)
    futures.append(g.submit(float(i)))
    if i:
        assert np.array_equal(futures[i - 1].result(), np.full(2 * n, i - 1.0)), i
assert np.array_equal(futures[-1].result(), np.full(2 * n, 39.0))


def raises_on_rank_1(s):  # (a call's error: its future's, not submit's, on any host)
    if synk.rank() == 1:
        raise KeyError("rank 1's")
    return s


fut = synk.function(raises_on_rank_1, bcast_inputs=["s"], reduce="sum").submit(1.0)
assert isinstance(fut.exception(), KeyError), fut.exception()
print("SUBMITTED OK", flush=True)
synk.close()
"""
    run = mpirun.run(tmp_path, body, hosts=hosts)
    assert run.rc == 0 and "SUBMITTED OK" in run.out, run


def _slow_workers(x, i):
    if synk.rank() != 0:
        time.sleep(0.3)
    return x.sum() * i


@pytest.mark.gpu
def test_submits_on_gpu_ranks_return_before_the_workers_shares_end(monkeypatch):
    """Rank 0's share launches its work and returns: the first submits of a call whose
    workers take 0.3 s return at once (up to the bound of outstanding calls); the results
    are combined when read; a timeout is raised by ``result()``, naming the late rank."""
    from conftest import use_devices

    use_devices(monkeypatch, 2)
    synk.fork(2, backend="gpu")
    try:
        f = synk.function(_slow_workers, bcast_inputs=["i"], reduce="sum")
        x = np.ones((8, 2))
        took = []
        futures = []
        for i in range(10):
            start = time.monotonic()
            futures.append(f.submit(x, float(i)))
            took.append(time.monotonic() - start)
        # Waiting for the workers would take seven shares, 2.1 s; the first submit also
        # ships the function, so the bound is three shares, far from both.
        assert sum(took[:7]) < 3 * 0.3, took
        assert [fut.result() for fut in futures] == [16.0 * i for i in range(10)]
        late = synk.function(_slow_workers, bcast_inputs=["i"], reduce="sum", timeout=0.5)
        futures = [late.submit(x, 1.0) for _ in range(3)]
        assert futures[0].result() == 16.0
        with pytest.raises(synk.CallTimeoutError) as err:
            futures[1].result()
        assert err.value.ranks == (1,)
    finally:
        synk.close()
