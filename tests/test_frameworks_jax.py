"""JAX through synk: arrays in and out of functions, synk.comm on JAX arrays under jax.grad,
jax.vjp, jax.jvp, jax.linear_transpose, jax.jit and jax.vmap (mpi4jax's test suite's
kinds of cases, with synk's convention: each rank's gradient is that of the sum of every
rank's loss), the training loop with synk.assign, and what is refused.

Each test runs many cases in one call: a group's workers import JAX once per group."""
import numpy as np
import pytest
from conftest import on_every_rank, use_devices
from framework_cases import CASES, coefficients, inputs, ranked, whole

import synk

jax = pytest.importorskip("jax", reason="the JAX tests need JAX: pip install 'synk[jax]'")
jnp = pytest.importorskip("jax.numpy")
pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(300)]

# float64 cases: JAX's own float32 by default; the comparisons allow for it
ATOL = 1e-4


def _ranks_gradients(arg):
    import jax
    import jax.numpy as jnp

    from synk import comm

    r, n = comm.rank(), comm.size()
    got = {}
    for case in arg[0]:
        if case in ("send_recv", "isend_irecv", "broadcast_none", "scatter"):
            continue  # (JAX cannot follow these: see test_what_jax_cannot_follow_is_refused)

        def loss(*xs, case=case):
            total = jnp.zeros(())
            for i, out in enumerate(ranked(comm, case, list(xs), r, n)):
                if out is not None:
                    total = total + (out * coefficients(r, i, tuple(out.shape))).sum()
            return total

        xs = [jnp.asarray(x, jnp.float32) for x in inputs(case, r, n)]
        grads = jax.grad(loss, argnums=tuple(range(len(xs))))(*xs)
        got[case] = [np.asarray(g) for g in grads]
    return got


def _reference(case: str, n: int) -> list:
    """Every rank's gradients of the sum of every rank's loss, in one process (JAX)."""
    X = [[jnp.asarray(x, jnp.float32) for x in inputs(case, r, n)] for r in range(n)]
    shapes = [len(x) for x in X]

    def total(*flat):
        it = iter(flat)
        Xs = [[next(it) for _ in range(k)] for k in shapes]
        outs = whole(case, Xs, n, (lambda parts: jnp.concatenate(parts),
                                   lambda shape: jnp.zeros(shape)))
        return sum((out * coefficients(r, i, tuple(out.shape))).sum()
                   for r in range(n) for i, out in enumerate(outs[r]) if out is not None)

    flat = [x for xr in X for x in xr]
    grads = jax.grad(total, argnums=tuple(range(len(flat))))(*flat)
    it = iter(grads)
    return [[np.asarray(next(it)) for _ in range(k)] for k in shapes]


@pytest.fixture(params=[2, 3, "gpu2"])
def group(request, monkeypatch):
    """A group of 2, then 3 CPU ranks, then of 2 simulated GPUs."""
    n, backend = (2, "gpu") if request.param == "gpu2" else (request.param, "cpu")
    if backend == "gpu":
        use_devices(monkeypatch, n)
    synk.fork(n, backend=backend)
    yield n
    synk.close()


def test_every_gradient_against_one_process(group):
    n = group
    got = on_every_rank(_ranks_gradients, CASES)
    for case in got[0]:
        want = _reference(case, n)
        for r in range(n):
            for g, w in zip(got[r][case], want[r]):
                np.testing.assert_allclose(g, w, atol=ATOL, err_msg=f"{case}, rank {r}")


