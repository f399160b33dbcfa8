"""Configuration errors: every ``SYNK_*`` variable is checked at ``synk.fork()``, and a bad
value is refused at once with a ``ValueError`` naming the variable, its value and the valid
range or form, and saying to unset it; ``SYNK_SIMULATE_GPUS`` set to a bad value is never a
silent fall-back to CPU ranks."""
import numpy as np
import pytest

import synk

ALL = ("SYNK_SPIN_US", "SYNK_INLINE_OUTPUT_BYTES", "SYNK_PARALLEL_REDUCE_RANKS", "SYNK_PROFILE",
       "SYNK_SIMULATE_GPUS", "SYNK_SIM_HANG_TIMEOUT", "SYNK_SIM_FAULTS",
       "SYNK_SIM_NCCL_VERSION", "SYNK_HOST_ID", "SYNK_MASTER_ADDR", "SYNK_MPI",
       "SYNK_PEER_TIMEOUT", "SYNK_BIND_CORES")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """None of synk's variables set (nor CUDA_VISIBLE_DEVICES)."""
    for name in (*ALL, "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# (variable, bad value, what the message says is valid)
BAD = [
    ("SYNK_SPIN_US", "fast", "a number of microseconds from 0.0 to 1000000.0"),
    ("SYNK_INLINE_OUTPUT_BYTES", "1e3", "a whole number of bytes from 0 to"),
    ("SYNK_PARALLEL_REDUCE_RANKS", "0", "a whole number of ranks from 2 to"),
    ("SYNK_PROFILE", "maybe", "0 or 1"),
    ("SYNK_PROFILE", "2", "0 or 1"),
    ("SYNK_BIND_CORES", "maybe", "0 or 1"),
    ("SYNK_SIMULATE_GPUS", "two", "a whole number of simulated CUDA devices from 0 to 1024"),
    ("SYNK_SIMULATE_GPUS", "-1", "from 0 to 1024"),
    ("SYNK_SIMULATE_GPUS", "1.5", "from 0 to 1024"),
    ("SYNK_SIMULATE_GPUS", "5000", "from 0 to 1024"),
    ("SYNK_SIM_HANG_TIMEOUT", "soon", "a number of seconds from 0.01 to 1000000.0"),
    ("SYNK_SIM_HANG_TIMEOUT", "0", "a number of seconds from 0.01"),
    ("SYNK_SIM_HANG_TIMEOUT", "nan", "a number of seconds from 0.01"),
    ("SYNK_SIM_FAULTS", "kill:rank=x", "kind:rank=R[:collective=K][:code=C]"),
    ("SYNK_SIM_FAULTS", "explode:rank=1", "kind:rank=R[:collective=K][:code=C]"),
    ("SYNK_SIM_FAULTS", "hang_init", "needs rank=R"),
    ("SYNK_SIM_FAULTS", "kill:rank=1:code=7", "kill takes no field 'code=7'"),
    ("SYNK_SIM_FAULTS", "kill:rank=1:collective=0", "collective='0'"),
    ("SYNK_SIM_NCCL_VERSION", "2.28.3", "an NCCL version code (2.28.3 is 22803) from 20900"),
    ("SYNK_SIM_NCCL_VERSION", "128", "from 20900 to 99999"),
    ("SYNK_HOST_ID", "a\tb", "at most 255 printable characters"),
    ("SYNK_HOST_ID", "h" * 256, "at most 255 printable characters"),
    ("SYNK_MASTER_ADDR", "not an address", "an IPv4 or IPv6 address or a host name"),
    ("SYNK_MASTER_ADDR", "10.0.0.1:5000", "an IPv4 or IPv6 address or a host name"),
    ("SYNK_MPI", "yes", "1 (run as an MPI job) or 0 (never)"),
    ("SYNK_PEER_TIMEOUT", "0", "from 1 to 3600"),
    ("SYNK_PEER_TIMEOUT", "2.5", "a whole number of seconds"),
]


@pytest.mark.parametrize("name, value, valid", BAD, ids=[f"{n}={v[:12]!r}" for n, v, _ in BAD])
def test_a_bad_value_is_refused_at_fork_naming_the_variable(clean_env, name, value, valid):
    clean_env.setenv(name, value)
    with pytest.raises(ValueError) as caught:
        synk.fork(2)
    message = str(caught.value)
    assert f"{name}={value!r} is not valid" in message
    assert valid in message
    assert "unset it" in message or "leave it unset" in message
    assert synk.size() == 1  # nothing started (the leak check sees no process either)


def test_a_bad_profile_is_refused_when_a_function_is_built(clean_env):
    clean_env.setenv("SYNK_PROFILE", "maybe")
    with pytest.raises(ValueError, match="SYNK_PROFILE='maybe' is not valid: it must be 0 or 1"):
        synk.function(np.sum)
    synk.function(np.sum, profile=False)  # an explicit profile= does not read it


GOOD = [
    ("SYNK_SPIN_US", "0"), ("SYNK_SPIN_US", "250.5"), ("SYNK_INLINE_OUTPUT_BYTES", "1"),
    ("SYNK_PARALLEL_REDUCE_RANKS", "2"), ("SYNK_PROFILE", "1"), ("SYNK_PROFILE", "off"),
    ("SYNK_PROFILE", ""), ("SYNK_SIMULATE_GPUS", "0"), ("SYNK_SIMULATE_GPUS", " "),
    ("SYNK_SIM_HANG_TIMEOUT", "0.5"), ("SYNK_SIM_FAULTS", "kill:rank=1:collective=3,"
                                                         "hang_init:rank=0"),
    ("SYNK_SIM_NCCL_VERSION", "23003"), ("SYNK_HOST_ID", "node-a"),
    ("SYNK_MASTER_ADDR", "127.0.0.1"), ("SYNK_MASTER_ADDR", "::1"),
    ("SYNK_MASTER_ADDR", "node1.example.org"), ("SYNK_MPI", "0"), ("SYNK_PEER_TIMEOUT", "10"),
]


@pytest.mark.parametrize("name, value", GOOD, ids=[f"{n}={v!r}" for n, v in GOOD])
def test_a_good_value_is_taken(clean_env, name, value):
    clean_env.setenv(name, value)
    assert synk.fork(1, backend="cpu") == 1
    assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(5)) == 5
    synk.close()


