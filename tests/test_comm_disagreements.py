"""Ranks that pass different ops, dtypes or shapes to one collective raise the same
``ValueError`` on every rank, naming what each passed (each rank's shape and dtype, or each
rank's structure), at every size (the board, one round of messages, two rounds, and ranks
whose sizes take different ways among them; NCCL on GPU ranks), never combine what does not
belong together nor wait for ever."""
import ast

import numpy as np
import pytest
from conftest import on_every_rank

import synk

pytestmark = pytest.mark.timeout(180)

# elements of float64: a board slot, a ring message, a shared-memory message, two rounds
SIZES = {"tiny": 3, "ring": 1000, "shared memory": 40_000, "two rounds": 600_000,
         "at the two-round limit": (4 << 20) // 2 // 8,  # (3 ranks: one element more on
         # rank 1 takes it to two rounds while the others take one)
         "board and messages": 20_000,  # (float32 fits a board slot, float64 does not)
         "one round and two": 400_000}  # (float32 takes one round, float64 two)
CASES = {  # what rank 1 passes (op, dtype, elements more), where every other rank passes
    # float64 with op "sum"
    "op": ("max", "float64", 0), "mean against sum": ("mean", "float64", 0),
    "mean against exact_mean": ("exact_mean", "float64", 0), "dtype": ("sum", "float32", 0),
    "length": ("sum", "float64", 1),
}


def _disagree(arg):
    marker, case, n, form, kind = arg
    xp = synk.xp(marker)
    r = synk.comm.rank()
    op, dtype, more = case if r == 1 else ("sum", "float64", 0)
    if op == "exact_mean" or (r != 1 and case[0] == "exact_mean"):
        op = "exact_mean" if r == 1 else "mean"
    x = xp.ones(n + more, dtype)
    try:
        if kind == "allreduce":
            synk.comm.allreduce([x] if form == "list" else x, op)
        elif kind == "iallreduce":
            synk.comm.iallreduce([x] if form == "list" else x, op).wait()
        elif kind == "reduce":
            synk.comm.reduce(x, op, root=0)
        elif kind == "reduce_scatter":
            synk.comm.reduce_scatter(x, op if op not in ("mean", "exact_mean") else "sum")
        else:
            synk.comm.scan(x, op if op not in ("mean", "exact_mean") else "sum")
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def _named(case: str, n: int, form: str, size: int = 3) -> str:
    """The error every rank raises where rank 1 passes ``CASES[case]`` (a dtype or a
    length), the others ``n`` float64 elements."""
    specs = [f"({n + (r == 1 and case == 'length')},) "
             f"{'float32' if r == 1 and case == 'dtype' else 'float64'}" for r in range(size)]
    if form == "array":
        return ("ValueError: the ranks passed arrays of different shapes or dtypes ("
                + ", ".join(f"rank {r}: {s}" for r, s in enumerate(specs))
                + "); op 'sum' needs the same shape and dtype on every rank")
    return ("ValueError: the ranks passed different structures to allreduce ("
            + ", ".join(f"rank {r}: [{s}]" for r, s in enumerate(specs))
            + "); every rank must pass the same structure: the same keys, shapes and dtypes")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("size", list(SIZES))
def test_allreduce_of_ranks_that_disagree_raises_on_every_rank(three, case, size):
    """Each rank's own shape and dtype (or structure) named, the same on every rank, whichever
    ways the ranks' sizes take; ranks that pass different ops name both."""
    for form in ("array", "list"):
        for kind in ("allreduce", "iallreduce"):
            said = on_every_rank(_disagree, np.zeros(1), CASES[case], SIZES[size], form, kind)
            if case in ("dtype", "length"):
                assert said == [_named(case, SIZES[size], form)] * 3, (form, kind, said)
                continue
            ops = {CASES[case][0], "sum" if case == "op" else "mean"}
            for s in said:
                assert s.startswith("ValueError") and "different" in s, (form, kind, s)
                assert all(op in s for op in ops), (form, kind, s)


