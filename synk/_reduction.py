"""The reduce ops, written once for every back end: their names, the dtype of a result, what
a rank without rows contributes, and how parts are combined.

Every function takes the array module (``numpy`` on the host, ``cupy`` on a GPU rank), so
the host combine, the slices of a GPU rank, the NCCL communicator, the fused allreduce and the
shared variables all follow the same rule rather than copies of it.

**The one rule of ``mean``**, on every back end::

    mean = sum_r (w_r / W) * x_r,    W = sum_r w_r

Each rank's part is pre-scaled by its factor ``w_r / W`` (rounded to the result's dtype) in
the result's dtype, and the scaled parts are summed in that dtype, by one collective of the
data's own bytes (in rank order where synk sums; NCCL picks its own order). The result's
dtype is the parts' float or complex type (float16 stays float16, bfloat16 bfloat16), and
float64 for integers and booleans, as numpy's. Unweighted means have ``w_r = 1``. A part of
weight 0 contributes exactly zero (not ``0 * x``, so the NaN of a mean over no rows stays
out). Pre-scaling keeps ``|w_r / W * x_r| <= |x_r|``, so no sum overflows where the mean
does not. Precision: a few ulps of the dtype per rank; the bound tested against float64
numpy is ``|mean - exact| <= (n + 2) * eps * sum_r |w_r / W * x_r|`` for n ranks and the
dtype's ``eps`` (``mean_error_bound``). This is what torch DDP, Horovod and
cupyx.distributed do, and it keeps a collective's bandwidth for the data.

Where ``W`` is not known to every rank beforehand (``synk.comm.allreduce(x, "mean",
weight=w)``), each rank sends its part scaled by ``w_r / S`` and that factor itself, one
more element in the same buffer, with ``S`` a scale every rank knows without a message (the
call's rows); the sum of the factors then divides the sum (``weighted_finish``).

**``exact_mean``** (or ``mean`` with ``SYNK_MEAN=exact``) is the float64 rule of synk 0.1,
for results that must agree bit for bit between CPU ranks, GPU ranks and MPI: each term
``w_r * x_r`` in float64 (complex128), the terms summed in that type, divided by ``W``,
then cast to the result dtype: the number ``np.average(x.astype(np.float64),
weights=w).astype(x.dtype)`` gives. It moves float64 over the collectives.

**The other ops** are numpy's ufuncs, folded over the parts in rank order, in the dtype of
numpy's promotion over every part: ``sum``, ``prod``, ``max``, ``min``; the bitwise ``band``,
``bor``, ``bxor`` (MPI's BAND, BOR, BXOR: integers and bools only, ``check_dtype``); the
logical ``land``, ``lor``, ``lxor`` (MPI's LAND, LOR, LXOR: any numbers, a bool result).
``maxloc``/``minloc`` give a value and a rank, so they are no fold of parts
(``synk.comm._loc``).

**By host** (under MPI, where a host runs several ranks): each such host combines its
ranks' parts into one ``partial`` (a mean's sum of scaled terms, an exact mean's sum of
float64 terms not yet divided; another op in the result's dtype), and the master combines
the partials (``combine_partials``). The terms and the types are the same; only the order
of the sums differs: host by host.
"""
from __future__ import annotations

import enum
import functools

import numpy as np

from . import _settings

MEANS = ("mean", "exact_mean")  # in the data's dtype; in float64 (synk 0.1's rule)
ARITHMETIC = ("sum", "prod", "max", "min") + MEANS
BITWISE = ("band", "bor", "bxor")  # MPI's BAND, BOR, BXOR: integers and bool, their dtype
LOGICAL = ("land", "lor", "lxor")  # MPI's LAND, LOR, LXOR: any numbers, a bool result
OPS = ARITHMETIC + BITWISE + LOGICAL  # the elementwise ops of every reduction
LOC_OPS = ("maxloc", "minloc")  # (value, lowest rank holding it): synk.comm only
_ALIASES = {"avg": "mean", "exact_avg": "exact_mean", "bitwise_and": "band",
            "bitwise_or": "bor", "bitwise_xor": "bxor", "logical_and": "land",
            "logical_or": "lor", "logical_xor": "lxor"}
