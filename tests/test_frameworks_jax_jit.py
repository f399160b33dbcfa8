"""synk.comm inside ``jax.jit`` as mpi4jax's users write it: several independent collectives
and messages in one compiled function run in the program's order on every rank (never
paired across ranks in another order), a send whose result is unused still sends, a
receive takes a template of its shape (``recv(..., like=)``), a collective's result
written straight into XLA's buffers is numpy's answer, and a synk function called under
``jax.jit`` says what to do instead."""
import time

import numpy as np
import pytest

import synk

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

pytestmark = [pytest.mark.frameworks, pytest.mark.timeout(180)]


def _two_allreduces(arg):
    """Two independent allreduces in one jitted function; one rank does extra work on the
    first one's input (``first``) or on the second's, so that XLA, unordered, would run
    them in different orders on different ranks."""
    import jax
    import jax.numpy as jnp

    extra_on, repeats = arg
    r = synk.comm.rank()

    @jax.jit
    def step(a, b):
        if r == 0:
            for _ in range(20):  # (work that delays one input on this rank only)
                if extra_on == "first":
                    a = jnp.sin(jnp.arcsin(a))
                else:
                    b = jnp.sin(jnp.arcsin(b / 2000)) * 2000
        return synk.comm.allreduce(a, "sum"), synk.comm.allreduce(b, "sum")

    out = []
    for _ in range(repeats):
        x, y = step(jnp.full(4, 0.25), jnp.full(4, 1000.0))
        out.append((np.asarray(x).tolist(), np.asarray(y).tolist()))
    return out


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("extra_on", ["first", "second"])
def test_independent_collectives_under_jit_keep_the_programs_order(n, extra_on):
    synk.fork(n)
    try:
        got = synk.function(_two_allreduces, bcast_inputs=["arg"], reduce=None, timeout=120)(
            (extra_on, 10))
    finally:
        synk.close()
    for rank, calls in enumerate(got):
        for x, y in calls:
            np.testing.assert_allclose(x, [0.25 * n] * 4, rtol=1e-5, err_msg=f"rank {rank}")
            np.testing.assert_allclose(y, [1000.0 * n] * 4, rtol=1e-5, err_msg=f"rank {rank}")


def _two_sendrecvs(arg):
    import jax
    import jax.numpy as jnp

    r, n = synk.comm.rank(), synk.comm.size()

    @jax.jit
    def halo(left, right):
        if r == 0:
            for _ in range(20):
                left = jnp.floor(left + 0.25)  # (exact for these integers)
        got_left = synk.comm.sendrecv(right, (r + 1) % n, (r - 1) % n, tag=1)
        got_right = synk.comm.sendrecv(left, (r - 1) % n, (r + 1) % n, tag=2)
        return got_left, got_right

    a, b = halo(jnp.full(3, 10.0 * r), jnp.full(3, 10.0 * r + 1))
    return np.asarray(a).tolist(), np.asarray(b).tolist()


@pytest.mark.parametrize("n", [2, 3])
def test_independent_sendrecvs_under_jit_keep_the_programs_order(n):
    synk.fork(n)
    try:
        got = synk.function(_two_sendrecvs, bcast_inputs=["arg"], reduce=None, timeout=120)(0)
    finally:
        synk.close()
    for r, (from_left, from_right) in enumerate(zip(*got)):  # (each output: every rank's)
        assert from_left == [10.0 * ((r - 1) % n) + 1] * 3  # the left one's right edge
        assert from_right == [10.0 * ((r + 1) % n)] * 3  # the right one's left edge


def _send_unused_then_recv_like(arg):
    import jax
    import jax.numpy as jnp

    r = synk.comm.rank()
    if r == 0:
        @jax.jit
        def step(x):
            synk.comm.send(x * 3, 1, tag=5)  # (its result unused, as mpi4jax.send's)
            return x + 1

        return np.asarray(step(jnp.ones(3))).tolist()

    @jax.jit
    def take(template):
        return synk.comm.recv(0, 5, like=template) * 2

    return np.asarray(take(jnp.zeros(3))).tolist()


def test_a_send_whose_result_is_unused_still_sends_and_recv_takes_a_template(ranks2):
    got = synk.function(_send_unused_then_recv_like, bcast_inputs=["arg"], reduce=None,
                        timeout=60)(0)
    assert got == [[2.0] * 3, [6.0] * 3]