@pytest.mark.parametrize("kind", ["reduce", "reduce_scatter", "scan"])
def test_rooted_and_prefix_reductions_of_ranks_that_disagree_raise(three, kind):
    for case in ("op", "dtype", "length"):
        if kind in ("reduce_scatter", "scan") and case == "op":
            continue  # (no mean there: "max" against "sum" is the op case below)
        for said in on_every_rank(_disagree, np.zeros(1), CASES[case], 6, "array", kind):
            assert said.startswith("ValueError") and "different" in said, (case, said)
    for said in on_every_rank(_disagree, np.zeros(1), ("max", "float64", 0), 6, "array", kind):
        assert said.startswith("ValueError") and "different" in said, said


def test_the_error_names_what_each_rank_passed(ranks2):
    def fn(arg):
        x = np.ones(3, np.float32 if synk.comm.rank() else np.float64)
        synk.comm.allreduce(x)

    with pytest.raises(ValueError, match=r"rank 0: \(3,\) float64, rank 1: \(3,\) float32"):
        synk.function(fn, bcast_inputs=["arg"])(0)


def _float32_on_rank_1(arg):
    n, form = arg
    x = np.ones(n, np.float32 if synk.comm.rank() == 1 else np.float64)
    try:
        synk.comm.allreduce([x] if form == "list" else x)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


@pytest.mark.parametrize("n", [3, 8192, 40_000, 131_072, 700_000])
def test_two_ranks_name_what_each_passed_at_every_size(ranks2, n):
    """2 ranks, a board slot (64 KiB of float64), messages, 1 MiB, and float32 in one round
    against float64 in two (5.6 MB): each rank's shape and dtype, not a chunk's."""
    for form in ("array", "list"):
        said = on_every_rank(_float32_on_rank_1, n, form)
        assert said == [_named("dtype", n, form, 2)] * 2, said


def _structures_differ(arg):
    marker, case = arg
    xp = synk.xp(marker)
    r = synk.comm.rank()
    try:
        if case == "dict":
            synk.comm.allreduce({"w": xp.ones((2, 3)), "b": xp.ones(3, xp.float32 if r == 1
                                                                     else xp.float64)})
        elif case == "long":
            synk.comm.allreduce({f"w{i}": xp.ones(3, xp.float32 if r == 1 and i == 17
                                                  else xp.float64) for i in range(40)})
        elif case == "leaves":
            synk.comm.iallreduce([xp.ones(4)] * (2 if r == 1 else 1), "mean").wait()
        else:
            synk.comm.allreduce([xp.ones(4)], "mean", weight=1.0 if r == 0 else None)
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


STRUCTURES = {
    "dict": "the ranks passed different structures to allreduce (rank 0: {'w': (2, 3) "
            "float64, 'b': (3,) float64}, rank 1: {'w': (2, 3) float64, 'b': (3,) float32}, "
            "rank 2: {'w': (2, 3) float64, 'b': (3,) float64}); every rank must pass the same "
            "structure: the same keys, shapes and dtypes",
    "long": "the ranks passed different structures to allreduce (at ['w17']: rank 0: (3,) "
            "float64, rank 1: (3,) float32, rank 2: (3,) float64); every rank must pass the "
            "same structure: the same keys, shapes and dtypes",
    "leaves": "the ranks passed different structures to allreduce (rank 0: [(4,) float64], "
              "rank 1: [(4,) float64, (4,) float64], rank 2: [(4,) float64]); every rank must "
              "pass the same structure: the same keys, shapes and dtypes",
    "weight": "the ranks passed different weights to allreduce mean: rank(s) [0] gave "
              "weight= and others not (rank(s) [1, 2]); give every rank its weight (0 for a "
              "rank with no rows), or none",
}


@pytest.mark.parametrize("case", list(STRUCTURES))
def test_a_fused_allreduce_names_each_ranks_structure(three, case):
    """A structure's allreduce carries a digest of it: every rank raises the same error
    naming each rank's structure (a long one's first leaf that differs), or its weight."""
    said = on_every_rank(_structures_differ, np.zeros(1), case)
    assert said == [f"ValueError: {STRUCTURES[case]}"] * 3, said


