"""A rank that the others wait for is named, with where every rank is and its Python stack:
once a call after ``SYNK_STUCK_REPORT`` seconds (a ``StuckRanksWarning``, nothing stopped),
and in a ``CallTimeoutError``'s message. On CPU ranks and simulated GPUs."""
import time
import warnings

import numpy as np
import pytest
from conftest import use_devices

import synk

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["cpu", "gpu"])
def reporting(request, monkeypatch):
    """3 ranks that report after 1 s."""
    monkeypatch.setenv("SYNK_STUCK_REPORT", "1")
    if request.param == "gpu":
        use_devices(monkeypatch, 3)
    synk.fork(3, backend=request.param)
    yield request.param
    synk.close()


def _one_rank_late(x):
    synk.comm.allreduce(np.ones(2), "sum")
    if synk.comm.rank() == 2:
        start = time.monotonic()
        while time.monotonic() - start < 3.0:  # the late rank's own work
            pass
    return synk.comm.allreduce(np.ones(2), "sum").sum()


def _reports(run) -> tuple:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = run()
    return result, [str(w.message) for w in seen if w.category is synk.StuckRanksWarning]


def test_the_rank_the_others_wait_for_is_named_with_where_each_is_and_its_stack(reporting):
    result, reports = _reports(lambda: synk.function(_one_rank_late, reduce=None)(
        np.ones((3, 1))))
    assert [float(r) for r in result] == [6.0, 6.0, 6.0]  # (nothing was stopped)
    assert len(reports) == 1, reports
    text = reports[0]
    assert "for rank(s) [2]; nothing was stopped" in text and "_one_rank_late" in text
    for r in (0, 1):
        assert f"rank {r}: in or past synk.comm.allreduce, the 2nd collective" in text
    assert "rank 2: in or past synk.comm.allreduce, the 1st collective" in text
    stack = text.split("rank 2's Python stack:", 1)[1]
    assert __file__ in stack and "in _one_rank_late" in stack, stack
    assert "rank 0's Python stack" not in text and "rank 1's Python stack" not in text


def _rank_1_sleeps(x):
    if synk.comm.rank() == 1:
        time.sleep(2.5)  # (one C call: its Python stack is dumped all the same)
    return synk.comm.allreduce(np.ones(1), "sum").sum()


def test_a_rank_inside_a_c_call_gets_its_python_stack(reporting):
    _, reports = _reports(lambda: synk.function(_rank_1_sleeps, reduce=None)(np.ones((3, 1))))
    assert len(reports) == 1, reports
    assert "rank 1: runs its function in call" in reports[0]
    stack = reports[0].split("rank 1's Python stack:", 1)[1]
    assert "in _rank_1_sleeps" in stack, stack


def _master_late(x):
    if synk.comm.rank() == 0:
        time.sleep(2.5)
    return synk.comm.allreduce(np.ones(1), "sum").sum()


def test_the_masters_own_share_is_named_too(reporting):
    _, reports = _reports(lambda: synk.function(_master_late, reduce=None)(np.ones((3, 1))))
    assert len(reports) == 1 and "for rank(s) [0]" in reports[0], reports
    assert "in _master_late" in reports[0].split("rank 0's Python stack:", 1)[1]


def _all_compute(x):
    time.sleep(2.5)
    return x.sum()


def test_ranks_that_all_compute_without_a_collective_are_not_reported(reporting):
    result, reports = _reports(lambda: synk.function(_all_compute, reduce="sum")(
        np.ones((3, 1))))
    assert float(result) == 3.0 and reports == []


def _sleeps_for_ever(x):
    if synk.comm.rank() == 1:
        time.sleep(1000)
    return synk.comm.allreduce(np.ones(1), "sum").sum()


def test_a_timeout_says_where_every_rank_was_and_gives_the_late_ranks_stack(monkeypatch):
    monkeypatch.setenv("SYNK_STUCK_REPORT", "0")  # (off: the timeout alone says it)
    synk.fork(3)
    try:
        with pytest.raises(synk.CallTimeoutError) as caught:
            synk.function(_sleeps_for_ever, reduce=None, timeout=2)(np.ones((3, 1)))
    finally:
        synk.close()
    text = str(caught.value)
    assert "Where every rank was:" in text
    assert "rank 0: its share of call" in text and "ended by an error or an interrupt" in text
    assert "rank 1: runs its function in call" in text
    assert "rank 2: in or past synk.comm.allreduce, the 1st collective" in text
    assert "in _sleeps_for_ever" in text.split("rank 1's Python stack:", 1)[1]
    assert "rank 2's Python stack" not in text  # (it waits for rank 1)


def test_zero_turns_the_report_off_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv("SYNK_STUCK_REPORT", "0")
    synk.fork(3)
    try:
        _, reports = _reports(lambda: synk.function(_rank_1_sleeps, reduce=None)(
            np.ones((3, 1))))
    finally:
        synk.close()
    assert reports == []
    monkeypatch.setenv("SYNK_STUCK_REPORT", "soon")
    with pytest.raises(ValueError, match="SYNK_STUCK_REPORT"):
        synk.fork(2)
    assert synk.size() == 1
