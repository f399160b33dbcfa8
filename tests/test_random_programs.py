"""Random programs of synk.comm collectives and of calls give numpy's answers, or the error
they must give, on CPU ranks, simulated GPUs and MPI (the harness: ``random_programs``).

Hypothesis draws each program (collectives blocking and not, up to hundreds in flight,
waited in each rank's own order; arrays, fused lists and dicts of mixed dtypes, Python
numbers; ``out=``, aliased too; every op, weighted means with weights of any size; sizes
around every algorithm's limits; sub-groups, some run by a thread of their own; one rank
that passes another op, dtype, shape, structure, root or weighting), runs it on every
rank in one call, and checks each rank's results against ``random_programs``' numpy model,
and each disagreement for an error of the call. A failure is shrunk to a short program;
the ones found are kept below as plain tests.

A short run takes part in every test run. ``--hypothesis-profile=soak`` runs for
``SYNK_SOAK_MINUTES`` (default 30) in all, shared by the tests of this file:

    SYNK_SOAK_MINUTES=60 pytest tests/test_random_programs.py --hypothesis-profile=soak
"""
from __future__ import annotations

import os
import time

import mpirun
import numpy as np
import pytest
from conftest import use_devices
from hypothesis import HealthCheck, given, note, settings, strategies as st
from hypothesis.control import currently_in_test_context
from random_programs import (
    Disagrees,
    check,
    disagreeing_programs,
    expected_error,
    programs,
    run_program,
)

import synk
from synk.errors import CallTimeoutError, GroupBrokenError, WorkerDiedError

_SOAKING = os.environ.get("SYNK_SOAK_MINUTES") is not None or "soak" in os.environ.get(
    "PYTEST_ADDOPTS", "")
_TESTS = 9  # the tests below that share a soak's minutes
_SOAK_S = float(os.environ.get("SYNK_SOAK_MINUTES", "30")) * 60 / _TESTS
_TIMEOUT = int(_SOAK_S + 600) if _SOAKING else 600
_EXAMPLES = 12  # programs per test in a short run
_CALL_TIMEOUT = 45.0  # a program's call: a hang is a failure, not a wait for ever


def _soak(request) -> bool:
    return request.config.getoption("hypothesis_profile", None) == "soak"


def _run_for(request, check_one, strategy=None) -> int:
    """``check_one(example)`` of Hypothesis's examples of ``strategy`` (default: its
    ``data()``, to draw from) once, or, soaking, again and again until this test's share
    of ``SYNK_SOAK_MINUTES`` is spent; how many examples ran."""
    runs = [0]
    soak = _soak(request)

    @settings(max_examples=settings.default.max_examples if soak else _EXAMPLES,
              deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data() if strategy is None else strategy)
    def test(example):
        runs[0] += 1
        check_one(example)

    stop = time.monotonic() + _SOAK_S
    while True:
        test()
        if not soak or time.monotonic() > stop:
            break
    print(f"{request.node.name}: {runs[0]} examples")
    return runs[0]


class Ranks:
    """A group of ``n`` ranks (CPU, or simulated GPUs), started again after a call that
    broke it (a hang stops the group: that example fails, the next ones go on)."""

    def __init__(self, n: int, backend: str = "cpu") -> None:
        self.n, self.backend = n, backend
        self.f = None

    def call(self, program: dict):
        if self.f is None:
            synk.close()
            synk.fork(self.n, backend=self.backend)
            self.f = synk.function(run_program, bcast_inputs=["program", "marker"],
                                   reduce=None, timeout=_CALL_TIMEOUT)
        try:
            return self.f(program, np.zeros(1))
        except (CallTimeoutError, GroupBrokenError, WorkerDiedError):
            self.f = None  # (the group was stopped)
            raise


def called(ranks: Ranks, program: dict):
    """Each rank's results of ``program`` (noted for Hypothesis's report); a call that timed
    out fails as a hang."""
    if currently_in_test_context():  # (a kept counterexample runs outside Hypothesis)
        note(repr(program))
    try:
        return ranks.call(program)
    except CallTimeoutError:
        raise AssertionError("the call hung (a rank waited for ever)") from None


def one_program(ranks: Ranks, program: dict, exact: bool = True) -> None:
    """Run ``program`` and check it: numpy's answers, or the call raises what it must."""
    want_error = expected_error(program)
    try:
        results = called(ranks, program)
    except AssertionError:
        raise
    except Exception as err:
        if want_error is None:
            raise
        assert isinstance(err, want_error.errors), (
            f"the call raised {type(err).__name__} where {want_error} should raise one of "
            f"{[e.__name__ for e in want_error.errors]}: {err}")
        return
    assert want_error is None or want_error.may_return, (
        f"the call returned numbers where it must raise: {want_error}")
    check(program, results, exact)