def _transformations(arg):
    """mpi4jax's allreduce, sendrecv and matvec cases, on synk.comm."""
    import jax
    import jax.numpy as jnp

    from synk import comm

    r, n = comm.rank(), comm.size()
    a = jnp.ones((3, 2))
    out = {}

    def allreduce(x):
        return comm.allreduce(x)

    def keep(key, value):
        out[key] = np.asarray(value)

    keep("eager", allreduce(a))
    keep("jit", jax.jit(allreduce)(a))
    keep("scalar", allreduce(jnp.float32(1)))
    keep("scalar jit", jax.jit(allreduce)(1.0))
    keep("vmap", jax.vmap(allreduce)(a))
    keep("vmap jit", jax.jit(jax.vmap(allreduce))(a))
    keep("transpose", jax.linear_transpose(allreduce, a)(a)[0])

    def lt(y):
        return jax.linear_transpose(allreduce, a)(y)[0]

    keep("transpose twice", jax.linear_transpose(lt, a)(a)[0])
    keep("transpose twice jit", jax.jit(lambda y: jax.linear_transpose(lt, a)(y)[0])(a))
    value, grad = jax.value_and_grad(lambda x: allreduce(x).sum())(a)
    keep("value", value)
    keep("grad", grad)
    keep("grad jit", jax.jit(jax.grad(lambda x: allreduce(x).sum()))(a))
    primal, tangent = jax.jvp(allreduce, (a,), (2 * a,))
    keep("jvp", tangent)
    primal, tangent = jax.jit(lambda x, t: jax.jvp(allreduce, (x,), (t,)))(a, 2 * a)
    keep("jvp jit", tangent)
    keep("chained", jax.grad(lambda x: allreduce(x) + allreduce(x))(0.0))
    keep("chained jit", jax.jit(jax.grad(lambda x: allreduce(x) + allreduce(x)))(0.0))
    keep("jacrev", jax.jacrev(lambda x: allreduce(x).sum())(a))
    keep("jacfwd", jax.jacfwd(lambda x: allreduce(x).sum())(a))

    @jax.custom_vjp
    def f(x, y):
        return allreduce((jnp.sin(x) * y).sum())

    f.defvjp(lambda x, y: (f(x, y), (jnp.cos(x), jnp.sin(x), y)),
             lambda res, g: (res[0] * allreduce(g) * res[2], res[1] * allreduce(g)))
    keep("custom_vjp jit", jax.jit(jax.grad(f))(jnp.ones(3), jnp.ones(3) * 2))
    # sendrecv between ranks 0 and 1 (mpi4jax's test_sendrecv_grad, _grad_2, _jacrev)
    if n == 2:
        other = 1 - r
        x0 = jnp.ones((3, 2)) * (r + 1)
        keep("sendrecv", comm.sendrecv(x0, other))
        keep("sendrecv jit", jax.jit(lambda x: comm.sendrecv(x, other))(x0))
        keep("sendrecv vmap", jax.vmap(lambda x: comm.sendrecv(x, other))(x0))

        def g1(x):
            return (comm.sendrecv(x, other) * (r + 1)).sum()

        def g2(x):
            x = comm.sendrecv(x, other) * (r + 1) * 5
            return (comm.sendrecv(x, other) * (r + 1) ** 2).sum()

        keep("sendrecv grad", jax.grad(g1)(x0))
        keep("sendrecv grad 2", jax.grad(g2)(x0))
        keep("sendrecv jacrev", jax.jacrev(g1)(x0))
        keep("sendrecv jit grad", jax.jit(jax.grad(g1))(x0))
    # mpi4jax's matvec: A's columns and x split over the ranks, y = A x on every rank
    rng = np.random.default_rng(123)
    A = jnp.asarray(rng.uniform(size=(5, 6 * n)), jnp.float32)
    x = jnp.asarray(rng.uniform(size=6 * n), jnp.float32)
    v = jnp.asarray(rng.uniform(size=6 * n), jnp.float32)
    A_local, x_local, v_local = A[:, 6 * r:6 * r + 6], x[6 * r:6 * r + 6], v[6 * r:6 * r + 6]

    def mv(xl):
        return allreduce(A_local @ xl)

    keep("matvec", mv(x_local))
    keep("matvec jit", jax.jit(mv)(x_local))
    keep("matvec jvp", jax.jvp(mv, (x_local,), (v_local,))[1])
    keep("matvec jvp jit", jax.jit(lambda x, t: jax.jvp(mv, (x,), (t,))[1])(x_local, v_local))
    y = jnp.asarray(rng.uniform(size=5), jnp.float32)
    keep("matvec vjp", jax.vjp(mv, x_local)[1](y)[0])
    keep("matvec transpose", jax.linear_transpose(mv, x_local)(y)[0])
    keep("matvec transpose jit", jax.jit(jax.linear_transpose(mv, x_local))(y)[0])
    return out


