"""Combining the ranks' outputs with MPI's collectives, when the ranks span hosts:
``MpiOutputs``. Every rank replies, each large output replaced by an ``MpiPart``; rank 0
plans the collectives (``plan``) and sends the plan (``protocol.COMBINE``); every rank then
runs them into rank 0 (``combine``).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._reduction import (
    LOGICAL,
    MEANS,
    Kind,
    accumulator,
    exact_finish,
    exact_term,
    factors,
    identity,
    mean_work_dtype,
    result_dtype,
    term_or_none,
    weights_of,
    widest,
)
from .._wire.arrays import dtype_token, wrap_output
from ..comm.host.mpi_collectives import HostCollectives, exact
from . import ops as _ops
from .records import DONE_OUTPUT, Share, ShareResult


class MpiPart(NamedTuple):
    """In a reply, in the place of an output of at least ``limit`` bytes: what it is (it
    follows by MPI's collectives, once rank 0 has every reply)."""

    shape: tuple
    dtype: object  # a dtype token (wire.dtype_token)
    nbytes: int


class MpiOutputs:
    """Where a rank of a group across hosts hands its outputs: ``collectives`` are this rank's,
    ``limit`` the bytes from which an output goes by MPI; ``pack`` readies a worker's reply. Rank 0
    sends each function's last plan with its next CALL; every rank runs it after its reply
    (``settle``), with stand-ins where its share did not match, so no rank waits in vain. If every
    rank matched (``valid``) those are the results, at no extra round; else they are dropped and the
    plan made from the replies runs."""

    collective = True  # every rank ends its share here, with rows or not

    def __init__(self, collectives: HostCollectives, rank: int, limit: int,
                 pack: bool) -> None:
        self.collectives, self.rank, self.limit, self.pack = collectives, rank, limit, pack
        self._kept: tuple | None = None  # (call id, its Share or None) of the last share
        self.expected: tuple | None = None  # (call id, the plan its CALL came with)
        self._matched = False  # this rank's share of that call is as the plan expects
        self._settled: tuple | None = None  # rank 0: the expected plan, once it ran
        self._plans: dict = {}  # rank 0: function id -> the plan its last call ran
        self.ways: dict = {}  # rank 0: (op, result dtype) -> the way it went last

    def expect(self, plan: tuple | None, call_id: int) -> None:
        """Call ``call_id`` came with ``plan`` (its function's last, or None): every rank
        runs it once its reply is out (``settle``), whatever its share did."""
        self.expected = None if plan is None else (call_id, plan)
        self._matched = False
        self._settled = None

    def finish(self, share: Share | None, reduce, fname: str, call_id: int) -> ShareResult:
        """This rank's end of call ``call_id``'s share (None: it had no rows): the share to
        reply with; the share itself is kept for the collectives. Where the call came with
        a plan that this share matches, its planned outputs are ``DONE_OUTPUT`` in the
        reply (``settle`` combines them)."""
        if all(op is None for op in (reduce if isinstance(reduce, tuple) else (reduce,))):
            # (no array op or gather: every output rides the replies as it is, as on one host)
            self._kept = None
            return ShareResult(share, None, 0.0)
        self._kept = (call_id, share)
        ops = None if share is None else _ops.share_ops(reduce, share, fname)
        expected = self.expected
        planned: dict = {}
        if expected is not None and expected[0] == call_id:
            self._matched = _matches(expected[1], self.rank, share, ops, self.limit)
            if self._matched:
                planned = expected[1][3]
        if share is None:
            return ShareResult(None, None, 0.0)
        limit, pack = self.limit, self.pack
        outputs = []
        assert ops is not None  # (a share's)
        for i, ((kind, value), op) in enumerate(zip(share.outputs, ops)):
            if i in planned:
                kind, value = DONE_OUTPUT
            elif op is not None and value.nbytes >= limit:
                value = MpiPart(tuple(value.shape), dtype_token(value.dtype), int(value.nbytes))
            elif op is not None and pack:
                value = wrap_output(value)
            outputs.append((kind, value))
        return ShareResult(share.replace_outputs(outputs), None, 0.0)

    def settle(self) -> dict:
        """Once this rank's reply is out (rank 0: once it has every reply): run the plan the
        call came with, with this rank's outputs where its share matched it, else with
        stand-ins of the planned shapes (the results are then thrown away: see
        ``valid``); {output index: result} on rank 0."""
        expected, self.expected = self.expected, None
        assert expected is not None
        self._settled = expected
        call_id, plan = expected
        kept = self._kept
        share = kept[1] if self._matched and kept is not None and kept[0] == call_id else None
        mines = _mines(plan, self.rank, share, stand_in=share is None)
        return self._combine(plan, mines)

    def planned(self, fid: int, call_id: int) -> tuple | None:
        """Rank 0: the plan for call ``call_id`` of function ``fid`` (its last call's, which
        every rank runs right after its reply: no round to agree on one), or None."""
        plan = self._plans.get(fid)
        self.expect(plan, call_id)
        return plan

    def valid(self, shares: dict) -> bool:
        """Rank 0, with every reply in and none failed: whether every rank's share matched
        the plan the call came with (the results of ``settle`` are the call's)."""
        assert self._settled is not None
        ranks, _, _, outputs = self._settled[1]
        present = [r for r in sorted(shares) if shares[r] is not None]
        if present != list(ranks):
            return False
        for r in present:
            for i, (kind, value) in enumerate(shares[r].outputs):
                if (i in outputs) != (kind == Kind.DONE) or type(value) is MpiPart:
                    return False
        return True

    def plan(self, shares: dict, reduce, fname: str, fid: int, call_id: int) -> tuple | None:
        """Rank 0, with every reply of call ``call_id`` in and none failed (``shares``: every
        rank's, its own among them): the plan of the collectives every rank is to run now,
        or None (also kept as the plan of ``fid``'s next call); raises the error of outputs
        that disagree."""
        if self._kept is None or self._kept[0] != call_id:
            return None
        if self._settled is not None:  # outputs a rank matched are described by the plan
            shares = _described(shares, self._settled[1])
        plan, error = _plan(shares, reduce, fname, self.limit)
        if plan is None:
            self._plans.pop(fid, None)
        else:
            self._plans[fid] = plan
            while len(self._plans) > _PLANS:
                del self._plans[next(iter(self._plans))]
        if error is not None:
            raise error
        return None if plan is None else (call_id, plan)

    def combine(self, plan: tuple) -> dict:
        """Run ``plan``'s collectives with the share kept of its call; {output index:
        result} on rank 0."""
        kept, self._kept = self._kept, None
        if kept is None or kept[0] != plan[0]:
            raise RuntimeError(f"synk: no share of call {plan[0]} is kept for its outputs' "
                               f"collectives (kept: {None if kept is None else kept[0]})")
        return self._combine(plan[1], _mines(plan[1], self.rank, kept[1], False))

    # -- the collectives of a plan ---------------------------------------------------------
    def _combine(self, plan: tuple, mines: dict) -> dict:
        """Every output of ``plan`` combined into rank 0 ({output index: result} there), from
        this rank's ``mines`` ({output index: its part, or None without rows})."""
        ranks, weights, _, outputs = plan
        terms = {i: _mean_term(mines.get(i), self.rank, ranks, weights, shape, dtypes)
                 for i, (op, _, shape, dtypes) in outputs.items() if op == "mean"}
        # (where a rank's term underflowed, every rank folds that mean, as it learns here)
        underflowed = self.collectives.arrive([t is None for t in terms.values()])
        folded = {i for i, u in zip(terms, underflowed) if u}
        results = {}
        for i, (op, kind, shapes, dtypes) in outputs.items():
            mine = mines.get(i)
            if op == "gather":
                results[i], way = self._gather(mine, ranks, shapes, dtypes), "gather"
            elif i in folded:
                results[i] = self._fold(op, kind, mine, ranks, weights, shapes,
                                        [np.dtype(d) for d in dtypes])
                way = "fold"
            else:
                results[i], way = self._reduce(op, kind, mine, ranks, weights, shapes,
                                               dtypes, terms.get(i))
            if self.rank == 0:
                self.ways[(op, np.asarray(results[i]).dtype.str)] = way
        return results

    def _gather(self, mine, ranks: list, shapes: list, dtypes: list):
        """``gather``: every rank's rows in rank order, by ``Gatherv``."""
        c = self.collectives
        dtype = np.result_type(*map(np.dtype, dtypes))
        tail = tuple(shapes[0][1:])
        rows = dict(zip(ranks, (s[0] if s else 1 for s in shapes)))
        counts = [rows.get(r, 0) for r in range(c.size)]
        width = int(np.prod(tail, dtype=np.int64))
        part = (np.empty((0, *tail), dtype) if mine is None else
                np.ascontiguousarray(np.atleast_1d(mine), dtype))
        out = c.result((sum(counts), *tail), dtype) if self.rank == 0 else None
        if width and dtype.itemsize:
            c.gather(part, [n * width for n in counts], out, dtype.itemsize)
        return out

    def _reduce(self, op: str, kind: int, mine, ranks: list, weights: list, shape: tuple,
                dtypes: list, term=None) -> tuple:
        """An array op: (the result on rank 0, else None; the way it went). ``term``: this rank's of
        a mean (``_mean_term``). ``reduce`` adds in MPI's order: a float sum or mean may differ from
        one in rank order in its last bits (docs/api/calls.md, "How mean is computed")."""
        c = self.collectives
        dtypes = [np.dtype(d) for d in dtypes]
        dtype = result_dtype(op, dtypes)
        wire, wire_op = _on_the_wire(op, dtype)
        if not exact(wire, wire_op):
            return self._fold(op, kind, mine, ranks, weights, shape, dtypes), "fold"
        if op == "mean":  # (synk._reduction's rule: w/W * x in the mean's dtype)
            part = np.ascontiguousarray(term, wire)
        elif op in MEANS:  # (the exact float64 terms)
            weights_, total = weights_of([(w, None) for w in weights])
            weight = dict(zip(ranks, weights_)).get(self.rank, 0)
            if mine is None or not weight:
                part = np.zeros(shape, wire)
            else:
                part = np.ascontiguousarray(exact_term(np, np.asarray(mine), weight), wire)
        else:
            if mine is None:
                part = np.full(shape, identity(op, dtype), dtype)
            elif op in LOGICAL or dtype == np.bool_:  # (nonzero is true)
                part = np.not_equal(mine, 0)
            else:
                part = np.asarray(mine).astype(dtype, copy=False)
            part = np.ascontiguousarray(part.view(np.uint8) if part.dtype == np.bool_ else part,
                                        wire)
        out = c.result(shape, wire) if self.rank == 0 else None
        c.reduce(part, wire_op, out)
        if out is None:
            return None, "reduce"
        if op == "exact_mean":
            out = exact_finish(out, total, dtype)
        elif wire != dtype:  # booleans; small integers, wrapped as numpy's
            out = out.view(np.bool_) if dtype == np.bool_ else out.astype(dtype)
        return _ops.restore_kind(out, kind), "reduce"

    def _fold(self, op: str, kind: int, mine, ranks: list, weights: list, shape: tuple,
              dtypes: list):
        """An array op whose answer MPI's op would not give: every rank's part gathered to
        rank 0 as it is, and combined there by numpy in rank order."""
        c = self.collectives
        sizes = [int(np.prod(shape, dtype=np.int64)) * d.itemsize for d in dtypes]
        unit = min(d.itemsize for d in dtypes)
        nbytes = dict(zip(ranks, sizes))
        counts = [nbytes.get(r, 0) // unit for r in range(c.size)]
        part = (np.empty(0, np.uint8) if mine is None else
                np.ascontiguousarray(mine).reshape(-1).view(np.uint8))
        out = c.result((sum(counts) * unit,), np.uint8) if self.rank == 0 else None
        c.gather(part, counts, out, unit)
        if out is None:
            return None
        parts, at = [], 0
        for w, dtype, size in zip(weights, dtypes, sizes):
            parts.append((w, out[at:at + size].view(dtype).reshape(shape)))
            at += size
        return _ops.combine_output(op, parts, Kind(kind))


def _mean_term(mine, rank: int, ranks: list, weights: list, shape: tuple, dtypes: list):
    """This rank's term of a mean, ``w / W * x`` in the dtype it is summed in (zeros for a
    rank without rows, or of weight 0), or None where a term underflowed (``term_or_none``:
    every rank then folds that mean, so that numpy's combine keeps the term's bits)."""
    weights_, total = weights_of([(w, None) for w in weights])
    weight = dict(zip(ranks, factors(weights_, total))).get(rank, 0)
    dtype = result_dtype("mean", [np.dtype(d) for d in dtypes])
    if mine is None or not weight:
        return np.zeros(shape, mean_work_dtype(dtype))
    return term_or_none(np.asarray(mine), weight, dtype)


def _on_the_wire(op: str, dtype: np.dtype) -> tuple:
    """(the dtype an op's parts travel in, MPI's op): a mean's scaled terms summed in its
    own dtype, an exact mean's in float64 (complex128); booleans (every logical op's parts:
    nonzero is true) as bytes of 0 and 1; sums of 8- and 16-bit integers, which ``exact``
    refuses, in 32 bits, cast back on rank 0 (wrapping as numpy's sums do)."""
    if op in MEANS:
        return (accumulator(dtype) if op == "exact_mean" else mean_work_dtype(dtype)), "sum"
    if dtype == np.bool_:
        return np.dtype(np.uint8), op
    if op == "sum" and dtype.kind in "iu" and dtype.itemsize < 4:
        return np.dtype(f"{dtype.kind}4"), op
    return dtype, op


def _part(value) -> tuple:
    """(shape, dtype token, bytes) of an output as a reply carries it."""
    if type(value) is MpiPart:
        return value
    value = np.asarray(value)
    return tuple(value.shape), dtype_token(value.dtype), int(value.nbytes)


_PLANS = 256  # rank 0 keeps the last plan of this many functions


def _matches(plan: tuple, rank: int, share: Share | None, ops, limit: int) -> bool:
    """Whether this rank's ``share`` (None: no rows) is as ``plan`` expects it: its rows,
    structure, and each output's op, kind, shape and dtype; no other output large."""
    ranks, weights, layout, outputs = plan
    if share is None or rank not in ranks:
        return share is None and rank not in ranks
    j = ranks.index(rank)
    if share.weight != weights[j] or share.layout() != layout:
        return False
    for i, ((kind, value), op) in enumerate(zip(share.outputs, ops)):
        entry = outputs.get(i)
        if entry is None:
            if op is not None and value.nbytes >= limit:
                return False
            continue
        planned_op, planned_kind, shapes, dtypes = entry
        shape = shapes[j] if op == "gather" else shapes
        if (op != planned_op or int(kind) != planned_kind or tuple(value.shape) != shape
                or dtype_token(value.dtype) != dtypes[j]):
            return False
    return True


def _mines(plan: tuple, rank: int, share: Share | None, stand_in: bool) -> dict:
    """This rank's parts of ``plan``'s outputs: its share's, or (``stand_in``) zeros of the
    shapes and dtypes the plan expects of it; none where the plan has it without rows."""
    ranks, _, _, outputs = plan
    if rank not in ranks:
        return {}
    j = ranks.index(rank)
    if not stand_in:
        assert share is not None
        return {i: np.asarray(share.outputs[i][1]) for i in outputs}
    return {i: np.zeros(shapes[j] if op == "gather" else shapes, np.dtype(dtypes[j]))
            for i, (op, _, shapes, dtypes) in outputs.items()}


def _described(shares: dict, plan: tuple) -> dict:
    """``shares`` with the outputs that matched ``plan`` (``DONE_OUTPUT`` in their replies)
    described as the plan has them."""
    ranks, _, _, outputs = plan
    described = {}
    for r, share in shares.items():
        if share is not None and r in ranks:
            j = ranks.index(r)
            parts = list(share.outputs)
            for i, (kind, _) in enumerate(parts):
                if kind == Kind.DONE and i in outputs:
                    op, planned_kind, shapes, dtypes = outputs[i]
                    shape = shapes[j] if op == "gather" else shapes
                    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtypes[j]).itemsize
                    parts[i] = (Kind(planned_kind), MpiPart(shape, dtypes[j], nbytes))
            share = share.replace_outputs(parts)
        described[r] = share
    return described


def _plan(shares: dict, reduce, fname: str, limit: int) -> tuple:
    """(plan, None) or (None, the error to raise) from every rank's reply. The plan: (ranks with
    rows, their rows, their outputs' structure, {output index: (op, kind, shape, dtypes)}),
    ``shape`` a gather's per rank, ``dtypes`` per rank in ``ranks``' order. No plan where a rank
    failed, the outputs disagree or every output is under ``limit``. Gathers go by ``Gatherv``; an
    op by ``Reduce`` where MPI's gives numpy's answer (``exact``; means by ``_on_the_wire``), else
    (also a mean whose term underflowed) the parts are gathered and combined by numpy in rank order,
    as the replies' are."""
    ranks = [r for r in sorted(shares) if shares[r] is not None]
    if not ranks:
        return None, None
    try:
        _ops.check_same_outputs(fname, {r: shares[r].layout() for r in ranks})
        ops = _ops.share_ops(reduce, shares[ranks[0]], fname)
        outputs = {}
        for i, op in enumerate(ops):
            if op is None:
                continue
            parts = [_part(shares[r].outputs[i][1]) for r in ranks]
            if max(p[2] for p in parts) < limit:
                continue  # small on every rank: in the replies
            _ops.check_shapes(op, {f"rank {r}": p[0] for r, p in zip(ranks, parts)}, i, fname)
            dtypes = [p[1] for p in parts]
            if op == "gather":
                np.result_type(*map(np.dtype, dtypes))  # (or raise, as concatenate would)
            kind = int(widest([shares[r].outputs[i][0] for r in ranks]))
            shape = [tuple(p[0]) for p in parts] if op == "gather" else tuple(parts[0][0])
            outputs[i] = (op, kind, shape, dtypes)
    except (ValueError, TypeError) as err:
        return None, err
    if not outputs:
        return None, None
    return (ranks, [shares[r].weight for r in ranks], shares[ranks[0]].layout(), outputs), None