@pytest.mark.timeout(_TIMEOUT)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_random_programs_on_cpu_ranks(request, n):
    ranks = Ranks(n)
    try:
        _run_for(request, lambda data: one_program(ranks, data.draw(programs(
            n, allow_big=n <= 3))))
    finally:
        synk.close()


def every_rank_raises(ranks: Ranks, program: dict) -> None:
    """Run a ``disagreeing_programs`` program: each rank must raise one of the errors its
    disagreement may give."""
    want = expected_error(program)
    said = [r.get("raised") for r in called(ranks, program)]
    names = {e.__name__ for e in want.errors}
    d = program["disagree"]
    if d["field"] == "skip":  # (the ranks that wait for the one that skips raise; those
        # that do not wait for it, a reduce's other senders, a scan's earlier ranks, may not)
        said[d["rank"]] = None
        raised = [s for s in said if s is not None]
        assert raised and all(s[0] in names for s in raised), (
            f"{want}: the ranks that wait for it must raise {sorted(names)}; the ranks: "
            f"{said}")
        return
    assert all(s is not None and s[0] in names for s in said), (
        f"{want}: each rank must raise {sorted(names)}; the ranks: {said}")


@pytest.mark.timeout(_TIMEOUT)
@pytest.mark.parametrize("n", [2, 3])
def test_a_disagreement_raises_on_every_rank(request, n):
    """Not only on the rank that sees it: a rank whose part of a collective looks right
    (its chunk of a reduce-scatter or of a two-round allreduce) raises too, rather than
    computing on or waiting for a rank that left."""
    ranks = Ranks(n)
    try:
        _run_for(request, lambda data: every_rank_raises(ranks, data.draw(
            disagreeing_programs(n, allow_big=True))))
    finally:
        synk.close()


@pytest.mark.gpu
@pytest.mark.timeout(_TIMEOUT)
def test_random_programs_on_simulated_gpus(request, monkeypatch):
    """Device arrays: NCCL's reductions (the simulator's) and the host's, as a GPU rank
    takes them; float sums within a few ulps (NCCL's order of the terms is its own). A rank
    that skips a collective is named once its function returns, also where its next
    collective met the others' skipped one inside NCCL."""
    use_devices(monkeypatch, 2)
    ranks = Ranks(2, "gpu")
    try:
        _run_for(request, lambda data: one_program(
            ranks, data.draw(programs(2, groups=False)), exact=False))
    finally:
        synk.close()


_MPI_JOB = """
from hypothesis import HealthCheck, given, note, settings, strategies as st
from hypothesis.control import currently_in_test_context
from random_programs import check, expected_error, programs, run_program

f = synk.function(run_program, bcast_inputs=["program", "marker"], reduce=None, timeout=90)
count = [0]

@settings(max_examples={examples}, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def body(data):
    program = data.draw(programs(n))
    want = expected_error(program)
    count[0] += 1
    try:
        results = f(program, np.zeros(1))
    except Exception as err:
        assert want is not None and isinstance(err, want.errors), repr(err)
        return
    assert want is None or want.may_return, str(want)
    check(program, results)

stop = time.monotonic() + {seconds}
while True:
    body()
    if time.monotonic() > stop:
        break
print("PROGRAMS", count[0], flush=True)
synk.close()
"""


@pytest.mark.timeout(_TIMEOUT)
def test_random_programs_across_pretend_hosts_under_mpi(request, tmp_path):
    """Three ranks on two pretend hosts under mpiexec: synk.comm over MPI between them,
    with disagreements (a skipped collective among them) and values refused on one rank,
    as on one host."""
    soak = _soak(request)
    body = _MPI_JOB.format(examples=20 if soak else _EXAMPLES,  # (short rounds: the job
                           seconds=_SOAK_S if soak else 0)  # stops between them)
    tests = os.path.dirname(os.path.abspath(__file__))  # (every rank imports the harness)
    run = mpirun.run(tmp_path, body, hosts=("a", "b", "b"),
                     timeout=_SOAK_S + 500 if soak else 500, env={"PYTHONPATH": tests})
    assert run.rc == 0, run.text[-12000:]
    print(next(line for line in run.out.splitlines() if line.startswith("PROGRAMS")))


# -- calls: the same function again and again, its arguments changing or not -----------------
def _step(x, w, b=5.0, c=6.0, *args, **kw):
    """Rows of ``x`` (scattered), ``w`` whole: elementwise, so that the gathered rows are
    the single-process answer bit for bit."""
    extra = float(sum(args)) + float(sum(v for _, v in sorted(kw.items())))
    return x * w[0] * b + c + extra + w[-1, 0]


