"""Impossible sizes and sizes past the machine's memory: refused before anything is made, with a
ValueError or ShmSpaceError that says what to do, and a Data left as it was."""
import builtins
import errno
import io
import os

import numpy as np
import pytest
from conftest import synk_segments

import synk

# What the machine reports (free space in /dev/shm, its memory) is faked where the kernel says
# it, os.statvfs and /proc/meminfo, to stand for a machine too small.

GiB = 2**30
_FALLOCATE = os.posix_fallocate


def meminfo() -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes, read here rather than through synk."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            fields[key] = int(rest.split()[0]) * 1024
    return fields["MemTotal"], fields["MemAvailable"]


def fake_meminfo(monkeypatch, total: int, available: int) -> None:
    """/proc/meminfo, as this process reads it, saying ``total`` and ``available`` bytes."""
    text = f"MemTotal: {total // 1024} kB\nMemAvailable: {available // 1024} kB\n"
    real_open = builtins.open

    def fake_open(file, mode="r", *args, **kwargs):
        if file == "/proc/meminfo":
            return io.BytesIO(text.encode()) if "b" in mode else io.StringIO(text)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)


def fake_shm_free(monkeypatch, free: int) -> None:
    """os.statvfs of /dev/shm saying ``free`` bytes are free."""
    real_statvfs = os.statvfs

    def statvfs(path):
        st = real_statvfs(path)
        if os.path.realpath(path) != "/dev/shm":
            return st
        blocks = free // st.f_frsize + 1
        return os.statvfs_result((st.f_bsize, st.f_frsize, max(st.f_blocks, blocks), blocks,
                                  blocks) + tuple(st)[5:])

    monkeypatch.setattr(os, "statvfs", statvfs)


@pytest.fixture
def guarded(monkeypatch):
    """No test here may really reserve a huge block, even should the check be missing: the
    reservation of anything past 1 GiB fails as on a full /dev/shm, and is recorded."""
    huge = []

    def fallocate(fd, offset, length):
        if length > GiB:
            huge.append(length)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return _FALLOCATE(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    return huge


@pytest.fixture
def past_memory(monkeypatch, guarded):
    """A byte count past MemAvailable that /dev/shm's free space admits (where /dev/shm is
    smaller than that, its free space is made to say so)."""
    size = meminfo()[1] + 64 * 2**20
    st = os.statvfs("/dev/shm")
    if st.f_bavail * st.f_frsize < size:
        fake_shm_free(monkeypatch, 2 * size)
    return size


def new_segments(before) -> set:
    """This process's segments made since ``before``, but for the lock of its Data's prefix
    (made with the first Data, kept until synk.close())."""
    return {n for n in synk_segments() - before if not n.endswith("-lock")}


def state(d) -> tuple:
    return d.shape, d.dtype, d.name, d.capacity, d.array.copy()


def assert_unchanged(d, before) -> None:
    shape, dtype, name, capacity, contents = before
    assert (d.shape, d.dtype, d.name, d.capacity) == (shape, dtype, name, capacity)
    np.testing.assert_array_equal(d.array, contents)


def assert_data_works() -> None:
    d = synk.data(np.arange(4.0), oversize=2)
    d.resize(6)
    np.testing.assert_array_equal(d.array, [0, 1, 2, 3, 0, 0])
    d.free()


def assert_memory_error(err, needed: int) -> None:
    total, available = meminfo()
    assert err.needed == needed
    assert err.available is not None and err.usable is not None
    assert err.usable < needed and err.usable <= err.available
    assert abs(err.available - available) < total // 8  # (it moves a little meanwhile)
    text = str(err)
    assert f"needs {needed:,} bytes" in text and "available" in text and "memory" in text


# -- Bug 6: impossible numbers -----------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2**60, 16), (2**63,), (0, 2**62, 2**62), (-1,), (-2, -3)],
                         ids=["bytes-wrap", "length-too-large", "zero-and-huge", "negative",
                              "two-negatives"])
def test_impossible_shape_is_a_value_error(shape):
    before = synk_segments()
    with pytest.raises(ValueError, match="shape"):
        synk.data(shape=shape)
    assert synk_segments() == before  # not even the lock of the prefix
    assert_data_works()


@pytest.mark.parametrize("oversize", [1e18, 1e308])
def test_impossible_oversize_is_a_value_error_and_leaves_nothing(oversize):
    before = synk_segments()
    with pytest.raises(ValueError, match="smaller oversize"):
        synk.data(np.ones(3), oversize=oversize)
    with pytest.raises(ValueError, match="smaller oversize"):
        synk.data(shape=(3,), dtype=np.complex128, oversize=oversize)
    assert synk_segments() == before  # no 0-byte segment either
    assert_data_works()


