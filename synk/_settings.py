"""synk's environment variables (``SYNK_*``), read and checked in one place: the lowest
layer's, through which every other reads its variables (the MPI launchers' that tell synk it
runs as one of several MPI processes too, ``mpi_launcher()``).
"""
from __future__ import annotations

import ipaddress
import math
import os
import re
from typing import NamedTuple

MAX_SIMULATED_GPUS = 1024
DEFAULT_HANG_TIMEOUT = 60.0
MIN_HANG_TIMEOUT = 0.01
MAX_HANG_TIMEOUT = 1e6
MIN_NCCL_VERSION = 20900  # 2.9.0: from 2.9, NCCL's code is major * 10000 + minor * 100 + patch
MAX_NCCL_VERSION = 99999

# each fault kind, and the fields it takes besides rank=R (sim/_faults.py)
FAULT_FIELDS = {"kill": ("collective",), "async_error": ("collective", "code"),
                "cuda_error": ("collective", "code"), "hang_init": (), "kill_init": ()}
_FIELD_LOW = {"rank": 0, "collective": 1, "code": 1}
_FIELD_HIGH = (1 << 31) - 1
_WHOLE = re.compile(r"\+?[0-9]+")


def raw(name: str) -> str | None:
    """The value of ``name``, stripped; None when unset or blank (which means the default)."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return None
    return text.strip()


def invalid(name: str, text: str, rule: str, default: str = "") -> ValueError:
    """The error for ``name=text``: ``rule`` says what it must be, ``default`` what unset means."""
    note = f" ({default})" if default else ""
    return ValueError(f"environment variable {name}={text!r} is not valid: it must be {rule}; "
                      f"unset it to use the default{note}")


def number(name: str, default, kind, low, high, what: str, default_text: str = ""):
    """``name`` as a number of ``kind`` (int: a whole number; float: a finite number), from
    ``low`` to ``high``; ``default`` when unset or blank."""
    text = raw(name)
    if text is None:
        return default
    value = None
    if kind is int:
        if _WHOLE.fullmatch(text):
            value = int(text)
    elif "_" not in text:
        try:
            value = kind(text)
        except ValueError:
            value = None
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or not (
        low <= value <= high
    ):
        raise invalid(name, os.environ[name], f"{what} from {low} to {high}", default_text)
    return value


def simulate_gpus() -> int:
    """``SYNK_SIMULATE_GPUS``: simulated devices in the machine (0 when unset)."""
    return number("SYNK_SIMULATE_GPUS", 0, int, 0, MAX_SIMULATED_GPUS,
                  "a whole number of simulated CUDA devices",
                  "0: no simulator; the real GPUs, if any, else the CPU")


def sim_hang_timeout() -> float:
    """``SYNK_SIM_HANG_TIMEOUT``: seconds after which a simulated wait that would hang
    forever on a GPU raises."""
    return number("SYNK_SIM_HANG_TIMEOUT", DEFAULT_HANG_TIMEOUT, float, MIN_HANG_TIMEOUT,
                  MAX_HANG_TIMEOUT, "a number of seconds", f"{DEFAULT_HANG_TIMEOUT:g} s")


def sim_nccl_version() -> int | None:
    """``SYNK_SIM_NCCL_VERSION``: the NCCL version code the simulator reports, or None
    (the installed NCCL wheel's)."""
    return number("SYNK_SIM_NCCL_VERSION", None, int, MIN_NCCL_VERSION, MAX_NCCL_VERSION,
                  "an NCCL version code (2.28.3 is 22803)",
                  "the installed NCCL wheel's version")


FAULTS_FORM = ("faults separated by commas, each kind:rank=R[:collective=K][:code=C], kind "
               "one of kill (which takes collective=K), async_error, cuda_error (which take "
               "collective=K and code=C), hang_init, kill_init; R a whole number >= 0, K and "
               "C >= 1")


def sim_faults(spec: str | None = None) -> list[dict]:
    """``SYNK_SIM_FAULTS`` (or ``spec``) parsed: one dict per fault, its ``kind`` and its
    whole-number fields (``rank``, and ``collective`` and ``code`` where given)."""
    text = os.environ.get("SYNK_SIM_FAULTS", "") if spec is None else spec
    faults = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        kind, *fields = (part.strip() for part in item.split(":"))
        if kind not in FAULT_FIELDS:
            raise _bad_faults(text, f"unknown fault {kind!r} in {item!r}")
        fault: dict = {"kind": kind}
        for field in fields:
            key, sep, value = (part.strip() for part in field.partition("="))
            if not sep or key not in ("rank", *FAULT_FIELDS[kind]):
                raise _bad_faults(text, f"{kind} takes no field {field!r} (in {item!r})")
            if key in fault:
                raise _bad_faults(text, f"{key} is given twice in {item!r}")
            if not _WHOLE.fullmatch(value) or not (
                    _FIELD_LOW[key] <= int(value) <= _FIELD_HIGH):
                raise _bad_faults(text, f"{key}={value!r} in {item!r} is not a whole number "
                                        f">= {_FIELD_LOW[key]}")
            fault[key] = int(value)
        if "rank" not in fault:
            raise _bad_faults(text, f"{item!r} needs rank=R")
        faults.append(fault)
    return faults


def _bad_faults(text: str, what: str) -> ValueError:
    return ValueError(f"environment variable SYNK_SIM_FAULTS={text!r} is not valid ({what}): "
                      f"it must be {FAULTS_FORM}; unset it to use the default (no faults)")


def check_simulator() -> None:
    """Check every simulator variable (``ValueError`` naming the first bad one): the
    simulator reads them here, in every process."""
    simulate_gpus()
    sim_hang_timeout()
    sim_faults()
    sim_nccl_version()


DEFAULT_INLINE_OUTPUT_BYTES = 32 << 10  # measured: below it, pickling in the reply is faster
# (from it, the reply ring's six copies of an output cost more than its one into shared memory)
DEFAULT_PARALLEL_REDUCE_RANKS = 5  # see _call.collect
MAX_HOST_ID = 255
DEFAULT_PEER_TIMEOUT = 3  # seconds; below Open MPI's launcher's (see docs/cluster.md)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}\.?$){_LABEL}(?:\.{_LABEL})*\.?")


class Settings(NamedTuple):
    spin_us: float | None  # None: the default for the group's size
    inline_output_bytes: int
    parallel_reduce_ranks: int


def read() -> Settings:
    """Every ``SYNK_*`` variable checked; the tuning ones returned. Run at every ``fork()``, so a
    bad value is refused there with a ``ValueError`` naming the variable, its value, its valid
    range and that unsetting it gives the default. Unset or blank: the default."""
    check_others()
    return Settings(
        spin_us=number("SYNK_SPIN_US", None, float, 0.0, 1e6,
                       "a number of microseconds", "1000 when every rank has a core, else 0"),
        inline_output_bytes=number("SYNK_INLINE_OUTPUT_BYTES", DEFAULT_INLINE_OUTPUT_BYTES,
                                   int, 0, 1 << 40, "a whole number of bytes",
                                   str(DEFAULT_INLINE_OUTPUT_BYTES)),
        parallel_reduce_ranks=number("SYNK_PARALLEL_REDUCE_RANKS",
                                     DEFAULT_PARALLEL_REDUCE_RANKS, int, 2, 1 << 20,
                                     "a whole number of ranks",
                                     str(DEFAULT_PARALLEL_REDUCE_RANKS)),
    )


def check_others() -> None:
    """Check the ``SYNK_*`` variables that ``read()`` does not return (``ValueError`` naming
    the first bad one)."""
    profile_default()
    _MEAN_RULE[0] = _mean_rule()  # (read again: a group's ranks start with what it says now)
    mpi_mode()
    host_id()
    master_addr()
    peer_timeout()
    stuck_report()
    bind_cores()
    check_simulator()


DEFAULT_STUCK_REPORT = 30.0


def stuck_report() -> float:
    """``SYNK_STUCK_REPORT``: after how many seconds of the ranks of a call waiting, all in
    the same places, for some that are behind, the master names those (a
    ``StuckRanksWarning``, once a call); 0: never."""
    return number("SYNK_STUCK_REPORT", DEFAULT_STUCK_REPORT, float, 0.0, 1e6,
                  "a number of seconds", f"{DEFAULT_STUCK_REPORT:g}")


def profile_default() -> bool:
    """``SYNK_PROFILE``: 1 (or true, yes, on) profiles every function built without
    ``profile=``; 0 (false, no, off), empty or unset does not."""
    return _switch("SYNK_PROFILE", False, "0: no profiling")


def bind_cores() -> bool:
    """``SYNK_BIND_CORES``: 1 (or true, yes, on; the default) runs each CPU rank of a group on
    one host on cores of its own, where they go round; 0 (false, no, off) lets them run on
    any."""
    return _switch("SYNK_BIND_CORES", True, "1: cores of its own")


def _switch(name: str, default: bool, default_text: str) -> bool:
    text = raw(name)
    if text is None:
        return default
    if text.lower() in _TRUE + _FALSE:
        return text.lower() in _TRUE
    raise invalid(name, os.environ[name], "0 or 1 (also false/true, no/yes, off/on)",
                  default_text)


def mean_rule() -> str:
    """``SYNK_MEAN``: ``"dtype"`` (unset, empty, ``dtype``) or ``"exact"`` (``exact``,
    ``float64``). Read at ``fork()`` (workers inherit the environment), or on first use without
    a group; kept until ``close()`` or the next ``fork()``, since the ranks must agree on it."""
    rule = _MEAN_RULE[0]
    if rule is None:
        rule = _MEAN_RULE[0] = _mean_rule()  # (an invalid value raises, and is not kept)
    return rule


_MEAN_RULE: list = [None]  # the rule this process keeps (None: not read yet)


def forget_mean_rule() -> None:
    """The group has ended (``close()``): ``mean_rule()`` reads the variable again."""
    _MEAN_RULE[0] = None


def _mean_rule() -> str:
    text = raw("SYNK_MEAN")
    if text is None or text.lower() == "dtype":
        return "dtype"
    if text.lower() in ("exact", "float64"):
        return "exact"
    raise invalid("SYNK_MEAN", os.environ["SYNK_MEAN"], "dtype or exact (also float64)",
                  "dtype: in the data's own dtype")


def mpi_mode() -> bool | None:
    """``SYNK_MPI``: True (1: run as an MPI job, fail if MPI is missing), False (0: never),
    None (unset: as the launcher's variables say, ``mpi_launcher()``)."""
    text = raw("SYNK_MPI")
    if text is None:
        return None
    if text not in ("0", "1"):
        raise invalid("SYNK_MPI", os.environ["SYNK_MPI"], "1 (run as an MPI job) or 0 (never)",
                      "detect the MPI launcher from its environment")
    return text == "1"


_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
              "SLURM_STEP_NUM_TASKS")