def _step_combined(x, w, b=5.0, c=6.0, *args, **kw):
    """``_step``'s rows combined over the ranks (``_COMBINED``): their sums (of small
    integers and halves, exact in any order), maxima, count (a Python int) and mean."""
    rows = _step(x, w, b, c, *args, **kw)
    return rows.sum(axis=0), rows.max(axis=0), len(rows), rows.mean(axis=0)


_COMBINED = ("sum", "max", "sum", "mean")


def _step_accumulated(x, w, b=5.0, c=6.0, *args, total=None, **kw):
    """``_step``'s rows summed over the ranks into ``total``, a shared variable (each
    rank's replica, in place: route B's update), and its value after that, on each rank
    (``reduce=None``)."""
    rows = _step(x, w, b, c, *args, **kw)
    total += synk.comm.allreduce(rows.sum(axis=0))
    return total.copy()


_ROWS = 12
_CALL = st.fixed_dictionaries({
    "x": st.sampled_from(["data", "array"]),
    # an array's: as it is, in another dtype, or with more rows than the last call's
    "x form": st.sampled_from(["same", "same", "float32", "int", "more rows"]),
    "w": st.sampled_from(["small", "large", "data"]),  # (large: staged, not in the message)
    "b": st.sampled_from(["default", "position", "keyword"]),
    "c": st.sampled_from(["default", "position", "keyword"]),
    "value": st.sampled_from([2.0, 3.0, -0.0, 0.5]),
    "extra": st.sampled_from(["none", "positional", "keywords", "other keywords"]),
    "change": st.sampled_from(["none", "none", "w in place", "x in place", "w anew",
                               "x set"]),
    "batch": st.sampled_from([None, None, "int", "slice", "indices", "mask"]),
    # a plain call; bound now and called; the last bound step again, with nothing more
    # (a step of plain values: the workers' held task); submitted, its result read later;
    # bound in part and called with the rest
    "form": st.sampled_from(["plain", "plain", "bound", "again", "again", "submitted",
                             "partial"]),
    # a partly bound step's: how many of the positional arguments are bound, and whether
    # its keywords are bound too, with other values that each call's own override
    "split": st.integers(0, 5),
    "decoy": st.booleans(),
    # its rows gathered, or combined by the reduce ops of each output
    # (or summed into a shared variable, in place on every rank)
    "outputs": st.sampled_from(["gathered", "gathered", "combined", "accumulated"]),
    "slices": st.sampled_from([1, 1, 2]),  # (num_slices=)
})
_BATCHES = {None: None, "int": 5, "slice": slice(2, 9, 3),
            "indices": np.array([7, 1, 1, 10]), "mask": np.arange(_ROWS) % 3 == 0}


def _options(call: dict, made: dict) -> dict:
    """The options of ``call`` (of a step or function ``made`` by a call of its outputs):
    its ``batch=`` and ``num_slices=``, these only where every piece of the combined
    outputs' two ranks gets a row (their maxima take one)."""
    batch = _BATCHES[call["batch"]]
    options = {} if batch is None else {"batch": batch}
    rows = len(np.arange(_ROWS)[slice(0, batch) if isinstance(batch, int) else (
        slice(None) if batch is None else batch)])
    if call["slices"] > 1 and made["outputs"] != "accumulated" and (
            made["outputs"] == "gathered" or rows >= 2 * call["slices"]):  # (synk.comm
        # refuses a sliced call)
        options["num_slices"] = call["slices"]
    return options


def _x_form(x: np.ndarray, call: dict) -> np.ndarray:
    """The array ``x`` a call passes: as it is, in another dtype, or with more rows (where
    its ``batch=`` picks rows of any length, and no call of a step bound with it may pick
    them otherwise)."""
    form = call["x form"]
    if form == "float32":
        return x.astype(np.float32)
    if form == "int":
        return x.astype(np.int64)
    if form == "more rows" and call["batch"] not in ("indices", "mask") and \
            call["form"] not in ("bound", "again"):
        return np.concatenate([x, 2 * x[:4]])
    return x


