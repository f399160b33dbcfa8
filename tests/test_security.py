"""Security: owner-only shared memory with unguessable names, modules in the working
directory that never run in a worker, and another user's stale segments left alone. (The
control channel, local, authenticated both ways and never unpickling anything before
authentication, and the sweep of /dev/shm are attacked and judged from the inside in
test_wire_rings_and_segments.py.)"""
import os
import stat
import subprocess
import sys

import numpy as np
import pytest
from conftest import synk_segments

import synk


def test_segments_are_owner_only_with_unguessable_names(monkeypatch):
    monkeypatch.setenv("SYNK_INLINE_OUTPUT_BYTES", "1")  # outputs through worker blocks too
    before = synk_segments()
    synk.fork(3)
    try:
        d = synk.data(np.arange(12.0).reshape(6, 2))
        f = synk.function(lambda x, y: x * y, bcast_inputs=["y"], reduce="gather")
        big = np.ones(100_000)  # staged: a plain array scattered through shared memory
        g = synk.function(lambda x: np.full(1000, x.sum()), reduce="sum")
        assert np.array_equal(f(d, 2.0), d.array * 2)
        assert np.array_equal(g(big), np.full(1000, 100_000.0))
        made = synk_segments() - before
        locks = {name for name in made if name.endswith("-lock")}
        assert len(locks) == 2, made  # the group's prefix and the Data's, each locked
        assert len(made - locks) >= 3, made  # a Data block, a staging block, output blocks
        for name in made:
            st = os.stat(f"/dev/shm/{name}")
            assert stat.S_IMODE(st.st_mode) == 0o600, (name, oct(st.st_mode))
            assert st.st_uid == os.getuid()
            parts = name.split("-")
            assert parts[0] == "synk" and int(parts[1]) == os.getpid()
            assert len(parts[2]) == 16  # 64 random bits per owner
            assert len(parts[-1]) == 16 or name in locks  # and 64 more per block
        suffixes = {name.split("-")[-1] for name in made - locks}
        assert len(suffixes) == len(made - locks)  # each block has its own random part
    finally:
        synk.close()


# -- the working directory, shared /dev/shm ---------------------------------------------------
def test_modules_in_the_working_directory_do_not_run_in_workers(tmp_path, monkeypatch):
    """``python -m`` would put the working directory first on the workers' sys.path, so
    that these files would run in every worker before it authenticates the master."""
    marker = tmp_path / "ran"
    for module in ("hmac", "numpy", "pickle"):
        (tmp_path / f"{module}.py").write_text(
            f"open({str(marker)!r}, 'a').write('{module}\\n')\n"
        )
    monkeypatch.chdir(tmp_path)
    synk.fork(2)
    try:
        assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(4)) == 4
    finally:
        synk.close()
    assert not marker.exists(), f"ran in a worker: {marker.read_text().split()}"


def _no_such_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1000  # above every pid this machine can give


OTHER_USER_FORKS = """
import numpy as np, synk
synk.fork(2)
print(synk.function(lambda x: x.sum(), reduce="sum")(np.ones(5)), flush=True)
synk.close()
"""


def test_another_users_stale_segments_do_not_stop_fork():
    """For real, in a private /dev/shm: stale segments of another user's dead masters (one
    from a version without locks, one with a lock file), which this master may neither
    judge nor remove (it runs without the capabilities that let root do so)."""
    pid, old, new = _no_such_pid(), os.urandom(8).hex(), os.urandom(8).hex()
    stale = [f"synk-{pid}-{old}-d0-{'e' * 16}", f"synk-{pid}-{new}-lock",
             f"synk-{pid}-{new}-d0-{'f' * 16}"]
    shell = (
        "mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm || exit 99\n"
        "umask 077\n"
        + "".join(f": > /dev/shm/{name} && chown nobody /dev/shm/{name}\n" for name in stale)
        + "chown nobody /dev/shm\n"  # (as in Docker, the master owns neither them nor it)
        + "setpriv --inh-caps=-all --bounding-set=-fowner,-dac_override,-dac_read_search "
        '"$0" -c "$1" || exit $?\n'
        "ls /dev/shm\n"
    )
    try:
        out = subprocess.run(["unshare", "--mount", "sh", "-c", shell, sys.executable,
                              OTHER_USER_FORKS], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"unshare is not available: {err}")
    if out.returncode == 99 or "unshare:" in out.stderr or "setpriv:" in out.stderr:
        pytest.skip(f"needs root, to mount a private /dev/shm and drop capabilities: "
                    f"{out.stderr}")
    assert out.returncode == 0, out.stderr
    result, *left = out.stdout.split()
    assert result == "5.0"
    assert sorted(left) == sorted(stale)  # skipped, not removed; nothing else is left
