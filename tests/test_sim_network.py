"""The simulated NCCL's network transport (synk/_devices/sim/_net.py), between real
processes on this machine: ranks that do not share the id maker's /dev/shm meet over TCP, as
NCCL's socket transport does. Here a rank is sent to the network as NCCL sends ranks of one
node there, with NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1; tests/test_hosts_apart.py runs
GPU ranks on hosts that share nothing. Every op and dtype against numpy, data movement, a
rank elsewhere moving the whole communicator to TCP, the failures (a killed rank,
disagreeing ranks) and a root that cannot be reached, which must fail at once."""
import os
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import test_nccl_sim as base
from conftest import first_op

import synk

# No public handle: the simulated NCCL's network transport, tested here on its own.
from synk._testing import make_id, sim_net as _net
from synk.simulator import cupy as cp

pytestmark = pytest.mark.gpu

TCP = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
# the ranks import the synk under test (a checkout's), not the one this Python installed
PYTHONPATH = os.pathsep.join(filter(None, [
    os.path.dirname(os.path.dirname(os.path.abspath(synk.__file__))),
    os.environ.get("PYTHONPATH")]))


def board_kind(comm, dev, rank, n):
    """One allreduce; how this rank met its peers, and the sum."""
    x = dev.to_device(np.full(4, float(rank + 1), np.float32))
    total = float(dev.to_host(comm.allreduce(x))[0])
    return type(comm.guard.comm._board).__name__, total


