"""``allreduce`` of a structure of arrays (a list, tuple or dict, nested), fused, and the
mean, written once for any communicator: the leaves travel in one buffer per dtype, handed to
the communicator's ``allreduce_many`` with a header every rank checks.

::

    leaves --_layout (_LAYOUTS)--> the head, one buffer per dtype (_packed, _mean_packing)
           --comm.allreduce_many(packed, op, _agree)--> the reduced buffers
           --_finished--> views of one fresh buffer per dtype, in the structure
"""
from __future__ import annotations

import hashlib
import math
import struct

import numpy as np

from ... import _float32_on_device as _device32, _reduction, _tree
from .. import context as _context, passed as _passed
from ..communicator import WRITTEN, Packed, message_offsets
from ..handle import then
from . import loc as _loc, out as _out

_HEAD = 3  # int64 words ahead of a rank's message: the structure's digest, its weight,
# the factor it scaled its leaves by (a weighted mean's)
# signature -> _Layout, the structures seen (at most _KEEP of them). Its one rule: a layout
# is keyed by everything it is made from (the structure, each leaf's type, shape and dtype,
# the op, weighted or not) and never changed once made, but for ``messages``, the packing
# buffer of a blocking call, free again when that call returns: no entry is ever stale.
_LAYOUTS: dict = {}
_SMALL = 64 << 10  # leaves of fewer bytes than this, on average, are scaled after one copy
_KEEP = 64


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def check_weight(weight, op: str):
    if weight is None:
        return None
    if op not in _reduction.MEANS:
        raise ValueError(f"weight= averages with op='mean'; op {op!r} takes no weight")
    try:
        w = float(weight)
    except (TypeError, ValueError):
        raise TypeError(f"weight must be a number (this rank's rows), not {weight!r}") from None
    if not (math.isfinite(w) and w >= 0) or isinstance(weight, bool):
        raise ValueError(f"weight must be a finite number >= 0 (this rank's rows), not {weight!r}")
    return w


class _Layout:
    """Where each leaf of one structure goes (its dtype group, offset, result dtype and
    kind) and where the groups go in a message. Made once per structure, op and weighting,
    and reused with its last message (``messages``): a training step only packs, reduces
    and unpacks. Its ``digest`` (structure, op, weight or none) must agree (``_agree``)."""

    __slots__ = ("digest", "buffer_bytes", "offsets", "nbytes", "messages", "structure",
                 "kinds", "packing", "unpacking", "plain", "flat", "head", "dtype_list",
                 "as_they_are", "tiny")

    def __init__(self, structure, arrays: list, kinds: list, wanted: list, dtypes: list,
                 op: str, weighted: bool) -> None:
        self.digest = _hash(repr((structure, [(a.shape, a.dtype.str) for a in arrays], op,
                                  weighted)))
        self.structure, self.kinds = structure, kinds
        groups: dict = {}  # the group's dtype -> the leaves' indices, in order
        for i, dtype in enumerate(dtypes):
            groups.setdefault(dtype, []).append(i)
        places: list = [None] * len(arrays)  # leaf -> (group number, offset, size)
        sizes: list = []  # each group's elements
        for g, idx in enumerate(groups.values()):
            at = 0
            for i in idx:
                places[i] = (g, at, arrays[i].size)
                at += arrays[i].size
            sizes.append(at)
        self.buffer_bytes = [n * d.itemsize for n, d in zip(sizes, groups)]
        self.offsets, self.nbytes = message_offsets(_HEAD * 8, self.buffer_bytes)
        self.messages: dict = {}  # array module -> the message its last call packed into
        # per group: (dtype, its byte offset, its elements, [(leaf, first, end, shape)])
        self.packing = [
            (dtype, at, size, [(i, places[i][1], places[i][1] + places[i][2], arrays[i].shape)
                               for i in idx])
            for (dtype, idx), at, size in zip(groups.items(), self.offsets, sizes)]
        # per leaf: (group, first, end, shape, the result's dtype where it is not the group's)
        self.unpacking = [
            (g, at, at + n, arrays[i].shape, None if wanted[i] == dtypes[i] else wanted[i])
            for i, (g, at, n) in enumerate(places)]
        # every leaf is an array whose result is an array of its group's dtype
        self.plain = all(k == _reduction.ARR for k in kinds) and all(
            u[4] is None for u in self.unpacking)
        self.flat = structure == ("list", (None,) * len(arrays))  # a list of leaves
        self.head = _header(self.digest, None)  # (an unweighted mean's, every call)
        self.dtype_list = list(groups)
        self.as_they_are = all(len(leaves) == 1 for *_, leaves in self.packing)
        # the least scale that is a normal number of every group's dtype (``_scale``)
        self.tiny = max([_reduction.least_normal(d) if d.kind in "fc" else 0.0
                         for d in self.dtype_list], default=0.0)


