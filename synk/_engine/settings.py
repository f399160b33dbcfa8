"""synk's environment variables (``SYNK_*``), read and checked in one place.

``read()`` runs at every ``fork()`` and checks every ``SYNK_*`` variable synk reads, so a bad
value is refused there with a ``ValueError`` that names the variable, its value and its valid
range or form, and says to unset it for the default, rather than as a bare error deep in a
call, a silent fallback, or an error in a worker. The variables and what is valid:

* ``SYNK_SPIN_US``: a number of microseconds from 0 to 1e6;
* ``SYNK_INLINE_OUTPUT_BYTES``: a whole number of bytes from 0 to 2**40;
* ``SYNK_PARALLEL_REDUCE_RANKS``: a whole number of ranks from 2 to 2**20;
* ``SYNK_PROFILE``: 0 or 1 (also false/true, no/yes, off/on), read again when a function is
  built (``profile_default()``, with ``profile=None``);
* ``SYNK_MPI``: 0 or 1 (also read, and checked first, by ``mpi.detect()``);
* ``SYNK_HOST_ID``: a host key, at most 255 printable characters;
* ``SYNK_MASTER_ADDR``: an IPv4 or IPv6 address or a host name;
* the simulator's: ``SYNK_SIMULATE_GPUS``, ``SYNK_SIM_HANG_TIMEOUT``, ``SYNK_SIM_FAULTS``,
  ``SYNK_SIM_NCCL_VERSION``, parsed by ``synk/_devices/env_vars.py``, which the simulator
  uses too (it may not import from the engine).

Unset or blank, each takes its default.
"""
from __future__ import annotations

import ipaddress
import os
import re
from typing import NamedTuple

from .._devices import env_vars
from .._devices.env_vars import invalid, number, raw

DEFAULT_INLINE_OUTPUT_BYTES = 256 << 10  # measured: below it, pickling in the reply is faster
DEFAULT_PARALLEL_REDUCE_RANKS = 5  # see _call.collect
MAX_HOST_ID = 255

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}\.?$){_LABEL}(?:\.{_LABEL})*\.?")


class Settings(NamedTuple):
    spin_us: float | None  # None: the default for the group's size
    inline_output_bytes: int
    parallel_reduce_ranks: int


def read() -> Settings:
    """Every ``SYNK_*`` variable of the environment checked; the tuning ones returned."""
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
    _switch("SYNK_MPI", "detect the MPI launcher from its environment")
    _host_id()
    _master_addr()
    env_vars.check_simulator()


def profile_default() -> bool:
    """``SYNK_PROFILE``: 1 (or true, yes, on) profiles every function built without
    ``profile=``; 0 (false, no, off), empty or unset does not."""
    return _switch("SYNK_PROFILE", "0: no profiling", also=True)


def _switch(name: str, default: str, also: bool = False) -> bool:
    """``name`` as 0 or 1 (with ``also``, the words for them too); unset: False."""
    text = raw(name)
    if text is None:
        return False
    on, off = (_TRUE, _FALSE) if also else (_TRUE[:1], _FALSE[:1])
    if text.lower() in on:
        return True
    if text.lower() in off:
        return False
    words = " (also false/true, no/yes, off/on)" if also else ""
    raise invalid(name, _value(name), f"0 or 1{words}", default)


def _host_id() -> None:
    """``SYNK_HOST_ID``: a host key of printable characters."""
    text = raw("SYNK_HOST_ID")
    if text is not None and (len(text) > MAX_HOST_ID or not text.isprintable()
                             or not _encodable(text)):
        raise invalid("SYNK_HOST_ID", _value("SYNK_HOST_ID"),
                      f"a host key of at most {MAX_HOST_ID} printable characters "
                      "(ranks with the same key form one host)", "the machine, as MPI sees it")


def _master_addr() -> None:
    """``SYNK_MASTER_ADDR``: an IP address or a host name (not looked up here)."""
    text = raw("SYNK_MASTER_ADDR")
    if text is None:
        return
    try:
        ipaddress.ip_address(text)
        return
    except ValueError:
        pass
    if not _HOST_NAME.fullmatch(text) or text.replace(".", "").isdigit():
        raise invalid("SYNK_MASTER_ADDR", _value("SYNK_MASTER_ADDR"),
                      "an IPv4 or IPv6 address or a host name of the master's host",
                      "the addresses of the master's host name and interfaces, in turn")


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # bytes the file system encoding could not decode
        return False
    return True


def _value(name: str) -> str:
    return os.environ[name]