def run_ranks(n, scenario, rank_env, faults="", uid=None, wait=45, hang_timeout=20):
    """``scenario`` (of test_nccl_sim, or ``board_kind``) on ``n`` ranks in fresh processes,
    each with its own extra environment; {rank: (kind, value, seconds)} and the exit codes.
    No segment of the communicator is left behind."""
    import base64
    import pickle

    uid = make_id(cp) if uid is None else uid
    prefix = uid[8:112].rstrip(b"\0").decode()
    procs = []
    for rank in range(n):
        env = dict(os.environ, SYNK_SIMULATE_GPUS=str(n), SYNK_SIM_FAULTS=faults,
                   SYNK_SIM_HANG_TIMEOUT=str(hang_timeout), STOP_AFTER="0",
                   PYTHONPATH=PYTHONPATH, **rank_env[rank])
        env.pop("CUDA_VISIBLE_DEVICES", None)
        procs.append(subprocess.Popen([sys.executable, __file__, str(rank), str(n), uid.hex(),
                                       scenario], env=env, stdout=subprocess.PIPE, text=True))
    found, codes = {}, []
    deadline = time.monotonic() + wait
    try:
        for rank, proc in enumerate(procs):
            try:
                out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    found[rank] = pickle.loads(base64.b64decode(line.split()[1]))
            codes.append(proc.returncode)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    left = [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
    assert not left, f"segments left behind: {left}"
    return found, codes


def test_ranks_with_p2p_and_shm_disabled_meet_over_tcp_and_match_numpy():
    found, codes = run_ranks(3, "every_op_and_dtype", [TCP] * 3)
    assert codes == [0, 0, 0]
    for rank in range(3):
        kind, value, _ = found[rank]
        assert kind == "ok" and value == [], value
    found, codes = run_ranks(3, "board_kind", [TCP] * 3)
    assert codes == [0, 0, 0]
    assert [found[r][1] for r in range(3)] == [("NetBoard", 6.0)] * 3


def test_data_movement_over_tcp():
    found, codes = run_ranks(3, "data_movement", [TCP] * 3)
    assert codes == [0, 0, 0]
    xs = [np.arange(12.0).reshape(4, 3) + 100 * r for r in range(3)]
    for rank in range(3):
        kind, out, _ = found[rank]
        assert kind == "ok", out
        np.testing.assert_array_equal(out["broadcast"], xs[2])
        np.testing.assert_array_equal(out["ring"], xs[(rank - 1) % 3])
    np.testing.assert_array_equal(found[1][1]["recv"], [7, 8])


def test_one_rank_elsewhere_moves_the_whole_communicator_to_tcp():
    """Ranks 0 and 2 wait on the shared-memory board; rank 1 cannot use it and calls the
    root, which marks the board: the two switch, and all three meet over TCP."""
    found, codes = run_ranks(3, "board_kind", [{}, TCP, {}])
    assert codes == [0, 0, 0]
    assert [found[r][1] for r in range(3)] == [("NetBoard", 6.0)] * 3, found


def test_ranks_on_one_board_stay_there():
    found, codes = run_ranks(2, "board_kind", [{}, {}])
    assert [found[r][1] for r in range(2)] == [("Board", 3.0)] * 2, found


def test_a_rank_killed_over_tcp_is_reported_in_seconds():
    """Its connections close: the survivors' collective fails with ncclRemoteError naming
    it, long before the hang timeout (20 s here)."""
    found, codes = run_ranks(3, "many_allreduces", [TCP] * 3,
                             faults=f"kill:rank=1:collective={first_op(3) + 2}")
    assert codes[1] == -9
    for rank in (0, 2):
        kind, (name, message, status), seconds = found[rank]
        assert (kind, name, status) == ("error", "CollectiveError", 6), message
        assert "rank 1" in message and "died" in message and seconds < 15, message


def test_disagreeing_ranks_over_tcp_get_the_simulators_error_on_every_rank():
    found, codes = run_ranks(2, "mismatched_count", [TCP] * 2)
    assert codes == [0, 0]
    for rank in range(2):
        kind, (name, message, status), _ = found[rank]
        assert (kind, name, status) == ("error", "SimulatorError", None), message
        assert "disagree" in message and "undefined behaviour" in message, message


def test_a_root_nobody_can_reach_fails_at_once():
    """The id names an address where nothing listens (as when the maker's NCCL_SOCKET_IFNAME
    names an interface the other hosts cannot reach): the rank says so within seconds,
    where it would wait for the hang timeout (20 s) for a rendezvous that cannot happen."""
    uid = make_id(cp)
    _net.give_up(uid[8:112].rstrip(b"\0").decode())  # (its own root is not used)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # (closed: nothing listens there)
    uid = uid[:_net.ADDRESS_AT] + socket.inet_aton("127.0.0.1") + struct.pack(">H", dead_port) \
        + uid[_net.ADDRESS_AT + 6:]
    found, codes = run_ranks(2, "raw", [TCP] * 2, uid=uid)
    for rank in range(2):
        kind, (name, message, status), seconds = found[rank]
        assert (kind, name, status) == ("error", "NcclError", 6), message
        assert f"cannot reach the bootstrap root at 127.0.0.1:{dead_port}" in message
        assert "cannot be simulated" in message and seconds < 10, message


@pytest.mark.parametrize("spec, interfaces, chosen", [
    # NCCL's default order: ib first, then anything but docker/lo/virbr, then docker, lo
    ("", [("lo", "127.0.0.1"), ("docker0", "172.17.0.1"), ("eth0", "10.0.0.2")], "eth0"),
    ("", [("lo", "127.0.0.1"), ("eth0", "10.0.0.2"), ("ib0", "10.1.0.2")], "ib0"),
    ("", [("lo", "127.0.0.1"), ("docker0", "172.17.0.1")], "docker0"),
    ("", [("lo", "127.0.0.1")], "lo"),
    # NCCL_SOCKET_IFNAME: prefixes, ^ excludes, = matches exactly
    ("eth", [("lo", "127.0.0.1"), ("eth0", "10.0.0.2"), ("eth1", "10.0.1.2")], "eth0"),
    ("^eth0,lo", [("lo", "127.0.0.1"), ("eth0", "10.0.0.2"), ("eth1", "10.0.1.2")], "eth1"),
    ("=eth", [("eth", "10.0.0.9"), ("eth0", "10.0.0.2")], "eth"),
    ("lo", [("eth0", "10.0.0.2"), ("lo", "127.0.0.1")], "lo"),
])
def test_the_bootstrap_interface_is_chosen_as_nccl_chooses_it(monkeypatch, spec, interfaces,
                                                              chosen):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", spec)
    monkeypatch.setattr(_net, "interface_addresses",
                        lambda: [(name, address, True) for name, address in interfaces])
    _net.forget_interface()
    try:
        assert _net.bootstrap_interface()[0] == chosen
    finally:
        _net.forget_interface()


def test_no_interface_is_nccls_invalid_usage_at_get_unique_id(monkeypatch):
    """"Bootstrap : no socket interface found" (src/bootstrap.cc): ncclGetUniqueId fails."""
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuch")
    _net.forget_interface()
    try:
        with pytest.raises(cp.cuda.nccl.NcclError,
                           match="no socket interface found matching NCCL_SOCKET_IFNAME") as info:
            cp.cuda.nccl.get_unique_id()
        assert info.value.status == 5
    finally:
        _net.forget_interface()


if __name__ == "__main__":
    base.board_kind = board_kind  # a scenario of this file, run by test_nccl_sim's rank
    base._rank_main(int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4])
