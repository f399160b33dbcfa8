"""Random programs of ``synk.comm`` collectives, run on every rank of a call, and their
one-process numpy model: the randomized harness of ``test_random_programs.py``.

A *program* is a list of operations (plain dicts, so that it pickles to the ranks as a
broadcast input). Every rank runs it inside one call: each operation makes this rank's
input from the program's seed (``rank_input``: the master makes every rank's the same
way), calls the collective (blocking, or non-blocking with its handle waited later, in an
order of the rank's own), and keeps the result. The master then checks every rank's
results against ``expected``, computed with numpy from all the ranks' inputs: integers
and the ops folded in rank order bit for bit, means within their documented bound.

A program may carry one *disagreement*: one rank passes another op, dtype, shape,
structure, root or weighting to one collective. Then the whole call must raise
``ValueError`` or ``TypeError`` (the ranks that see it raise it; the others stop), and
never return numbers, nor hang. Or one rank passes a value that it refuses on its own
(Python objects) to a collective of the call or of a sub-group (and maybe to later ones of
the call too), catches each error and goes on: then no rank may take another collective's
data for a refused one's; the call raises, or returns the model's numbers where no rank
needed a refused part.

Hypothesis draws the programs (``programs``), and shrinks a failing one to a short one;
the counterexamples it found are kept in ``test_random_programs.py`` as plain tests.
"""
from __future__ import annotations

import threading

import numpy as np
from hypothesis import assume, strategies as st

import synk
from synk import _reduction

# The byte sizes where synk.comm changes its way (shm_mesh's ring, the board's slots, the
# shared-memory messages, host_collectives.ONE_SHOT_BYTES, the fused one round's limit):
# arrays are drawn around them.
LIMITS = (16 << 10, 64 << 10, 128 << 10, 256 << 10)
TWO_ROUNDS = 4 << 20  # an allreduce in two rounds past these bytes read from the peers
# (host_collectives.ONE_SHOT_BYTES): the "big" arrays, drawn rarely (slow on two cores)

REAL = ("float64", "float32", "float16", "int64", "int32", "uint8", "bool")
ALL = REAL + ("complex128",)
OPS = {  # reduce op -> the dtypes it is drawn with
    "sum": ALL, "prod": ("float64", "float32", "int64", "int32", "complex128"),
    "max": REAL, "min": REAL, "mean": ALL, "exact_mean": ("float64", "float32", "int32"),
    "band": ("int64", "int32", "uint8", "bool"), "bor": ("int64", "uint8", "bool"),
    "bxor": ("int64", "int32", "bool"), "land": ALL, "lor": ALL, "lxor": REAL,
}
WEIGHTS = (0.0, 1.0, 2.0, 3.0, 7.0, 1e-50, 1e-300, 1e30, 1e300, 1e308)
KINDS = ("allreduce", "allreduce", "allreduce", "reduce", "broadcast", "allgather",
         "reduce_scatter", "gather", "scatter", "alltoall", "scan", "exscan", "barrier",
         "sendrecv")
_TAG = 7  # every message of a program: from one rank with one tag, received in order