PICKY = BITWISE + LOC_OPS  # the ops that do not take every number
_NAMES: dict = {}  # an op as given -> its name, lowercased and unaliased (``canonical``)
_UFUNC = {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum",
          "band": "bitwise_and", "bor": "bitwise_or", "bxor": "bitwise_xor",
          "land": "logical_and", "lor": "logical_or", "lxor": "logical_xor"}


def canonical(op, allowed: tuple = OPS, what: str = "synk.comm") -> str:
    """``op``'s canonical name ("avg" is "mean", any case), or a ValueError listing
    ``allowed``."""
    if isinstance(op, str):
        name = _NAMES.get(op)
        if name is None:
            lower = op.lower()
            name = _ALIASES.get(lower, lower)
            if len(_NAMES) < 1024:
                _NAMES[op] = name
    else:
        name = op
    if name == "mean" and _settings.mean_rule() == "exact":
        name = "exact_mean"
    if name not in allowed:
        raise ValueError(f"unknown op {op!r} for {what}: use one of {list(allowed)}")
    return name


def check_dtype(op: str, dtype, what: str = "synk", parts=()) -> None:
    """TypeError unless ``op`` takes numbers of ``dtype``: bitwise ops integers and bool,
    maxloc/minloc real numbers (the others take every number). ``parts``: the dtypes that
    ``dtype`` promotes, when it comes from several ranks."""
    if op not in PICKY:
        return
    dtype = np.dtype(dtype)
    if op in BITWISE and dtype.kind not in "biu":
        kinds = sorted({str(np.dtype(d)) for d in parts}, key=str)
        if kinds and all(np.dtype(d).kind in "biu" for d in parts):  # int64 with uint64
            raise TypeError(
                f"{what}: op {op!r} is bitwise and takes integers, and every rank passed "
                f"integers, but of dtypes {', '.join(kinds)}, which numpy promotes to "
                f"{dtype} (no integer dtype holds them all); pass the same integer dtype on "
                "every rank (cast to int64, or to uint64)")
        raise TypeError(f"{what}: op {op!r} is bitwise and takes integer and bool arrays, not "
                        f"{dtype}; cast to an integer dtype, or use 'land', 'lor' or 'lxor' "
                        "for the truth of any numbers")
    if op in LOC_OPS and dtype.kind not in "biuf":
        raise TypeError(f"{what}: op {op!r} compares real numbers (bool, integers, floats), "
                        f"not {dtype}")


def promoted(dtypes) -> np.dtype:
    """numpy's promotion over ``dtypes`` (``np.result_type``), which is slow enough to skip
    in the usual case of one native dtype everywhere."""
    if not isinstance(dtypes, list):
        dtypes = list(dtypes)
    first = dtypes[0]
    if isinstance(first, np.dtype) and first.isnative and dtypes.count(first) == len(dtypes):
        return first
    return np.result_type(*dtypes)


def mean_dtype(dtypes) -> np.dtype:
    """The dtype of a mean of parts of ``dtypes``: their float or complex type, float64 for
    integers and booleans."""
    dtype = promoted(dtypes)
    return dtype if dtype.kind in "fc" else np.dtype(np.float64)


def result_dtype(op, dtypes) -> np.dtype:
    """The dtype of ``op`` over parts of ``dtypes``: numpy's promotion over all of them
    (whichever rank returned which); booleans sum and multiply as counts (``int_``), as
    numpy's ``sum`` does; logical ops give bool."""
    if op in MEANS:
        return mean_dtype(dtypes)
    if op in LOGICAL:
        return np.dtype(bool)
    dtype = promoted(dtypes)
    if op in BITWISE:
        check_dtype(op, dtype, parts=dtypes)
    return np.dtype(np.int_) if op in ("sum", "prod") and dtype.kind == "b" else dtype


