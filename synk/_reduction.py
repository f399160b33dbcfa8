"""The reduce ops, written once for every back end (each function takes the array module,
numpy or cupy), so the host combine, a GPU rank's slices, the NCCL communicator, the fused
allreduce and the shared variables follow one rule::

    parts [(w_r, x_r), ...], in rank order
      mean        sum_r (w_r / W) * x_r, W = sum_r w_r, in the data's dtype  (scaled)
      exact_mean  (sum_r w_r * x_r in float64) / W, rounded once  (exact_term, exact_finish)
      the others  numpy's ufunc folded over the parts  (_folded, extremum_rule)
"""
from __future__ import annotations

import enum
import functools

import numpy as np

from . import _float32_on_device as _device32, _settings

MEANS = ("mean", "exact_mean")  # in the data's dtype; in float64 (synk 0.1's rule)
# A weighted mean's parts as its collectives combine them: each part already scaled by its
# rank, the combine scales it again by its own factor (a weight of the ``weights`` given)
# and sums; with no weights, a plain sum (``synk.comm``'s fused mean; not an op of users)
SCALED_SUM = "scaled_sum"
ARITHMETIC = ("sum", "prod", "max", "min") + MEANS
BITWISE = ("band", "bor", "bxor")  # MPI's BAND, BOR, BXOR: integers and bool, their dtype
LOGICAL = ("land", "lor", "lxor")  # MPI's LAND, LOR, LXOR: any numbers, a bool result
OPS = ARITHMETIC + BITWISE + LOGICAL  # the elementwise ops of every reduction
LOC_OPS = ("maxloc", "minloc")  # (value, lowest rank holding it): synk.comm only, no fold
# of parts (``synk.comm.algorithms.loc``)
_ALIASES = {"avg": "mean", "exact_avg": "exact_mean", "bitwise_and": "band",
            "bitwise_or": "bor", "bitwise_xor": "bxor", "logical_and": "land",
            "logical_or": "lor", "logical_xor": "lxor"}
PICKY = BITWISE + LOC_OPS  # the ops that do not take every number
_NAMES: dict = {}  # an op as given -> its name, lowercased and unaliased (``canonical``)
_UFUNC = {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum",
          "band": "bitwise_and", "bor": "bitwise_or", "bxor": "bitwise_xor",
          "land": "logical_and", "lor": "logical_or", "lxor": "logical_xor"}


def canonical(op, allowed: tuple = OPS, what: str = "synk.comm", rule: bool = True) -> str:
    """``op``'s canonical name ("avg" is "mean", any case), or a ValueError listing
    ``allowed``; with ``rule``, ``"mean"`` as the running group's mean rule names it
    (``ruled``). A name kept beyond the running call (a ``Function``'s reduce) is taken
    without ``rule`` and ruled where a call uses it."""
    if isinstance(op, str):
        name = _NAMES.get(op)
        if name is None:
            lower = op.lower()
            name = _ALIASES.get(lower, lower)
            if len(_NAMES) < 1024:
                _NAMES[op] = name
    else:
        name = op
    if rule:
        name = ruled(name)
    if name not in allowed:
        raise ValueError(f"unknown op {op!r} for {what}: use one of {list(allowed)}")
    return name


def ruled(op):
    """``op`` (a canonical name, or None) as the running group's mean rule makes it:
    ``"mean"`` is ``"exact_mean"`` under ``SYNK_MEAN=exact`` (read at ``fork()``, the same
    on every rank of the group)."""
    if op == "mean" and _settings.mean_rule() == "exact":
        return "exact_mean"
    return op


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


def check_same(op: str, specs: dict) -> None:
    """The ranks' arrays of one reduction (``specs``: rank -> (shape, dtype)) must have one
    shape and one dtype, else ``ValueError`` naming each rank's (the same on every rank
    that reads them all): numpy would promote mixed dtypes, but which rank's dtype wins
    must not depend on the path a size takes, nor differ from what NCCL can do."""
    values = iter(specs.values())
    first = next(values)
    for spec in values:  # (the usual case: the same tuple everywhere, compared as it is)
        if spec != first:
            break
    else:
        return
    if any(tuple(s) != tuple(first[0]) or np.dtype(d) != np.dtype(first[1])
           for s, d in specs.values()):
        raise different_arrays(op, ", ".join(f"rank {r}: {tuple(s)} {np.dtype(d)}"
                                             for r, (s, d) in sorted(specs.items())))


