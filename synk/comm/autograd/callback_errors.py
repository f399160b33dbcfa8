"""The exceptions raised in synk's JAX host callbacks, handed back as themselves: under
``jax.jit`` JAX turns an exception raised in a callback (``jax_primitive``) into an error of
its own, which ``except synk.SynkError`` would miss, so this rank keeps each one and raises
it in place of JAX's.

::

    a callback raises exc  --keep-->  KEPT (emptied as a piece of the call starts, ends: clear)
    JAX raises its error   --original-->  exc itself, JAX's error as its __context__
                           (raising_originals: where JAX runs a computation;
                            _call.share: where the user's function raises, so that the
                            master gets the original)
    a piece failed         --forget_failed_tokens-->  the next computation starts a fresh chain
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from ...errors import add_note  # (no JAX here: ``_call.share`` imports this on every rank)

KEPT: list = []  # this rank's callbacks' exceptions, since fn started on this piece
SAID = 1000  # the characters of an exception's text that JAX's error must hold to stand for it
_MOST = 16  # (a function that catches JAX's errors in a loop keeps the latest only)


def keep(exc: BaseException) -> None:
    """``exc`` was raised in one of synk's JAX host callbacks on this rank."""
    if len(KEPT) >= _MOST:
        del KEPT[0]
    KEPT.append(exc)


def clear() -> None:
    """Empty ``KEPT``: as the function starts on a piece of the call, and as it ends, so that
    no call's exception stands for another's, and none is kept alive (with its frames)
    between calls."""
    KEPT.clear()


def original(exc: BaseException) -> BaseException | None:
    """The kept exception JAX's error ``exc`` stands for (the latest whose text it
    carries), noted as such; None when ``exc`` is no such error."""
    if not KEPT or not _from_jax(exc) or any(exc is k for k in KEPT):
        return None
    text = str(exc)
    for kept in reversed(KEPT):
        said = str(kept)
        if type(kept).__name__ in text and (not said or said[:SAID] in text):
            note = (f"synk: raised in synk.comm under jax.jit (in JAX's host callback), which "
                    f"JAX reports as its {type(exc).__name__}, holding the text alone; synk "
                    "raises the original")
            if note not in getattr(kept, "__notes__", ()):
                add_note(kept, note)
            return kept
    return None


def raising_originals(run: Callable) -> Callable:
    """``run`` (JAX's run of a compiled computation) raising, where JAX's error stands for
    an exception of synk's callbacks, that exception itself (JAX's as its ``__context__``).
    Put around ``pxla.ExecuteReplicated.__call__``, which every jitted computation with
    synk's ordered effect runs through (JAX's C++ fast path takes none with effects), so
    that a jitted call raises synk's error, of its own type, as outside ``jax.jit``."""
    @functools.wraps(run)
    def raising(*args, **kwargs):
        try:
            return run(*args, **kwargs)
        except Exception as exc:
            kept = original(exc) if KEPT else None
            if kept is None:
                raise
            raise kept  # noqa: B904 (JAX's error stays chained as its __context__)

    raising.synk_originals = True  # type: ignore[attr-defined]
    return raising


def forget_failed_tokens() -> None:
    """Drop this thread's JAX ordered-effect tokens that carry a failed computation's error
    (``jax._src.dispatch.runtime_tokens``, thread-local: no public API resets it), waiting for their
    computations; the others stay, keeping the effects' order. Such a token makes every
    later jitted ``synk.comm`` call (and JAX's exit hook) raise the error again, on JAX's
    GPU platform and under ``shard_map`` on its CPU one (jax-ml/jax#37587)."""
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
    """Whether ``exc`` may be JAX's report of a callback's exception: JAX's runtime error
    (``jax.errors.JaxRuntimeError``), whose text holds the original's traceback, with no
    ``__cause__`` (XLA hands back only the text: jax-ml/jax#26102), or the plain
    ``ValueError`` the jitted function's C++ fast path raises instead once a call of it has
    succeeded (jax-ml/jax#34083)."""
    kind = type(exc)
    return kind is ValueError or kind.__module__.split(".")[0] in ("jax", "jaxlib")
