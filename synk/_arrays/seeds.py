"""Each rank's process-wide random generators seeded from ``synk.fork(seed=...)`` and the
rank (``seed_rank``), so that two runs of a program give the same bits (dropout,
``np.random`` in a function), and no two ranks draw the same numbers.
"""
from __future__ import annotations

import random

import numpy as np

from . import on_import


def rank_seed(seed: int, rank: int) -> int:
    """Rank ``rank``'s seed under ``fork(seed=seed)``: a 32-bit int, the first word of
    numpy's ``SeedSequence([seed, rank])``."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, np.uint32)[0])


def check(seed) -> int | None:
    """``fork()``'s ``seed``: None, or a non-negative int (a ValueError says what else)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be None or a non-negative int, got {seed!r}")
    return int(seed)


def seed_rank(seed: int | None, rank: int, device=None) -> None:
    """Seed this process's generators as rank ``rank`` of a group forked with ``seed`` (at
    ``fork()``, on every rank) with ``rank_seed``: Python's ``random``, numpy's global
    generator, torch's (CUDA's too; seeded when the function first imports torch, so no rank
    loads it for a seed) and, on a GPU rank (``device``), CuPy's. JAX has no process-wide
    generator: its keys are the program's."""
    if seed is None:
        return
    mine = rank_seed(seed, rank)
    random.seed(mine)
    np.random.seed(mine)
    on_import.when_imported("torch", "seed", lambda torch: torch.manual_seed(mine))
    if device is not None and not device.is_host:
        xp = device.xp
        with xp.cuda.Device(device.device_id):
            xp.random.seed(mine)