def _arguments(call: dict, state: dict) -> tuple:
    """(args, kwargs) of ``call`` as the caller passes them, and as ``_step`` takes them in
    one process."""
    x = state["xd"] if call["x"] == "data" else _x_form(state["x"], call)
    w = {"small": state["small"], "large": state["large"], "data": state["wd"]}[call["w"]]
    w_local = state["large"] if call["w"] == "large" else state["small"]
    args, local, kwargs = [x, w], [state["x"] if call["x"] == "data" else x, w_local], {}
    v = call["value"]
    if call["b"] == "position" or call["c"] == "position":
        b = v if call["b"] == "position" else 5.0
        args.append(b)
        local.append(b)
    if call["c"] == "position":
        args.append(v)
        local.append(v)
    for name in ("b", "c"):
        if call[name] == "keyword" and not (name == "b" and call["c"] == "position"):
            kwargs[name] = v
    if call["extra"] == "positional" and len(args) == 4:
        args.append(1.0)
        local.append(1.0)
    elif call["extra"] == "keywords":
        kwargs.update(k1=1.0, k2=2.0)
    elif call["extra"] == "other keywords":
        kwargs.update(k2=1.0)
    return args, kwargs, local


def _change(call: dict, state: dict) -> None:
    change = call["change"]
    if change == "w in place":
        state["small"] += 1
        state["large"][0] += 1
    elif change == "x in place":
        state["x"][:2] *= -1
        state["xd"].set_value(state["x"])
    elif change == "w anew":
        state["small"] = state["small"] + 1
        state["large"] = state["large"] - 1
    elif change == "x set":
        state["x"] = state["x"] + 1
        state["xd"].set_value(state["x"])
    if change in ("w in place", "w anew"):
        state["wd"].set_value(state["small"])


def _calls_body():
    state: dict = {}

    def body(calls):
        if "gathered" not in state:
            rng = np.random.default_rng(0)
            state["x"] = rng.integers(-4, 5, (_ROWS, 3)).astype(np.float64)
            state["small"] = rng.integers(1, 4, (1, 3)).astype(np.float64)
            state["large"] = rng.integers(1, 4, (20_000, 3)).astype(np.float64)
            state["xd"] = synk.data(state["x"])
            state["wd"] = synk.data(state["small"])
            state["gathered"] = synk.function(_step, inputs=["x"], reduce="gather", timeout=60)
            state["combined"] = synk.function(_step_combined, inputs=["x"],
                                              reduce=_COMBINED, timeout=60)
            state["accumulated"] = synk.function(_step_accumulated, inputs=["x"],
                                                 reduce=None, timeout=60)
            state["total"] = synk.shared(np.zeros(3))
            state["total model"] = np.zeros(3)
        submitted = []
        for call in calls:
            _change(call, state)  # (a Data's set_value waits for the submitted calls)
            form = call["form"]
            if form == "again" and "step" in state:
                step, bound_call, args, kwargs, local = state["step"]
                batch = _BATCHES[call["batch"]]
                got = step(**_options(call, bound_call))
                local = list(local)  # (a Data is live: its values now; plain ones as bound)
                if bound_call["w"] == "data":
                    local[1] = state["small"]
                x_now = state["x"] if bound_call["x"] == "data" else local[0]
                _check(got, x_now, local, kwargs, batch, (bound_call, call),
                       _added(state, bound_call, x_now, local, kwargs, batch))
                continue
            args, kwargs, local = _arguments(call, state)
            f = state[call["outputs"]]
            batch = _BATCHES[call["batch"]]
            options = _options(call, call)
            total = {"total": state["total"]} if call["outputs"] == "accumulated" else {}
            if form == "partial":  # bound in part, the rest passed per call (a keyword
                # bound with a decoy that the call's own overrides: functools.partial's rule)
                split = min(call["split"], len(args))
                decoys = {k: 9.0 for k in kwargs} if call["decoy"] else {}
                step = f.bind(*args[:split], **decoys, **total)
                got = step(*args[split:], **options, **kwargs)
                _check(got, local[0], local, kwargs, batch, call,
                       _added(state, call, local[0], local, kwargs, batch))
                step.close()
                continue
            if form in ("bound", "again"):
                step = f.bind(*args, **kwargs, **total)  # (by value: later changes are
                # not its; a shared variable is live)
                state["step"] = (step, call, args, kwargs, [v.copy() if isinstance(
                    v, np.ndarray) else v for v in local])
                got = step(**options)
            elif form == "submitted":  # (its plain values as they are now)
                submitted.append((f.submit(*args, **options, **kwargs, **total),
                                  local[0].copy(), [np.copy(v) for v in local], kwargs,
                                  batch, call,
                                  _added(state, call, local[0], local, kwargs, batch)))
                continue
            else:
                got = f(*args, **options, **kwargs, **total)
            _check(got, local[0], local, kwargs, batch, call,
                   _added(state, call, local[0], local, kwargs, batch))
        _read(submitted)
        for r in range(2):  # (every rank's replica: the sums of every call's rows)
            np.testing.assert_array_equal(state["total"].get_value(r), state["total model"])

    return body