def _key(structure, leaves: list, op: str, weighted: bool) -> tuple | None:
    """What a layout is kept under (``_LAYOUTS``): everything it is made from; None where a
    leaf is no array (a number: its layout is not kept)."""
    try:
        return (structure, tuple([(type(x), x.shape, x.dtype) for x in leaves]), op, weighted)
    except AttributeError:
        return None


def _layout(structure, leaves: list, arrays: list, op: str, weighted: bool) -> _Layout:
    """The layout of ``leaves`` (``arrays``: as the communicator's arrays) for ``op``."""
    key = _key(structure, leaves, op, weighted)
    layout = None if key is None else _LAYOUTS.get(key)
    if layout is None:
        wanted = [_reduction.result_dtype(op, [a.dtype]) for a in arrays]  # (the results')
        if op == "mean":  # (scaled while packed: in the dtype it is summed in)
            dtypes = [_reduction.mean_work_dtype(d) for d in wanted]
        else:  # the parts' own: the communicator gives op's dtype (a bool sum's counts, an
            dtypes = [a.dtype for a in arrays]  # exact mean's float64...)
        kinds = [_reduction.kind_of(x) for x in leaves]
        layout = _Layout(structure, arrays, kinds, wanted, dtypes, op, weighted)
        if key is not None and all(type(x) is type(a) for x, a in zip(leaves, arrays)):
            if len(_LAYOUTS) >= _KEEP:  # (numbers' layouts are not kept: see ``known``)
                _LAYOUTS.pop(next(iter(_LAYOUTS)))
            _LAYOUTS[key] = layout
    return layout


def known(value: _tree.Flat, op: str, weighted: bool) -> _Layout | None:
    """The layout of ``value`` when a call of ``op`` laid out one like it before (the same
    structure, array types, shapes and dtypes: its leaves were checked then); else None.
    (One array reduced by an op other than a mean is never laid out: it goes to the
    communicator as it is.)"""
    if value.structure is None and op not in _reduction.MEANS:
        return None
    key = _key(value.structure, value.leaves, op, weighted)
    return None if key is None else _LAYOUTS.get(key)


def _header(digest: int, weight, scale=None) -> np.ndarray:
    """The head of this rank's buffers: the digest of the structure and op and, for a
    weighted or exact mean, this rank's weight (and the scale of its leaves)."""
    return np.frombuffer(_WORDS.pack(digest, math.nan if weight is None else weight,
                                     math.nan if scale is None else scale), np.int64)


_WORDS = struct.Struct("=qdd")  # a header: the digest, the weight and scale (NaN: none)


def _agree(heads) -> list | None:
    """Check the ranks' headers (``ValueError`` on every rank where the structures, a
    ``weight=`` included, differ); returns an exact mean's weights (None without one) or a
    mean's factors of its parts (``_factors``)."""
    first = heads[0].tobytes()
    same = True
    for h in heads:  # (a loop rather than all(): this runs in every fused collective)
        if h.tobytes() != first:
            same = False
            break
    if same:  # (the usual case: one header everywhere)
        _, weight, scale = _WORDS.unpack_from(first)
        n = len(heads)
        if weight != weight:  # (NaN: no weight; a scale: a mean's parts as they are)
            return None if scale != scale else _factors([1.0] * n, [scale] * n)
        if scale != scale:  # (an exact mean's weights)
            return agreed_weights([weight] * n, "allreduce")
        if weight > 0:  # (``_factors`` of equal weights and scales, its arithmetic as
            # there: one factor for every part)
            total = float(sum([weight] * n))
            if total != math.inf:
                f = _reduction.factor(weight, total) / scale
                return None if f == 1.0 else [f] * n
        weights = agreed_weights([weight] * n, "allreduce")  # (raises: they sum to 0)
        return None if weights is None else _factors(weights, [scale] * n)
    return _agree_mixed(heads)