# -- drawing programs ------------------------------------------------------------------------
@st.composite
def leaf_shapes(draw, dtype: str, size_class: str, size: int) -> tuple:
    itemsize = np.dtype(dtype).itemsize
    if size_class == "tiny":
        return draw(st.sampled_from([(), (1,), (3,), (2, 3), (0,), (5, 1)]))
    if size_class == "limit":
        limit = draw(st.sampled_from(LIMITS))
        delta = draw(st.integers(-2, 2))
        return (max(1, limit // itemsize + delta),)
    if size_class == "big":
        return (TWO_ROUNDS // (max(size, 2) - 1) // itemsize + draw(st.integers(-1, 1)),)
    return (draw(st.integers(1, 300)),)


@st.composite
def operations(draw, size: int, allow_big: bool) -> dict:
    kind = draw(st.sampled_from(KINDS))
    op = {"kind": kind, "seed": draw(st.integers(0, 2 ** 31 - 1)),
          "blocking": draw(st.booleans()), "group": None}
    size_class = draw(st.sampled_from(
        ["tiny", "tiny", "small", "small", "limit"] + (["big"] if allow_big else [])))
    if kind in ("allreduce", "reduce", "scan", "exscan", "reduce_scatter"):
        name = draw(st.sampled_from(sorted(OPS)))
        if kind == "reduce_scatter" and name == "exact_mean":
            name = "mean"
        if kind in ("scan", "exscan") and name in _reduction.MEANS:
            name = "sum"
        dtypes = OPS[name]
        op["op"] = name
    else:
        dtypes = ALL
    op["root"] = draw(st.integers(0, size - 1))
    if kind == "allreduce":
        op["form"] = draw(st.sampled_from(["array", "array", "list", "dict", "nested",
                                           "pyint", "pyints", "pyfloat"]))
    elif kind in ("broadcast", "allgather"):  # (an allgather of a structure: each leaf's rows)
        op["form"] = draw(st.sampled_from(["array", "list", "dict"]))
    elif kind in ("reduce", "scan", "exscan"):
        op["form"] = draw(st.sampled_from(["array", "array", "array", "pyint", "pyints"]))
    elif kind == "reduce_scatter":
        op["form"] = draw(st.sampled_from(["array", "array", "array", "pyints"]))
    else:
        op["form"] = "array"
    if op["form"] in ("pyint", "pyints"):  # (a Python int, or a list of them: one big)
        op["op"] = draw(st.sampled_from(["sum", "prod", "max", "min"]
                                        + (["mean"] if kind == "allreduce" or (
                                            kind == "reduce" and op["form"] == "pyint")
                                           else [])))
        op["big"] = draw(st.sampled_from([1, 1, 2 ** 31, 2 ** 62, 2 ** 62 + 7]))
        op["length"], op["hot"] = draw(st.integers(1, 3)), draw(st.integers(0, 2))
        op["leaves"] = [((), "int64")]
    elif op["form"] == "pyfloat":
        op["op"] = draw(st.sampled_from(["sum", "max", "min", "mean"]))
        op["leaves"] = [((), "float64")]
    else:
        n_leaves = 1 if op["form"] == "array" else draw(st.integers(1, 4))
        leaves = []
        for _ in range(n_leaves):
            dtype = draw(st.sampled_from(dtypes))
            leaves.append((draw(leaf_shapes(dtype, size_class, size)), dtype))
        op["leaves"] = leaves
    if kind in ("allgather", "gather", "scatter", "alltoall"):
        op["rows"] = [draw(st.integers(0, 4)) for _ in range(size)]
    if kind == "reduce_scatter":  # (split: counts=None, synk's split of the rows they add to)
        op["counts"] = [draw(st.integers(1 if op["form"] == "pyints" else 0, 3))
                        for _ in range(size)]
        op["split"] = draw(st.booleans())
    op["special"] = draw(st.sampled_from([None, None, None, "nan", "inf", "zeros", "huge",
                                          "tiny"]))
    mean = op.get("op") in _reduction.MEANS
    if kind in ("allreduce", "reduce") and mean and op["form"] not in (
            "pyint", "pyints", "pyfloat"):
        if draw(st.booleans()):
            op["weights"] = [draw(st.sampled_from(WEIGHTS)) for _ in range(size)]
            if not any(op["weights"]):
                op["weights"][0] = 1.0
    if kind == "allreduce" and op["form"] in ("array", "list"):
        op["out"] = draw(st.sampled_from([None, None, "fresh", "inplace"]
                                         + (["alias"] if op["form"] == "list" else [])))
    return op


@st.composite
def programs(draw, size: int, allow_big: bool = False, groups: bool = True,
             disagreements: bool = True, skips: bool = True, refusals: bool = True) -> dict:
    """A program for ``size`` ranks: its operations, maybe some of them on a sub-group
    (the ranks of one parity, run by a thread of their own when ``threaded``), and maybe
    one disagreement (a skipped collective among them with ``skips``, a value refused on
    one rank with ``refusals``)."""
    ops = draw(st.lists(operations(size, allow_big), min_size=1, max_size=8))
    if draw(st.integers(0, 9)) == 0:  # a burst of small non-blocking ones in flight
        burst = draw(st.integers(20, 300))
        form = draw(st.sampled_from(["array", "list"]))
        name = draw(st.sampled_from(["sum", "max", "mean"]))
        ops += [{"kind": "allreduce", "seed": i, "blocking": False, "group": None,
                 "op": name, "form": form, "root": 0, "special": None,
                 "leaves": [((2,), "int64"), ((1,), "float64")][:1 if form == "array" else 2]}
                for i in range(burst)]
    program = {"ops": ops, "size": size, "threaded": False,
               "wait_seed": draw(st.integers(0, 2 ** 31 - 1))}
    if groups and size >= 3 and draw(st.integers(0, 3)) == 0:
        smallest = min(len(group_members(size, 0)), len(group_members(size, 1)))
        for op in ops:  # (on the ranks of each parity: sizes fit the smaller group)
            if draw(st.booleans()):
                op["group"] = "parity"
                op["root"] %= smallest
        program["threaded"] = draw(st.booleans())
    if disagreements and draw(st.integers(0, 4)) == 0:  # (no skip beside a sub-group's
        # thread: a rank with a thread of its own may yet send, so two ranks that wait for
        # each other there wait until the timeout)
        alone = not program["threaded"]
        program["disagree"] = draw(disagreement(
            ops, size, skip=skips and alone, refuse=refusals))
    return program


@st.composite
def disagreement(draw, ops: list, size: int, skip: bool = True,
                 refuse: bool = True) -> dict:
    """One rank passes something else to one collective, or (with ``skip``) skips it and
    goes on with the program's later operations: the call must raise. Or (with
    ``refuse``) one rank's value is refused there (``refusal``)."""
    if refuse and draw(st.integers(0, 3)) == 0:
        return draw(refusal(ops, size))
    candidates = [i for i, op in enumerate(ops) if op["group"] is None and op["kind"] in (
        "allreduce", "reduce", "broadcast", "reduce_scatter", "scan", "exscan")]
    if not candidates:
        return {}
    i = draw(st.sampled_from(candidates))
    op = ops[i]
    what = ["dtype", "shape"]
    if "op" in op:
        what.append("op")
    if op["kind"] == "reduce":  # (a broadcast's root is not checked: MPI's rule, below)
        what.append("root")
    if op["form"] in ("list", "dict", "nested"):
        what.append("structure")
    if op.get("weights") is not None:
        what.append("weight")
    if op["kind"] == "broadcast":  # (only the root's array counts)
        what = [w for w in what if w not in ("dtype", "shape", "structure")]
        if not what:
            return {}
    if op["form"] in ("pyint", "pyints", "pyfloat"):  # (its leaves are not what it passes)
        what = [w for w in what if w == "op"]
    skippers = {"allreduce": range(size), "reduce_scatter": range(size),  # (the ranks some
                "reduce": [r for r in range(size) if r != op["root"]],  # other rank waits
                "scan": range(size - 1), "exscan": range(size - 1)}.get(op["kind"], [])  # for)
    if skip and skippers:
        what.append("skip")
    if not what:
        return {}
    field = draw(st.sampled_from(what))
    rank = draw(st.sampled_from(list(skippers)) if field == "skip"
                else st.integers(0, size - 1))
    if field == "skip":  # (it goes on without calling it)
        change = {"skip": True}
    elif field == "op":
        others = [o for o in sorted(OPS) if o != op["op"] and all(
            d in OPS[o] for _, d in op["leaves"])]
        if op["kind"] in ("scan", "exscan", "reduce_scatter"):
            others = [o for o in others if o not in ("exact_mean", "mean")]
        if not others:
            return {}
        change = {"op": draw(st.sampled_from(others))}
    elif field == "dtype":
        shape, dtype = op["leaves"][0]
        other = "float32" if dtype == "float64" else "float64"
        if op.get("op") in ("band", "bor", "bxor"):
            other = "int32" if dtype == "int64" else "int64"
        change = {"leaves": [(shape, other)] + op["leaves"][1:]}
    elif field == "shape" and op["kind"] == "reduce_scatter":  # (its rows are its counts)
        change = {"counts": [op["counts"][0] + 1] + op["counts"][1:]}
    elif field == "shape":
        shape, dtype = op["leaves"][0]
        change = {"leaves": [((shape[0] + 1,) + shape[1:] if shape else (2,), dtype)]
                  + op["leaves"][1:]}
    elif field == "root":
        change = {"root": (op["root"] + 1) % size}
    elif field == "structure":
        leaves = op["leaves"]
        change = {"leaves": leaves[:-1] if len(leaves) > 1 else leaves + leaves}
    else:
        change = {"weights": None}
    return {"op": i, "rank": rank, "change": change, "field": field}


@st.composite
def refusal(draw, ops: list, size: int) -> dict:
    """One rank passes Python objects to one collective (a rooted one's root, since the
    others' values are not read), catches the error and goes on with the program. In a
    sub-group's collective: a rank of one of the groups (``rank`` is its number in the
    call)."""
    candidates = [(i, op) for i, op in enumerate(ops)
                  if op["kind"] not in ("barrier", "sendrecv")]
    if not candidates:
        return {}
    i, op = draw(st.sampled_from(candidates))
    members = list(range(size)) if op["group"] is None else group_members(
        size, draw(st.integers(0, 1)))
    rank = members[op["root"] % len(members)] if op["kind"] in ("broadcast", "scatter") \
        else draw(st.sampled_from(members))
    later = [j for j, other in candidates if j > i and other["group"] == op["group"]
             and other["kind"] not in ("broadcast", "scatter")]  # (every rank's value read;
    # the call's, or the rank's sub-group's)
    also = draw(st.lists(st.sampled_from(later), max_size=2, unique=True)) if later and \
        draw(st.integers(0, 2)) == 0 else []
    found = {"op": i, "rank": rank, "change": {"refuse": True}, "field": "refuse"}
    if also:  # (the rank refuses these too, catching each error)
        found["also"] = sorted(also)
    return found


def refused_ops(program: dict) -> tuple:
    """The operations whose value the program's refusing rank refuses (none: ())."""
    d = program.get("disagree") or {}
    if d.get("field") != "refuse":
        return ()
    return (d["op"], *d.get("also", ()))


def split_rows(op: dict, n: int) -> list:
    """Where a reduce_scatter over ``n`` ranks cuts its rows: at ``counts``, or as synk
    splits rows (shares differing by at most one row, the larger first)."""
    counts = list(op["counts"][:n])
    if op["split"]:
        base, extra = divmod(sum(counts), n)
        counts = [base + (r < extra) for r in range(n)]
    return [int(b) for b in np.cumsum([0] + counts)]


@st.composite
def disagreeing_programs(draw, size: int, allow_big: bool = False) -> dict:
    """A program of blocking collectives whose last one has a disagreement (one rank passes
    another op, dtype, shape, structure, root or weighting, or skips it), each rank catching
    its error: every rank must raise there (but one that skips it: every rank that waits for
    it), none compute past it nor wait for ever."""
    ops = draw(st.lists(operations(size, allow_big), min_size=1, max_size=4))
    for op in ops:
        op["blocking"] = True
    found = draw(disagreement(ops, size, refuse=False))
    assume(bool(found))
    return {"ops": ops[:found["op"] + 1], "size": size, "threaded": False,
            "wait_seed": draw(st.integers(0, 2 ** 31 - 1)), "disagree": found, "catch": True}


def group_members(size: int, parity: int) -> list:
    return [r for r in range(size) if r % 2 == parity]


def effective(program: dict, i: int, rank: int) -> dict:
    """Operation ``i`` as ``rank`` (its number in the call) runs it (its disagreement
    applied)."""
    op = program["ops"][i]
    d = program.get("disagree") or {}
    if d.get("rank") == rank and (d.get("op") == i or i in d.get("also", ())):
        return {**op, **d["change"]}
    return op


# -- inputs ----------------------------------------------------------------------------------
def _values(rng, shape: tuple, dtype: str, special) -> np.ndarray:
    return np.asarray(_drawn(rng, shape, dtype, special))  # (0-d: an array, not a scalar)


def _drawn(rng, shape: tuple, dtype: str, special):
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.random(shape) < 0.5
    if dt.kind in "iu":
        info = np.iinfo(dt)
        lo, hi = (0, 4) if special != "huge" else (0, int(info.max))
        if dt.kind == "i" and special != "huge":
            lo = -3
        return rng.integers(lo, hi, shape, dtype=dt, endpoint=True)
    real = np.dtype(dt.char.lower() if dt.kind == "c" else dt)
    real = np.dtype({"F": "f4", "D": "f8"}.get(dt.char, real.str))
    x = (rng.standard_normal(shape) * 3).astype(real)
    if special == "huge":
        with np.errstate(over="ignore"):
            x = (x * float(np.finfo(real).max) / 8).astype(real)
    elif special == "tiny":
        x = (x * float(np.finfo(real).smallest_subnormal) * 2).astype(real)
    elif special == "zeros":
        x = np.where(rng.random(shape) < 0.5, real.type(0.0), real.type(-0.0)).astype(real)
    elif special in ("nan", "inf") and x.size:
        bad = np.nan if special == "nan" else np.inf
        x.reshape(-1)[rng.integers(0, x.size)] = bad * (1 if rng.random() < 0.5 else -1)
    if dt.kind == "c":
        return (x + 1j * (rng.standard_normal(shape)).astype(real)).astype(dt)
    return x


def rank_input(op: dict, rank: int, n: int):
    """What ``rank`` of ``n`` passes to ``op`` (the operation as it runs it): an array, a
    structure of them, a Python number, or (``scatter``, ``alltoall``) a list of one array
    per rank."""
    rng = np.random.default_rng([op["seed"], rank])
    special = op.get("special")
    leaves = op["leaves"]
    kind = op["kind"]
    if op["form"] == "pyint":
        return int(op["big"]) * (rank + 1) if op["big"] > 1 else int(rng.integers(-5, 6))
    if op["form"] == "pyints":  # (reduce_scatter's: one per row)
        length = sum(op["counts"][:n]) if kind == "reduce_scatter" else op["length"]
        values = [int(v) for v in rng.integers(-5, 6, length)]
        if op["big"] > 1:
            values[op["hot"] % length] = int(op["big"]) * (rank + 1)
        return values
    if op["form"] == "pyfloat":
        return float(rng.standard_normal())
    if kind in ("allgather", "gather"):
        arrays = [_values(rng, (op["rows"][rank],) + tuple(shape[1:]), dtype, special)
                  for shape, dtype in leaves]
        return _formed(arrays, op["form"])
    if kind in ("scatter", "alltoall"):
        shape, dtype = leaves[0]
        return [_values(rng, (op["rows"][p],) + tuple(shape[1:]), dtype, special)
                for p in range(n)]
    if kind == "reduce_scatter":
        shape, dtype = leaves[0]
        return _values(rng, (sum(op["counts"][:n]),) + tuple(shape[1:]), dtype, special)
    return _formed([_values(rng, tuple(shape), dtype, special) for shape, dtype in leaves],
                   op["form"])


def _formed(arrays: list, form: str):
    """``arrays`` in the structure ``form`` names."""
    if form == "array":
        return arrays[0]
    if form == "list":
        return arrays
    if form == "dict":
        return {f"k{j}": a for j, a in enumerate(arrays)}
    return {"a": arrays[:1], "b": {"c": arrays[1:]}}


# -- running a program on the ranks ----------------------------------------------------------
def host(value):
    """``value`` with device arrays copied to numpy (recursively)."""
    if isinstance(value, dict):
        return {k: host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host(v) for v in value)
    if hasattr(value, "get") and hasattr(value, "dtype") and not isinstance(value, np.ndarray):
        return value.get()
    return value


def _device(value, xp):
    if xp is np:
        return value
    if isinstance(value, dict):
        return {k: _device(v, xp) for k, v in value.items()}
    if isinstance(value, list):
        return [_device(v, xp) for v in value]
    if isinstance(value, np.ndarray):
        return xp.asarray(value)
    return value


def _issue(comm, op: dict, x, size: int, rank: int):
    """Start ``op`` on ``comm`` (``synk.comm`` or a group); a Handle where non-blocking,
    else the result. ``out=`` as the operation asks: the result is then that array."""
    kind, blocking = op["kind"], op["blocking"]
    root = op["root"]
    if kind == "allreduce":
        weights = op.get("weights")
        weight = None if weights is None else weights[rank]
        out = op.get("out")
        if out is None:
            f = comm.allreduce if blocking else comm.iallreduce
            return f(x, op["op"], weight=weight)
        leaves = x if isinstance(x, list) else [x]
        kept = [_reduction.result_dtype(op["op"], [a.dtype]) == a.dtype for a in leaves]
        if out == "inplace" and not all(kept):  # (a result of another dtype: not into x)
            out = "fresh"
        if out == "inplace":
            out = x
        elif out == "fresh":
            xp = synk.xp(leaves[0])
            outs = [xp.empty(a.shape, _reduction.result_dtype(op["op"], [a.dtype]))
                    for a in leaves]
            out = outs if isinstance(x, list) else outs[0]
        elif out == "alias":  # (one array named for every leaf)
            out = [x[0]] * len(x)
        f = comm.allreduce if blocking else comm.iallreduce
        return f(x, op["op"], weight=weight, out=out)
    if kind == "reduce":
        weights = op.get("weights")
        weight = None if weights is None else weights[rank]
        f = comm.reduce if blocking else comm.ireduce
        return f(x, op["op"], root, weight=weight)
    if kind == "broadcast":
        f = comm.broadcast if blocking else comm.ibroadcast
        return f(x if rank == root else None, root)
    if kind == "allgather":
        return (comm.allgather if blocking else comm.iallgather)(x)
    if kind == "gather":
        return (comm.gather if blocking else comm.igather)(x, root)
    if kind == "scatter":
        return (comm.scatter if blocking else comm.iscatter)(x if rank == root else None, root)
    if kind == "alltoall":
        return (comm.alltoall if blocking else comm.ialltoall)(x)
    if kind == "reduce_scatter":
        f = comm.reduce_scatter if blocking else comm.ireduce_scatter
        return f(x, op["op"], None if op["split"] else op["counts"][:size])
    if kind == "scan":
        return (comm.scan if blocking else comm.iscan)(x, op["op"])
    if kind == "exscan":
        return (comm.exscan if blocking else comm.iexscan)(x, op["op"])
    if kind == "sendrecv":  # (a ring: this rank's x to the next, the one before's here)
        dest, source = (rank + 1) % size, (rank - 1) % size
        if blocking:
            return comm.sendrecv(x, dest, source, tag=_TAG)
        return _Exchange(comm.isend(x, dest, tag=_TAG), comm.irecv(source, tag=_TAG))
    return comm.barrier() if blocking else comm.ibarrier()


REFUSED = "refused on its own"  # (a refusing rank's result of that op)


def _refused(comm, op: dict, size: int, rank: int) -> str:
    """``op`` with Python objects for this rank's value, which it must refuse on its own:
    its error caught (the program goes on), ``REFUSED``; else what it returned, which
    ``check`` rejects."""
    bad = np.array([1, "a"], dtype=object)
    value = [bad] * size if op["kind"] in ("scatter", "alltoall") else bad
    try:
        got = _issue(comm, {**op, "out": None}, value, size, rank)
        return repr(got if op["blocking"] else got.wait())
    except (TypeError, ValueError):
        return REFUSED


class _Exchange:
    """A non-blocking sendrecv: ``wait()`` gives what was received."""

    def __init__(self, sent, received) -> None:
        self.sent, self.received = sent, received

    def wait(self):
        got = self.received.wait()
        self.sent.wait()
        return got


def _run_ops(comm, program: dict, indices: list, rank: int, size: int, results: dict,
             xp, me: int) -> None:
    """``program``'s operations ``indices`` on ``comm`` (the call's, or a sub-group's, in
    which this rank is ``rank`` of ``size``; ``me``: its number in the call, which a
    disagreement names)."""
    handles = []
    for i in indices:
        op = effective(program, i, me)
        if op.get("skip"):
            continue
        if op.get("refuse"):
            results[i] = _refused(comm, op, size, rank)
            continue
        x = _device(rank_input(op, rank, size), xp)
        got = _issue(comm, op, x, size, rank)
        if op["blocking"]:
            results[i] = host(got)
        else:
            handles.append((i, got))
    order = np.random.default_rng([program["wait_seed"], rank]).permutation(len(handles))
    for j in order:
        i, h = handles[j]
        results[i] = host(h.wait())


def run_program(program: dict, marker) -> dict:
    """Run ``program`` on this rank (inside a synk function); {op index: result}. Its
    arrays are ``marker``'s kind: numpy's, or device arrays where ``marker`` arrived as one
    (a broadcast input of a GPU rank). A program that ``catch``es gives {"raised": (the
    error's type name, its message)} for an error of this rank's."""
    if not program.get("catch"):
        return _run_program(program, marker)
    try:
        return _run_program(program, marker)
    except Exception as err:
        return {"raised": (type(err).__name__, str(err))}


def _run_program(program: dict, marker) -> dict:
    xp = synk.xp(marker)
    comm = synk.comm
    rank, size = comm.rank(), comm.size()
    results: dict = {}
    grouped = [i for i, op in enumerate(program["ops"]) if op["group"] == "parity"]
    plain = [i for i, op in enumerate(program["ops"]) if op["group"] is None]
    group = comm.split(rank % 2) if grouped else None
    if grouped and program["threaded"]:
        errors: list = []

        def run_group():
            try:
                _run_ops(group, program, grouped, group.rank(), group.size(), results, xp,
                         rank)
            except BaseException as err:  # (raised in the call's thread, below)
                errors.append(err)

        thread = threading.Thread(target=run_group)
        thread.start()
        try:
            _run_ops(comm, program, plain, rank, size, results, xp, rank)
        finally:
            thread.join()
        if errors:
            raise errors[0]
        return results
    for i, op in enumerate(program["ops"]):
        if op["group"] == "parity":
            _run_ops(group, program, [i], group.rank(), group.size(), results, xp, rank)
        else:
            _run_ops(comm, program, [i], rank, size, results, xp, rank)
    return results


# -- the model ---------------------------------------------------------------------------------
class Disagrees(Exception):
    """Why a program must make its call raise (a disagreement, an alias, an overflow, weights
    that sum to 0), and the exceptions that may say so."""

    def __init__(self, why: str, errors: tuple = (ValueError, TypeError),
                 may_return: bool = False) -> None:
        super().__init__(why)
        self.errors, self.may_return = errors, may_return


def expected_error(program: dict) -> Disagrees | None:
    """Why the program's call must raise, or None where it must return the model's
    numbers. (Several reasons: the call may raise any of their errors, whichever comes
    first on the ranks.)"""
    reasons = []
    d = program.get("disagree") or {}
    if d.get("field") == "skip":
        reasons.append(Disagrees(f"rank {d['rank']} skips op {d['op']}"))  # (its next
        # collective may meet theirs: on GPU ranks, a device array against a host one)
    elif d.get("field") == "refuse":
        reasons.append(Disagrees(f"rank {d['rank']} refuses its value of op(s) "
                                 f"{list(refused_ops(program))} and "
                                 "goes on", may_return=True))
    elif d:
        reasons.append(Disagrees(f"rank {d['rank']} passes another {d['field']} to op "
                                 f"{d['op']}"))
    size = program["size"]
    for op in program["ops"]:
        counts = [size] if op["group"] is None else [len(group_members(size, p)) for p in (0, 1)]
        if op.get("out") == "alias" and _aliased_in_vain(op):
            reasons.append(Disagrees("out= names one array twice"))
        for n in counts:
            weights = op.get("weights")
            if weights is not None and not sum(weights[:n]) > 0:
                reasons.append(Disagrees("the weights sum to 0"))
            if op["form"] in ("pyint", "pyints"):  # (Python ints combine as int64, or
                values = [rank_input(op, r, n) for r in range(n)]  # raise)
                if op["form"] == "pyint":
                    values = [[v] for v in values]
                if any(_past_int64(op, list(column)) for column in zip(*values)):
                    reasons.append(Disagrees("Python ints past int64", (OverflowError,)))
    if not reasons:
        return None
    errors = tuple({e for reason in reasons for e in reason.errors})
    return Disagrees("; ".join(str(r) for r in reasons), errors,
                     all(reason.may_return for reason in reasons))


def _past_int64(op: dict, values: list) -> bool:
    """Whether the ranks' Python ints of one place (``values``, in rank order) leave
    int64's range: one of them, or their sum or product over the ranks the operation
    combines (a scan's every prefix; reduce_scatter's, reduced whole, every rank)."""
    combined, results = 0 if op["op"] == "sum" else 1, []
    for v in values:  # (the result over ranks 0..r, for each r)
        combined = combined + v if op["op"] == "sum" else combined * v
        results.append(combined)
    answers = {"scan": results, "exscan": results[:-1]}.get(op["kind"], results[-1:])
    return not all(-2 ** 63 <= v < 2 ** 63 for v in values) or (
        op["op"] in ("sum", "prod") and not all(-2 ** 63 <= a < 2 ** 63 for a in answers))


def _aliased_in_vain(op: dict) -> bool:
    """Whether ``out=`` naming the first leaf for every leaf must raise: it overlaps itself
    (two leaves, the first not empty), or a leaf's result has another shape or dtype."""
    leaves = op["leaves"]
    first = (tuple(leaves[0][0]), np.dtype(leaves[0][1]))
    results = {(tuple(shape), _reduction.result_dtype(op["op"], [np.dtype(d)]))
               for shape, d in leaves}
    return results != {first} or (len(leaves) > 1 and np.prod(first[0], dtype=int) > 0)


def _flat(tree) -> list:
    if isinstance(tree, dict):
        return [leaf for v in tree.values() for leaf in _flat(v)]
    if isinstance(tree, (list, tuple)):
        return [leaf for v in tree for leaf in _flat(v)]
    return [tree]


_UFUNCS = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
           "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor,
           "land": np.logical_and, "lor": np.logical_or, "lxor": np.logical_xor}


def _fold(op: str, parts: list) -> np.ndarray:
    """``op`` over ``parts`` (arrays of one shape) in rank order, in numpy's dtype: the bits
    synk's host collectives give."""
    values = [np.asarray(p) for p in parts]
    dtype = _reduction.result_dtype(op, [v.dtype for v in values])
    if op in _reduction.LOGICAL:
        values = [v if v.dtype == bool else v != 0 for v in values]
    values = [v.astype(dtype) for v in values]
    acc = values[0]
    with np.errstate(all="ignore"):
        for v in values[1:]:
            acc = _UFUNCS[op](acc, v)
    return np.asarray(acc)


def mean_error_bound(parts_abs_sum, n: int, dtype) -> float:
    """The documented bound of a mean's error against float64 numpy: ``(n + 2) * eps *
    sum_r |w_r / W * x_r|`` for ``n`` parts of ``dtype`` (elementwise, given the sum): a few
    ulps of the dtype per rank, for results in the dtype's normal range."""
    dtype = _reduction.mean_dtype([np.dtype(dtype)])
    eps = np.finfo(dtype).eps if dtype.kind in "fc" else np.finfo(np.float64).eps
    return (n + 2) * float(eps) * parts_abs_sum


def _mean(op: str, parts: list, weights) -> tuple:
    """(the expected value, its tolerance) of a mean of ``parts``: for ``mean`` numpy's in
    float64 (complex128), within the documented bound plus the result dtype's subnormal
    spacing per part; for ``exact_mean`` the bits of its rule (float64 terms in rank order,
    divided, cast)."""
    values = [np.asarray(p) for p in parts]
    dtype = _reduction.mean_dtype([v.dtype for v in values])
    ws, total = _reduction.weights_of([(w, None) for w in (
        [1.0] * len(values) if weights is None else weights)])
    acc = np.promote_types(dtype, np.float64)
    with np.errstate(all="ignore"):
        if op == "exact_mean":
            terms = [np.multiply(v, acc.type(w), dtype=acc) for w, v in zip(ws, values) if w]
            summed = terms[0]
            for t in terms[1:]:
                summed = summed + t
            return np.asarray((summed / acc.type(total)).astype(dtype)), None
        terms = [v.astype(acc) * _reduction.factor(w, total) for w, v in zip(ws, values) if w]
        exact = terms[0]
        for t in terms[1:]:
            exact = exact + t
        bound = mean_error_bound(sum(np.abs(t) for t in terms), len(values), dtype)
        bound = bound + (len(values) + 2) * float(np.finfo(dtype).smallest_subnormal)
    return exact, (dtype, bound)


def _reduced(op: str, parts: list, weights, form: str) -> list:
    """The expected leaves of a reduction of ``parts`` (structures alike): ``(value,
    tolerance)`` pairs (tolerance None: these bits)."""
    if form == "pyints":  # (each place as one Python int)
        return [_reduced(op, list(column), weights, "pyint")[0] for column in zip(*parts)]
    if form == "pyint" and op in ("sum", "prod", "max", "min"):
        if op in ("max", "min"):
            return [((max if op == "max" else min)(parts), None)]
        total = 0 if op == "sum" else 1
        for p in parts:
            total = total + p if op == "sum" else total * p
        return [(total, None)]
    if form == "pyint":  # (a mean of ints: of the floats they are)
        parts = [float(p) for p in parts]
    leaves = [_flat(p) for p in parts]
    out = []
    for j in range(len(leaves[0])):
        column = [np.asarray(lv[j]) for lv in leaves]
        if op in _reduction.MEANS:
            out.append(_mean(op, column, weights))
        elif op == "prod" and any(np.asarray(c).dtype.kind == "c" for c in column):
            out.append((_fold(op, column), "ulps"))  # (numpy's complex product of an array
            # and of a number may round apart: its loops use FMA where they can)
        else:
            out.append((_fold(op, column), None))
    return out


def _check_value(got, want, tolerance, where: str, exact: bool) -> None:
    if isinstance(want, int) and not isinstance(want, bool):
        assert type(got) is int and got == want, f"{where}: {got!r} != {want!r}"
        return
    got_a, want_a = np.asarray(got), np.asarray(want)
    assert got_a.shape == want_a.shape, f"{where}: shape {got_a.shape} != {want_a.shape}"
    if tolerance == "ulps":
        exact, tolerance = False, None
    if tolerance is None:
        assert got_a.dtype == want_a.dtype, f"{where}: dtype {got_a.dtype} != {want_a.dtype}"
        if exact or got_a.dtype.kind not in "fc":
            same = np.array_equal(got_a, want_a, equal_nan=got_a.dtype.kind in "fc")
            assert same, f"{where}: {got_a!r} != numpy's {want_a!r}"
            return
        eps = float(np.finfo(got_a.dtype).eps)  # (another order of the sum: NCCL's)
        np.testing.assert_allclose(got_a, want_a, rtol=8 * eps, atol=0, equal_nan=True,
                                   err_msg=where)
        return
    dtype, bound = tolerance
    assert got_a.dtype == dtype, f"{where}: dtype {got_a.dtype} != {dtype}"
    with np.errstate(all="ignore"):
        g = got_a.astype(want_a.dtype)
        finite = np.isfinite(want_a)
        fits = finite & (np.abs(want_a) <= float(np.finfo(dtype).max))
        good = np.where(fits, np.abs(g - want_a) <= bound, True)
        odd = np.where(~finite, np.isnan(g) == np.isnan(want_a), True)
    assert good.all(), f"{where}: {got_a!r} is not within {bound!r} of numpy's {want_a!r}"
    assert odd.all(), f"{where}: {got_a!r} against numpy's {want_a!r} (NaN, inf)"


def check(program: dict, results: list, exact: bool = True) -> None:
    """Assert every rank's results (``results[r]``: {op index: value}) are the model's
    (``exact``: floats folded in rank order bit for bit; else within a few ulps, for NCCL's
    order of the terms)."""
    size = program["size"]
    d = program.get("disagree") or {}
    refuser = d["rank"] if d.get("field") == "refuse" else None
    refused = refused_ops(program)
    for i in refused:
        got = results[refuser][i]
        assert got == REFUSED, f"rank {refuser} took Python objects in op {i}: {got}"
    for i, op in enumerate(program["ops"]):
        if op["group"] == "parity":
            for parity in (0, 1):
                _check_op(op, i, group_members(size, parity), results, exact,
                          refuser if i in refused else None)
        else:
            _check_op(op, i, list(range(size)), results, exact,
                      refuser if i in refused else None)


def _check_op(op: dict, i: int, members: list, results: list, exact: bool,
              refuser: int | None = None) -> None:
    """Op ``i``'s result on each member (but ``refuser``, which refused its value) against
    the model."""
    n = len(members)
    ranks = [r for r in range(n) if members[r] != refuser]
    kind = op["kind"]
    inputs = [rank_input(op, r, n) for r in range(n)]  # (by the member's own number)

    def where(r: int) -> str:
        return f"op {i} ({kind} {op.get('op', '')} {op['form']}) on rank {members[r]}"

    def same(got, want, tolerance, r: int, part: str = "") -> None:
        _check_value(got, want, tolerance, where(r) + part, exact)

    def result(r: int):
        return results[members[r]][i]

    if kind == "barrier":
        return
    if op["form"] == "pyints" and kind != "allreduce":  # (an int64 array, of the places'
        for r in ranks:  # Python ints)
            if kind == "reduce_scatter":
                bounds = split_rows(op, n)
                want = _ints_array(op["op"], inputs)[bounds[r]:bounds[r + 1]]
            elif kind == "reduce":
                want = _ints_array(op["op"], inputs) if r == op["root"] else None
            else:
                upto = r + 1 if kind == "scan" else r
                want = _ints_array(op["op"], inputs[:upto]) if upto else None
            if want is None:
                assert result(r) is None, f"{where(r)}: {result(r)!r} where None is due"
                continue
            same(result(r), want, None, r)
        return
    if kind in ("allreduce", "reduce"):
        weights = op.get("weights")
        expected = _reduced(op["op"], inputs, None if weights is None else weights[:n],
                            op["form"])
        for r in ranks:
            got = result(r)
            if kind == "reduce" and r != op["root"]:
                assert got is None, f"{where(r)}: {got!r} off the root"
                continue
            number = op["form"] in ("pyint", "pyfloat")
            leaves = [got] if number else _flat(got)
            assert len(leaves) == len(expected), f"{where(r)}: the structure of {got!r}"
            for g, (want, tolerance) in zip(leaves, expected):
                same(g, want, tolerance, r)
            if number:
                assert type(got) in (int, float), f"{where(r)}: a {type(got)}, not a number"
        return
    if kind == "broadcast":
        want = _flat(inputs[op["root"]])
        for r in ranks:
            got = _flat(result(r))
            assert len(got) == len(want), f"{where(r)}: the structure of {result(r)!r}"
            for g, w in zip(got, want):
                same(g, w, None, r)
        return
    if kind in ("allgather", "gather"):
        parts = [_flat(x) for x in inputs]  # (each rank's leaves, each joined along axis 0)
        want = [np.concatenate([np.atleast_1d(p[j]) for p in parts])
                for j in range(len(parts[0]))]
        for r in ranks:
            if kind == "gather" and r != op["root"]:
                assert result(r) is None, f"{where(r)}: {result(r)!r} off the root"
                continue
            got = _flat(result(r))
            assert len(got) == len(want), f"{where(r)}: the structure of {result(r)!r}"
            for g, w in zip(got, want):
                same(g, w, None, r)
        return
    if kind == "scatter":
        for r in ranks:
            same(result(r), inputs[op["root"]][r], None, r)
        return
    if kind == "alltoall":
        for r in ranks:
            assert len(result(r)) == n, f"{where(r)}: {len(result(r))} parts"
            for p in range(n):
                same(result(r)[p], inputs[p][r], None, r, f" part {p}")
        return
    if kind == "reduce_scatter":
        bounds = split_rows(op, n)
        for r in ranks:
            (want, tolerance), = _reduced(op["op"], [x[bounds[r]:bounds[r + 1]] for x in inputs],
                                          None, "array")
            same(result(r), want, tolerance, r)
        return
    if kind == "sendrecv":
        for r in ranks:
            same(result(r), inputs[(r - 1) % n], None, r)
        return
    if kind in ("scan", "exscan"):
        for r in ranks:
            upto = r + 1 if kind == "scan" else r
            if upto == 0:
                assert result(r) is None, f"{where(r)}: {result(r)!r} on rank 0 of an exscan"
                continue
            (want, tolerance), = _reduced(op["op"], inputs[:upto], None, op["form"])
            same(result(r), want, tolerance, r)
        return
    raise AssertionError(f"no model of {kind}")


def _ints_array(op: str, parts: list) -> np.ndarray:
    """``op`` of the ranks' lists of Python ints ``parts``, place by place, as the int64
    array a rooted, prefix or scattered reduction gives."""
    return np.array([want for want, _ in _reduced(op, parts, None, "pyints")], np.int64)


def budget_seconds(default: float) -> float:
    """How long a soak runs (``SYNK_SOAK_MINUTES``), else ``default``."""
    import os

    minutes = os.environ.get("SYNK_SOAK_MINUTES")
    return default if not minutes else float(minutes) * 60
