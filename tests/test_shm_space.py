"""Room in /dev/shm: a segment that does not fit is a clear ShmSpaceError (never SIGBUS) and
leaves the group usable, whoever creates it; staging blocks stay bounded when functions come
and go, or are called with ever new arguments."""
import errno
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import synk_segments

import synk
from synk import comm

MAX_PER_FUNCTION = 8  # docs/reliability.md: a function keeps at most 8 staging blocks


def refuse(fd, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


_FALLOCATE = os.posix_fallocate


def shm_full(full: bool) -> None:
    """Make this process's reservations of shared memory fail as on a full /dev/shm, or
    stop that (called inside a function, it does so in a worker)."""
    os.posix_fallocate = refuse if full else _FALLOCATE


@pytest.fixture
def no_room(monkeypatch):
    """/dev/shm is full for this process (the master) until the test undoes it."""
    monkeypatch.setattr(os, "posix_fallocate", refuse)
    return monkeypatch


def sums(x):
    return x.sum()


def assert_usable():
    assert synk.function(sums, reduce="sum")(np.ones(9)) == 9


# -- a full /dev/shm, for each creator of segments --------------------------------------------
def test_data_that_does_not_fit(no_room):
    before = synk_segments()
    with pytest.raises(synk.ShmSpaceError, match=r"synk.Data of shape \(1000,\)") as info:
        synk.data(np.ones(1000))
    err = info.value
    assert err.needed == 8000 and err.free is not None
    assert "8,000 bytes" in str(err) and "free" in str(err) and "--shm-size" in str(err)
    assert not {n for n in synk_segments() - before if not n.endswith("-lock")}
    no_room.undo()
    d = synk.data(np.arange(5.0))
    no_room.setattr(os, "posix_fallocate", refuse)
    with pytest.raises(synk.ShmSpaceError):
        d.resize(10_000)  # growing needs a new block: the old one and its contents stay
    assert d.shape == (5,) and np.array_equal(d.array, np.arange(5.0))


def test_staged_argument_that_does_not_fit(ranks2, no_room):
    f = synk.function(sums, reduce="sum")
    big = np.ones(100_000)  # scattered from shared memory
    with pytest.raises(synk.ShmSpaceError, match=r"argument 'x' of sums"):
        f(big)
    no_room.undo()
    assert f(big) == 100_000  # the group is usable, and the same argument now fits
    assert_usable()


def test_master_output_that_does_not_fit(monkeypatch):
    monkeypatch.setenv("SYNK_PARALLEL_REDUCE_RANKS", "2")  # rank 0 exports its outputs too
    synk.fork(2)
    try:
        x = synk.data(np.ones(4))
        f = synk.function(lambda x: np.ones(100_000) * x.sum(), reduce="sum")
        monkeypatch.setattr(os, "posix_fallocate", refuse)
        with pytest.raises(synk.ShmSpaceError, match="rank 0's outputs"):
            f(x)
        monkeypatch.undo()
        np.testing.assert_array_equal(f(x), np.full(100_000, 4.0))  # every reply was read
    finally:
        synk.close()


def big_output(x, full_on_rank_1):
    if synk.rank() == 1:
        shm_full(full_on_rank_1)
    return np.ones(100_000) * x.sum()  # past the inline limit: through shared memory


def test_worker_output_that_does_not_fit(ranks3):
    f = synk.function(big_output, bcast_inputs=["full_on_rank_1"], reduce="sum")
    with pytest.raises(synk.ShmSpaceError, match="rank 1's outputs") as info:
        f(np.ones(6), True)
    assert info.value.needed == 800_000
    np.testing.assert_array_equal(f(np.ones(6), False), np.full(100_000, 6.0))


def big_allreduce(x, full_on_rank_1):
    if synk.rank() == 1:
        shm_full(full_on_rank_1)
    try:
        return comm.allreduce(np.ones(200_000)).sum()  # past SHM_FROM: through shared memory
    finally:
        shm_full(False)


def test_comm_message_that_does_not_fit(ranks3):
    f = synk.function(big_allreduce, bcast_inputs=["full_on_rank_1"], reduce=None)
    with pytest.raises(synk.ShmSpaceError, match="synk.comm message from rank 1"):
        f(np.ones(3), True)
    assert f(np.ones(3), False) == [600_000.0] * 3


def _can_mount_a_small_shm() -> str | None:
    """Why a private 64 MiB /dev/shm cannot be had here, or None if it can."""
    try:
        out = subprocess.run(
            ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"],
            capture_output=True, text=True, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"unshare is not available: {err}"
    if out.returncode:
        return f"cannot mount a private tmpfs (needs root or user namespaces): {out.stderr}"
    return None


SMALL_SHM_SCRIPT = """
import os, numpy as np, synk
from synk import comm

synk.fork(2)
f = synk.function(lambda x: x.sum(), reduce="sum")
big = np.ones(10_000_000)  # 80 MB, more than the 64 MiB /dev/shm holds


def check(what, call):
    try:
        call()
    except synk.ShmSpaceError as err:  # (two ranks reserving at once: the race is named)
        assert err.needed > err.free or "ran out while it was reserved" in str(err), err
        print(what, "ShmSpaceError:", err, flush=True)
    else:
        print(what, "no error", flush=True)
    assert f(np.ones(1000)) == 1000  # the group is usable after it


def out(x):
    return np.ones(10_000_000) if synk.rank() == 1 else np.ones(0)


def message(x, rows=10_000_000):
    return comm.allreduce(np.ones(rows)).sum()


check("data", lambda: synk.data(big))
check("staged", lambda: f(big))
check("output", lambda: synk.function(out, reduce="gather")(np.ones(4)))
check("comm", lambda: synk.function(message, reduce=None)(np.ones(4)))
d = synk.data(np.arange(1000.0))
small = synk.function(lambda x: message(x, 1_000_000), reduce=None)
print("after", float(f(d)), [float(v) for v in small(np.ones(4))], flush=True)
synk.close()
print("left", sorted(os.listdir("/dev/shm")), flush=True)
"""


def test_a_small_dev_shm_for_real(tmp_path):
    """Docker's default: a 64 MiB /dev/shm. Without the reservation, each of these would
    kill its process with SIGBUS."""
    why = _can_mount_a_small_shm()
    if why:
        pytest.skip(why)
    script = tmp_path / "small_shm.py"
    script.write_text(SMALL_SHM_SCRIPT)
    out = subprocess.run(
        ["unshare", "--mount", "sh", "-c",
         'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" "$1"', sys.executable,
         str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert "synk.Data of shape (10000000,)" in lines["data"]
    assert "argument 'x' of <lambda>" in lines["staged"]
    assert "rank 1's outputs" in lines["output"]
    assert "synk.comm message from rank" in lines["comm"]
    for what in ("data", "staged", "output"):
        assert "it needs 80,000,000 bytes" in lines[what], lines[what]
    assert lines["after"] == "499500.0 [2000000.0, 2000000.0]"
    assert lines["left"] == "[]"


# -- staging stays bounded --------------------------------------------------------------------
def shm_bytes() -> int:
    total = 0
    for name in synk_segments():
        try:
            total += os.stat(f"/dev/shm/{name}").st_size
        except FileNotFoundError:
            pass
    return total


def mapped_by(pid: int) -> set:
    with open(f"/proc/{pid}/maps") as f:
        return {line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/synk-" in line}


def test_functions_built_again_and_again_free_their_staging(ranks2):
    """A notebook cell run 20 times, each time building a function and calling it with a
    large argument: /dev/shm and the workers' mappings stay at about one argument."""
    worker = synk.function(lambda x: os.getpid(), reduce=None)(np.ones(2))[1]  # rank 1's pid
    big = np.ones(1_000_000)  # 8 MB, staged
    used, mapped = [], []
    for _ in range(20):
        f = synk.function(lambda x: x.sum(), reduce="sum")
        assert f(big) == 1_000_000
        used.append(shm_bytes())
        mapped.append(len(mapped_by(worker)))
    assert max(used) < 3 * big.nbytes, used
    assert max(mapped) <= 5, mapped  # its control ring, comm ring, board and place row
    # (``_engine.whereabouts``), one argument


def test_staging_per_function_is_bounded(ranks2):
    """Called with a new argument name each time, a function keeps at most
    MAX_PER_FUNCTION staging blocks; one call's own blocks are never given up."""
    def total(**parts):
        return sum(v.sum() for v in parts.values())

    f = synk.function(total, reduce="sum")
    staging = f"-f{f.fid}-"
    part = np.ones(20_000)  # 160 KB: staged
    for i in range(3 * MAX_PER_FUNCTION):
        assert f(**{f"k{i}": part * i}) == 20_000 * i
        blocks = [n for n in synk_segments() if staging in n]
        assert len(blocks) <= MAX_PER_FUNCTION, blocks
    many = {f"m{i}": part for i in range(MAX_PER_FUNCTION + 4)}
    assert f(**many) == 20_000 * len(many)  # all of one call's blocks are kept
    assert f(**{"k1": part}) == 20_000
    assert len([n for n in synk_segments() if staging in n]) <= len(many)