def _read(submitted: list) -> None:
    """The submitted calls' results, checked in the order submitted."""
    for future, x_then, local, kwargs, batch, call, total in submitted:
        _check(future.result(), x_then, local, kwargs, batch, call, total)
    submitted.clear()


def _added(state: dict, made: dict, x, local: list, kwargs: dict, batch):
    """Where a call of a function or step ``made`` for ``accumulated`` outputs: the shared
    total's model after it (this call's rows added); else None."""
    if made["outputs"] != "accumulated":
        return None
    pick = slice(None) if batch is None else (
        slice(0, batch) if isinstance(batch, int) else batch)
    state["total model"] = state["total model"] + _step(
        x[pick], *local[1:], **kwargs).sum(axis=0)
    return state["total model"].copy()


def _check(got, x, local: list, kwargs: dict, batch, call, total=None) -> None:
    """``got`` is ``_step`` (or ``_step_combined``, as ``call``, a call's or a bound step
    and the call of it, says) in one process on ``batch``'s rows of ``x``."""
    pick = slice(None) if batch is None else (
        slice(0, batch) if isinstance(batch, int) else batch)
    local = [x[pick], *local[1:]]
    made = call[0] if isinstance(call, tuple) else call
    if made["outputs"] == "accumulated":  # (each rank's total after the call: the model's)
        assert len(got) == 2, repr(call)
        for g in got:
            np.testing.assert_array_equal(g.get() if hasattr(g, "get") else g, total,
                                          err_msg=repr(call))
        return
    if made["outputs"] == "gathered":
        np.testing.assert_array_equal(got, _step(*local, **kwargs), err_msg=repr(call))
        return
    want = _step_combined(*local, **kwargs)
    assert type(got) is tuple and len(got) == 4, repr(call)
    for g, w in zip(got[:3], want[:3]):
        np.testing.assert_array_equal(g, w, err_msg=repr(call))
    assert type(got[2]) is int, repr(call)
    np.testing.assert_allclose(got[3], want[3], rtol=1e-12, atol=1e-12, err_msg=repr(call))


@pytest.mark.timeout(_TIMEOUT)
@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_random_sequences_of_calls_give_each_calls_own_answer(request, monkeypatch, backend):
    """The same function called again and again (what a call may keep from the last one
    must never give the last one's answer): its arguments by position or keyword, kept or
    changed in place, Data set anew, rows picked by ``batch=``; plain calls, bound steps
    (called again with nothing more: their values as bound, a Data's as it is now) and
    submitted calls (read after the later ones ran, a Data changed meanwhile through its
    methods, which wait for them); the rows gathered, or combined by
    each output's reduce op (sums, maxima, a Python int's sum, a weighted mean), or
    summed into a shared variable in place on every rank; in one slice or two. And steps
    bound in part, called with the rest of the arguments (keywords bound, then given
    again by the call, which wins)."""
    if backend == "gpu":
        use_devices(monkeypatch, 2)
    synk.fork(2, backend=backend)
    try:
        _run_for(request, _calls_body(), st.lists(_CALL, min_size=1, max_size=6))
    finally:
        synk.close()


# -- counterexamples the harness found, kept as plain tests ---------------------------------------
def test_fused_iallreduces_in_flight_each_get_their_own_result(ranks2):
    """Found by the harness (and torch.distributed's allreduce_coalesced stress test): a
    fused allreduce packed straight into the board's slot was read back from the slot by
    its own rank's lane after the caller had posted a later collective there."""
    ranks = Ranks(2)
    ranks.f = synk.function(run_program, bcast_inputs=["program", "marker"], reduce=None,
                            timeout=_CALL_TIMEOUT)
    program = {"size": 2, "threaded": False, "wait_seed": 0, "ops": [
        {"kind": "allreduce", "seed": i, "blocking": False, "group": None, "op": "sum",
         "form": "list", "root": 0, "special": None, "leaves": [((1,), "int64")] * 2}
        for i in range(200)]}
    one_program(ranks, program)


def _plain_sums(n: int, grouped: int) -> list:
    """``n`` non-blocking sums of two int64, the ``grouped``-th on the sub-group."""
    ops = [{"kind": "allreduce", "seed": i, "blocking": False, "group": None, "op": "sum",
            "form": "array", "root": 0, "special": None, "leaves": [((2,), "int64")]}
           for i in range(n)]
    ops[grouped]["group"] = "parity"
    return ops