def _dtype_differs_on_rank_1(arg):
    marker = arg[0]
    xp = synk.xp(marker)
    x = xp.ones(3, xp.float32 if synk.comm.rank() == 1 else xp.float64)
    try:
        synk.comm.allreduce(x)
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_dtype_disagreement_is_worded_alike_by_every_transport(three):
    """The host's, NCCL's and the staged transport's check (device arrays on GPU ranks)."""
    said = on_every_rank(_dtype_differs_on_rank_1, np.zeros(1))
    assert all(s.endswith(
        "the ranks passed arrays of different shapes or dtypes (rank 0: (3,) float64, rank 1: "
        "(3,) float32, rank 2: (3,) float64); op 'sum' needs the same shape and dtype on every "
        "rank") for s in said), said


def _weight_refused_on_one_rank(arg):
    """Rank 0 passes a weight with an op that takes none (its own error, which the others
    cannot see), the others a weighted mean; each rank catches what it raises."""
    kind = arg[0]
    r = synk.comm.rank()
    op = "sum" if r == 0 else "mean"
    try:
        if kind == "reduce":
            synk.comm.reduce(np.ones(3), op, root=0, weight=1.0)
        elif kind == "ireduce":
            synk.comm.ireduce(np.ones(3), op, root=1, weight=1.0).wait()
        elif kind == "allreduce":
            synk.comm.allreduce(np.ones(3), op, weight=1.0)
        else:
            synk.comm.iallreduce([np.ones(3)], op, weight=1.0).wait()
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


@pytest.mark.parametrize("kind", ["reduce", "ireduce", "allreduce", "iallreduce"])
def test_a_weight_refused_on_one_rank_raises_on_every_rank(ranks3, kind):
    """The rank that refuses its weight still takes part in the collective (without it), so
    that the others, which must raise too, are not left waiting for it."""
    for said in on_every_rank(_weight_refused_on_one_rank, kind, timeout=30):
        assert said.startswith("ValueError") and "different" in said, said


def _python_int_past_int64_on_one_rank(arg):
    """Rank 1's Python int is past int64's range (its own error, which the others cannot
    see), the others' are small; each rank catches what it raises, then every rank calls one
    more allreduce, which must pair with the same call on every rank."""
    op, form, blocking = arg
    r = synk.comm.rank()
    value = 2 ** 63 + 5 if r == 1 else r + 1
    x = [value, np.ones(2, np.int64)] if form == "list" else value
    try:
        if blocking:
            synk.comm.allreduce(x, op)
        else:
            synk.comm.iallreduce(x, op).wait()
        said = "no error"
    except OverflowError as err:
        said = f"OverflowError: {err}"
    return said, synk.comm.allreduce(r + 1, "sum")


@pytest.mark.parametrize("op", ["sum", "prod", "max", "min", "mean", "band", "bor", "bxor",
                                "land", "lor", "lxor"])
@pytest.mark.parametrize("form", ["int", "list"])
def test_a_python_int_past_int64_on_one_rank_raises_on_every_rank(three, op, form):
    """The rank whose int is out of range takes part with 0 in its place, and every rank
    raises, naming it; the next collective gets every rank's next call."""
    for blocking in (True, False):
        said, after = zip(*on_every_rank(_python_int_past_int64_on_one_rank, op, form,
                                         blocking, timeout=30))
        assert all(s.startswith("OverflowError") and "rank(s) [1] is past the range of "
                   "int64" in s for s in said), said
        assert "this rank's: 9223372036854775813" in said[1]
        assert list(after) == [6] * 3


def _located_past_int64_on_one_rank(arg):
    r = synk.comm.rank()
    try:
        synk.comm.allreduce(2 ** 63 + 5 if r == 1 else r + 1, arg[0])
        said = "no error"
    except (OverflowError, ValueError) as err:
        said = f"{type(err).__name__}: {err}"
    return said, synk.comm.allreduce(r + 1, "sum")


@pytest.mark.parametrize("op", ["maxloc", "minloc"])
def test_a_python_int_past_int64_under_maxloc_raises_on_every_rank(ranks3, op):
    """maxloc and minloc carry no flag: the refusing rank takes part with a float, which
    the others' ints disagree with."""
    said, after = zip(*on_every_rank(_located_past_int64_on_one_rank, op, timeout=30))
    assert all(s.startswith("ValueError") for s in said), said
    assert list(after) == [6] * 3


