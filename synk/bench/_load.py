"""A busy core: a process that spins in a loop, pinned to one CPU, for the "one busy core"
rows (a machine where the ranks do not have every core to themselves)."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

_SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


@contextlib.contextmanager
def busy_core():
    """Keep the last CPU this process may use busy while the block runs."""
    cpu = max(os.sched_getaffinity(0))
    proc = subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu)])
    try:
        yield cpu
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def environment(**values: str):
    """Set environment variables (e.g. ``SYNK_SPIN_US``, read by ``synk.fork``) for the block."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
