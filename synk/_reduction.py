"""The reduce ops, written once for every back end: their names, the dtype of a result, what
a rank without rows contributes, and how parts are combined.

Every function takes the array module (``numpy`` on the host, ``cupy`` on a GPU rank), so
the host combine, the slices of a GPU rank, the NCCL transport, the fused allreduce and the
shared variables all follow the same rule rather than copies of it.

**The one rule of ``mean``**, on every back end::

    mean = sum_r(w_r * x_r) / sum_r(w_r)

Each term ``w_r * x_r`` is computed in float64 (complex128 for complex parts), the terms are
summed in that type (in rank order where synk sums; NCCL picks its own order) and the sum is
divided by the weights' total, then cast to the result dtype: the parts' float or complex
type, float64 for integers and booleans. Unweighted means have ``w_r = 1``. A part of weight
0 contributes exactly zero (not ``0 * x``, so the NaN of a mean over no rows stays out). So a
float16 or float32 mean of large values that cancel is the same number on CPU ranks, GPU
ranks and over MPI, and the one single-process numpy gives with
``np.average(x.astype(np.float64), weights=w).astype(x.dtype)``.

**The other ops** are numpy's ufuncs, folded over the parts in rank order, in the dtype of
numpy's promotion over every part: ``sum``, ``prod``, ``max``, ``min``; the bitwise ``band``,
``bor``, ``bxor`` (MPI's BAND, BOR, BXOR: integers and bools only, ``check_dtype``); the
logical ``land``, ``lor``, ``lxor`` (MPI's LAND, LOR, LXOR: any numbers, a bool result).
``maxloc``/``minloc`` give a value and a rank, so they are no fold of parts
(``synk.comm._loc``).

**By host** (under MPI, where a host runs several ranks): each such host combines its
ranks' parts into one ``partial`` (a mean's sum of terms, not yet divided; another op in
the result's dtype), and the master combines the partials (``combine_partials``). The terms
and the types are the same; only the order of the sums differs: host by host.
"""
from __future__ import annotations

import functools

import numpy as np

ARITHMETIC = ("sum", "prod", "max", "min", "mean")
BITWISE = ("band", "bor", "bxor")  # MPI's BAND, BOR, BXOR: integers and bool, their dtype
LOGICAL = ("land", "lor", "lxor")  # MPI's LAND, LOR, LXOR: any numbers, a bool result
OPS = ARITHMETIC + BITWISE + LOGICAL  # the elementwise ops of every reduction
LOC_OPS = ("maxloc", "minloc")  # (value, lowest rank holding it): synk.comm only
_ALIASES = {"avg": "mean", "bitwise_and": "band", "bitwise_or": "bor", "bitwise_xor": "bxor",
            "logical_and": "land", "logical_or": "lor", "logical_xor": "lxor"}
PICKY = BITWISE + LOC_OPS  # the ops that do not take every number
_UFUNC = {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum",
          "band": "bitwise_and", "bor": "bitwise_or", "bxor": "bitwise_xor",
          "land": "logical_and", "lor": "logical_or", "lxor": "logical_xor"}


def canonical(op, allowed: tuple = OPS, what: str = "synk.comm") -> str:
    """``op``'s canonical name ("avg" is "mean", any case), or a ValueError listing
    ``allowed``."""
    name = _ALIASES.get(op.lower(), op.lower()) if isinstance(op, str) else op
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
    if op == "mean":
        return mean_dtype(dtypes)
    if op in LOGICAL:
        return np.dtype(bool)
    dtype = promoted(dtypes)
    if op in BITWISE:
        check_dtype(op, dtype, parts=dtypes)
    return np.dtype(np.int_) if op in ("sum", "prod") and dtype.kind == "b" else dtype


def accumulator(dtype) -> np.dtype:
    """The dtype a mean of ``dtype`` accumulates in: float64, or complex128."""
    return np.promote_types(mean_dtype([dtype]), np.float64)


