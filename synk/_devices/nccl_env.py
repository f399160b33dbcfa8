"""How NCCL reads its environment variables (src/misc/param.cc, ``ncclLoadParam``): once per
process, at first use, each with ``strtoll(value, NULL, 0)``. The simulator's NCCL and
synk's decisions about what NCCL will do both read them through here."""
from __future__ import annotations

import os
import re


def strtoll(text: str) -> int:
    """C's ``strtoll(text, NULL, 0)``: leading space, a sign, a 0x / 0 base prefix, digits up
    to the first that is not one; 0 if none ("0x1" is 1, "1abc" is 1, "yes" is 0)."""
    found = re.match(r"\s*([+-]?)(0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)", text)
    if not found:
        return 0
    sign, digits = found.groups()
    base = 16 if digits[:2].lower() == "0x" else 8 if digits.startswith("0") else 10
    value = int(digits, base)
    return -value if sign == "-" else value


def read(name: str, default):
    """The value NCCL would take for ``name`` from this process's environment: ``default``
    when unset or empty."""
    raw = os.environ.get(name)
    return default if raw is None or raw == "" else strtoll(raw)