def test_a_fused_allreduce_in_flight_keeps_its_slot_from_later_plain_ones():
    """Found by the harness (shrunk): a fused allreduce packed straight into the board's
    slot, then plain non-blocking ones posted in the same slot before this rank's lane read
    its own part back (its head read as another's data: "different structures"), on 4
    ranks, a thread running a sub-group's collective meanwhile."""
    ranks = Ranks(4)
    plain = _plain_sums(20, grouped=6)
    fused = {"kind": "allreduce", "seed": 454, "blocking": False, "group": None,
             "op": "lxor", "form": "list", "root": 2, "special": None, "out": None,
             "leaves": [((26,), "float64"), ((34,), "int64"), ((3,), "float64"),
                        ((3,), "float64")]}
    program = {"size": 4, "threaded": True, "wait_seed": 1, "ops": [fused] + plain}
    try:
        for _ in range(30):
            one_program(ranks, program)
    finally:
        synk.close()


def test_a_0d_complex_sum_on_gpu_ranks(monkeypatch):
    """Found by the harness (shrunk): a sum of a 0-d complex device array, which NCCL
    reduces as a pair of floats, raised CuPy's "Changing the dtype of a 0d array" (as
    numpy, CuPy views no 0-d array as another itemsize); blocking or not, reduced to all
    or to one, of either complex dtype."""
    use_devices(monkeypatch, 2)
    ranks = Ranks(2, backend="gpu")
    ops = [{"kind": kind, "seed": i, "blocking": blocking, "group": None, "op": "sum",
            "form": "array", "root": 1, "special": None, "out": None,
            "leaves": [((), dtype)]}
           for i, (kind, blocking, dtype) in enumerate(
               (kind, blocking, dtype) for kind in ("allreduce", "reduce")
               for blocking in (True, False) for dtype in ("complex128", "complex64"))]
    try:
        one_program(ranks, {"size": 2, "threaded": False, "wait_seed": 0, "ops": ops})
    finally:
        synk.close()


def _refusing(kind: str, rank: int, n: int) -> dict:
    def op(kind: str, seed: int) -> dict:
        return {"kind": kind, "seed": seed, "blocking": True, "group": None, "op": "sum",
                "form": "array", "root": 1, "special": None, "out": None, "rows": [2] * n,
                "leaves": [((3,), "float64")]}

    return {"size": n, "threaded": False, "wait_seed": 0,
            "ops": [op(kind, 1), op("allreduce", 2), op(kind, 3)],
            "disagree": {"op": 0, "rank": rank, "change": {"refuse": True}, "field": "refuse"}}


def test_a_value_refused_and_caught_on_one_rank():
    """The harness's refusal: one rank passes Python objects, catches the error and goes
    on; the call raises, or (no rank needed that part: a scan's last rank, a gather's root)
    returns the model's numbers on the other ranks, never another collective's."""
    ranks = Ranks(3)
    try:
        for kind, rank in (("allreduce", 1), ("broadcast", 1), ("gather", 1), ("scan", 2),
                           ("allgather", 0)):
            one_program(ranks, _refusing(kind, rank, 3))
    finally:
        synk.close()


def test_a_value_refused_and_caught_on_one_gpu_rank(monkeypatch):
    """The harness's refusal on simulated GPUs: where the others wait inside NCCL for the
    refusing rank's part (an allgather, a reduction NCCL has no op for, gathered; a burst
    of fused sums in flight, whose last ones the others wait for as the call ends: found
    by soaks), they raise at once rather than wait until the call's timeout."""
    use_devices(monkeypatch, 2)
    ranks = Ranks(2, backend="gpu")
    try:
        for kind, rank in (("allgather", 0), ("allgather", 1), ("allreduce", 0),
                           ("broadcast", 1), ("scan", 0)):
            one_program(ranks, _refusing(kind, rank, 2))
        bxor = _refusing("allreduce", 0, 2)
        bxor["ops"][0] |= {"op": "bxor", "form": "dict", "leaves": [((51,), "bool")]}
        one_program(ranks, bxor)
        burst = {"size": 2, "threaded": False, "wait_seed": 216485, "ops": [
            {"kind": "allreduce", "seed": i, "blocking": False, "group": None, "op": "sum",
             "form": "list", "root": 0, "special": None,
             "leaves": [((2,), "int64"), ((1,), "float64")]} for i in range(60)],
            "disagree": {"op": 43, "rank": 0, "change": {"refuse": True}, "field": "refuse"}}
        for _ in range(4):  # (one fewer in flight on rank 0: the others' last ones never
            one_program(ranks, burst, exact=False)  # complete, waited for as the call ends)
    finally:
        synk.close()