def accumulator(dtype) -> np.dtype:
    """The dtype an exact mean of ``dtype`` accumulates in: float64, or complex128."""
    return np.promote_types(mean_dtype([dtype]), np.float64)


def exact_term(xp, x, weight):
    """This part's term of an exact mean, ``weight * x`` in the accumulator dtype; zeros for
    a part of weight 0."""
    acc = accumulator(x.dtype)
    if not weight:
        return xp.zeros(x.shape, acc)
    if xp is np:  # the same bits, without the widened copy of x
        return np.multiply(x, acc.type(weight), dtype=acc)
    return x.astype(acc) * acc.type(weight)


def exact_finish(total, weight_sum, dtype):
    """An exact mean from the sum of its terms: divided by the weights' total, in ``dtype``.
    ``total`` is the caller's scratch: an array is divided in place."""
    total /= total.dtype.type(weight_sum)
    return total.astype(dtype, copy=False)


def scaled(xp, x, factor: float, dtype=None):
    """This part's term of a mean, ``factor * x`` in the mean's dtype (``dtype``, default:
    ``x``'s mean dtype): zeros for a factor of 0 (so a NaN or an infinity of a part that
    counts for nothing stays out)."""
    dtype = mean_dtype([x.dtype]) if dtype is None else dtype
    if not factor:
        return xp.zeros(x.shape, dtype)
    if xp is np:
        return np.multiply(x, dtype.type(factor), dtype=dtype)
    return x.astype(dtype, copy=False) * dtype.type(factor)


def factors(weights: list, total: float) -> list:
    """Each part's factor ``w / W`` of a mean."""
    return [w / total if w else 0.0 for w in weights]


def weighted_finish(total, scale_sum, dtype):
    """A mean whose parts went as ``w_r / S * x_r`` with their factors summed beside them
    (``scale_sum``, the weights' total over ``S``): the sum divided by it, in ``dtype``
    (no division where it is 1, as it is when the weights were the call's rows). ``total``
    is the caller's scratch: an array is divided in place."""
    if scale_sum != 1:
        total /= total.dtype.type(scale_sum)
    return total.astype(dtype, copy=False)


def mean_error_bound(parts_abs_sum, n: int, dtype) -> float:
    """The documented bound of a mean's error against float64 numpy: ``(n + 2) * eps *
    sum_r |w_r / W * x_r|`` for ``n`` parts of ``dtype`` (elementwise, given the sum)."""
    dtype = mean_dtype([np.dtype(dtype)])
    eps = np.finfo(dtype).eps if dtype.kind in "fc" else np.finfo(np.float64).eps
    return (n + 2) * float(eps) * parts_abs_sum


def weights_of(parts) -> tuple[list, float]:
    """(each part's weight, their total) for a mean: equal weights when every weight is 0
    (an output of ranks that processed no rows)."""
    weights = [w for w, _ in parts]
    total = float(sum(weights))
    if not total:
        return [1] * len(parts), float(len(parts))
    return weights, total


def identity(op: str, dtype: np.dtype):
    """What a part with no rows contributes to ``op`` over ``dtype``: it changes nothing."""
    if op in ("sum", "bor", "bxor", "lor", "lxor") or op in MEANS:
        return 0
    if op == "prod":
        return 1
    if op in ("band", "land"):  # (every bit set)
        return True if dtype.kind == "b" else np.invert(dtype.type(0))
    if dtype.kind == "b":
        return op == "min"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return info.min if op == "max" else info.max
    return -np.inf if op == "max" else np.inf


class Kind(enum.IntEnum):
    """What kind of value an output or a leaf was, so that a result is given back as the
    ranks gave their parts. Ordered: the ranks' parts of one output combine to the widest
    kind among them (``widest``). Messages carry a kind as its plain int (a member pickles
    much slower); ``Kind(k)`` or ``KINDS[k]`` reads it back."""

    PY = 0  # a Python number
    NP = 1  # a numpy scalar (a 0-d device array comes back as one)
    ARR = 2  # an array
    DONE = 3  # not a kind of value: an output combined already (on the devices)


