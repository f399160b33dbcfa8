"""A shallow-water model split over the ranks, its steps compiled with ``jax.jit``, the halo
exchanges between neighbouring ranks done with ``synk.comm.sendrecv`` inside the compiled
function, and the result checked against the same model in one process.

    python demos/shallow_water_jax.py [RANKS] [STEPS]

The model: a layer of fluid of depth ``h`` and velocity ``(u, v)`` on a rotating plane, a
channel periodic in x and walled in y, started from a bump of water at rest. One step
(forward-backward in time, centred differences, a little viscosity):

    h <- h - dt * (d(h u)/dx + d(h v)/dy)
    u <- u + dt * (-u du/dx - v du/dy + f v - g dh/dx + nu lap u)
    v <- v + dt * (-u dv/dx - v dv/dy - f u - g dh/dy + nu lap v),   v = 0 at the walls

The fields are arrays of shape (NX, NY), x along axis 0, so synk splits the channel into
slabs of x by rows, one per rank. Each difference along x needs one column of each
neighbouring slab: the rank sends its first column to the rank on its left while receiving
the first column of the rank on its right, and the same the other way
(``synk.comm.sendrecv``, a halo exchange; ``h``, ``u`` and ``v`` in one message). A
compiled call runs ``CHUNK`` steps (``jax.lax.fori_loop``), so its exchanges run inside
XLA's loop, in the program's order on every rank. The master's 64-bit JAX holds on every
rank.
"""
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import synk

NX, NY = 96, 48  # cells along x (split over the ranks) and y
DX = 10e3  # metres per cell
G, DEPTH, F = 9.81, 100.0, 1e-4  # gravity, mean depth, Coriolis parameter
DT = 0.1 * DX / np.sqrt(G * DEPTH)  # seconds per step (a tenth of the CFL limit)
NU = 0.02 * DX**2 / DT  # viscosity
CHUNK = 50  # steps per compiled call


def initial() -> tuple:
    """A bump of water at rest in the middle of the channel."""
    x = (np.arange(NX) - NX / 2)[:, None] * DX
    y = (np.arange(NY) - NY / 2)[None, :] * DX
    h = DEPTH + np.exp(-(x**2 + y**2) / (8 * DX) ** 2)
    return h, np.zeros((NX, NY)), np.zeros((NX, NY))


def step(h, u, v, halo):
    """One step of the model; ``halo(fields)`` gives the fields (stacked on axis 0) with
    one column of each neighbour's along x."""
    def padded(fields):  # a column of each neighbour along x, edge values along y
        return jnp.pad(halo(fields), ((0, 0), (0, 0), (1, 1)), mode="edge")

    def ddx(a):
        return (a[2:, 1:-1] - a[:-2, 1:-1]) / (2 * DX)

    def ddy(a):
        return (a[1:-1, 2:] - a[1:-1, :-2]) / (2 * DX)

    def lap(a):
        return (a[2:, 1:-1] + a[:-2, 1:-1] + a[1:-1, 2:] + a[1:-1, :-2]
                - 4 * a[1:-1, 1:-1]) / DX**2

    hp, up, vp = padded(jnp.stack([h, u, v]))
    h = h - DT * (ddx(hp * up) + ddy(hp * vp))
    (hp,) = padded(h[None])
    u_new = u + DT * (-u * ddx(up) - v * ddy(up) + F * v - G * ddx(hp) + NU * lap(up))
    v_new = v + DT * (-u * ddx(vp) - v * ddy(vp) - F * u - G * ddy(hp) + NU * lap(vp))
    v_new = v_new.at[:, 0].set(0.0).at[:, -1].set(0.0)  # the walls
    return h, u_new, v_new


def periodic(fields):
    """One process's halo: the channel's own far columns (it is periodic in x)."""
    return jnp.concatenate([fields[:, -1:], fields, fields[:, :1]], axis=1)


def exchanged(fields):
    """A rank's halo: a column of each neighbouring rank's slab (periodic over the ranks)."""
    rank, n = synk.comm.rank(), synk.comm.size()
    left, right = (rank - 1) % n, (rank + 1) % n
    from_right = synk.comm.sendrecv(fields[:, :1], dest=left, source=right, tag=0)
    from_left = synk.comm.sendrecv(fields[:, -1:], dest=right, source=left, tag=1)
    return jnp.concatenate([from_left, fields, from_right], axis=1)


def run(h, u, v, steps: int, halo):
    """``steps`` steps, ``CHUNK`` to a compiled call; (h, u, v, seconds per step)."""
    @jax.jit
    def chunk(state):
        return jax.lax.fori_loop(0, CHUNK, lambda _, s: step(*s, halo), state)

    state = chunk((h, u, v))  # (compiled, and the first chunk run)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps // CHUNK - 1):
        state = chunk(state)
    jax.block_until_ready(state)
    seconds = (time.perf_counter() - start) / max(1, steps - CHUNK)
    return (*state, seconds)


def on_ranks(h, u, v, steps: int):
    """Run on every rank over its slab of the channel (JAX arrays)."""
    return run(h, u, v, steps, exchanged)


def main(ranks: int | None = None, steps: int = 500) -> None:
    jax.config.update("jax_enable_x64", True)
    steps = max(2, steps // CHUNK) * CHUNK
    h0, u0, v0 = initial()
    want = run(*(jnp.asarray(a) for a in (h0, u0, v0)), steps, periodic)

    synk.fork(ranks)
    n = synk.size()
    print(f"synk: {n} ranks, a {NX} x {NY} channel, {steps} steps")
    model = synk.function(on_ranks, bcast_inputs=["steps"],
                          reduce=("gather", "gather", "gather", None))
    h, u, v, seconds = model(*(jnp.asarray(a) for a in (h0, u0, v0)), steps)
    synk.close()

    for got, expected in zip((h, u, v), want[:3]):
        assert np.array_equal(np.asarray(got), np.asarray(expected))  # (the same bits)
    print(f"after {steps * DT / 3600:.1f} model hours: depth {float(jnp.min(h)):.4f} to "
          f"{float(jnp.max(h)):.4f} m, largest speed {float(jnp.max(jnp.hypot(u, v))):.4f} "
          "m/s: as in one process")
    print(f"a step: {max(seconds) * 1e6:.0f} us on the ranks, {want[3] * 1e6:.0f} us in one "
          "process")
    print("All assertions passed.")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(*args)