def test_good_values_together_reach_the_workers(clean_env):
    for name, value in [("SYNK_SPIN_US", "100"), ("SYNK_INLINE_OUTPUT_BYTES", "8"),
                        ("SYNK_PARALLEL_REDUCE_RANKS", "2"), ("SYNK_PROFILE", "0"),
                        ("SYNK_SIM_HANG_TIMEOUT", "5"), ("SYNK_SIM_FAULTS", "kill_init:rank=7"),
                        ("SYNK_SIM_NCCL_VERSION", "22803"), ("SYNK_HOST_ID", "h"),
                        ("SYNK_MASTER_ADDR", "localhost"), ("SYNK_MPI", "0"),
                        ("SYNK_PEER_TIMEOUT", "7")]:
        clean_env.setenv(name, value)
    synk.fork(2, backend="cpu")
    try:
        f = synk.function(lambda x: x * 2, reduce="gather")
        assert np.array_equal(f(np.arange(40.0)), np.arange(40.0) * 2)
    finally:
        synk.close()


@pytest.mark.gpu
def test_a_good_simulate_gpus_runs_on_the_simulator(clean_env):
    clean_env.setenv("SYNK_SIMULATE_GPUS", "1")
    clean_env.setenv("SYNK_SIM_HANG_TIMEOUT", "20")
    assert synk.backend().startswith("backend 'gpu'")  # what fork() picks
    synk.fork(1)
    try:
        assert synk.backend().startswith("backend 'gpu'")
        assert synk.function(lambda x: x.sum(), reduce="sum")(np.ones(6)) == 6
    finally:
        synk.close()