def _agree_mixed(heads) -> list | None:
    """``_agree`` where the ranks' headers differ."""
    digests = {int(h[0]) for h in heads}
    if len(digests) > 1:  # (the communicator names what each rank passed in its place)
        raise _reduction.disagreement(
            "the ranks passed different structures to allreduce (their keys, shapes or "
            "dtypes differ, or some gave weight= and others not); every rank must pass the "
            "same structure")
    words = [_WORDS.unpack_from(h.tobytes()) for h in heads]
    weights = agreed_weights([None if math.isnan(w) else w for _, w, _ in words], "allreduce")
    scales = [s for _, _, s in words]
    if all(math.isnan(s) for s in scales):  # (an exact mean's weights, or none)
        return weights
    if weights is None:  # (an unweighted mean: ``1 / size`` where a part has no scale of
        # its own, ``1.0`` where it went as it is)
        weights, scales = [1.0] * len(heads), [1.0 / len(heads) if math.isnan(s) else s
                                               for s in scales]
    return _factors(weights, scales)


def _factors(weights: list, scales: list) -> list | None:
    """Each rank's factor of its part of a mean, which it scaled by its own ``scales[r]``
    while packing (1: packed as it is): ``(w_r / W) / scale_r`` (0 for a part of weight 0),
    or None where each is 1 (the weights were the call's rows: the usual case, a plain
    sum)."""
    normalised, total = _reduction.weights_of([(w, None) for w in weights])
    factors = [_reduction.factor(w, total) / s if w and s else 0.0
               for w, s in zip(normalised, scales)]
    for f in factors:
        if f != 1.0:
            return factors
    return None


def _scale(comm, weight: float, layout) -> float:
    """The factor this rank scales its leaves of a weighted mean by while packing:
    ``weight / S`` (``S`` the call's rows: with rows as weights, the mean's own terms), at
    least ``1 / size`` (the communicator's second factor ``(w / W) / scale`` stays at most
    ``size``: weights of 1e-50 would lose a subnormal mean), and ``1 / size`` where past 1
    (overflow) or not a normal number; 0 for weight 0."""
    if not weight:
        return 0.0
    even = 1.0 / comm.size
    scale = weight / max(_context.now().rows, 1)
    if scale <= 1.0 and scale >= layout.tiny:
        return max(scale, even)
    return even


def _mean_packing(comm, weight, layout: _Layout) -> tuple:
    """How this rank packs its leaves of a mean (``weight``: its own, or None): (factor,
    None for as they are; the buffers' op; the head; ``(digest, weight)`` of leaves packed
    as they are, or None). Where the host combines (``prescaled_means`` False), a rank whose
    scaled term underflowed, and a device always (no flag), packs them as they are, for the
    combine's rule that keeps a subnormal's bits (``_reduction``)."""
    if comm.xp is not np and not comm.prescaled_means:
        return None, _reduction.SCALED_SUM, _header(layout.digest, weight, 1.0), None
    if weight is None:
        factor, op, head = 1.0 / comm.size, "sum", layout.head
    else:
        factor = _scale(comm, weight, layout)
        op, head = _reduction.SCALED_SUM, _header(layout.digest, weight, factor)
    if comm.prescaled_means:
        return factor, op, head, None
    return factor, _reduction.SCALED_SUM, head, (layout.digest, weight)


def agreed_weights(weights: list, what: str) -> list | None:
    """Every rank's ``weight=`` of a mean (None where not given), checked: all or none
    given, not all 0. The weights, or None when no rank gave one."""
    given = [w is not None for w in weights]
    if not any(given):
        return None
    if not all(given):
        missing = [r for r, g in enumerate(given) if not g]
        raise ValueError(f"{what}: rank(s) {missing} gave no weight= while others did; "
                         "give every rank its weight (0 for a rank with no rows)")
    if not sum(weights) > 0:
        raise ValueError(f"{what}: the weights sum to 0 on every rank, so there is nothing "
                         "to average")
    return weights