def test_failed_resize_leaves_the_data_unchanged():
    d = synk.data(np.arange(6.0).reshape(2, 3), oversize=2)
    before = state(d)
    for shape, oversize in [((2**60, 16), 1), ((-1, 3), 1), ((2**63,), 1), ((4,), 1e18),
                            ((100,), 1e300)]:
        with pytest.raises(ValueError):
            d.resize(shape, oversize=oversize)
        assert_unchanged(d, before)
    d.resize((3, 3))
    np.testing.assert_array_equal(d.array, [[0, 1, 2], [3, 4, 5], [0, 0, 0]])


def test_failed_set_value_leaves_the_data_unchanged():
    d = synk.data(np.arange(5.0))
    before = state(d)
    with pytest.raises(ValueError, match="smaller oversize"):
        d.set_value(np.ones(3, np.int32), oversize=1e18)
    assert_unchanged(d, before)
    d.set_value(np.ones(3, np.int32))
    assert d.dtype == np.int32 and list(d.array) == [1, 1, 1]


# -- Bug 10: the machine's memory, not only /dev/shm -------------------------------------------
def test_data_past_memory_is_refused_before_it_is_made(past_memory, guarded):
    before = synk_segments()
    with pytest.raises(synk.ShmSpaceError, match="not enough memory") as info:
        synk.data(shape=(past_memory,), dtype=np.uint8)
    assert_memory_error(info.value, past_memory)
    assert "synk.Data of shape" in str(info.value)
    assert not guarded, "the block was made and its memory asked for"
    assert not new_segments(before)
    assert_data_works()


def test_oversize_past_memory_is_refused(past_memory, guarded):
    """The issue's case: oversize=1e9 on 3 float64 reserved 24 GB on a 23 GB machine."""
    before = synk_segments()
    oversize = past_memory / 24
    with pytest.raises(synk.ShmSpaceError, match="not enough memory") as info:
        synk.data(np.ones(3), oversize=oversize)
    assert abs(info.value.needed - past_memory) <= 1  # (24 * oversize, rounded up)
    assert_memory_error(info.value, info.value.needed)
    assert not guarded and not new_segments(before)
    assert_data_works()


def test_a_block_that_leaves_no_memory_to_spare_is_refused(guarded):
    """A block must leave some memory to the processes: just under MemAvailable is too much."""
    size = meminfo()[1] - 32 * 2**20
    before = synk_segments()
    with pytest.raises(synk.ShmSpaceError, match="not enough memory"):
        synk.data(shape=(size,), dtype=np.uint8)
    assert not guarded and not new_segments(before)


def test_resize_and_set_value_past_memory_leave_the_data_unchanged(past_memory, guarded):
    d = synk.data(np.arange(5.0))
    before, segments = state(d), synk_segments()
    with pytest.raises(synk.ShmSpaceError, match="not enough memory") as info:
        d.resize((past_memory // 8 + 1,))
    assert_memory_error(info.value, (past_memory // 8 + 1) * 8)
    assert_unchanged(d, before)
    with pytest.raises(synk.ShmSpaceError, match="not enough memory"):
        d.resize(7, oversize=past_memory / 56)
    assert_unchanged(d, before)
    with pytest.raises(synk.ShmSpaceError, match="not enough memory"):
        d.set_value(np.ones(3, np.int32), oversize=past_memory / 12)  # dtype kept too
    assert_unchanged(d, before)
    assert not guarded and synk_segments() == segments
    d.resize(8)
    np.testing.assert_array_equal(d.array, [0, 1, 2, 3, 4, 0, 0, 0])


def sums(x):
    return x.sum()


def test_staging_past_memory_is_refused_and_the_group_stays_usable(ranks2, monkeypatch):
    """Every segment synk makes is checked where it is made: here an argument's staging
    block, on a machine made to report 4 MiB available."""
    total = meminfo()[0]
    f = synk.function(sums, reduce="sum")
    big = np.ones(1_000_000)  # 8 MB, scattered from shared memory
    before = synk_segments()
    fake_meminfo(monkeypatch, total, 4 * 2**20)
    with pytest.raises(synk.ShmSpaceError, match="argument 'x' of sums") as info:
        f(big)
    assert info.value.available == 4 * 2**20 and info.value.needed >= big.nbytes
    assert "not enough memory" in str(info.value)
    assert not new_segments(before)
    monkeypatch.undo()
    assert f(big) == 1_000_000
    assert f(synk.data(np.arange(10.0))) == 45


def test_a_tmpfs_without_a_size_limit_is_not_taken_for_full(monkeypatch):
    """tmpfs mounted with size=0 has no limit and reports 0 blocks: free space unknown."""
    st = os.statvfs("/dev/shm")
    unlimited = os.statvfs_result((st.f_bsize, st.f_frsize, 0, 0, 0) + tuple(st)[5:])
    monkeypatch.setattr(os, "statvfs", lambda path: unlimited)
    assert_data_works()  # (free space unknown: not refused as full)