def different_arrays(op: str, listing: str) -> ValueError:
    """The error of ranks that passed ``op`` arrays of different shapes or dtypes
    (``listing``: each rank's, as this rank sees them), worded alike by every transport."""
    return disagreement(arrays_differ(op, listing))


def arrays_differ(op: str, listing: str) -> str:
    return (f"the ranks passed arrays of different shapes or dtypes ({listing}); op {op!r} "
            "needs the same shape and dtype on every rank")


def disagreement(message: str) -> ValueError:
    """A ``ValueError`` of ranks that passed a collective arrays or structures that differ, as one
    rank found it: a rank may see a peer's chunk, not its array, or a digest of its structure, so a
    transport that can names what each rank passed in its place (``synk.comm.passed``)."""
    error = ValueError(message)
    error._synk_disagreement = True  # type: ignore[attr-defined]
    return error


def is_disagreement(error: BaseException) -> bool:
    """Whether ``error`` is a ``disagreement`` not named yet."""
    return getattr(error, "_synk_disagreement", False) is True


def settled(error: BaseException) -> None:
    """``error`` is no ``disagreement`` to name any more: named, or raised again by
    another wait than the one that found it."""
    vars(error).pop("_synk_disagreement", None)


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
    """The dtype of a mean of parts of ``dtypes``: their float or complex type (float16 stays
    float16, bfloat16 bfloat16), float64 for integers and booleans, as numpy's."""
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
    if op == SCALED_SUM:
        return dtype
    if op in BITWISE:
        check_dtype(op, dtype, parts=dtypes)
    return np.dtype(np.int_) if op in ("sum", "prod") and dtype.kind == "b" else dtype


def mean_work_dtype(dtype) -> np.dtype:
    """The dtype a mean of result dtype ``dtype`` is summed in: float32 for float16 (rounded
    once at the end), as numpy's ``_mean`` (numpy/_core/_methods.py) accumulates, since float16's
    scaled terms would lose their low bits; else ``dtype``."""
    dtype = np.dtype(dtype)
    return _F32 if dtype == _F16 else dtype


_F16, _F32 = np.dtype(np.float16), np.dtype(np.float32)


def accumulator(dtype) -> np.dtype:
    """The dtype an exact mean of ``dtype`` accumulates in: float64, or complex128."""
    return np.promote_types(mean_dtype([dtype]), np.float64)


def exact_term(xp, x, weight):
    """This part's term of an exact mean, ``weight * x`` in float64 (complex128); zeros for
    weight 0. Summed, divided by ``W`` (``exact_finish``) and cast, it is
    ``np.average(x.astype(np.float64), weights=w).astype(x.dtype)``: the same bits on CPU ranks,
    GPU ranks and MPI, at the cost of float64 over the collectives."""
    acc = accumulator(x.dtype)
    if not weight:
        return xp.zeros(x.shape, acc)
    if xp is np:  # the same bits, without the widened copy of x
        return np.multiply(x, acc.type(weight), dtype=acc)
    if _device32.flushes(xp, x.dtype):
        return _device32.widened(xp, x) * acc.type(weight)
    return x.astype(acc) * acc.type(weight)


def exact_finish(total, weight_sum, dtype, xp=np):
    """An exact mean from the sum of its terms: divided by the weights' total, in ``dtype``.
    ``total`` is the caller's scratch: an array is divided in place."""
    total /= total.dtype.type(weight_sum)
    if _device32.flushes(xp, dtype):
        return _device32.narrowed(xp, total, dtype)
    return total.astype(dtype, copy=False)