def allreduce(comm, value: _tree.Flat, op: str, weight, wait: bool = True,
              out: _tree.Flat | None = None, layout: _Layout | None = None, ints: bool = True,
              what: str = "allreduce", passed=None):
    """``value`` (taken apart) reduced with ``op`` on ``comm`` (``weight``: this rank's, of a
    mean); ``wait=False``: a Handle. ``out`` (taken apart): written directly where it can
    be, else delivered. ``layout``: ``known``'s. ``ints``: Python ints checked to stay in
    int64 (``what``: named in errors). ``passed()``: what the caller was given (default:
    the value). One buffer per dtype, as Horovod's tensor fusion and DDP's buckets; a mean's
    leaves scaled while packed (a ``SCALED_SUM``), an ``exact_mean``'s summed in float64."""
    leaves, structure = value.leaves, value.structure
    if op in _reduction.LOC_OPS:
        return _delivered(_loc.locate(comm, comm.host, value.value, op, wait=wait), out,
                          what, wait)
    if op not in _reduction.MEANS and structure is None and (
            type(leaves[0]) is np.ndarray or _reduction.kind_of(leaves[0]) == _reduction.ARR):
        call = comm.allreduce if wait else comm.iallreduce  # (the array as it is)
        return _delivered(call(leaves[0], op, out=None if out is None else out.value), out,
                          what, wait)
    weighted = weight is not None
    if layout is None:
        if ints and _python_ints(leaves):
            return _delivered(_checked_ints(comm, value, op, weight, wait, what), out, what,
                              wait)
        xp = comm.xp
        arrays = [xp.asarray(x) for x in leaves]  # (their dtypes checked by synk.comm.allreduce)
        layout = _layout(structure, leaves, arrays, op, weighted)
    else:
        arrays = leaves
    unscaled = None
    if op == "mean":
        factor, send_op, head, unscaled = _mean_packing(comm, weight, layout)
    else:  # (an exact mean's weight, if any, in the head: the communicator applies it)
        factor, send_op, head = None, op, _header(layout.digest, weight)
    packed = _packed(comm.xp, layout, head, arrays, factor, weighted, reuse=wait,
                     unscaled=unscaled, copy=op == "mean")
    packed.passed = passed or (lambda: _passed.of_value(op, weighted, structure, leaves))
    if out is not None and comm.xp is np:  # (a mean's leaves are read only while packed,
        # before any result is written: ``out`` may be ``x`` itself)
        packed.into = _into(out, layout, arrays, copied=op == "mean")

    def finished(results: list):
        if results and results[0] is WRITTEN:  # (every buffer: see ``Packed.into``)
            assert out is not None
            return out.value
        got = _finished(results, layout)
        if out is not None:
            return _out.deliver_leaves(got, structure, out, what)
        if structure is None:
            return got[0]
        return got if layout.flat else _tree.rebuild(structure, iter(got))

    return then(comm.allreduce_many(packed, send_op, _agree, wait, label=op), finished, wait)


def _delivered(got, out: _tree.Flat | None, what: str, wait: bool):
    """``got`` (a Handle of it where not ``wait``) delivered into ``out``, if given."""
    return got if out is None else then(got, lambda r: _out.deliver(r, out, what), wait)


def _into(out: _tree.Flat, layout: _Layout, arrays: list, copied: bool) -> list | None:
    """``Packed.into`` of ``out`` (a structure as the result's), where its every leaf is a
    C-contiguous writable numpy array of its result's shape and dtype, apart from each
    other and, unless the inputs ``arrays`` are ``copied`` into the message before any
    result is written, from them; else None (the result is copied into ``out``)."""
    if not layout.plain or out.structure != layout.structure:  # (so as many leaves)
        return None
    outs = out.leaves
    for o, a in zip(outs, arrays):
        if (type(o) is not np.ndarray or o.shape != a.shape or o.dtype != a.dtype
                or not o.flags.c_contiguous or not o.flags.writeable):
            return None
    if _out.overlapping(outs if copied else outs + arrays) is not None:
        return None
    return [[(first, end, outs[i].reshape(-1)) for i, first, end, _ in leaves]
            for *_, leaves in layout.packing]


