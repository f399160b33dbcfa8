"""synk.comm's shared-memory path for large messages: collectives against numpy at sizes
that take it (allreduce's every op is in test_comm.py), segments private and reused, and
nothing left mapped or behind."""
import os
import stat

import numpy as np
import pytest
from conftest import on_every_rank

from synk import comm

# docs/api/comm.md, "Transport (CPU)": from 128 KiB up (on 2 ranks; 64 KiB in larger groups), an
# array travels through shared memory
SHM_FROM = 128 * 1024

N = 3
ROWS = SHM_FROM // 8 + 1000  # float64 rows of one column: past SHM_FROM even when split 3 ways


def msg_segments() -> list:
    mine = f"synk-{os.getpid()}-"  # other synk programs on the machine do not count
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(mine) and "-msg" in n)


def mapped_msg_segments() -> int:
    with open("/proc/self/maps") as f:
        return len({line.split()[-1] for line in f if "/dev/shm/synk-" in line and "-msg" in line})


def data_of(rank, rows=ROWS * 3):
    return np.random.default_rng(rank).random(rows) + 0.5


def test_large_allreduce_of_ints_and_of_mixed_dtypes(ranks3):
    def fn(arg):
        r = comm.rank()
        ints = comm.allreduce(np.arange(ROWS * 3) * r, "max")
        try:
            comm.allreduce(np.full(ROWS * 3, r, np.float64 if r else np.float32))
        except ValueError as err:
            return ints, str(err)
        return ints, "no error"

    for ints, mixed in on_every_rank(fn):
        assert ints.dtype == np.arange(1).dtype and np.array_equal(ints, np.arange(ROWS * 3) * 2)
        assert "different shapes or dtypes" in mixed and "float32" in mixed  # (cast first)


def test_large_reduce_scatter_allgather_broadcast(ranks3):
    def fn(arg):
        r = comm.rank()
        rows = np.full((ROWS + r, 2), r)
        return (comm.reduce_scatter(data_of(r).reshape(-1, 3), "sum"), comm.allgather(rows),
                comm.broadcast(data_of(7) if r == 1 else None, root=1))

    got = on_every_rank(fn)
    full = np.sum([data_of(r).reshape(-1, 3) for r in range(N)], axis=0)
    np.testing.assert_allclose(np.concatenate([g[0] for g in got]), full)
    joined = np.concatenate([np.full((ROWS + r, 2), r) for r in range(N)])
    for _, gathered, bcast in got:
        assert np.array_equal(gathered, joined) and np.array_equal(bcast, data_of(7))


def test_large_sizes_that_differ_raise_instead_of_hanging(ranks3):
    with pytest.raises(ValueError, match="different (shapes|size)"):
        on_every_rank(lambda arg: comm.allreduce(np.ones(ROWS * 3 + comm.rank())), timeout=30)
    assert on_every_rank(lambda arg: float(comm.allreduce(np.ones(ROWS * 3))[-1])) == [3.0] * 3


# One rank's array on each side of a limit of allreduce's: a board slot (small), one
# round of messages (up to 4 MiB a rank reads), two rounds (past that). Each side waits
# for what the other's way never sends, unless it sees the other's way and raises.
SIDES = {"slot | one round": (100, 100_000), "slot | two rounds": (100, 3 << 20),
         "one round | two rounds": (100_000, 3 << 20)}


@pytest.mark.parametrize("sides", list(SIDES))
def test_sizes_on_either_side_of_a_limit_raise_on_every_rank(ranks3, sides):
    def fn(arg):
        small, large = SIDES[arg[0]]
        try:
            comm.allreduce(np.ones(large if comm.rank() == 1 else small))
        except ValueError as err:
            return str(err)
        return "no error"

    for message in on_every_rank(fn, sides, timeout=60):
        assert "different shapes" in message or "another size" in message
    assert on_every_rank(lambda arg: float(comm.allreduce(np.ones(3))[-1])) == [3.0] * 3


def test_large_messages_go_through_private_segments(ranks2):
    def fn(arg):
        x = np.arange(ROWS, dtype=np.float64)
        if comm.rank() == 0:
            handle = comm.isend(x, dest=1)
            handle.wait()
            x[:] = -1  # the message was taken at isend: changing x now must not matter
            comm.barrier()
            return None
        got = comm.recv(source=0)
        comm.barrier()
        return got

    assert msg_segments() == []
    got = on_every_rank(fn)
    assert np.array_equal(got[1], np.arange(ROWS, dtype=np.float64))
    names = msg_segments()
    assert names, "a large message should have gone through shared memory"
    for name in names:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode) == 0o600


def test_segments_are_reused_and_released(ranks3):
    def fn(arg):
        r = comm.rank()
        comm.allreduce(np.ones(ROWS * 3))
        if r == 1:
            comm.send(np.ones(ROWS), dest=2, tag=5)  # never received: freed by the next call
        return mapped_msg_segments()

    for _ in range(20):
        mapped = on_every_rank(fn)
    # A rank has at most two messages out to each peer at once (plus the one never
    # received), so it never needs more segments than that, however many calls run.
    bound = 2 * (N - 1) + 1
    made = [int(name.split("-msg")[1].split("-")[0]) for name in msg_segments()]
    assert made and max(made) <= bound, msg_segments()
    assert len(made) <= N * bound
    assert max(mapped) <= bound + N * bound


def test_growing_messages_retire_old_segments(ranks2):
    def fn(arg):
        x = np.ones(arg[0])
        comm.allreduce(x)
        return mapped_msg_segments()

    for rows in [ROWS * 2, ROWS * 20, ROWS * 200, ROWS * 2, ROWS * 400]:
        mapped = on_every_rank(fn, rows)
        assert len(msg_segments()) <= 2 * 2, msg_segments()
        assert max(mapped) <= 4, "retired segments should be unmapped by the receivers"