def test_jax_transformations(group):
    n = group
    got = on_every_rank(_transformations, None)
    a = np.ones((3, 2))
    rng = np.random.default_rng(123)
    A = rng.uniform(size=(5, 6 * n)).astype(np.float32)
    x = rng.uniform(size=6 * n).astype(np.float32)
    v = rng.uniform(size=6 * n).astype(np.float32)
    y = rng.uniform(size=5).astype(np.float32)
    for r, mine in enumerate(got):
        for key in ("eager", "jit", "vmap", "vmap jit", "grad", "grad jit", "jacrev", "jacfwd",
                    "transpose", "transpose twice", "transpose twice jit"):
            np.testing.assert_allclose(mine[key], n * a, err_msg=key)  # transpose: allreduce
        assert mine["scalar"] == n and mine["scalar jit"] == n
        assert mine["value"] == n * a.sum()
        np.testing.assert_allclose(mine["jvp"], 2 * n * a)
        np.testing.assert_allclose(mine["jvp jit"], 2 * n * a)
        assert mine["chained"] == 2 * n and mine["chained jit"] == 2 * n
        # the user's rule: cos(x) * allreduce(g) * y, g = 1
        np.testing.assert_allclose(mine["custom_vjp jit"], n * np.cos(1.0) * 2 * np.ones(3),
                                   rtol=1e-6)
        cols = slice(6 * r, 6 * r + 6)
        np.testing.assert_allclose(mine["matvec"], A @ x, rtol=1e-5)
        np.testing.assert_allclose(mine["matvec jit"], A @ x, rtol=1e-5)
        np.testing.assert_allclose(mine["matvec jvp"], A @ v, rtol=1e-5)
        np.testing.assert_allclose(mine["matvec jvp jit"], A @ v, rtol=1e-5)
        # the transpose over the ranks: every rank's y counts (synk's convention), so A^T
        # applied to n * y; mpi4jax's identity transpose would give A^T y
        for key in ("matvec vjp", "matvec transpose", "matvec transpose jit"):
            np.testing.assert_allclose(mine[key], (A.T @ (n * y))[cols], rtol=1e-5, err_msg=key)
        if n == 2:
            other = 1 - r
            np.testing.assert_array_equal(mine["sendrecv"], np.ones((3, 2)) * (other + 1))
            np.testing.assert_array_equal(mine["sendrecv jit"], np.ones((3, 2)) * (other + 1))
            np.testing.assert_array_equal(mine["sendrecv vmap"], np.ones((3, 2)) * (other + 1))
            for key in ("sendrecv grad", "sendrecv jacrev", "sendrecv jit grad"):
                np.testing.assert_array_equal(mine[key], np.ones((3, 2)) * (other + 1))
            np.testing.assert_array_equal(mine["sendrecv grad 2"],
                                          np.ones((3, 2)) * (r + 1) ** 2 * (other + 1) * 5)


def _refused(arg):
    import jax
    import jax.numpy as jnp

    from synk import comm

    r, n = comm.rank(), comm.size()
    said = {}
    for key, fn in [
        ("max", lambda x: comm.allreduce(x, "max").sum()),
        ("send", lambda x: comm.send(x, (r + 1) % n) + comm.recv((r - 1) % n).sum()),
    ]:
        try:
            jax.grad(fn)(jnp.ones(3))
        except synk.SynkError as err:
            said[key] = str(err)
    try:
        jax.vmap(comm.allgather)(jnp.ones((2, 3)))
    except synk.SynkError as err:
        said["vmap"] = str(err)
    try:
        comm.allreduce(jnp.ones(2), out=jnp.zeros(2))
    except TypeError as err:
        said["out"] = str(err)
    try:  # (a receive takes no array: inside jax.jit it would run once, while tracing)
        jax.jit(lambda x: x + comm.recv((r + 1) % n))(jnp.ones(2))
    except synk.SynkError as err:
        said["recv jit"] = str(err)
    said["broadcast jit"] = np.asarray(jax.jit(lambda x: comm.broadcast(x, 1))(
        jnp.full(2, float(r)))).tolist()  # every rank passes an array: JAX traces it
    return said