def _finished(results: list, layout: _Layout) -> list:
    """The leaves of the result from the reduced buffers ``results``: in the usual case,
    views of one fresh buffer per dtype."""
    if layout.plain:  # (the usual case: views of the results, as they are)
        out = []
        for g, a, b, shape, _ in layout.unpacking:
            out.append(results[g][a:b].reshape(shape))
    else:
        out = []
        for (g, a, b, shape, cast), kind in zip(layout.unpacking, layout.kinds):
            part = results[g][a:b].reshape(shape)
            if cast is not None and part.dtype != cast:  # (a float16 mean, summed in
                part = part.astype(cast)  # float32)
            out.append(_reduction.restore_kind(part, kind))  # (a number stays one)
    return out


_INT_CHECKED = ("sum", "prod")  # the ops whose Python ints may leave int64's range
_INT64 = 2.0 ** 63


def _python_ints(leaves: list) -> bool:
    return any(type(leaf) is int for leaf in leaves)


def in_int64(value: int) -> bool:
    """Whether ``value``, a Python int, is one the ranks can combine (as int64)."""
    return -_INT64 <= value < _INT64


def python_ints(x) -> tuple | None:
    """The Python ints of ``x`` (an int, or a list or tuple holding some, nested too): each
    leaf's, in order, None for a leaf that is no int; None where ``x`` holds none."""
    if type(x) is int:
        return (x,)
    if isinstance(x, (list, tuple)):
        leaves = _tree.flatten(x)[0]
        if _python_ints(leaves):
            return tuple([v if type(v) is int else None for v in leaves])
    return None


def past_ints_as_zero(x, numbers: tuple):
    """``x`` (whose Python ints are ``numbers``) with those past int64's range as 0: a rank
    passing one takes part all the same, so that every rank raises
    (``check_python_ints``) and none waits for it."""
    if all(v is None or in_int64(v) for v in numbers):
        return x
    if type(x) is int:
        return 0
    leaves, structure = _tree.flatten(x)
    return _tree.rebuild(structure, iter(
        [0 if type(v) is int and not in_int64(v) else v for v in leaves]))


def check_python_ints(numbers: list, op: str, what: str, ends=None) -> None:
    """``OverflowError``, the same on every rank, where the ranks' Python ints
    (``numbers``: each rank's ``python_ints``, or None) cannot be combined as int64: one is
    past its range, or their sum or product in a place leaves it (over ranks 0..``e`` for
    each ``e`` in ``ends``, a scan's prefixes; else every rank). Rooted and prefix
    collectives exchange their ints beforehand, so that every rank decides alike."""
    past = [r for r, ints in enumerate(numbers) if ints is not None and any(
        v is not None and not in_int64(v) for v in ints)]
    if past:
        raise OverflowError(
            f"synk.comm.{what}: a Python int of rank(s) {past} is past the range of int64, "
            "in which synk combines Python ints; pass floats for numbers that large")
    if op not in _INT_CHECKED or any(ints is None for ints in numbers) or \
            len({len(ints) for ints in numbers}) > 1:
        return
    _check_combined(numbers, op, what,
                    range(len(numbers) - 1, len(numbers)) if ends is None else ends)


def _check_combined(numbers: list, op: str, what: str, ends) -> None:
    """``check_python_ints``' check of the ints combined, place by place."""
    for place in range(len(numbers[0])):
        combined = None
        for rank, ints in enumerate(numbers):
            value = ints[place]
            if value is None:  # (not an int on every rank: a float's place)
                break
            combined = value if combined is None else (
                combined + value if op == "sum" else combined * value)
            if rank in ends and not in_int64(combined):
                raise OverflowError(
                    f"synk.comm.{what}: the {op} of the ranks' Python ints is {combined}, past "
                    "the range of int64, in which synk combines them; pass floats for numbers "
                    "that large, or gather the ints (synk.comm.allgather_object) and combine "
                    "them")


