"""The exceptions raised in synk's JAX host callbacks, handed back as themselves.

Under ``jax.jit`` a ``synk.comm`` operation runs in a host callback (``jax_primitive``), and
JAX turns an exception raised there into its own error: ``jax.errors.JaxRuntimeError`` whose
text holds the original's traceback, with no ``__cause__`` (XLA hands back only the text:
jax-ml/jax#26102), or a plain ``ValueError`` from the jitted function's C++ fast path once
a call of it has succeeded (jax-ml/jax#34083). ``except synk.SynkError`` would miss it.

So this rank keeps each exception its callbacks raise (``keep``), and where the user's
function raises (``_call.share``), JAX's error that carries the text of a kept one is
replaced by that very exception (``original``): the master gets the original type, a
``SynkError``, a ``ValueError`` of mismatched shapes, a ``CommAborted``..., as for errors
raised outside ``jax.jit``. Inside the function, the jitted call still raises JAX's error.

And a failed callback leaves JAX unusable on this thread: the token a computation with an
ordered effect hands to the next holds its error, so every later jitted ``synk.comm`` call
(and JAX's exit hook) raises that error again, on JAX's GPU platform and under
``shard_map`` on its CPU one (jax-ml/jax#37587). Where a piece of the call raised, or a
callback raised in it, ``_call.share`` drops the tokens that carry an error
(``forget_failed_tokens``), so that the next computation starts a fresh chain, as JAX's first
one does.

Stale rule: ``KEPT`` holds the exceptions raised since the function started on this piece
of the call, and is emptied when it starts and when it ends (``clear``), so that no call's
exception stands for another's, and none is kept alive (with its frames) between calls.
Jax-free: ``_call.share`` imports it on every rank.
"""
from __future__ import annotations

import sys

from ...errors import add_note

KEPT: list = []  # this rank's callbacks' exceptions, since fn started on this piece
_MOST = 16  # (a function that catches JAX's errors in a loop keeps the latest only)


def keep(exc: BaseException) -> None:
    """``exc`` was raised in one of synk's JAX host callbacks on this rank."""
    if len(KEPT) >= _MOST:
        del KEPT[0]
    KEPT.append(exc)


def clear() -> None:
    KEPT.clear()


def original(exc: BaseException) -> BaseException | None:
    """The kept exception JAX's error ``exc`` stands for (the latest whose text it
    carries), noted as such; None when ``exc`` is no such error."""
    if not KEPT or not _from_jax(exc) or any(exc is k for k in KEPT):
        return None
    text = str(exc)
    for kept in reversed(KEPT):
        said = str(kept)
        if type(kept).__name__ in text and (not said or said in text):
            add_note(kept, f"synk: raised in synk.comm under jax.jit (in JAX's host callback); "
                           f"JAX reported it as {type(exc).__name__} inside the function, "
                           "and synk raises the original")
            return kept
    return None


def forget_failed_tokens() -> None:
    """Drop this thread's JAX ordered-effect tokens that carry a failed computation's error
    (``jax._src.dispatch.runtime_tokens``, thread-local: no public API resets it); those of
    computations that succeeded stay, so that the order of effects is kept. Waits for the
    computations whose tokens it checks. Nothing to do where JAX is not loaded."""
    dispatch = sys.modules.get("jax._src.dispatch")
    tokens = getattr(dispatch, "runtime_tokens", None)
    for table in (getattr(tokens, "current_tokens", {}),
                  getattr(tokens, "output_runtime_tokens", {})):
        for key, token in list(table.items()):
            try:
                token.block_until_ready()
            except Exception:  # (the error of the computation that produced it)
                del table[key]


def _from_jax(exc: BaseException) -> bool:
    """Whether ``exc`` may be JAX's report of a callback's exception: JAX's runtime error,
    or the ValueError its fast path raises instead."""
    kind = type(exc)
    return kind is ValueError or kind.__module__.split(".")[0] in ("jax", "jaxlib")
