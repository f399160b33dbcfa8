"""fork, close and the small helpers of the public API."""
from __future__ import annotations

import atexit
import os
import signal
import threading
import warnings

from . import devices as _devices
from ._engine import shm as _shm, state as _state
from ._engine.group import Group
from .data import free_all
from .errors import SynkError


def fork(n: int | None = None, *, backend: str = "auto") -> int:
    """Start the ranks: ``n`` counts them including this process (rank 0).

    Default ``n``: one rank per CPU core. Returns the number of ranks. Returns only when
    every rank has reported ready; raises ``WorkerStartError`` with the cause otherwise.
    """
    group = _state.group
    if group is not None:
        if group.broken is None and not group.closed:
            raise SynkError("synk.fork() was already called; call synk.close() first")
        close()  # the last group broke: clear it away and start afresh
    _devices.choose_backend(backend)
    cores = _devices.cpu_count()
    if n is None:
        n = cores
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive int (ranks including the master), got {n!r}")
    if n > cores:
        warnings.warn(
            f"synk.fork(n={n}) starts more ranks than the {cores} CPU cores available; "
            "they will share cores", RuntimeWarning, stacklevel=2,
        )
    _shm.sweep_orphans()
    _state.generation += 1
    _state.group = Group(n)
    _state.set_rank(0, n)
    _handle_sigterm()
    return n


def close() -> None:
    """Stop the workers and free every shared-memory block (idempotent; runs at exit)."""
    group, _state.group = _state.group, None
    try:
        if group is not None and group.pid == os.getpid():
            group.close()
    finally:
        free_all()
        _state.set_rank(0, 1)
        _restore_sigterm()


def size() -> int:
    """Number of ranks in the running group (1 when none is running)."""
    return _state.size


def rank() -> int:
    """This process's rank: 0 in the master, the worker's rank inside a synk function."""
    return _state.rank


def xp(x):
    """The array module of ``x``: ``cupy`` for CuPy arrays, else ``numpy``."""
    if type(x).__module__.split(".", 1)[0] == "cupy":
        import cupy

        return cupy
    import numpy

    return numpy


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (kill, timeout, job schedulers): stop the group and free shared memory as
    Ctrl-C would, then die by SIGTERM, as without this handler."""
    try:
        for _ in range(3):
            try:
                group = _state.group
                if group is not None and group.pid == os.getpid():
                    group.terminate()
                free_all()
                break
            except BaseException:  # e.g. the watchdog's interrupt of the master's share,
                continue  # which lands here once a worker is gone: every step may be redone
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(128 + signal.SIGTERM)  # not reached: the signal ends the process


def _handle_sigterm() -> None:
    """Install ``_on_sigterm`` where SIGTERM still has its default action; a handler the
    user installed is left alone. Only the main thread may set handlers."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _restore_sigterm() -> None:
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _forget_parent_group() -> None:
    """In a child made by ``os.fork()``: the parent's group is not this process's to use or
    stop (its exit-time close() would otherwise stop the parent's workers)."""
    _state.group = None
    _state.set_rank(0, 1)


os.register_at_fork(after_in_child=_forget_parent_group)
atexit.register(close)