def _checked_ints(comm, value: _tree.Flat, op: str, weight, wait: bool, what: str):
    """A value with Python int leaves reduced with ``op`` in one collective, beside a flag
    per rank of ints past int64 (sent as 0, so none waits) and, for a sum or product, a
    float64 copy of each int: Python's answer, or ``OverflowError`` on every rank. In range,
    the float64 result is within ``2**11 * size`` of the int64 one; wrapped, at least
    ``2**63`` apart (a NaN of the copy, ``inf * 0``, is a 0 the ints give rightly)."""
    leaves, structure = value.leaves, value.structure
    refused = [v for v in leaves if type(v) is int and not in_int64(v)]
    if refused:
        leaves = [0 if type(v) is int and not in_int64(v) else v for v in leaves]
    # Rank r's flag is the r-th: "refused" is the value that ``op`` carries from any one
    # rank to the result (0 through a product, minimum or AND; else 1), and no other rank
    # sets that place, so that no op (an XOR) can cancel it.
    unset = 1 if op in ("prod", "min", "band", "land") else 0
    flags = [unset] * comm.size
    if refused:
        flags[comm.rank] = 1 - unset
    copies = [float(v) if in_int64(v) else 0.0 for v in leaves
              if type(v) is int] if op in _INT_CHECKED else []
    together = [_tree.rebuild(structure, iter(leaves)), copies, flags]
    got = allreduce(comm, _tree.apart(together), op, weight, wait, ints=False,
                    passed=lambda: _passed.of_value(op, weight is not None, structure, leaves))

    def checked(all_three):
        result, sums, flagged = all_three
        ranks = [r for r, f in enumerate(flagged) if bool(f) != bool(unset)]
        if ranks:
            mine = f" (this rank's: {refused[0]})" if refused else ""
            raise OverflowError(
                f"synk.comm.{what}: a Python int of rank(s) {ranks} is past the range of "
                f"int64, in which synk combines Python ints{mine}; pass floats for numbers "
                "that large")
        ints = [v for v in _tree.flatten(result)[0] if type(v) is int]
        for exact, near in zip(ints, sums):
            if abs(float(near) - exact) > _INT64 / 2:
                raise OverflowError(
                    f"synk.comm.{what}: the {op} of the ranks' Python ints is about "
                    f"{float(near):.6g}, past the range of int64, in which synk combines "
                    "them; pass floats for numbers that large, or gather the ints "
                    "(synk.comm.allgather_object) and add them")
        return result

    return then(got, checked, wait)


def _packed(xp, layout: _Layout, head: np.ndarray, arrays: list, factor, weighted: bool,
            reuse: bool, unscaled: tuple | None = None, copy: bool = False) -> Packed:
    """The head and one flat buffer per dtype group, leaves copied in (scaled by
    ``factor``), as a ``Packed`` (``weighted``: the head's weight still to apply), packed
    where the communicator asks, or into the layout's last message where ``reuse`` (a
    blocking call's). ``unscaled``: as ``_mean_packing``'s. ``copy``: a mean's leaves copied
    in their group's dtype even where they could go as they are."""
    if factor is None and layout.as_they_are and not copy:  # one leaf a group: as they are
        return Packed(head, [xp.ascontiguousarray(arrays[leaves[0][0]]).reshape(-1)
                             for *_, leaves in layout.packing], weighted=weighted)
    packing = _Packing(xp, layout, head, arrays, factor, reuse, unscaled)
    packed = Packed(head, pack=packing.pack, pack_part=packing.pack_part,
                    buffer_bytes=layout.buffer_bytes, dtypes=layout.dtype_list,
                    offsets=layout.offsets, nbytes=layout.nbytes, weighted=weighted)
    packing.packed = packed
    return packed


