"""Ctrl-C held back while synk releases what it must not leave half released."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def deferred():
    """Ctrl-C (SIGINT) held back until the block has run to its end, then raised (or handed
    to the handler that was there): for the release of a group, which, stopped half way,
    would leave its workers and segments behind with nothing left to release them. Only
    the main thread gets SIGINT's ``KeyboardInterrupt``; elsewhere the block simply runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if previous is signal.default_int_handler:
                raise KeyboardInterrupt
            if callable(previous):
                previous(signal.SIGINT, caught[0])