def scaled(xp, x, factor: float, dtype=None):
    """This part's term of a mean, ``factor * x`` in ``mean_work_dtype(dtype)`` (default: ``x``'s);
    zeros for factor 0 (so a NaN of a part that counts for nothing stays out). A mean is ``sum_r
    (w_r / W) * x_r``, summed in rank order where synk sums (NCCL picks its own). Scaling first
    keeps ``|w_r / W * x_r| <= |x_r|``, so no sum overflows where the mean does not, and the data
    moves in its own dtype, as in torch DDP, Horovod, cupyx.distributed."""
    dtype = mean_work_dtype(mean_dtype([x.dtype]) if dtype is None else dtype)
    if not factor:
        return xp.zeros(x.shape, dtype)
    if not normal(factor, dtype):  # (scaled in float64, then rounded: see ``_normal``)
        acc = accumulator(dtype)
        if _device32.flushes(xp, dtype):
            return _device32.narrowed(xp, _device32.widened(xp, x.astype(dtype, copy=False))
                                      * acc.type(factor), dtype)
        return (x.astype(acc) * acc.type(factor)).astype(dtype)
    if xp is np:
        return np.multiply(x, dtype.type(factor), dtype=dtype)
    if _device32.flushes(xp, dtype):  # (CuPy's float32 product would flush subnormals)
        return _device32.scaled(xp, x.astype(dtype, copy=False),
                                float(dtype.type(factor).real))
    return x.astype(dtype, copy=False) * dtype.type(factor)


def normal(factor: float, dtype: np.dtype) -> bool:
    """Whether a mean's ``factor`` is a normal number of ``dtype``: a tiny weight's factor
    rounded to the dtype would lose its bits, or become 0 (and ``0 * inf`` a NaN where
    numpy's float64 answer is the infinity), so such a part is scaled in float64 and its
    term rounded to the dtype once."""
    return abs(factor) >= least_normal(dtype)


def least_normal(dtype: np.dtype) -> float:
    """The smallest normal number of the float (or complex) ``dtype``."""
    tiny = _TINY.get(dtype)
    if tiny is None:
        tiny = _TINY[dtype] = float(np.finfo(dtype).tiny)
    return tiny


_TINY: dict = {}  # dtype -> its smallest normal number (np.finfo is slow to ask)


def factors(weights: list, total: float) -> list:
    """Each part's factor ``w / W`` of a mean (``total``: ``W``, from ``weights_of``). Where no
    rank knows ``W`` beforehand (``allreduce(x, "mean", weight=w)``) the weights travel with the
    parts, or are exchanged first where NCCL sums: always ``w_r / W`` of the weights themselves."""
    return [factor(w, total) for w in weights]


def factor(weight: float, total: float) -> float:
    """A part's factor ``weight / total``: 0 for weight 0, never 0 for another (at least
    float64's smallest number), so that its NaN or infinity stays in, as in ``np.average``."""
    if not weight:
        return 0.0
    return weight / total or _LEAST


_LEAST = float(np.nextafter(0.0, 1.0))  # float64's smallest positive number


def weights_of(parts) -> tuple[list, float]:
    """(each part's weight, their total) for a mean: equal weights when every weight is 0
    (an output of ranks that processed no rows). Weights whose total is past float64's
    range are taken relative to the largest (the factors ``w / W`` are the same)."""
    weights = [w for w, _ in parts]
    total = float(sum(weights))
    if not total:
        return [1] * len(parts), float(len(parts))
    if total == float("inf"):
        largest = max(weights)
        weights = [w / largest for w in weights]
        total = float(sum(weights))
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
    if xp is not np and any(_device32.flushes(xp, v.dtype) for v in values):
        # (on the host: CuPy's kernels would flush float32 subnormals; numpy's answer)
        return xp.asarray(combine(op, [(w, xp.asnumpy(v)) for w, v in parts]))
    if xp is np and values[0].size > _BLOCK and len({v.shape for v in values}) == 1:
        # Large: block by block into the result, so that no temporary (a float64
        # accumulator for mean) is ever the size of the whole array.
        out = np.empty(values[0].shape, result_dtype(op, [v.dtype for v in values]))
        combine_into(op, parts, out)
        return out
    if op == SCALED_SUM:
        return _scaled_sum_of(xp, parts, values)
    if op in MEANS:
        return _mean_of(xp, op, parts, values)
    return _folded(xp, op, values)


def _scaled_sum_of(xp, parts, values: list):
    """``combine``'s ``SCALED_SUM`` of arrays: ``sum_r w_r * x_r`` in rank order."""
    out = xp.empty(values[0].shape, promoted([v.dtype for v in values]))
    if xp is np:
        combine_into(SCALED_SUM, parts, out)
        return out
    acc = None
    for w, v in parts:
        if w:
            term = scaled(xp, v, w, out.dtype)
            acc = term if acc is None else acc + term
    return xp.zeros_like(out) if acc is None else acc


