"""Errors arrive as what they are, on every rank: an object whose pickling raises
keeps its own exception type in the ``*_object`` collectives, and every other rank raises
too (none is left waiting, even where the failing rank catches its error and goes on);
synk's own errors raised under ``jax.jit`` reach the master as themselves, not as JAX's
runtime error; a ragged nested list says what is wrong and what to pass instead of
numpy's "setting an array element with a sequence"."""
import re
import threading

import numpy as np
import pytest

import synk
from synk import comm

pytestmark = pytest.mark.timeout(300)


class ReduceBoom(Exception):
    """The user's own error, raised while its object is pickled."""


class Unpicklable:
    def __reduce__(self):
        raise ReduceBoom("this object refuses to be pickled")


def run(fn, *arg, timeout=60):
    """fn(arg) on every rank, as a list in rank order."""
    return synk.function(fn, bcast_inputs=["arg"], reduce=None, timeout=timeout)(arg)


def _object_call(case: str, bad):
    """Collective ``case`` of the ``*_object`` family, where one rank's object is ``bad``."""
    r, n = comm.rank(), comm.size()
    if case == "broadcast_object":
        return comm.broadcast_object(bad if r == 0 else None, 0)
    if case == "broadcast_object from rank 1":
        return comm.broadcast_object(bad if r == 1 else None, 1)
    if case == "allgather_object":
        return comm.allgather_object(bad if r == 1 else r)
    if case == "gather_object":
        return comm.gather_object(bad if r == 1 else r, 0)
    if case == "gather_object, the root's":
        return comm.gather_object(bad if r == 0 else r, 0)
    assert case == "scatter_object"
    return comm.scatter_object([0] + [bad] * (n - 1) if r == 0 else None, 0)


OBJECT_CASES = ["broadcast_object", "broadcast_object from rank 1", "allgather_object",
                "gather_object", "gather_object, the root's", "scatter_object"]
FAILING_RANK = {"broadcast_object from rank 1": 1, "allgather_object": 1, "gather_object": 1}


def _caught_then_go_on(arg):
    """Every rank runs the failing collective, catches what it raises, and then takes
    part in another one: a rank left waiting in the first would hang the second."""
    case, kind = arg
    bad = Unpicklable() if kind == "reduce" else threading.Lock()
    try:
        _object_call(case, bad)
        raised = None
    except Exception as exc:
        raised = type(exc).__name__
    return raised, comm.allgather_object(comm.rank())


@pytest.fixture
def ranks3_cpu():
    synk.fork(3, backend="cpu")
    yield 3
    synk.close()


def test_object_collectives_raise_on_every_rank_with_the_users_type(ranks3_cpu):
    n = ranks3_cpu
    for case in OBJECT_CASES:
        failing = FAILING_RANK.get(case, 0)
        got = list(zip(*run(_caught_then_go_on, case, "reduce")))  # (rank by rank)
        for r, (raised, after) in enumerate(got):  # the same error on every rank
            assert after == list(range(n)), (case, r)
            assert raised == "ReduceBoom", (case, r, raised)
        # not caught: the master raises the user's type, whichever rank pickled it
        with pytest.raises(ReduceBoom, match="refuses to be pickled") as info:
            run(lambda arg: _object_call(arg[0], Unpicklable()), case)
        notes = str(getattr(info.value, "__notes__", ""))
        assert "cannot be pickled" in notes and "every" in notes, (case, notes)
        assert f"rank {failing}" in notes or f"ranks [{failing}" in notes, (case, notes)
    # what pickle itself refuses (a lock) is still the TypeError that names the collective
    for r, (raised, _) in enumerate(zip(*run(_caught_then_go_on, "broadcast_object", "lock"))):
        assert raised == "TypeError", r
    with pytest.raises(TypeError, match="broadcast_object's object cannot be pickled"):
        run(lambda arg: comm.broadcast_object(threading.Lock() if comm.rank() == 0 else 1))
    assert run(lambda arg: comm.broadcast_object({"fine": comm.rank()}, 2)) == [{"fine": 2}] * n


# -- ragged nested lists ---------------------------------------------------------------------
RAGGED = [[0] * 3, [0] * 2]  # rows of different lengths: numpy makes no array of them


def _ragged_in(arg):
    """Collective ``arg[0]`` given a ragged list on every rank."""
    case = arg[0]
    r, n = comm.rank(), comm.size()
    if case == "scatter":
        return comm.scatter([RAGGED] * n if r == 0 else None, 0)
    if case == "alltoall":
        return comm.alltoall([RAGGED] * n)
    if case == "send":
        return comm.sendrecv(RAGGED, (r + 1) % n, (r - 1) % n)
    return getattr(comm, case)(RAGGED)


@pytest.mark.parametrize("case,name", [("scatter", "chunks[0]"), ("gather", "x"),
                                       ("reduce", "x"), ("reduce_scatter", "x"), ("scan", "x"),
                                       ("alltoall", "x[0]"), ("send", "x")])
def test_ragged_lists_in_synk_comm_say_what_to_pass(ranks2, case, name):
    with pytest.raises(ValueError, match=rf"synk.comm.\w+: {re.escape(name)} is a ragged") as info:
        run(_ragged_in, case)
    said = str(info.value)
    assert "scatter_object" in said and "pad the rows" in said, said
    assert "setting an array element with a sequence" not in said
    # uneven chunks (each an array of its own) are what scatter takes: they still travel
    got = run(lambda arg: comm.scatter([[0] * 3, [0] * 2] if comm.rank() == 0 else None, 0))
    assert [g.tolist() for g in got] == [[0, 0, 0], [0, 0]]