PY, NP, ARR = Kind.PY, Kind.NP, Kind.ARR
KINDS = tuple(Kind)  # int -> Kind, by index (faster than Kind(k))


def widest(kinds) -> Kind:
    """The kind of a result combined from parts of ``kinds``: an array if any part was one,
    else a numpy scalar if any was, else a Python number."""
    return KINDS[max(kinds)]


def kind_of(value) -> Kind:
    if type(value) is np.ndarray:
        return ARR
    if isinstance(value, np.generic):
        return NP
    if isinstance(value, (bool, int, float, complex)):
        return PY
    return ARR  # (numpy's, a device array, or an array-like made one by np.asarray)


def restore_kind(result: np.ndarray, kind: int):
    """``result`` as the kind of value ``kind`` (a ``Kind``, or its int)."""
    if kind == PY:
        return result.item()
    if kind == NP:
        return result[()]
    return result


def combine(op: str, parts, xp=np):
    """``parts`` (``[(weight, array), ...]`` of one shape, in rank order) combined with
    array op ``op``, by the rules above."""
    values = [v for _, v in parts]
    if _floats(values):  # numbers
        if op in NUMBER_OPS:
            return combine_numbers(op, parts)
        parts = [(w, np.asarray(v)) for w, v in parts]
        values = [v for _, v in parts]
    if xp is np and values[0].size > _BLOCK and len({v.shape for v in values}) == 1:
        # Large: block by block into the result, so that no temporary (a float64
        # accumulator for mean) is ever the size of the whole array.
        out = np.empty(values[0].shape, result_dtype(op, [v.dtype for v in values]))
        combine_into(op, parts, out)
        return out
    if op in MEANS:
        weights, total = weights_of(parts)
        dtype = mean_dtype([v.dtype for v in values])
        acc = None
        exact = op == "exact_mean"
        for w, v in zip(weights, values):
            if w:
                term = exact_term(xp, v, w) if exact else scaled(xp, v, w / total, dtype)
                if acc is None:  # (a new array, or a scalar for 0-d parts)
                    acc = term
                else:
                    acc += term
        return exact_finish(acc, total, dtype) if exact else acc
    dtype = result_dtype(op, [v.dtype for v in values])
    if op in LOGICAL:  # (the truth of any number, complex and NaN too: nonzero, as bool())
        values = [v if v.dtype == bool else v != 0 for v in values]
    values = [v if v.dtype == dtype else v.astype(dtype) for v in values]
    return functools.reduce(getattr(xp, _UFUNC[op]), values)


_BLOCK = 1 << 16  # elements combined at a time, so that temporaries stay in cache
NUMBER_OPS = frozenset(("sum", "prod", "mean", "exact_mean"))  # ``combine_numbers``'s


def _floats(values: list) -> bool:
    for v in values:
        if type(v) is not float:
            return False
    return True


def combine_numbers(op: str, parts, dtype: np.dtype | None = None):
    """``combine`` of numbers for an op of ``NUMBER_OPS``, without an array per number: of
    Python floats (IEEE doubles: numpy's float64 arithmetic; a rank's output that is a
    number travels as one), or, with ``dtype`` (a float dtype), of numpy scalars of it (the
    0-d parts' values). The same operations in the same order, in the same dtype, as on
    arrays."""
    if op == "sum":  # (the usual case, in short)
        acc = parts[0][1]
        for _, v in parts[1:]:
            acc = acc + v
        return acc
    if op == "mean":
        weights, total = weights_of(parts)
        cast = float if dtype is None else dtype.type
        terms = [v * cast(w / total) for w, (_, v) in zip(weights, parts) if w]
        acc = terms[0]  # (a weight: weights_of gives one where all were 0)
        for term in terms[1:]:
            acc = acc + term
        return acc
    if op == "exact_mean":  # in float64 (Python floats), then in the parts' dtype
        weights, total = weights_of(parts)
        terms = [float(v) * w for w, (_, v) in zip(weights, parts) if w]
        acc = terms[0]
        for term in terms[1:]:
            acc = acc + term
        return acc / total if dtype is None else dtype.type(acc / total)
    acc = parts[0][1]
    for _, v in parts[1:]:
        acc = acc * v
    return acc