def _folded(xp, op: str, values: list):
    """``combine`` of arrays by an elementwise op: its ufunc folded over ``values`` in rank
    order, in the dtype of numpy's promotion over every part (``result_dtype``)."""
    dtype = result_dtype(op, [v.dtype for v in values])
    if op in LOGICAL:  # (the truth of any number, complex and NaN too: nonzero, as bool())
        values = [v if v.dtype == bool else v != 0 for v in values]
    values = [v if v.dtype == dtype else v.astype(dtype) for v in values]
    result = functools.reduce(getattr(xp, _UFUNC[op]), values)
    return extremum_rule(op, values, result, xp) if op in EXTREMA else result


def _mean_of(xp, op: str, parts, values: list):
    """``combine``'s mean (or exact mean) of arrays: the terms summed as they come
    (``_terms_summed``); on the host, where a term underflowed, ``_mean_into``'s rule."""
    if op == "exact_mean" or xp is not np or len({v.shape for v in values}) > 1:
        return _terms_summed(xp, op, parts, values)
    try:
        with np.errstate(under="raise"):
            return _terms_summed(np, op, parts, values)
    except FloatingPointError:
        out = np.empty(values[0].shape, mean_dtype([v.dtype for v in values]))
        _mean_into(parts, out)
        return out if out.ndim else out[()]


def _terms_summed(xp, op: str, parts, values: list):
    """Each counted part's term of a mean (``scaled``) or exact mean (``exact_term``),
    summed in rank order, in the mean's dtype."""
    weights, total = weights_of(parts)
    dtype = mean_dtype([v.dtype for v in values])
    acc = None
    exact = op == "exact_mean"
    for w, v in zip(weights, values):
        if w:
            term = exact_term(xp, v, w) if exact else scaled(xp, v, factor(w, total), dtype)
            if acc is None:  # (a new array, or a scalar for 0-d parts)
                acc = term
            else:
                acc += term
    assert acc is not None  # (weights_of gives a weight where all were 0)
    if exact:
        return exact_finish(acc, total, dtype)
    return acc if acc.dtype == dtype else acc.astype(dtype)


EXTREMA = ("max", "min")
_UINTS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def extremum_rule(op: str, values: list, result, xp=np):
    """``result`` (numpy's ``maximum``/``minimum`` folded over ``values``) as IEEE 754-2019's
    maximum/minimum make it, the rule of NCCL's and CUDA's ``max``/``min`` (``fmaxf``, PTX's
    ``max``: +0.0 > -0.0), with numpy's winning NaN as ``np.nan``'s bits: so CPU and GPU ranks
    give the same bits. Written into ``result`` where it is an array not among ``values``."""
    dtype = getattr(result, "dtype", None)
    if dtype is None or dtype.kind != "f" or dtype.itemsize not in _UINTS:
        return result
    array = isinstance(result, xp.ndarray)
    out = result if array and all(result is not v for v in values) else xp.array(result)
    zero = out == 0
    if zero.any():
        uint = _UINTS[dtype.itemsize]
        bits = [xp.asarray(v, dtype).view(uint) for v in values]
        if op == "max":  # (every part <= 0 there: +0.0 if one is: the AND of their bits)
            signed = functools.reduce(xp.bitwise_and, bits)
        else:  # (every part >= 0 there: -0.0 if one is: the OR of their sign bits)
            signed = functools.reduce(xp.bitwise_or, bits) & uint(1 << (8 * dtype.itemsize - 1))
        xp.copyto(out, xp.broadcast_to(signed.view(dtype), out.shape), where=zero)
    nan = xp.isnan(out)
    if nan.any():
        xp.copyto(out, dtype.type(np.nan), where=nan)
    return out if array else out[()]


_BLOCK = 1 << 16  # elements combined at a time, so that temporaries stay in cache
NUMBER_OPS = frozenset(("sum", "prod", "mean", "exact_mean"))  # ``combine_numbers``'s


def _floats(values: list) -> bool:
    for v in values:
        if type(v) is not float:
            return False
    return True


def combine_numbers(op: str, parts, dtype: np.dtype | None = None):
    """``combine`` of numbers for an op of ``NUMBER_OPS``, without an array per number: Python
    floats, or with ``dtype`` numpy scalars of it; the same operations, order and dtype as on
    arrays."""
    if op == "sum":  # (the usual case, in short)
        acc = parts[0][1]
        for _, v in parts[1:]:
            acc = acc + v
        return acc
    if op == "mean":
        return _mean_of_numbers(parts, dtype)
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