def mean_term(xp, x, weight):
    """This part's term of a mean, ``weight * x`` in the accumulator dtype; zeros for a
    part of weight 0."""
    acc = accumulator(x.dtype)
    if not weight:
        return xp.zeros(x.shape, acc)
    if xp is np:  # the same bits, without the widened copy of x
        return np.multiply(x, acc.type(weight), dtype=acc)
    return x.astype(acc) * acc.type(weight)


def mean_finish(total, weight_sum, dtype):
    """The mean from the sum of the terms: divided by the weights' total, in ``dtype``.
    ``total`` is the caller's scratch: an array is divided in place."""
    total /= total.dtype.type(weight_sum)
    return total.astype(dtype, copy=False)


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
    if op in ("sum", "mean", "bor", "bxor", "lor", "lxor"):
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


# Kinds of value, to give back a result as the ranks gave their parts: a Python number, a
# numpy scalar, an array.
PY, NP, ARR = 0, 1, 2


def kind_of(value) -> int:
    if isinstance(value, np.generic):
        return NP
    if isinstance(value, (bool, int, float, complex)):
        return PY
    return ARR  # (numpy's, a device array, or an array-like made one by np.asarray)


def restore_kind(result: np.ndarray, kind: int):
    """``result`` as the kind of value ``kind``."""
    if kind == PY:
        return result.item()
    if kind == NP:
        return result[()]
    return result


def combine(op: str, parts, xp=np):
    """``parts`` (``[(weight, array), ...]`` of one shape, in rank order) combined with
    array op ``op``, by the rules above."""
    values = [v for _, v in parts]
    if xp is np and values[0].size > _BLOCK and len({v.shape for v in values}) == 1:
        # Large: block by block into the result, so that no temporary (a float64
        # accumulator for mean) is ever the size of the whole array.
        out = np.empty(values[0].shape, result_dtype(op, [v.dtype for v in values]))
        combine_into(op, parts, out)
        return out
    if op == "mean":
        weights, total = weights_of(parts)
        acc = None
        for w, v in zip(weights, values):
            if w:
                term = mean_term(xp, v, w)  # (a new array, or a scalar for 0-d parts)
                if acc is None:
                    acc = term
                else:
                    acc += term
        return mean_finish(acc, total, mean_dtype([v.dtype for v in values]))
    dtype = result_dtype(op, [v.dtype for v in values])
    if op in LOGICAL:  # (the truth of any number, complex and NaN too: nonzero, as bool())
        values = [v if v.dtype == bool else v != 0 for v in values]
    values = [v if v.dtype == dtype else v.astype(dtype) for v in values]
    return functools.reduce(getattr(xp, _UFUNC[op]), values)


_BLOCK = 1 << 16  # elements combined at a time, so that temporaries stay in cache


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
    flat = [(w, v.reshape(-1)) for w, v in parts]
    out = out.reshape(-1)
    for a in range(0, out.size, _BLOCK):
        b = min(a + _BLOCK, out.size)
        out[a:b] = combine(op, [(w, v[a:b]) for w, v in flat])


def partial(op: str, parts, dtype) -> np.ndarray:
    """``parts`` (``[(weight, array), ...]`` of one shape, host arrays) combined as one
    term of a larger combine whose result has dtype ``dtype``: for ``mean`` the sum of
    their terms in the accumulator dtype (weights as given: the caller applies
    ``weights_of`` over all the parts), for the other ops the op over them in ``dtype``."""
    dtype = np.dtype(dtype)
    if op == "mean":
        total = np.zeros(parts[0][1].shape, accumulator(dtype))
        for w, v in parts:
            if w:
                total += mean_term(np, v, w)
        return total
    out = np.empty(parts[0][1].shape, dtype)
    combine_into(op, parts, out)
    return out


def combine_partials(op: str, partials, weight_total: float, dtype) -> np.ndarray:
    """The result from ``partials`` (each from ``partial``, in host order): for ``mean``,
    their sum divided by ``weight_total``, in ``dtype``."""
    total = partials[0].copy()
    if op == "mean":
        for p in partials[1:]:
            total += p
        return mean_finish(total, weight_total, np.dtype(dtype))
    ufunc = getattr(np, _UFUNC[op])
    for p in partials[1:]:
        ufunc(total, p, out=total)
    return total