def test_a_refusing_rank_that_goes_on_to_wait_elsewhere_is_named():
    """Found by the harness (shrunk): a rank refused its value of a non-blocking collective,
    caught the error and went on to wait for something else: a message of a ring (found in
    CI), or, with a thread running sub-group sums, a board slot behind later non-blocking
    sums whose lanes the others queued after the refused one (found by a soak). The others
    waited for its part until the call's timeout; now they raise at once."""
    ranks = Ranks(3)
    gather = {"kind": "allgather", "seed": 1, "blocking": False, "group": None, "root": 0,
              "form": "array", "rows": [0, 0, 0], "special": None,
              "leaves": [((2048,), "float64")]}
    ring = {"kind": "sendrecv", "seed": 2, "blocking": False, "group": None, "root": 1,
            "form": "array", "special": None, "leaves": [((176,), "float16")]}
    band = {"kind": "allreduce", "seed": 3, "blocking": False, "group": None, "op": "band",
            "form": "list", "root": 0, "special": None, "out": "fresh",
            "leaves": [((2, 3), "int64")]}
    refusal = {"op": 0, "rank": 1, "change": {"refuse": True}, "field": "refuse"}
    try:
        one_program(ranks, {"size": 3, "threaded": False, "wait_seed": 0,
                            "ops": [band, ring],
                            "disagree": refusal})
        one_program(ranks, {"size": 3, "threaded": True, "wait_seed": 0,
                            "ops": [gather] + _plain_sums(20, grouped=3),
                            "disagree": refusal | {"rank": 0}})
    finally:
        synk.close()


def _refuses_two_then_receives(x):
    """Rank 1 refuses its values of two allreduces in a row, catching both errors, and
    waits for a message from rank 0; rank 0 waits in the first allreduce (of its rows: a
    device array on GPU ranks)."""
    if synk.comm.rank() == 1:
        for _ in range(2):
            with pytest.raises(TypeError):
                synk.comm.allreduce(np.array([1, "a"], dtype=object))
        return synk.comm.recv(0)
    return synk.comm.allreduce(x[0])


def test_a_gpu_rank_that_skipped_a_collective_never_launches_another_against_it(monkeypatch):
    """Found by the harness (a soak): rank 1 skipped a broadcast that rank 0 waited in inside
    NCCL, and launched its next collective, an allgather, against it: NCCL would match the
    two (on a GPU a hang or wrong numbers; the simulator's error), and the group's
    communicators, kept, failed every later call. Now the rank that would launch a
    collective of another name at the number a peer launched raises instead, and the next
    program gives its numbers."""
    use_devices(monkeypatch, 2)
    ranks = Ranks(2, "gpu")

    def op(kind: str, seed: int, blocking: bool, leaves: list) -> dict:
        return {"kind": kind, "seed": seed, "blocking": blocking, "group": None, "root": 0,
                "form": "array", "special": None, "rows": [1, 1], "leaves": leaves}

    skipped = {"size": 2, "threaded": False, "wait_seed": 0,
               "ops": [op("broadcast", 7, True, [((262136,), "uint8")]),
                       op("allgather", 8, False, [((3,), "float64")])],
               "disagree": {"op": 0, "rank": 1, "change": {"skip": True}, "field": "skip"}}
    after = {"size": 2, "threaded": False, "wait_seed": 0,
             "ops": [op("allgather", 1, True, [((3,), "float64")]),
                     op("broadcast", 2, True, [((5,), "float32")])]}
    try:
        one_program(ranks, skipped, exact=False)
        one_program(ranks, after, exact=False)
    finally:
        synk.close()


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_a_rank_that_refuses_two_collectives_and_waits_elsewhere_is_named(monkeypatch,
                                                                          backend):
    """A rank refused its values of two collectives in a row, caught both errors and went
    on to wait for a message, while its peer waited in the first of them: its row said only
    its last refusal, so the peer waited until the call's timeout. Now a row says which of
    the numbers before its last one it refused too, and the peer raises at once."""
    if backend == "gpu":
        use_devices(monkeypatch, 2)
    synk.fork(2, backend=backend)
    try:
        f = synk.function(_refuses_two_then_receives, inputs=["x"], reduce=None,
                          timeout=_CALL_TIMEOUT)
        started = time.monotonic()
        with pytest.raises(ValueError, match="refused its value of that collective"):
            f(np.ones((2, 3)))
        assert time.monotonic() - started < _CALL_TIMEOUT / 2, "named only at the timeout"
    finally:
        synk.close()