def test_what_jax_cannot_follow_is_refused(ranks2):
    got = on_every_rank(_refused, None)
    for said in got:
        assert "op 'max' has no gradient" in said["max"]
        assert "use synk.comm.sendrecv" in said["send"].replace("Use", "use")
        assert "under jax.vmap is not supported" in said["vmap"]
        assert "JAX arrays are immutable" in said["out"]
        assert "while jax.jit traces a function" in said["recv jit"]
        assert said["broadcast jit"] == [1.0, 1.0]
    # the group goes on
    assert on_every_rank(lambda arg: float(synk.comm.allreduce(jnp.ones(()))), None) == [2, 2]


# -- functions and the training loop -------------------------------------------------------
def _loss(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


def _step(x, y, w):
    import jax

    loss, g = jax.value_and_grad(_loss)(w, x, y)
    g = synk.comm.allreduce(g, "mean", weight=len(x))
    synk.assign(w, w - 0.1 * g)
    return loss, x.sum(0)


def test_training_loop_matches_one_process(ranks3_or_gpu):
    rng = np.random.default_rng(0)
    X = jnp.asarray(rng.standard_normal((40, 5)), jnp.float32)
    Y = jnp.asarray(rng.standard_normal((40, 2)), jnp.float32)
    w0 = jnp.asarray(rng.standard_normal((5, 2)) * 0.1, jnp.float32)
    w = synk.shared(w0)
    step = synk.function(_step, inputs=["x", "y"], reduce=("mean", "sum"))
    xd, yd = synk.data(X), synk.data(Y)
    alone = w0
    for k in range(0, 40, 9):
        idx = np.arange(k, min(k + 9, 40))
        loss, sums = step(xd, yd, w, batch=idx)
        assert isinstance(loss, jax.Array) and isinstance(sums, jax.Array)
        want, g = jax.value_and_grad(_loss)(alone, X[idx], Y[idx])
        alone = alone - 0.1 * g
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        np.testing.assert_allclose(sums, X[idx].sum(0), rtol=1e-5, atol=1e-5)
    for r in range(synk.size()):
        got = w.get_value(r)
        assert isinstance(got, jax.Array)
        np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-6)


@pytest.fixture(params=["cpu", "gpu"])
def ranks3_or_gpu(request, monkeypatch):
    """3 CPU ranks, then 2 simulated GPUs."""
    backend = request.param
    if backend == "gpu":
        use_devices(monkeypatch, 2)
    synk.fork(2 if backend == "gpu" else 3, backend=backend)
    yield
    synk.close()


def test_jax_arrays_in_functions_and_data(ranks2):
    x = jnp.arange(12.0).reshape(6, 2)
    d = synk.data(x)
    f = synk.function(lambda x, p: (x * p["s"], type(x).__name__), bcast_inputs=["p"],
                      reduce=("gather", None))
    joined, names = f(d, {"s": jnp.float32(2)})
    assert isinstance(joined, jax.Array)
    np.testing.assert_array_equal(joined, np.asarray(x) * 2)
    assert names == ["ArrayImpl", "ArrayImpl"]
    b = jnp.ones(3, jnp.bfloat16)
    got = synk.function(lambda b: b * 2, bcast_inputs=["b"], reduce="sum")(b)
    assert got.dtype == jnp.bfloat16 and np.asarray(got, np.float32).tolist() == [4.0] * 3


def _assign_and_read(w):
    before = float(w[-1])
    synk.assign(w, w + 1.0)
    return np.array([before, float(w[-1])])


_KEPT: list = []


def _keep_first(x):
    _KEPT.append(x)
    return np.array([float(_KEPT[0][0, 0]), float(x[0, 0])])