def _rooted_python_int_past_int64(arg):
    kind, op = arg
    r = synk.comm.rank()
    x = 2 ** 63 + 5 if r == 1 else r + 1
    try:
        if kind == "reduce":
            synk.comm.reduce(x, op, root=0)
        else:
            getattr(synk.comm, kind)(x, op)
        said = "no error"
    except OverflowError as err:
        said = f"OverflowError: {err}"
    return said, synk.comm.allreduce(r + 1, "sum")


@pytest.mark.parametrize("op", ["sum", "prod", "max", "bxor"])
@pytest.mark.parametrize("kind", ["reduce", "scan", "exscan"])
def test_a_python_int_past_int64_in_a_rooted_or_prefix_reduction_raises_on_every_rank(
        ranks3, kind, op):
    """The rank whose int is out of range takes part (its int travels in the exchange of
    forms that comes first), and every rank raises, naming it."""
    said, after = zip(*on_every_rank(_rooted_python_int_past_int64, kind, op, timeout=30))
    assert all(s.startswith(f"OverflowError: synk.comm.{kind}: a Python int of rank(s) [1]")
               for s in said), said
    assert len(set(said)) == 1
    assert list(after) == [6] * 3


def _python_ints_combined(arg):
    kind, values = arg
    x = values[synk.comm.rank()]
    try:
        if kind == "reduce":
            return synk.comm.reduce(x, "sum", root=0)
        return getattr(synk.comm, kind)(x, "sum")
    except OverflowError as err:
        return f"OverflowError: {err}"


@pytest.mark.parametrize("kind", ["reduce", "scan", "exscan"])
def test_python_ints_whose_sum_leaves_int64_raise_rather_than_wrap(ranks3, kind):
    """Python's answer, or OverflowError on every rank where an answer some rank gets would
    leave int64 (in which the ranks' ints travel, and would wrap): the total for reduce,
    each rank's prefix for the scans."""
    big = 2 ** 63 - 1
    got = on_every_rank(_python_ints_combined, kind, [1, 1, big], timeout=30)
    if kind == "exscan":  # (its prefixes stop before the last rank: they stay in range)
        assert got == [None, 1, 2]
    else:
        assert all(isinstance(g, str) and g.startswith(
            f"OverflowError: synk.comm.{kind}: the sum of the ranks' Python ints is "
            f"{big + 2}") for g in got), got
    got = on_every_rank(_python_ints_combined, kind, [2 ** 62, 2 ** 62, -5], timeout=30)
    if kind == "reduce":  # (the total is in range; a prefix is not)
        assert got == [2 ** 63 - 5, None, None]
    else:
        assert len(set(got)) == 1 and got[0].startswith("OverflowError"), got
    got = on_every_rank(_python_ints_combined, kind, [2 ** 62, -(2 ** 62), 2 ** 62],
                        timeout=30)
    assert got == {"reduce": [2 ** 62, None, None], "scan": [2 ** 62, 0, 2 ** 62],
                   "exscan": [None, 2 ** 62, 0]}[kind]


def _python_int_lists_combined(arg):
    kind, values, op = arg
    x = values[synk.comm.rank()]
    try:
        if kind == "reduce":
            got = synk.comm.reduce(x, op, root=0)
        elif kind == "ireduce_scatter":
            got = synk.comm.ireduce_scatter(x, op).wait()
        else:
            got = getattr(synk.comm, kind)(x, op)
    except OverflowError as err:
        return f"OverflowError: {err}"
    return "None" if got is None else repr((got.tolist(), got.dtype.str))  # (one kind
    # of output on every rank)


@pytest.mark.parametrize("kind", ["reduce", "scan", "exscan", "reduce_scatter",
                                  "ireduce_scatter"])
