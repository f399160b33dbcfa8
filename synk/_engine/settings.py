"""synk's tuning variables (``SYNK_*`` in the environment), read and checked in one place.

``read()`` runs at every ``fork()``, so a bad value is refused there with a message that
names the variable and its allowed range, rather than as a bare error deep in a call.
``SYNK_PROFILE`` is read when a function is built (``profile=None``).
"""
from __future__ import annotations

import math
import os
from typing import NamedTuple

DEFAULT_INLINE_OUTPUT_BYTES = 256 << 10  # measured: below it, pickling in the reply is faster
DEFAULT_PARALLEL_REDUCE_RANKS = 5  # see _call.collect


class Settings(NamedTuple):
    spin_us: float | None  # None: the default for the group's size
    inline_output_bytes: int
    parallel_reduce_ranks: int


def _number(name: str, default, kind, low, high, what: str):
    text = os.environ.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or not (
        low <= value <= high
    ):
        raise ValueError(
            f"environment variable {name}={text!r} is not valid: it must be {what} "
            f"from {low} to {high}; unset it to use the default"
        )
    return value


def read() -> Settings:
    """The tuning variables of the environment, checked."""
    return Settings(
        spin_us=_number("SYNK_SPIN_US", None, float, 0.0, 1e6,
                        "a number of microseconds"),
        inline_output_bytes=_number("SYNK_INLINE_OUTPUT_BYTES", DEFAULT_INLINE_OUTPUT_BYTES,
                                    int, 0, 1 << 40, "a whole number of bytes"),
        parallel_reduce_ranks=_number("SYNK_PARALLEL_REDUCE_RANKS",
                                      DEFAULT_PARALLEL_REDUCE_RANKS, int, 2, 1 << 20,
                                      "a whole number of ranks"),
    )


def profile_default() -> bool:
    """``SYNK_PROFILE``: 1 (or any value but 0 and empty) profiles every function."""
    return os.environ.get("SYNK_PROFILE", "").strip() not in ("", "0")