def _mean_of_numbers(parts, dtype: np.dtype | None):
    """``combine_numbers``' mean: its terms in the dtype it is summed in (``mean_work_dtype``;
    Python floats' float64), summed in rank order; where a term underflows, the mean of
    0-d arrays (``_mean_into``)."""
    weights, total = weights_of(parts)
    work = float if dtype is None else mean_work_dtype(dtype).type
    tiny = _F64_TINY if dtype is None else least_normal(mean_work_dtype(dtype))
    acc = None  # (a weight: weights_of gives one where all were 0)
    for w, (_, v) in zip(weights, parts):
        if w:
            term = work(v) * work(factor(w, total))
            if _underflowed(v, term, tiny):
                out = np.empty((), np.float64 if dtype is None else dtype)
                _mean_into([(w, np.asarray(v)) for w, v in parts], out)
                return float(out) if dtype is None else out[()]
            acc = term if acc is None else acc + term
    return acc if dtype is None else dtype.type(acc)


def _underflowed(value, term, tiny: float) -> bool:
    """Whether a number's ``term`` of a mean lost ``value``'s bits below the least normal
    number ``tiny``: a part (real or imaginary) of it nonzero, that part of the term not a
    normal number."""
    return bool((value.real and abs(term.real) < tiny)
                or (value.imag and abs(term.imag) < tiny))


_F64_TINY = float(np.finfo(np.float64).tiny)


def combine_into(op: str, parts, out: np.ndarray) -> None:
    """``combine(op, parts)`` on host arrays, written into ``out`` (of the parts' shape): in
    one pass for elementwise ops, else block by block."""
    values = [v for _, v in parts]
    ufunc = getattr(np, _UFUNC[op]) if op in _UFUNC else None
    if ufunc is not None and (op in BITWISE + LOGICAL or all(v.dtype != bool for v in values)):
        _folded_into(op, ufunc, values, out)
        return
    if op == "mean":
        _mean_into(parts, out)
        return
    if op == SCALED_SUM:
        if all(w == 1 for w, _ in parts):  # (the parts' own factors were the mean's)
            combine_into("sum", parts, out)
        else:
            _scaled_parts_summed([(w, v) for w, v in parts if w], out)
        return
    flat = [(w, v.reshape(-1)) for w, v in parts]
    out = out.reshape(-1)
    for a in range(0, out.size, _BLOCK):
        b = min(a + _BLOCK, out.size)
        out[a:b] = combine(op, [(w, v[a:b]) for w, v in flat])


def _folded_into(op: str, ufunc, values: list, out: np.ndarray) -> None:
    """``combine_into`` by an elementwise op: ``ufunc`` folded over ``values``."""
    if len(values) == 1:  # (a logical op's truth of any number: nonzero, as bool())
        np.copyto(out, values[0] != 0 if op in LOGICAL else values[0])
    else:
        ufunc(values[0], values[1], out=out)
    for v in values[2:]:
        ufunc(out, v, out=out)
    if op in EXTREMA:
        extremum_rule(op, values, out)


def _mean_into(parts, out: np.ndarray) -> None:
    """A mean into ``out`` (the parts' mean dtype): each counted part's term ``w / W * x``
    summed (``_sum_of_terms``)."""
    weights, total = weights_of(parts)
    weighted = [(w, v) for w, (_, v) in zip(weights, parts) if w]
    _sum_of_terms([(factor(w, total), v) for w, v in weighted], out, weighted, total)


def _scaled_parts_summed(counted: list, out: np.ndarray) -> None:
    """``SCALED_SUM``'s ``sum_r f_r * x_r`` of ``counted`` (no ``f_r`` 0) into ``out``; where a
    term underflowed, as weights ``f_r / f_min`` of a total ``1 / f_min`` (equal factors weigh
    1 each, divided by ``n``, as numpy's mean)."""
    least = min(f for f, _ in counted)
    _sum_of_terms(counted, out, [(f / least, v) for f, v in counted], 1.0 / least)