def test_lists_of_python_ints_whose_sum_leaves_int64_raise_on_every_rank(ranks3, kind):
    """A list of Python ints is combined place by place as int64 (an int64 array comes
    back), or raises OverflowError on every rank where a place's answer some rank gets would
    leave int64's range: reduce_scatter's too where only one rank's part would (its
    rows reduced whole, as allreduce's)."""
    def run(values, op="sum"):
        said = on_every_rank(_python_int_lists_combined, kind, values, op, timeout=30)
        return [None if s == "None" else s if s.startswith("OverflowError") else ast.literal_eval(s)
                for s in said]

    big = [[2 ** 62, 1, 2], [2 ** 62, 1, 2], [-5, 1, 2]]  # (place 0: 2**63 - 5 in all; its
    got = run(big)  # prefix over ranks 0 and 1 is past the range)
    if kind == "reduce":
        assert got == [([2 ** 63 - 5, 3, 6], "<i8"), None, None], got
    elif kind in ("reduce_scatter", "ireduce_scatter"):
        assert got == [([2 ** 63 - 5], "<i8"), ([3], "<i8"), ([6], "<i8")], got
    else:
        assert len(set(got)) == 1 and got[0].startswith("OverflowError"), got
    got = run([[2 ** 62, 7, 1], [2 ** 62, 7, 1], [2 ** 62, 7, 1]])
    assert len(set(got)) == 1 and got[0].startswith("OverflowError: synk.comm.") \
        and "past the range of int64" in got[0], got
    past = run([[1, 2, 3], [2 ** 63 + 5, 2, 3], [1, 2, 3]], "max")
    assert all(p.startswith(f"OverflowError: synk.comm.{kind}: a Python int of rank(s) [1] "
                            "is past the range") for p in past), past
    fine = run([[1, 2, 3], [4, 5, 6], [7, 8, -9]], "prod")
    want = {"reduce": [([28, 80, -162], "<i8"), None, None],
            "scan": [([1, 2, 3], "<i8"), ([4, 10, 18], "<i8"), ([28, 80, -162], "<i8")],
            "exscan": [None, ([1, 2, 3], "<i8"), ([4, 10, 18], "<i8")]}.get(
        kind, [([28], "<i8"), ([80], "<i8"), ([-162], "<i8")])
    assert fine == want, fine


def _refused_on_one_rank_then_again(arg):
    kind = arg[0]
    r = synk.comm.rank()
    call = {"allgather": synk.comm.allgather, "allreduce": synk.comm.allreduce,
            "gather": lambda v: synk.comm.gather(v, 0), "scan": synk.comm.scan,
            "alltoall": lambda v: synk.comm.alltoall([v] * synk.comm.size()),
            "reduce_scatter": lambda v: synk.comm.reduce_scatter(
                np.repeat(v, synk.comm.size()))}[kind]
    said = []
    for value in (np.array([1, "a"], dtype=object) if r == 1 else np.array([1.0 + r]),
                  np.array([10.0 + r])):
        try:
            got = call(value)
            said.append(repr(None if got is None else np.asarray(got).tolist()))
        except (TypeError, ValueError) as err:
            said.append(type(err).__name__)
    return said


@pytest.mark.parametrize("kind", ["allgather", "allreduce", "gather", "scan", "alltoall",
                                  "reduce_scatter"])
def test_a_value_refused_on_one_rank_gives_no_rank_its_next_collective(ranks3, kind):
    """Rank 1 refuses its value (Python objects) on its own and catches the error: its
    collective still takes its number, so the others' wait for it raises rather than take
    rank 1's next collective for it (they got its data, as this one's), and the next
    collective of every rank gets its own data."""
    said = on_every_rank(_refused_on_one_rank_then_again, kind, timeout=60)
    assert said[1][0] == "TypeError", said
    assert all(s[0] == "ValueError" for r, s in enumerate(said) if r != 1), said
    want = {"allgather": [[10.0, 11.0, 12.0]] * 3, "allreduce": [[33.0]] * 3,
            "gather": [[10.0, 11.0, 12.0], None, None],
            "scan": [[10.0], [21.0], [33.0]],
            "alltoall": [[[10.0], [11.0], [12.0]]] * 3,
            "reduce_scatter": [[33.0]] * 3}[kind]
    assert [s[1] for s in said] == [repr(w) for w in want], said