_RANK_VARS = ("PMIX_RANK", "PMI_RANK")  # launched by a PMIx / PMI launcher, size unknown


def mpi_launcher() -> tuple[str, int | None] | None:
    """(variable, world size or None) when an MPI launcher's variables say this process is
    one of several MPI processes; None otherwise."""
    for var in _SIZE_VARS:
        text = os.environ.get(var, "").strip()
        if text.isdigit():
            if var == "SLURM_STEP_NUM_TASKS" and "SLURM_PROCID" not in os.environ:
                continue  # (a Slurm allocation, not a step srun started)
            return (var, int(text)) if int(text) > 1 else None
    for var in _RANK_VARS:
        if os.environ.get(var, "").strip().isdigit():
            return var, None
    return None


def host_id() -> str | None:
    """``SYNK_HOST_ID``: this process's pretend host, a key of printable characters (for
    tests of many hosts on one machine), or None: the machine, as MPI sees it."""
    text = raw("SYNK_HOST_ID")
    if text is not None and (len(text) > MAX_HOST_ID or not text.isprintable()
                             or not _encodable(text)):
        raise invalid("SYNK_HOST_ID", os.environ["SYNK_HOST_ID"],
                      f"a host key of at most {MAX_HOST_ID} printable characters "
                      "(ranks with the same key form one host)", "the machine, as MPI sees it")
    return text


def peer_timeout() -> int:
    """``SYNK_PEER_TIMEOUT``: the seconds after which a control connection to a rank on
    another host that stopped answering (its host lost power or network) fails, so that
    the rank is reported dead within them."""
    return number("SYNK_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT, int, 1, 3600,
                  "a whole number of seconds", str(DEFAULT_PEER_TIMEOUT))


def master_addr() -> str | None:
    """``SYNK_MASTER_ADDR``: the address the workers reach the master at, an IP address or
    a host name (not looked up here); None: the master's own, found in turn."""
    text = raw("SYNK_MASTER_ADDR")
    if text is None:
        return None
    try:
        ipaddress.ip_address(text)
        return text
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(text) or text.replace(".", "").isdigit():
        raise invalid("SYNK_MASTER_ADDR", os.environ["SYNK_MASTER_ADDR"],
                      "an IPv4 or IPv6 address or a host name of the master's host",
                      "the addresses of the master's host name and interfaces, in turn")
    return text


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # bytes the file system encoding could not decode
        return False
    return True