@pytest.fixture(params=["cpu", "gpu"])
def two_ranks(request, monkeypatch):
    """2 CPU ranks, then 2 simulated GPUs."""
    if request.param == "gpu":
        use_devices(monkeypatch, 2)
    synk.fork(2, backend=request.param)
    yield
    synk.close()


def test_a_jax_array_a_function_gets_keeps_its_value(two_ranks):
    """JAX arrays never change: the replica's array keeps its value when synk.assign writes
    the replica, and a scattered array kept by the function keeps its value when the next
    call's rows take synk's staging memory (both large enough for JAX to alias memory)."""
    w = synk.shared(jnp.zeros(40_000, jnp.float32))  # 160 KB
    step = synk.function(_assign_and_read, reduce=None)
    assert [r.tolist() for r in step(w)] == [[0.0, 0.0]] * 2
    assert [r.tolist() for r in step(w)] == [[1.0, 1.0]] * 2
    assert np.asarray(w.get_value()).tolist() == [2.0] * 40_000
    _KEPT.clear()
    keep = synk.function(_keep_first, reduce=None)
    x = jnp.broadcast_to(jnp.arange(80_000.0, dtype=jnp.float32)[:, None], (80_000, 4))
    assert [r.tolist() for r in keep(x)] == [[0.0, 0.0], [40_000.0, 40_000.0]]
    assert [r.tolist() for r in keep(x + 1e6)] == [[0.0, 1e6], [40_000.0, 1_040_000.0]]


def _read_then_assign(w, new):
    got = np.asarray(w)[[0, -1]].copy()
    if new is not None:
        synk.assign(w, new(w))
    return got


_DOUBLED = jax.jit(lambda a: a * 2.0, donate_argnums=0)


def _donate(w):
    first = float(w[0])
    _DOUBLED(w)  # (a donated array is deleted where the backend donates)
    return np.array([first, first])


@pytest.mark.parametrize("n", [40_000, 16])  # 160 KB, 64 B: compared by two ways
def test_a_jax_replica_reaches_the_function_with_the_value_the_replica_holds(two_ranks, n):
    """A JAX replica's array is handed over again from call to call (the one fn assigned,
    without a new copy) only while the replica still holds exactly its bytes: whatever
    wrote the replica since (set_value on every rank or one, a master-side collective, the
    master's replica written in place, an assignment of another dtype, a donation), the
    next call sees what the replica holds."""
    w = synk.shared(jnp.zeros(n, jnp.float32))
    f = synk.function(_read_then_assign, bcast_inputs=["new"], reduce=None)

    def read(new=None):
        return [r.tolist() for r in f(w, new)]

    assert read(lambda w: w + 1.0) == [[0.0, 0.0]] * 2
    assert read() == [[1.0, 1.0]] * 2  # (what fn assigned)
    assert read() == [[1.0, 1.0]] * 2
    w.set_value(jnp.full(n, 5.0, jnp.float32))
    assert read() == [[5.0, 5.0]] * 2
    w.set_value(jnp.full(n, 7.0, jnp.float32), rank=1)
    assert read() == [[5.0, 5.0], [7.0, 7.0]]
    synk.shared_all_reduce(w, "sum")
    assert read(lambda w: (w * 2.0).astype(jnp.int32)) == [[12.0, 12.0]] * 2
    assert read() == [[24.0, 24.0]] * 2  # (an int32 value, stored as float32)
    w.value[-1] = 3.0  # the master's replica itself
    assert read() == [[24.0, 3.0], [24.0, 24.0]]
    f_donate = synk.function(_donate, reduce=None)
    assert [r.tolist() for r in f_donate(w)] == [[24.0, 24.0]] * 2
    assert read() == [[24.0, 3.0], [24.0, 24.0]]


def _count_in_pieces(x, w):
    synk.assign(w, w + 1.0)
    return np.asarray(x).sum()