def _refuses_two_in_a_pair_then_receives():
    """Rank 3 refuses its values of two collectives of its pair (ranks 1 and 3) in a row,
    catching both errors, and waits for a message from rank 1; rank 1 waits in the pair's
    first collective."""
    r = synk.comm.rank()
    pair = synk.comm.split(r % 2)
    if r == 3:
        for _ in range(2):
            with pytest.raises(TypeError):
                pair.allreduce(np.array([1, "a"], dtype=object))
        return synk.comm.recv(1, tag=9)
    return pair.allreduce(np.ones(2)) if r == 1 else None


def test_a_rank_that_refuses_two_of_a_sub_groups_collectives_and_waits_elsewhere_is_named():
    """As above, in a sub-group: the row said only the sub-group's last refused collective,
    and rank 1, waiting in the first, waited until the timeout."""
    synk.fork(4)
    try:
        f = synk.function(_refuses_two_in_a_pair_then_receives, reduce=None,
                          timeout=_CALL_TIMEOUT)
        started = time.monotonic()
        with pytest.raises(ValueError, match="a sub-group's collective from rank 3, which "
                                             "refused its value"):
            f()
        assert time.monotonic() - started < _CALL_TIMEOUT / 2, "named only at the timeout"
    finally:
        synk.close()


def test_a_disagreement_raises_rather_than_computes(ranks2):
    ranks = Ranks(2)
    ranks.f = synk.function(run_program, bcast_inputs=["program", "marker"], reduce=None,
                            timeout=_CALL_TIMEOUT)
    op = {"kind": "allreduce", "seed": 1, "blocking": True, "group": None, "op": "sum",
          "form": "array", "root": 0, "special": None, "leaves": [((3,), "float64")]}
    for change in ({"op": "max"}, {"op": "mean"}, {"leaves": [((3,), "float32")]},
                   {"leaves": [((4,), "float64")]}):
        program = {"size": 2, "threaded": False, "wait_seed": 0, "ops": [op],
                   "disagree": {"op": 0, "rank": 1, "change": change, "field": "x"}}
        with pytest.raises((ValueError, TypeError)):
            ranks.call(program)
        assert isinstance(expected_error(program), Disagrees)


def test_a_weighted_mean_of_one_subnormal_part_keeps_its_bits():
    """Found by the soak (shrunk): a mean weighted [0, 0, 1e-50] of float64 values on 3
    ranks is rank 2's value itself; a subnormal one came back as -0.0."""
    ranks = Ranks(3)
    program = {"size": 3, "threaded": False, "wait_seed": 0, "ops": [
        {"kind": "allreduce", "seed": 1, "blocking": False, "group": None, "op": "mean",
         "root": 0, "form": "dict", "leaves": [((), "float64")], "special": "tiny",
         "weights": [0.0, 0.0, 1e-50]}]}
    try:
        one_program(ranks, program)
    finally:
        synk.close()


def test_a_weighted_complex_mean_multiplies_a_part_of_factor_1_as_numpy_does():
    """Found by the MPI soak (shrunk, and on one host alike): a reduce to rank 0 of a
    complex128 mean weighted [0, 1e-50, 1] gave rank 2's ``inf+1.03j`` as it was, where
    numpy's ``x * 1.0`` of it is ``inf+nanj`` (complex multiplication: inf * 0 is NaN)."""
    ranks = Ranks(3)
    program = {"size": 3, "threaded": False, "wait_seed": 0, "ops": [
        {"kind": "reduce", "seed": 0, "blocking": False, "group": None, "op": "mean",
         "root": 0, "form": "array", "leaves": [((1024,), "complex128")], "special": "inf",
         "weights": [0.0, 1e-50, 1.0]}]}
    try:
        one_program(ranks, program)
    finally:
        synk.close()


def test_a_dtype_disagreement_on_either_side_of_a_limit_beside_a_thread_raises():
    """Found by the soak: rank 0's band allreduce of 16385 int32 against the others' int64
    (64 KiB against 128 KiB: two ways through allreduce), on 4 ranks with a thread running
    a sub-group's collectives, hung instead of raising on every rank."""
    ranks = Ranks(4)
    plain = _plain_sums(20, grouped=3)
    first = {"kind": "allreduce", "seed": 1468, "blocking": False, "group": None,
             "op": "band", "root": 0, "form": "array", "leaves": [((16385,), "int64")],
             "special": None, "out": None}
    program = {"size": 4, "threaded": True, "wait_seed": 0, "ops": [first] + plain,
               "disagree": {"op": 0, "rank": 0, "change": {"leaves": [((16385,), "int32")]},
                            "field": "dtype"}}
    try:
        one_program(ranks, program)
    finally:
        synk.close()