def _recv_like_checks(arg):
    r = synk.comm.rank()
    if r == 0:
        synk.comm.send(np.arange(4.0), 1, tag=6)
        return None
    try:
        synk.comm.recv(0, 6, like=np.zeros(3))
    except synk.SynkError as err:
        return str(err)
    return "no error"


def test_recv_like_checks_the_messages_shape(ranks2):
    said = synk.function(_recv_like_checks, bcast_inputs=["arg"], reduce=None, timeout=60)(0)
    assert "(4,) float64, but like= is (3,) float64" in said[1]


def _into_xla_buffers(n):
    """Allreduces under ``jax.jit`` of a parameter, of values computed in the function (whose
    results XLA lets synk write in their own buffers), of one read again afterwards, of a
    structure, of one value given twice, of dtypes whose results are converted (bools,
    bfloat16), and of a weakly typed number (an allreduce, and a sendrecv round the ring)."""
    import jax
    import jax.numpy as jnp

    r = synk.comm.rank()

    @jax.jit
    def step(g, w):
        h = g * (r + 1)
        t = g + r
        return (synk.comm.allreduce(g, "mean"),
                synk.comm.allreduce(h, "mean", weight=r + 1),
                synk.comm.allreduce(t, "sum") + t,
                synk.comm.allreduce([h, t, g[:7]], "mean"),
                synk.comm.allreduce(g > 1, "sum"),
                synk.comm.allreduce(g.astype(jnp.bfloat16), "sum").astype(jnp.float32),
                synk.comm.allreduce(t, "max"),
                synk.comm.allreduce([h, h], "mean", weight=r + 1),
                synk.comm.allreduce(w + r, "sum"),
                synk.comm.sendrecv(w + r, (r + 1) % n_ranks, (r - 1) % n_ranks))

    n_ranks = synk.comm.size()
    g = jnp.arange(n, dtype=jnp.float32) / n * 3
    runs = [jax.tree.map(np.asarray, step(g, 0.5)) for _ in range(3)]
    return runs


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("n", [1000, 1_200_000])
def test_results_written_into_xlas_buffers_are_numpys(size, n):
    synk.fork(size)
    try:
        got = synk.function(_into_xla_buffers, bcast_inputs=["n"], reduce=None,
                            timeout=120)(n)
    finally:
        synk.close()
    g = (np.arange(n, dtype=np.float32) / n * 3).astype(np.float64)
    ranks = np.arange(size)
    weighted = sum((r + 1) * g * (r + 1) for r in ranks) / sum(ranks + 1)
    for rank, runs in enumerate(got):
        for mean, wmean, read_after, tree, count, bf16, top, twice, weak, passed in runs:
            close = dict(rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")
            np.testing.assert_allclose(mean, g, **close)
            np.testing.assert_allclose(wmean, weighted, **close)
            np.testing.assert_allclose(read_after, size * g + ranks.sum() + g + rank, **close)
            np.testing.assert_allclose(tree[0], g * (ranks + 1).mean(), **close)
            np.testing.assert_allclose(tree[1], g + ranks.mean(), **close)
            np.testing.assert_allclose(tree[2], g[:7], **close)
            assert count.dtype.kind == "i" and (count == size * (g > 1)).all()
            np.testing.assert_allclose(bf16, size * g, rtol=2e-2, atol=1e-2)
            np.testing.assert_allclose(top, g + size - 1, **close)
            for leaf in twice:  # (one value given twice: XLA copies it for one of them)
                np.testing.assert_allclose(leaf, weighted, **close)
            assert weak == 0.5 * size + ranks.sum()  # (a Python number's weak type)
            assert passed == 0.5 + (rank - 1) % size


def _board_allreduces(delay):
    """Jitted sums and products of each dtype the board's compiled path takes (ints that
    overflow, floats whose sum depends on its order), between eager allreduces of the same
    numbering, one rank late by ``delay`` seconds before some (the compiled wait hands the
    collective to Python past its budget); rank 0 runs the function eagerly where the others
    jit it (one collective, either way); every result is numpy's, in rank order."""

    import jax
    import jax.numpy as jnp

    was = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        return _board_steps(delay, jax, jnp)
    finally:
        jax.config.update("jax_enable_x64", was)


def _board_steps(delay, jax, jnp):
    r = synk.comm.rank()
    values = {"float32": np.float32([1e8, 0.1, -3.5]) * (r + 1) + np.float32(1e-3) * r,
              "float64": np.array([1e16, 0.1, -3.5]) * (r + 1) + 1e-3 * r,
              "int32": np.int32([2**30, -7, 5]) * (r + 1),
              "int64": np.int64([2**62, -7, 5]) * (r + 1)}

    def both(x):
        return synk.comm.allreduce(x, "sum"), synk.comm.allreduce(x, "prod")

    jitted = jax.jit(both)
    got = []
    for step in range(6):
        for name, x in values.items():
            if delay and step % 2 and r == 1:
                time.sleep(delay)
            f = both if r == 0 and step % 3 == 2 else jitted
            total, product = f(jnp.asarray(x))
            eager = synk.comm.allreduce(x, "sum")
            got.append((name, np.asarray(total).tolist(), np.asarray(product).tolist(),
                        eager.tolist()))
    return got


@pytest.mark.parametrize("size, delay", [(2, 0.0), (3, 0.0), (2, 0.01)])
def test_jitted_sums_and_products_on_the_board_are_numpys_bits(size, delay):
    synk.fork(size)
    try:
        got = synk.function(_board_allreduces, bcast_inputs=["delay"], reduce=None,
                            timeout=120)(delay)
    finally:
        synk.close()
    by_rank = []
    for name, dtype, base in (("float32", np.float32, [1e8, 0.1, -3.5]),
                              ("float64", np.float64, [1e16, 0.1, -3.5]),
                              ("int32", np.int32, [2**30, -7, 5]),
                              ("int64", np.int64, [2**62, -7, 5])):
        parts = [np.asarray(base, dtype) * (r + 1) for r in range(size)]
        if name.startswith("float"):
            parts = [p + dtype(1e-3) * r for r, p in enumerate(parts)]
        with np.errstate(over="ignore"):
            total, product = parts[0] + parts[1], parts[0] * parts[1]
            for p in parts[2:]:
                total, product = total + p, product * p
        by_rank.append((name, total.tolist(), product.tolist(), total.tolist()))
    for rank, results in enumerate(got):
        assert results == by_rank * 6, f"rank {rank}"


def _late_peer(arg):
    """Rank 1 exits, or raises, 0.3 s into the call; rank 0 waits for it in jitted
    allreduces that the board carries, or in jitted sendrecvs that take the ring's
    messages (``op``)."""
    import os

    import jax
    import jax.numpy as jnp

    how, op = arg
    step = jax.jit((lambda x: synk.comm.allreduce(x, "sum")) if op == "allreduce" else
                   (lambda x: synk.comm.sendrecv(x, 1 - synk.comm.rank())))
    x = jnp.ones(2)
    step(x)
    if synk.comm.rank() == 1:
        time.sleep(0.3)
        if how == "exit":
            os._exit(3)
        raise RuntimeError("rank 1 gives up")
    return np.asarray(step(x)).tolist()


@pytest.mark.parametrize("op", ["allreduce", "sendrecv"])
@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_peer_that_dies_or_raises_ends_a_jitted_wait_in_compiled_code(how, op):
    synk.fork(2)
    try:
        start = time.monotonic()
        with pytest.raises((synk.SynkError, RuntimeError)) as caught:
            synk.function(_late_peer, bcast_inputs=["arg"], timeout=60)((how, op))
        assert time.monotonic() - start < 20
        said = str(caught.value)
        assert ("exited with code 3" in said) if how == "exit" else ("rank 1 gives up" in said)
        if how == "raise":  # (the group stays usable; a worker that exits breaks it)
            got = synk.function(lambda: synk.comm.sendrecv(
                synk.comm.allreduce(np.ones(2)) * synk.comm.rank(),
                1 - synk.comm.rank()).tolist(), reduce=None)()
            assert got == [[2.0, 2.0], [0.0, 0.0]]
    finally:
        synk.close()


def _message(rank, step, dtype):
    """What ``rank`` sends at ``step``: its own values, of ``dtype``."""
    return (np.arange(6).reshape(3, 2) * (rank + 1) + 10 * step).astype(dtype)


def _jitted_sendrecvs(delay):
    """Jitted sendrecvs round the ring, in several dtypes, with eager messages around
    them: another tag's message first in the ring (the compiled receive hands over to
    Python), a message of the same tag sent before (taken first, in order), a receive of
    the same tag posted and not yet waited for (it keeps the first message), one rank late
    by ``delay`` before some (past the wait's budget), and rank 0 running eagerly at some
    steps where the others jit. Returns what each received, as lists."""
    import jax
    import jax.numpy as jnp

    r, n = synk.comm.rank(), synk.comm.size()
    right, left = (r + 1) % n, (r - 1) % n
    jitted = jax.jit(lambda x: synk.comm.sendrecv(x, right, left))
    got = []
    for step in range(8):
        for dtype in (np.float32, np.int64, np.bool_, np.complex64):
            x = _message(r, step, dtype)
            way = step % 4
            if way == 1:
                synk.comm.send(x[::-1].copy(), right, tag=5)
            elif way == 2:
                synk.comm.send(x[::-1].copy(), right, tag=0)
            elif way == 3:
                early = synk.comm.irecv(left, tag=0)
                synk.comm.send(x[::-1].copy(), right, tag=0)
            if delay and step % 2 and r == 1:
                time.sleep(delay)
            f = jitted if not (r == 0 and step % 3 == 2) else (
                lambda v: synk.comm.sendrecv(v, right, left))
            got.append(np.asarray(f(jnp.asarray(x))).tolist())
            if way == 1:
                got.append(synk.comm.recv(left, tag=5).tolist())
            elif way == 2:
                got.append(synk.comm.recv(left, tag=0).tolist())
            elif way == 3:
                got.append(early.wait().tolist())
    return got


@pytest.mark.parametrize("size, delay", [(2, 0.0), (3, 0.0), (2, 0.01)])
def test_jitted_sendrecvs_take_their_messages_in_order(size, delay):
    """Under jit the target takes a message straight from the ring where it is the next
    record, else Python does: either way each receive gets its message, in order."""
    synk.fork(size)
    try:
        got = synk.function(_jitted_sendrecvs, bcast_inputs=["delay"], reduce=None,
                            timeout=120)(delay)
    finally:
        synk.close()
    for r, results in enumerate(got):
        left, want = (r - 1) % size, []
        for step in range(8):
            for dtype in (np.float32, np.int64, np.bool_, np.complex64):
                sent, extra = _message(left, step, dtype), _message(left, step, dtype)[::-1]
                if step % 4 == 2:  # (the same tag's earlier message is the first's)
                    want += [extra.tolist(), sent.tolist()]
                else:  # (3: the receive posted first keeps it)
                    want += [sent.tolist()] + ([extra.tolist()] if step % 4 != 0 else [])
        assert results == want, f"rank {r}"


def _waiting_long_in_the_compiled_wait(steps):
    """Rank 1 comes 0.2 s late to each of ``steps`` jitted allreduces, so that rank 0's
    waits poll longer and longer (up to ``SYNK_SPIN_US``), then later still, while the
    master kills it."""
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda x: synk.comm.allreduce(x, "sum"))
    x = jnp.ones(2)
    for k in range(steps):
        if synk.comm.rank() == 1:
            time.sleep(0.2 if k < steps - 1 else 30)
        x = step(x)
    return np.asarray(x).tolist()


