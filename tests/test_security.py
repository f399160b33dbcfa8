"""Security: owner-only shared memory with unguessable names, and a control channel that is
local, authenticated both ways, and never unpickles anything before authentication."""
import logging
import os
import pickle
import socket
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import synk_segments

import synk

# No public handle: a worker's control channel and key, and the sweep of /dev/shm, which
# these tests forge, read and judge as an attacker or a stranger program would.
from synk import _testing
from synk._testing import auth as _auth, worker_command


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


def test_control_channel_is_a_local_socket_without_address(ranks2):
    conn = _testing.worker_channel(1)
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        assert sock.family == socket.AF_UNIX
        assert sock.getsockname() in ("", b"", None) and sock.getpeername() in ("", b"", None)
    finally:
        sock.close()


def test_the_key_is_not_on_the_command_line_or_in_the_environment(ranks2):
    proc = _testing.worker_process(1)
    key = _testing.running_group().key
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    with open(f"/proc/{proc.pid}/environ", "rb") as f:
        environ = f.read()
    for blob in (cmdline, environ):
        assert key not in blob and key.hex().encode() not in blob


class _Marker:
    """Unpickling this creates a file: the proof that a process unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _start_worker(key: bytes):
    ours, theirs = socket.socketpair()
    watch_r, watch_w = os.pipe()
    root = os.path.dirname(os.path.dirname(os.path.abspath(synk.__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.Popen(  # the command line synk starts its workers with
        worker_command(theirs.fileno(), watch_r, 0),
        pass_fds=(theirs.fileno(), watch_r), env=env, stderr=subprocess.PIPE,
    )
    theirs.close()
    os.close(watch_r)
    os.write(watch_w, key)
    from multiprocessing.connection import Connection

    return proc, Connection(ours.detach()), watch_w


def _finish(proc, conn, watch_w):
    try:
        code = proc.wait(timeout=30)
        err = proc.stderr.read().decode()
    finally:
        proc.stderr.close()
        conn.close()
        os.close(watch_w)
    return code, err


def test_worker_refuses_a_peer_that_skips_authentication(tmp_path):
    marker = tmp_path / "unpickled"
    proc, conn, watch_w = _start_worker(_auth.new_key())
    conn.send_bytes(pickle.dumps(_Marker(str(marker))))  # straight to a pickle, no challenge
    code, err = _finish(proc, conn, watch_w)
    assert code == 2 and "refused its control channel" in err
    assert "authentication challenge" in err
    assert not marker.exists(), "the worker unpickled data from an unauthenticated peer"


def test_worker_refuses_a_peer_with_the_wrong_key(tmp_path):
    marker = tmp_path / "unpickled"
    proc, conn, watch_w = _start_worker(_auth.new_key())
    with pytest.raises(_auth.AuthenticationError, match="without this group's key"):
        _auth.handshake(conn.send_bytes, conn.recv_bytes, _auth.new_key(), first=True)
    try:
        conn.send_bytes(pickle.dumps(_Marker(str(marker))))
    except OSError:
        pass  # already gone
    code, err = _finish(proc, conn, watch_w)
    assert code == 2 and "rejected this process's key" in err
    assert not marker.exists()


def test_worker_accepts_the_right_key_then_serves():
    from synk._testing import protocol as P, shm as _shm

    key = _auth.new_key()
    proc, conn, watch_w = _start_worker(key)
    _auth.handshake(conn.send_bytes, conn.recv_bytes, key, first=True)
    init = P.Init(rank=1, size=2, sys_path=list(sys.path), prefix=_shm.session_prefix(),
                  inline_output_bytes=1 << 20, spin_s=0.0, peers={}, backend="cpu",
                  device_id=None)
    conn.send_bytes(P.RID.pack(0) + pickle.dumps((P.INIT, init)))
    reply = conn.recv_bytes()
    assert P.RID.unpack_from(reply) == (0,)
    assert pickle.loads(reply[P.RID.size:]) == (P.OK, proc.pid)
    conn.send_bytes(P.RID.pack(1) + pickle.dumps((P.EXIT,)))
    code, err = _finish(proc, conn, watch_w)
    assert code == 0, err


def test_master_refuses_a_worker_without_the_key(monkeypatch):
    monkeypatch.setattr(
        _testing.LocalLaunch, "_give_key",
        staticmethod(lambda key, fd: os.write(fd, _auth.new_key())),
    )
    start = time.monotonic()
    with pytest.raises(synk.WorkerStartError, match="rank 1 failed authentication"):
        synk.fork(2)
    assert time.monotonic() - start < 30
    monkeypatch.undo()
    synk.fork(2)
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(3)) == 3
    synk.close()


def test_oversized_handshake_message_is_refused_unread():
    proc, conn, watch_w = _start_worker(_auth.new_key())
    try:
        conn.send_bytes(b"#SYNK-CHALLENGE#" + b"x" * 10_000_000)
    except BrokenPipeError:
        pass  # it stopped reading after the length
    code, err = _finish(proc, conn, watch_w)
    assert code == 2 and "refused its control channel" in err


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


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A private stand-in for /dev/shm, which other synk programs on the machine do not
    sweep, for the sweep to judge."""
    from synk._testing import shm as _shm

    monkeypatch.setattr(_shm, "SHM_DIR", str(tmp_path))
    return tmp_path


