"""How synk splits rows over ranks: shares that differ by at most one row, the first ranks
taking the extra ones (as ``np.array_split`` does)."""
from __future__ import annotations


def split_bounds(n_rows: int, n_ranks: int) -> tuple:
    """Start of each rank's share and the end; shares differ by at most one row."""
    base, extra = divmod(n_rows, n_ranks)
    bounds, pos = [0], 0
    for r in range(n_ranks):
        pos += base + (r < extra)
        bounds.append(pos)
    return tuple(bounds)
