"""Security: owner-only shared memory with unguessable names, and a control channel that is
local, authenticated both ways, and never unpickles anything before authentication."""
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
from synk._engine import auth as _auth, state as _state


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
        assert len(made) >= 3, made  # a Data block, a staging block, workers' output blocks
        for name in made:
            st = os.stat(f"/dev/shm/{name}")
            assert stat.S_IMODE(st.st_mode) == 0o600, (name, oct(st.st_mode))
            assert st.st_uid == os.getuid()
            parts = name.split("-")
            assert parts[0] == "synk" and int(parts[1]) == os.getpid()
            assert len(parts[2]) == 16 and len(parts[-1]) == 16  # 2 x 64 random bits
        suffixes = {name.split("-")[-1] for name in made}
        assert len(suffixes) == len(made)  # each block has its own random part
    finally:
        synk.close()


def test_control_channel_is_a_local_socket_without_address(ranks2):
    conn = _state.group.conns[1]
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    try:
        assert sock.family == socket.AF_UNIX
        assert sock.getsockname() in ("", b"", None) and sock.getpeername() in ("", b"", None)
    finally:
        sock.close()


def test_the_key_is_not_on_the_command_line_or_in_the_environment(ranks2):
    proc = _state.group.procs[1]
    key = _state.group._key
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "synk._engine.worker", str(theirs.fileno()), str(watch_r), "0"],
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
    from synk._engine import protocol as P, shm as _shm

    key = _auth.new_key()
    proc, conn, watch_w = _start_worker(key)
    _auth.handshake(conn.send_bytes, conn.recv_bytes, key, first=True)
    init = P.Init(1, 2, list(sys.path), _shm.session_prefix(), 1 << 20, 0.0, {})
    conn.send_bytes(pickle.dumps((P.INIT, init)))
    assert pickle.loads(conn.recv_bytes()) == (P.OK, proc.pid)
    conn.send_bytes(pickle.dumps((P.EXIT,)))
    code, err = _finish(proc, conn, watch_w)
    assert code == 0, err


def test_master_refuses_a_worker_without_the_key(monkeypatch):
    monkeypatch.setattr(
        "synk._engine.group.Group._give_key", lambda self, fd: os.write(fd, _auth.new_key())
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