def _make(folder, name: str) -> str:
    os.close(os.open(f"{folder}/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    return name


def test_sweep_judges_owners_by_their_lock_not_their_pid(shm_dir):
    """A master in another pid namespace (sharing /dev/shm, e.g. docker --ipc=host) has a
    pid that means nothing here: its segments survive while it holds its lock."""
    from synk._testing import shm as _shm

    pid = _no_such_pid()
    live, dead, legacy = (f"synk-{pid}-{os.urandom(8).hex()}-" for _ in range(3))
    made = [_make(shm_dir, live + "lock"), _make(shm_dir, live + "d0-" + "a" * 16),
            _make(shm_dir, dead + "lock"), _make(shm_dir, dead + "d0-" + "b" * 16),
            _make(shm_dir, legacy + "d0-" + "c" * 16)]  # a version without locks: by pid
    holder = subprocess.Popen(  # the live owner, in some other process
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('locked', flush=True)\ntime.sleep(60)\n", f"{shm_dir}/{live}lock"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert sorted(_shm.sweep_orphans()) == sorted(made[2:])
        assert sorted(os.listdir(shm_dir)) == sorted(made[:2])
        holder.kill()
        holder.wait()
        assert sorted(_shm.sweep_orphans()) == sorted(made[:2])  # its owner is gone now
        assert os.listdir(shm_dir) == []
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_a_live_owner_in_this_process_is_kept(shm_dir):
    from synk._testing import shm as _shm

    owner = _shm.Owner()
    _make(shm_dir, owner.prefix + "d0-" + "a" * 16)
    assert _shm.sweep_orphans() == []  # its lock is held, if from another descriptor
    owner.release()  # its blocks, then its lock file
    assert os.listdir(shm_dir) == []


def test_sweep_skips_what_it_may_not_remove(shm_dir, monkeypatch, caplog):
    from synk._testing import shm as _shm

    pid = _no_such_pid()
    stale = _make(shm_dir, f"synk-{pid}-{os.urandom(8).hex()}-d0-" + "d" * 16)
    real_unlink = _shm.unlink

    def unlink(name):
        if name == stale:
            raise PermissionError(1, "Operation not permitted", f"{shm_dir}/{name}")
        real_unlink(name)

    monkeypatch.setattr(_shm, "unlink", unlink)
    caplog.set_level(logging.DEBUG, logger="synk")
    assert _shm.sweep_orphans() == []  # another user's stale segment: no error
    assert _shm.sweep_orphans() == []
    said = [r for r in caplog.records if stale in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG  # said once
    assert os.listdir(shm_dir) == [stale]


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


def test_a_call_request_carries_every_field_of_its_task():
    """A CALL carries a rank's ShareTask as a plain tuple (ShareTask.wire and from_wire are
    the one place its fields are packed in order), its call number as the request's id:
    each field must arrive as itself, or a worker would read one field as another."""
    from synk._testing import Plan, ShareTask, protocol as P

    task = ShareTask(fid=3, args=("a", 1.5), kwargs={"k": 2}, spos=(0,), skeys=("k",),
                     plan=Plan((1, 2), (0, 3, 6), 2, None, 6), call_id=9, profile=True)
    updates = (("block",), (), (7,))
    message = P.RID.pack(9) + P.call("a test", task.wire(), updates)
    tag, wire, got_updates = P.read(message)
    back = ShareTask.from_wire(wire, P.rid_of(message))
    assert tag == P.CALL and got_updates == updates
    for name in ShareTask.__slots__:
        assert getattr(back, name) == getattr(task, name), name
    assert type(back.plan) is Plan


def test_a_call_reply_carries_its_fields_in_their_order():
    """protocol.call_reply builds a CALL's answer by keyword, and the master unpacks it in
    CallReply's order: the two must agree."""
    import inspect

    from synk._testing import protocol as P

    params = [p.name for p in inspect.signature(P.call_reply).parameters.values()]
    assert params == list(P.CallReply._fields)
    fields = {name: i for i, name in enumerate(P.CallReply._fields)}
    tag, sent = P.read(P.reply(3, P.call_reply(**fields)))
    assert tag == P.OK and P.CallReply(*sent) == P.CallReply(**fields)
