"""That every rank passes the same arrays to an NCCL reduction, checked beside it: NCCL checks
nothing (different counts hang or overrun buffers; equal counts of other shapes, dtypes or
ops combine what does not belong together).

::

    each rank: its header (collective, op, shape and dtype; a structure's
      digest) to every peer over the call's host communicator     host.start_heads
    agreed before: NCCL launched, the headers read as data moves  the check returned
    new: the headers read, then NCCL launched; kept once agreed   Agreement.agreed
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from ... import _reduction
from .. import passed as _passed
from .nccl_types import dtype_number

_DTYPES: dict[int, np.dtype] = {np.dtype(c).num: np.dtype(c) for c in "?bBhHiIlLqQefdgFDG"}
_DIMS = 8  # dimensions a header carries (more are folded into its digest)
_KEEP = 256  # agreed headers kept


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def array_head(what: str, op: str, x) -> np.ndarray:
    """The header of one array: a digest of the collective, op and full shape; the number
    of dimensions and the first ``_DIMS`` of them; the dtype's number (the same for equal
    dtypes: ``dtype_number``) and size."""
    head = np.full(4 + _DIMS, -1, np.int64)
    head[0] = _hash(repr((what, op, tuple(x.shape))))
    head[1] = x.ndim
    head[2:2 + min(x.ndim, _DIMS)] = x.shape[:_DIMS]
    head[-2], head[-1] = dtype_number(x.dtype), x.dtype.itemsize
    return head


def _shape_of(head) -> str:
    n = int(head[1])
    dims = [int(d) for d in head[2:2 + min(n, _DIMS)]]
    return repr(tuple(dims)) if n <= _DIMS else f"{n}-d, {tuple(dims)}..."


def _dtype_of(head) -> str:
    return str(_DTYPES.get(int(head[-2]), f"dtype number {int(head[-2])}"))


class Agreement:
    """One NCCL communicator's check of what the ranks pass; ``host()`` gives the running
    call's host communicator, ``abort(why)`` aborts the communicator. Headers every rank
    agreed on are kept (``agreed``): a loop's steady state costs no round trip. Ranks that
    disagree all raise the same ``ValueError``, naming what each passed (exchanged through
    ``synk.comm.passed``: a header holds a digest only). Where the operation was launched,
    every rank aborts its communicator first, made anew for the next call, and says so in
    its reply (``Communicator.aborted``)."""

    def __init__(self, host: Callable, abort: Callable[[str], None]) -> None:
        self._host, self._abort = host, abort
        self.agreed: dict[bytes, None] = {}  # headers every rank passed alike, oldest first

    def _keep(self, key: bytes) -> None:
        self.agreed[key] = None
        if len(self.agreed) > _KEEP:
            self.agreed.pop(next(iter(self.agreed)))

    def array(self, what: str, op: str, x):
        """(``x``, in the dtype the ranks promote to where they passed other dtypes; a
        check to call once the operation is launched). Outside synk.comm (the communicator
        called directly, with no host communicator of the call's), nothing is checked."""
        host = self._host()
        if host is None:
            return x, _nothing
        head = array_head(what, op, x)
        take = host.start_heads(head)
        key = head.tobytes()
        if key in self.agreed:
            return x, lambda: self._verify(take, head, what, op, x)
        self._verify(take, head, what, op, x)  # (aborted on every rank alike: the ranks
        self._keep(key)  # that launched could not go on)
        return x, _nothing

    def _verify(self, take, head, what: str, op: str, x) -> None:
        heads = take()
        if all(np.array_equal(h, head) for h in heads):
            return
        error = self._different(heads, what, op)
        self._abort(f"the ranks passed different arrays to {what}")
        raise take.named(error, _passed.of_array(what, op, x)) from None

    @staticmethod
    def _different(heads: list, what: str, op: str) -> ValueError:
        """The error where shapes or dtypes differ, else the ops or the forms do (a head
        holds the op's hash only), as this rank sees it (``take.named`` names what each
        rank passed in its place)."""
        if len({h.shape for h in heads}) > 1:  # (a fused collective's head)
            return _reduction.disagreement(
                f"synk.comm.{what}: the ranks called different collectives at the same point "
                "(a reduction of one array and one of a structure or a mean)")
        specs = [(_shape_of(h), _dtype_of(h)) for h in heads]
        if len(set(specs)) > 1:
            return _reduction.different_arrays(op, ", ".join(
                f"rank {r}: {shape} {dtype}" for r, (shape, dtype) in enumerate(specs)))
        return _reduction.disagreement(
            f"synk.comm.{what}: the ranks passed different ops (op {op!r} on this rank); "
            "every rank must pass the same op")

    def packed(self, head, op: str, agree: Callable, needs_weights: bool,
               passed: Callable | None = None):
        """For a fused collective of ``head`` (``_fused``'s: the structure's digest, a
        weight): (the weights ``agree`` gives where they are needed before the launch, else
        None; a check to call once the operations are launched). ``passed()``: what this
        rank passed (``Packed.passed``), to name where the ranks disagree."""
        head = head.copy()
        head[0] = _hash(repr((int(head[0]), op)))  # (the op too: every rank must pass it)
        key = head.tobytes()
        host = self._host()
        if host is None:  # (see ``array``; an exact mean's weights need the others')
            if needs_weights:
                raise RuntimeError("an exact mean of a structure runs through synk.comm")
            return None, _nothing
        take = host.start_heads(head)
        if not needs_weights and key in self.agreed:
            def verify() -> None:
                heads = take()
                if _other_structures(heads, head):
                    self._agreed(take, heads, head, agree, passed)  # (raises)
            return None, verify
        weights = self._agreed(take, take(), head, agree, passed)
        self._keep(key)
        return weights, _nothing

    def _agreed(self, take, heads: list, head, agree: Callable, passed: Callable | None):
        """What ``agree`` makes of every rank's head (the weights); where the structures
        differ, the communicator aborted (as on every rank alike) and the error naming what
        each rank passed."""
        try:
            return agree(heads)  # (raises where the structures differ)
        except ValueError as error:
            if _other_structures(heads, head):
                self._abort("the ranks passed different structures to allreduce")
            if not _reduction.is_disagreement(error):
                raise
            raise take.named(error, None if passed is None else passed()) from None


def _other_structures(heads: list, head) -> bool:
    """Whether a rank's head is not of ``head``'s structure (or not a fused one's)."""
    return any(h.shape != head.shape or int(h[0]) != int(head[0]) for h in heads)


def _nothing() -> None:
    pass