def _refused_at_the_root_then_broadcast(arg):
    """A rooted collective whose root refuses its own value (``arg[0]``), caught on every
    rank, then a broadcast: what each rank said, and what it got."""
    r, n = comm.rank(), comm.size()
    objects = np.array([1, "a"], dtype=object)
    refused = {
        "scatter, too few chunks": lambda: comm.scatter([np.zeros(2)] if r == 0 else None, 0),
        "scatter, a dict": lambda: comm.scatter([{"w": np.ones(2)}] * n if r == 0 else None, 0),
        "scatter, objects": lambda: comm.scatter([objects] * n if r == 0 else None, 0),
        "broadcast, objects": lambda: comm.broadcast(objects if r == 0 else None, 0),
        "ibroadcast, objects": lambda: comm.ibroadcast(objects if r == 0 else None, 0).wait(),
        "broadcast, a structure of objects": lambda: comm.broadcast(
            {"w": np.ones(2), "o": objects} if r == 0 else None, 0),
        "scatter_object, too few": lambda: comm.scatter_object([1] if r == 0 else None, 0),
    }[arg[0]]
    try:
        refused()
        said = "no error"
    except (TypeError, ValueError) as err:
        said = f"{type(err).__name__}: {err}"
    return said, comm.broadcast(np.arange(3.0) + 7 if r == 0 else None, 0).tolist()


@pytest.mark.parametrize("case", [
    "scatter, too few chunks", "scatter, a dict", "scatter, objects", "broadcast, objects",
    "ibroadcast, objects", "broadcast, a structure of objects", "scatter_object, too few"])
def test_a_root_that_refuses_its_own_value_raises_on_every_rank(ranks2, case):
    """A root that refuses what it sends (scatter's chunks not one per rank, not arrays,
    Python objects; a broadcast of Python objects) takes part all the same: every rank
    raises its error at once, where the others waited for what never came and took the
    root's next collective for it (a later broadcast's array returned as this one's, or its
    bytes unpickled as a header); the group goes on, each collective with its own data."""
    said, after = run(_refused_at_the_root_then_broadcast, case)
    name = case.split(",")[0].lstrip("i")
    assert len(set(said)) == 1 and said[0].startswith(
        (f"ValueError: synk.comm.{name}:", f"TypeError: synk.comm.{name}:")), said
    assert after == [[7.0, 8.0, 9.0]] * 2


def test_a_ragged_input_of_a_function_says_what_to_pass(ranks2):
    f = synk.function(lambda x: len(x), reduce=None)
    with pytest.raises(ValueError, match="input 'x' is a ragged nested sequence") as info:
        f(RAGGED)
    assert "bcast_inputs" in str(info.value) and "pad the rows" in str(info.value)
    with pytest.raises(ValueError, match="batch.* is a ragged nested sequence"):
        f(np.zeros(4), batch=RAGGED)
    with pytest.raises(ValueError, match="synk.data's value is a ragged nested sequence"):
        synk.data(RAGGED)
    with pytest.raises(ValueError, match="shared variable .* is a ragged nested sequence"):
        synk.shared(RAGGED)
    # sent whole, a ragged list is a Python object like any other
    assert synk.function(lambda x: len(x), bcast_inputs=["x"], reduce=None)(RAGGED) == [2, 2]
    assert f(np.zeros(4)) == [2, 2]


# -- synk's errors under jax.jit -------------------------------------------------------------
def _under_jit(arg):
    import jax
    import jax.numpy as jnp

    case = arg[0]
    r = comm.rank()

    @jax.jit
    def allgather(x):
        return comm.allgather(x)

    @jax.jit
    def allreduce(x):
        return comm.allreduce(x)

    if case == "allgather":
        return allgather(jnp.ones(2 + r))
    if case == "allgather after a good call":  # (JAX's fast path raises ValueError then)
        allgather(jnp.ones(2))
        return allgather(jnp.ones(2 + r))
    if case == "same shapes":
        return allgather(jnp.ones(2))
    assert case == "allreduce"
    return allreduce(jnp.ones(2 + r))


@pytest.mark.frameworks
def test_synk_errors_under_jax_jit_reach_the_master_as_themselves(ranks2):
    pytest.importorskip("jax", reason="the JAX tests need JAX: pip install 'synk[jax]'")
    import jax

    for case in ("allgather", "allgather after a good call"):
        with pytest.raises(synk.SynkError, match="every rank must pass the same shape") as info:
            run(_under_jit, case)
        assert type(info.value) is synk.SynkError, case
    with pytest.raises(ValueError, match="the ranks passed arrays of different shapes") as info:
        run(_under_jit, "allreduce")
    assert not isinstance(info.value, jax.errors.JaxRuntimeError)
    # the group goes on; inside the function the jitted call raises synk's error too, and
    # what the function makes of it is its own
    assert [np.asarray(g).tolist() for g in run(_under_jit, "same shapes")] == [[1.0] * 4] * 2
    with pytest.raises(RuntimeError, match="the user's own error, from SynkError") as info:
        run(_handled_under_jit)
    assert type(info.value) is RuntimeError


def _handled_under_jit(arg):
    try:
        _under_jit(("allgather",))
    except synk.SynkError as exc:
        raise RuntimeError(f"the user's own error, from {type(exc).__name__}") from exc