def test_a_worker_killed_while_a_rank_polls_in_the_compiled_wait_breaks_the_group(
        monkeypatch):
    """The watchdog tears the group down, on its own thread, while the master's target
    polls the board: the board's memory stays mapped until the target hands back, and the
    call raises the death."""
    import os
    import signal
    import threading

    from synk import _testing

    monkeypatch.setenv("SYNK_SPIN_US", "1000000")
    synk.fork(2)
    try:
        pid = _testing.worker_process(1).pid
        f = synk.function(_waiting_long_in_the_compiled_wait, bcast_inputs=["steps"],
                          timeout=60)
        threading.Timer(2.5, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(synk.WorkerDiedError, match="rank 1 was killed by SIGKILL"):
            f(12)
    finally:
        synk.close()


def _jitted_allreduces_until_stopped(arg):
    import jax
    import jax.numpy as jnp

    other = 1 - synk.comm.rank()
    step = jax.jit(lambda x: synk.comm.sendrecv(synk.comm.allreduce(x, "sum") * 0.5, other))
    x = jnp.ones(2)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        x = step(x)
    return np.asarray(x).tolist()


def test_a_timeout_that_lands_among_jitted_allreduces_stops_the_call():
    """The call's timeout interrupts rank 0 wherever it is among its jitted allreduces and
    sendrecvs, at times as synk's XLA target calls into Python (what it held let go of
    then): every call raises the timeout, and the next group works."""
    for limit in (0.5, 0.8, 1.1, 1.4):
        synk.fork(2)
        try:
            with pytest.raises(synk.CallTimeoutError):
                synk.function(_jitted_allreduces_until_stopped, bcast_inputs=["arg"],
                              timeout=limit)(0)
        finally:
            synk.close()
    synk.fork(2)
    try:
        assert synk.function(_two_allreduces, bcast_inputs=["arg"], reduce=None)(
            ("first", 1))[1] == [([0.5] * 4, [2000.0] * 4)]
    finally:
        synk.close()


def _caught_under_jit(arg):
    """A jitted allgather and allreduce whose shapes differ by rank, each caught inside the
    function by synk's own type; then a jitted call that works."""
    import jax
    import jax.numpy as jnp

    r = synk.comm.rank()
    gathered = jax.jit(lambda x: synk.comm.allgather(x))
    reduced = jax.jit(lambda x: synk.comm.allreduce(x))
    said = []
    for step, x in ((gathered, jnp.ones(2 + r)), (reduced, jnp.ones(2 + r)),
                    (gathered, jnp.ones(2 + r))):  # (the second time: a compiled function's)
        try:
            step(x)
            said.append("no error")
        except synk.SynkError as err:
            said.append(f"SynkError ({type(err).__name__}, from "
                        f"{type(err.__context__).__name__}): {err}")
        except ValueError as err:
            said.append(f"ValueError ({type(err).__name__}): {err}")
    said.append(np.asarray(gathered(jnp.ones(2))).tolist())
    return said


def test_synk_errors_in_a_jitted_call_are_synks_own_inside_the_function(ranks2):
    """JAX hands a callback's error on as its own ``JaxRuntimeError``, holding only its
    text: the jitted call raises synk's error itself (JAX's as its context), so that the
    function catches it by its type."""
    said = synk.function(_caught_under_jit, bcast_inputs=["arg"], reduce=None, timeout=120)(0)
    for r, (gather, reduce, again, after) in enumerate(said):
        for text in (gather, again):
            assert text.startswith("SynkError (SynkError, from JaxRuntimeError): "
                                   "synk.comm.allgather under a JAX transformation: this rank "
                                   f"got shape (5,) where ({4 + 2 * r},) was traced"), text
        assert reduce == (
            "ValueError (ValueError): the ranks passed arrays of different shapes or dtypes "
            "(rank 0: (2,) float32, rank 1: (3,) float32); op 'sum' needs the same shape and "
            "dtype on every rank"), reduce
        assert after == [1.0] * 4


def _jitted_without_the_compiled_handler(arg):
    """A jitted allreduce where synk's compiled XLA handler was not built (its extension
    module not found, as after an install without a C++ compiler)."""
    import importlib.util

    import jax
    import jax.numpy as jnp

    from synk.comm.autograd import xla_handler

    find, loaded = importlib.util.find_spec, list(xla_handler._LOADED)
    importlib.util.find_spec = lambda name, *rest: (
        None if name.endswith("._jax_ffi") else find(name, *rest))
    xla_handler._LOADED.clear()
    try:
        jax.jit(lambda x: synk.comm.allreduce(x) * 2)(jnp.ones(2))
        return "no error"
    except synk.SynkError as err:
        return str(err)
    finally:
        importlib.util.find_spec = find
        xla_handler._LOADED[:] = loaded


def test_without_the_compiled_handler_jit_says_so_and_the_group_stays_usable(ranks2):
    said = synk.function(_jitted_without_the_compiled_handler, bcast_inputs=["arg"],
                         reduce=None, timeout=120)(0)
    for text in said:
        assert "synk's compiled XLA handler, which was not built" in text, text
        assert "C++17 compiler" in text and "outside jax.jit" in text, text
    assert synk.function(_two_allreduces, bcast_inputs=["arg"], reduce=None)(
        ("first", 1))[1] == [([0.5] * 4, [2000.0] * 4)]


def test_a_synk_function_called_under_jit_says_what_to_do(ranks2):
    f = synk.function(lambda x: x.sum(), reduce="sum")
    with pytest.raises(TypeError, match="put the transformation inside the function"):
        jax.jit(lambda x: f(x))(jnp.ones((4, 2)))
    assert f(np.ones((4, 2))) == 8.0


SEVERAL_DEVICES = """
import numpy as np, jax, jax.numpy as jnp, synk
from jax.experimental import io_callback
from jax.sharding import NamedSharding, PartitionSpec as P

synk.fork(2, backend="cpu")


def on_two_devices(x):
    mesh = jax.make_mesh((2,), ("i",))
    return mesh, jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("i")))


def summed(x):  # on one device
    if synk.comm.rank() == 1 and len(x) == 2:
        x = np.concatenate([x, x])  # (another shape than rank 0's: every rank raises)
    return np.asarray(jax.jit(lambda y: synk.comm.allreduce(y * 2, "sum"))(jnp.asarray(x)))


def sharded(x):  # a value sharded across this rank's two devices
    _, y = on_two_devices(x)
    return np.asarray(jax.jit(lambda y: synk.comm.allreduce(y * 2, "sum"))(y))


def per_device(x):  # inside shard_map: a collective per device
    mesh, y = on_two_devices(x)
    body = lambda y: synk.comm.allreduce(y, "sum")
    return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                                            out_specs=P("i")))(y))


def no_fives(v):
    if (np.asarray(v) == 5).any():
        raise ValueError("no fives")
    return np.asarray(v)


def checked(x):  # the script's own ordered callback, per device
    mesh, y = on_two_devices(x)
    body = lambda y: io_callback(no_fives, y, y, ordered=True)
    return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"),
                                            out_specs=P("i")))(y))


def attempt(fn, x, want):
    try:
        return all(np.array_equal(r, want) for r in
                   synk.function(fn, bcast_inputs=["x"], reduce=None)(x))
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[-1][:90]}"


x = np.arange(8.0).reshape(4, 2)
print("SUM", attempt(summed, x, 4 * x))
print("SHARDED", attempt(sharded, x, 4 * x))
print("SHARD_MAP", attempt(per_device, x, 2 * x))
print("UNEVEN", attempt(summed, x[:2], 4 * x[:2]))
print("SUM AGAIN", attempt(summed, x, 4 * x))
print("CALLBACK", attempt(checked, x * 10, x * 10), attempt(checked, x, x),
      attempt(checked, x * 10, x * 10))
print("SUM AGAIN", attempt(summed, x, 4 * x))
synk.close()
"""


def test_a_ranks_jit_runs_on_one_device_and_an_error_in_it_leaves_jax_usable(
        tmp_path, monkeypatch):
    """Each rank with two JAX devices: synk.comm in a jit whose value is sharded across
    them, or inside ``jax.shard_map``, raises (synk runs one rank per device). After a call
    whose jitted function raised (synk's error of ranks' shapes, a callback of the script's
    own under ``shard_map``), later jitted calls run: JAX's ordered-effect token of the
    failed computation, which would raise the same error again in every later one
    (jax-ml/jax#37587; on JAX's GPU platform with one device too), is dropped."""
    from conftest import run_script

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = run_script(tmp_path / "script.py", SEVERAL_DEVICES).splitlines()
    one_device = "SynkError: synk.comm.allreduce under jax.jit on several devices of this rank"
    assert out[0] == "SUM True", out
    assert out[1].startswith(f"SHARDED {one_device}"), out
    assert out[2].startswith(f"SHARD_MAP {one_device}"), out
    assert out[3].startswith("UNEVEN ValueError: the ranks passed arrays of different shapes"), out
    assert out[4] == "SUM AGAIN True", out
    assert out[5].startswith("CALLBACK True ") and "no fives" in out[5] \
        and out[5].endswith(" True"), out
    assert out[6] == "SUM AGAIN True", out
