"""Heat flow on a ring, split over the ranks, each step one ``jax.jit``-compiled function
with several collectives: two halo exchanges and two allreduces.

    python demos/heat_jax.py [RANKS] [CELLS] [STEPS]

The rod is a ring of CELLS cells (periodic), u[i] its temperature; one explicit step is

    u[i] <- u[i] + ALPHA * (u[i-1] - 2 u[i] + u[i+1])

Each rank holds a run of cells (synk splits the initial rod by rows) and, at every step,
needs one cell of each neighbour's: inside the jitted step it sends its first cell to the
rank on its left while receiving the first cell of the rank on its right, and the same the
other way (``synk.comm.sendrecv``, mpi4jax's halo exchange), then takes the rod's total
heat and its hottest cell over every rank (``synk.comm.allreduce``, "sum" and "max"). synk
runs the collectives of a jitted function in the program's order on every rank, so the
two exchanges, which have the same shapes, never meet the wrong partner. The master's 64-bit
JAX (``jax_enable_x64``) holds on every rank.

The result is checked against the same steps in one process (numpy), the total heat
against its conservation.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import synk

ALPHA = 0.25


def single_process(u, steps: int) -> np.ndarray:
    for _ in range(steps):
        u = u + ALPHA * (np.roll(u, 1) - 2 * u + np.roll(u, -1))
    return u


def simulate(u, steps: int):
    """Run on every rank over its run of cells ``u`` (a JAX array)."""
    rank, n = synk.comm.rank(), synk.comm.size()
    left, right = (rank - 1) % n, (rank + 1) % n

    @jax.jit
    def step(u):
        from_right = synk.comm.sendrecv(u[:1], dest=left, source=right, tag=0)
        from_left = synk.comm.sendrecv(u[-1:], dest=right, source=left, tag=1)
        padded = jnp.concatenate([from_left, u, from_right])
        new = u + ALPHA * (padded[:-2] - 2 * u + padded[2:])
        total = synk.comm.allreduce(jnp.sum(new), "sum")
        hottest = synk.comm.allreduce(jnp.max(new), "max")
        return new, total, hottest

    totals, hottest = [], []
    for _ in range(steps):
        u, total, peak = step(u)
        totals.append(total)
        hottest.append(peak)
    return u, jnp.stack(totals), jnp.stack(hottest)


def main(ranks: int | None = None, cells: int = 1000, steps: int = 200) -> None:
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    rod = np.zeros(cells)
    rod[rng.integers(0, cells, 20)] = rng.uniform(50, 100, 20)  # a few hot spots

    synk.fork(ranks)
    n = synk.size()
    print(f"synk: {n} ranks, {cells} cells, {steps} steps")
    run = synk.function(simulate, bcast_inputs=["steps"], reduce=("gather", None, None))
    u, totals, hottest = run(jnp.asarray(rod), steps)
    synk.close()

    want = single_process(rod, steps)
    np.testing.assert_allclose(np.asarray(u), want, rtol=1e-12, atol=1e-12)
    for r in range(n):  # every rank has the same totals: the rod's heat, conserved
        np.testing.assert_allclose(np.asarray(totals[r]), rod.sum(), rtol=1e-12)
        assert np.array_equal(np.asarray(hottest[r]), np.asarray(hottest[0]))
    assert np.asarray(hottest[0])[-1] == want.max()
    print(f"heat {float(totals[0][-1]):.6f} (at the start {rod.sum():.6f}), hottest cell "
          f"{float(hottest[0][-1]):.4f}: as in one process")
    print("All assertions passed.")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*args)
