"""Running ``fn`` on one piece of a rank's rows, empty pieces included.

Every rank runs ``fn`` on each of its pieces, also when it has no rows (fewer rows than
ranks, a small last batch, a ``local_batch`` of 0, more pieces than rows), so that it takes
part in the collectives the other ranks call (``synk.comm``): a rank that did not run ``fn``
would leave them waiting. What ``fn`` returns for no rows counts for nothing (a rank with no
rows contributes nothing to any reduction), so it runs quietly: numpy's warnings about empty
slices are silenced, and an error is not the call's as long as ``fn`` had called no
collective yet. The other ranks are told then (``_context.left``), so that their waits for
this rank's messages inside their function end with ``CommAborted`` instead of hanging. An
error after a collective is the call's: ``fn`` should handle 0 rows then.
"""
from __future__ import annotations

import warnings

import numpy as np

from ..comm import context as _context
from ..comm.autograd import callback_errors as _callback_errors
from ..errors import add_note

QUIET = object()  # what a piece that counts for nothing gives


def run(fn, args, kwargs, counts: bool):
    """``fn(*args, **kwargs)``; for a piece that does not count, quietly, and ``QUIET``."""
    context = _context.current
    context.in_fn = True
    if _callback_errors.KEPT:
        _callback_errors.clear()
    try:
        if counts:
            return fn(*args, **kwargs)
        ops = context.ops
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn(*args, **kwargs)
        except Exception as exc:
            if context.ops == ops:  # no collective yet: nobody has this rank's messages
                _context.left(exc)
                return QUIET
            add_note(exc, "synk: this rank had no rows for this piece of the call; it runs "
                          "the function on 0 rows all the same, so that it takes part in the "
                          "collectives of the call (what it returns counts for nothing): "
                          "make the function accept 0 rows")
            raise
        return QUIET
    except Exception as exc:  # (synk.comm's own exception under jax.jit, as itself)
        kept = _callback_errors.original(exc) if _callback_errors.KEPT else None
        if kept is None:
            raise
        raise kept  # noqa: B904 (JAX's error stays chained as its __context__)
    finally:
        context.in_fn = False
        if _callback_errors.KEPT:
            _callback_errors.clear()


def counts(plan, rank: int, k: int, rows) -> bool:
    """Whether piece ``k`` of ``rank`` counts: it has rows (or nothing is scattered), or it
    is rank 0's first when the call selects no rows at all (the result keeps its form)."""
    return rows is None or rows.count > 0 or (plan.total == 0 and rank == 0 and k == 0)