def _sum_of_terms(counted: list, out: np.ndarray, weighted: list, total: float) -> None:
    """``sum_r f_r * x_r`` of ``counted`` (``f_r = w_r / W`` of ``weighted`` and ``total``) into
    ``out``, scaled in ``mean_work_dtype`` and summed in rank order (``_scaled_sum_into``), or
    by ``_widen_underflows`` where a term underflowed: the scaling's own flag, no extra check."""
    work = out if out.dtype != _F16 else np.empty(out.shape, _F32)
    try:
        with np.errstate(under="raise"):
            _scaled_sum_into(counted, work)
    except FloatingPointError:
        with np.errstate(all="ignore"):
            _scaled_sum_into(counted, work)
            _widen_underflows(weighted, total, work)
    if work is not out:
        np.copyto(out, work, casting="same_kind")


def _widen_underflows(weighted: list, total: float, out: np.ndarray) -> None:
    """Where a term ``w / W * x`` of ``weighted`` fell below ``out``'s least normal number, the
    mean as ``exact_mean`` takes it (numpy's sum-then-divide for subnormals), since a scaled
    subnormal loses its low bits (all of them for ``1.4e-45 / 3`` in float32). Applied where a
    mean is combined on the host (``term_or_none``); NCCL's sum of device-scaled terms errs
    by up to ``n`` of the dtype's smallest subnormal."""
    if out.ndim == 0:  # (indexed by a mask below: as 1-d views)
        _widen_underflows([(w, np.reshape(x, 1)) for w, x in weighted], total, out.reshape(1))
        return
    tiny = least_normal(out.dtype)
    where = np.zeros(out.shape, bool)
    for w, x in weighted:
        x = np.asarray(x)
        for part in (x.real, x.imag) if x.dtype.kind == "c" else (x,):
            term = np.abs(np.multiply(part, factor(w, total), dtype=np.float64))
            where |= (term < tiny) & (part != 0)
    if not where.any():
        return
    acc = accumulator(out.dtype)
    wide = sum(np.multiply(np.asarray(x)[where], acc.type(w), dtype=acc) for w, x in weighted)
    wide = (wide / acc.type(total)).astype(out.dtype)
    scaled_sum = out[where]
    out[where] = np.where(np.isfinite(wide) | ~np.isfinite(scaled_sum), wide, scaled_sum)


def term_or_none(x: np.ndarray, factor: float, dtype=None):
    """``scaled(np, x, factor, dtype)``, a host part's term of a mean, or None where a term
    underflowed (``_widen_underflows``: the mean then needs the parts as they are)."""
    try:
        with np.errstate(under="raise"):
            return scaled(np, x, factor, dtype)
    except FloatingPointError:
        return None


def _scaled_sum_into(counted: list, out: np.ndarray) -> None:
    """``sum_r f_r * x_r`` of ``counted`` (at least one) into ``out`` (not float16): added block
    by block (temporaries stay in cache); a factor that is not a normal number of the dtype is
    applied as ``scaled`` does."""
    dtype = out.dtype
    if not all(normal(f, dtype) for f, _ in counted):  # (tiny factors: ``scaled``'s way)
        np.copyto(out, scaled(np, counted[0][1], counted[0][0], dtype))
        for f, v in counted[1:]:
            out += scaled(np, v, f, dtype)
        return
    counted = [(dtype.type(f), v) for f, v in counted]
    first, rest = counted[0], counted[1:]
    np.multiply(first[1], first[0], out=out, dtype=dtype)  # (dtype=: numpy 1.x would scale
    # a float16 part in float16, whatever the factor's dtype)
    if not rest:
        return
    # a part whose factor is 1 is its own term (x * 1 is x), but for complex numbers:
    # (inf + 1j) * (1 + 0j) is inf + nanj, as numpy multiplies it
    as_it_is = dtype.kind != "c"
    if out.size <= _BLOCK:  # (small: one temporary, in cache)
        for f, v in rest:
            if f == 1 and v.dtype == dtype and as_it_is:
                out += v
            else:
                out += np.multiply(v, f, dtype=dtype)
        return
    flat = out.reshape(-1)
    rest = [(f, v.reshape(-1)) for f, v in rest]
    for a in range(0, flat.size, _BLOCK):
        b = min(a + _BLOCK, flat.size)
        for f, v in rest:
            if f == 1 and v.dtype == dtype and as_it_is:
                flat[a:b] += v[a:b]
            else:
                flat[a:b] += np.multiply(v[a:b], f, dtype=dtype)
