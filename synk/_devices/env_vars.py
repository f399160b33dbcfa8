"""Parsing and checking of synk's ``SYNK_*`` environment variables, for the layers that read
them: the engine's settings (``synk/_engine/settings.py``, which checks every variable at
``fork()``) and the CUDA simulator (``sim``), which reads its own in every process and may not
import from the engine. A bad value raises ``ValueError`` naming the variable, its value, the
valid range or form, and saying to unset it for the default.

The simulator's variables:

* ``SYNK_SIMULATE_GPUS``: simulated CUDA devices, a whole number from 0 to
  ``MAX_SIMULATED_GPUS`` (0, like unset: no simulator);
* ``SYNK_SIM_HANG_TIMEOUT``: seconds, from ``MIN_HANG_TIMEOUT`` to ``MAX_HANG_TIMEOUT``
  (default 60), after which a simulated wait that would never return on a GPU raises;
* ``SYNK_SIM_FAULTS``: faults to inject (``sim._faults`` says what each does), separated by
  commas, each ``kind:rank=R[:collective=K][:code=C]``;
* ``SYNK_SIM_NCCL_VERSION``: the NCCL version code the simulator reports, a whole number from
  ``MIN_NCCL_VERSION`` to ``MAX_NCCL_VERSION`` (default: the installed NCCL wheel's).
"""
from __future__ import annotations

import math
import os
import re

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
    """The error for ``name=text``: ``rule`` says what it must be, ``default`` what unset
    means."""
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
        fault = {"kind": kind}
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
    """Check every simulator variable (``ValueError`` naming the first bad one)."""
    simulate_gpus()
    sim_hang_timeout()
    sim_faults()
    sim_nccl_version()