def test_each_piece_of_a_call_gets_what_the_last_piece_assigned(two_ranks):
    """A call of several pieces (num_slices=) runs fn on them one after another: each gets
    the replica as the piece before it left it, on CPU and GPU ranks alike (as a numpy
    replica updated in place would be)."""
    w = synk.shared(jnp.zeros(3, jnp.float32))
    f = synk.function(_count_in_pieces, inputs=["x"], reduce="sum")
    x = jnp.arange(8.0)
    assert float(f(x, w)) == 28.0
    assert float(f(x, w, num_slices=2)) == 28.0
    assert float(f(x, w, num_slices=4)) == 28.0
    for r in range(2):  # 1 + 2 + 4 runs of fn on each rank
        assert np.asarray(w.get_value(r)).tolist() == [7.0] * 3


def _size_then_assign(w, new):
    got = np.array([np.asarray(w).size, float(np.asarray(w)[-1])])
    if new is not None:
        synk.assign(w, new(w))
    return got


def test_an_array_broadcast_into_a_jax_replica_is_not_handed_over_for_it(two_ranks):
    """An array of another shape or dtype that fn assigned to a replica (broadcast or cast
    into it) is never what the next call gets for it: that has the replica's own shape,
    dtype and value, also after calls that handed the replica's array over again."""
    w = synk.shared(jnp.zeros(1000, jnp.float32))
    f = synk.function(_size_then_assign, bcast_inputs=["new"], reduce=None)

    def read(new=None):
        return [r.tolist() for r in f(w, new)]

    assert read() == read() == [[1000.0, 0.0]] * 2  # (the second: handed over again)
    assert read(lambda w: jnp.full((1,), 9.0, jnp.float32)) == [[1000.0, 0.0]] * 2
    assert read() == read() == [[1000.0, 9.0]] * 2
    assert read(lambda w: jnp.full((1,), 4, jnp.int32)) == [[1000.0, 9.0]] * 2
    assert read() == [[1000.0, 4.0]] * 2
    assert [r.dtype for r in synk.function(lambda w: np.asarray(w), reduce=None)(w)] == \
        [np.float32] * 2


def _assign_both(a, b, value):
    got = np.array([float(a[0]), float(b[0])])
    if value is not None:
        new = jnp.full(a.shape, value, a.dtype)
        synk.assign(a, new)
        synk.assign(b, new)  # (the same array, assigned to both)
    else:
        synk.assign(a, a + 1.0)
    return got


def test_one_array_assigned_to_two_replicas_is_told_apart_at_the_next_call(two_ranks):
    """An array fn assigned to two replicas is handed over for one of them only; the other
    gets a copy, so that synk.assign to it writes its own replica."""
    a, b = synk.shared(jnp.zeros(1000, jnp.float32)), synk.shared(jnp.zeros(1000, jnp.float32))
    f = synk.function(_assign_both, bcast_inputs=["value"], reduce=None)
    assert [r.tolist() for r in f(a, b, 4.0)] == [[0.0, 0.0]] * 2
    assert [r.tolist() for r in f(a, b, None)] == [[4.0, 4.0]] * 2
    assert [r.tolist() for r in f(a, b, None)] == [[5.0, 4.0]] * 2
    assert float(np.asarray(a.get_value(1))[0]) == 6.0
    assert float(np.asarray(b.get_value(1))[0]) == 4.0


def test_a_jitted_function_captured_from_a_script_is_shipped_again_when_it_changes(tmp_path):
    """jax.jit's function, captured by a script's synk function, is checked by the Python
    function it wraps (not pickled at every call): a change there ships it again."""
    from conftest import run_script

    out = run_script(tmp_path / "script.py", """
import numpy as np, jax, jax.numpy as jnp, synk
synk.fork(2, backend="cpu")
SCALE = 2.0
@jax.jit
def scaled(x):
    return x * SCALE
f = synk.function(lambda x: np.asarray(scaled(jnp.asarray(x))).sum(), reduce="sum")
print(f(np.ones(4)))
SCALE = 3.0
scaled = jax.jit(lambda x: x * SCALE)
print(f(np.ones(4)))
synk.close()
print("DONE")
""")
    assert out.split()[:2] == ["8.0", "12.0"], out