def combine_into(op: str, parts, out: np.ndarray) -> None:
    """``combine(op, parts)`` on host arrays, written into ``out`` (of the parts' shape): in
    one pass for elementwise ops, else block by block."""
    values = [v for _, v in parts]
    ufunc = getattr(np, _UFUNC[op]) if op in _UFUNC else None
    if ufunc is not None and (op in BITWISE + LOGICAL or all(v.dtype != bool for v in values)):
        if len(values) == 1:  # (a logical op's truth of any number: nonzero, as bool())
            np.copyto(out, values[0] != 0 if op in LOGICAL else values[0])
        else:
            ufunc(values[0], values[1], out=out)
        for v in values[2:]:
            ufunc(out, v, out=out)
        return
    if op == "mean":
        _mean_into(parts, out)
        return
    flat = [(w, v.reshape(-1)) for w, v in parts]
    out = out.reshape(-1)
    for a in range(0, out.size, _BLOCK):
        b = min(a + _BLOCK, out.size)
        out[a:b] = combine(op, [(w, v[a:b]) for w, v in flat])


def _mean_into(parts, out: np.ndarray) -> None:
    """A mean into ``out`` (the parts' mean dtype): the first counted part scaled into it,
    each other one's scaled term added block by block (its temporary stays in cache)."""
    weights, total = weights_of(parts)
    dtype = out.dtype
    counted = [(dtype.type(w / total), v) for w, (_, v) in zip(weights, parts) if w]
    first, rest = counted[0], counted[1:]
    np.multiply(first[1], first[0], out=out, dtype=dtype)  # (dtype=: numpy 1.x would scale
    # a float16 part in float16, whatever the factor's dtype)
    if not rest:
        return
    flat = out.reshape(-1)
    rest = [(f, v.reshape(-1)) for f, v in rest]
    for a in range(0, flat.size, _BLOCK):
        b = min(a + _BLOCK, flat.size)
        for f, v in rest:
            flat[a:b] += np.multiply(v[a:b], f, dtype=dtype)


def partial(op: str, parts, dtype) -> np.ndarray:
    """``parts`` (``[(weight, array), ...]`` of one shape, host arrays) combined as one
    term of a larger combine whose result has dtype ``dtype``: for ``mean`` the sum of
    their scaled terms, ``weight`` being the part's factor ``w / W`` over all the parts
    (the caller applies ``weights_of`` over them); for ``exact_mean`` the sum of their
    float64 terms, ``weight`` being ``w``; for the other ops the op over them in
    ``dtype``."""
    dtype = np.dtype(dtype)
    if op in MEANS:
        exact = op == "exact_mean"
        total = np.zeros(parts[0][1].shape, accumulator(dtype) if exact else dtype)
        for w, v in parts:
            if w:
                total += exact_term(np, v, w) if exact else scaled(np, v, w, dtype)
        return total
    out = np.empty(parts[0][1].shape, dtype)
    combine_into(op, parts, out)
    return out


def combine_partials(op: str, partials, weight_total: float, dtype) -> np.ndarray:
    """The result from ``partials`` (each from ``partial``, in host order): for
    ``exact_mean``, their sum divided by ``weight_total``, in ``dtype``."""
    total = partials[0].copy()
    if op in MEANS:
        for p in partials[1:]:
            total += p
        return exact_finish(total, weight_total, np.dtype(dtype)) if op == "exact_mean" \
            else total
    ufunc = getattr(np, _UFUNC[op])
    for p in partials[1:]:
        ufunc(total, p, out=total)
    return total