class _Packing:
    """One call's leaves packed into its layout's buffers (``Packed``'s ``pack`` and
    ``pack_part``). Where a scaled term underflows (``unscaled``: see ``_mean_packing``),
    the leaves are packed again as they are, under a head of scale 1."""

    __slots__ = ("xp", "layout", "head", "arrays", "factor", "reuse", "unscaled", "packed")

    def __init__(self, xp, layout: _Layout, head: np.ndarray, arrays: list, factor,
                 reuse: bool, unscaled: tuple | None = None) -> None:
        self.xp, self.layout, self.head, self.arrays = xp, layout, head, arrays
        self.factor, self.reuse, self.unscaled = factor, reuse, unscaled
        self.packed: Packed | None = None

    def pack(self, message):
        """Pack into ``message`` (None: the layout's kept message, or a new one)."""
        xp, layout = self.xp, self.layout
        if message is None:
            message = layout.messages.get(xp.__name__) if self.reuse else None
            if message is None:
                message = xp.empty(layout.nbytes, np.uint8)
                if self.reuse:
                    layout.messages[xp.__name__] = message
        head = self.head
        if self.unscaled is None:
            buffers = self._groups(message, self.factor)
        else:
            try:
                with np.errstate(under="raise"):
                    buffers = self._groups(message, self.factor)
            except FloatingPointError:
                buffers = self._groups(message, None)
                head = self._unscaled_head()
                if self.packed is not None:
                    self.packed.head = head
        head = head.view(np.uint8)
        message[:head.nbytes] = head if xp is np else xp.asarray(head)
        return message, buffers

    def _unscaled_head(self) -> np.ndarray:
        """The head of leaves packed as they are (scale 1)."""
        assert self.unscaled is not None
        digest, weight = self.unscaled
        return _header(digest, weight, 1.0)

    def _groups(self, message, factor) -> list:
        """Each group's buffer in ``message``, its leaves packed in (scaled by ``factor``)."""
        xp, arrays = self.xp, self.arrays
        buffers = []
        for dtype, at, size, leaves in self.layout.packing:
            data = message[at:at + size * dtype.itemsize].view(dtype)
            if factor is None:  # each leaf copied into its place
                for i, first, end, shape in leaves:
                    data[first:end].reshape(shape)[...] = arrays[i]
            elif not factor:  # weight 0: nothing, not 0 * x (a NaN of a mean over no rows
                data[...] = 0  # stays out)
            elif len(leaves) == 1 or size * dtype.itemsize > _SMALL * len(leaves):
                for i, first, end, shape in leaves:  # (each leaf scaled into its place,
                    _scaled_into(xp, arrays[i], factor,  # one pass each)
                                 data[first:end].reshape(shape), dtype)
            else:  # many small leaves: one copy of them all, then scaled in place (two passes
                # over the group, but one call each, not one per leaf)
                xp.concatenate([arrays[i].reshape(-1) for i, *_ in leaves], out=data)
                _scaled_into(xp, data, factor, data, dtype)
            buffers.append(data)
        return buffers

    def pack_part(self, g: int, lo: int, hi: int, dest) -> np.ndarray:
        """Elements ``lo`` to ``hi`` of buffer ``g`` alone, into ``dest``; the head they go
        with."""
        if self.unscaled is None:
            self._part(g, lo, hi, dest, self.factor)
            return self.head
        try:
            with np.errstate(under="raise"):
                self._part(g, lo, hi, dest, self.factor)
            return self.head
        except FloatingPointError:
            self._part(g, lo, hi, dest, None)
            return self._unscaled_head()

    def _part(self, g: int, lo: int, hi: int, dest, factor) -> None:
        xp, arrays = self.xp, self.arrays
        dtype, _, _, leaves = self.layout.packing[g]
        for i, first, end, _ in leaves:
            a, b = max(lo, first), min(hi, end)
            if a >= b:
                continue
            src, out = arrays[i].reshape(-1)[a - first:b - first], dest[a - lo:b - lo]
            if factor is None:
                out[...] = src
            elif factor:
                _scaled_into(xp, src, factor, out, dtype)
            else:
                out[...] = 0


def _scaled_into(xp, x, factor: float, out, dtype) -> None:
    """``x * factor`` in ``dtype`` (the group's: also where numpy 1.x would take ``x``'s)
    written into ``out``; on a device, float32 and complex64 by ``synk._float32_on_device``,
    whose products keep subnormals where CuPy's ``multiply`` flushes them."""
    if xp is not np and _device32.flushes(xp, dtype):
        _device32.scaled(xp, x.astype(dtype, copy=False), float(dtype.type(factor).real), out)
    else:
        xp.multiply(x, dtype.type(factor), out=out, dtype=dtype)
