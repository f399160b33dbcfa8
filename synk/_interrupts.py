"""Interrupts that must not land half way through a release, the watchdog's (sent by
``interrupt``, taken back by ``take_back``) and Ctrl-C: code that frees something runs in
``uninterruptible()``, and an interrupt meant for its thread meanwhile is raised as it leaves.
"""
from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
from collections.abc import Iterator

_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc  # (thread id, exc type or NULL)

# Which thread is inside a section, and which interrupts are sent and not yet landed, is known
# under this one lock, so that an interrupt cannot land inside a section it was sent before.
_lock = threading.RLock()  # (re-entrant: an interrupt may land while its thread holds it)
_sections: dict[int, int] = {}  # thread id -> how many uninterruptible sections it is in
_held: set[int] = set()  # threads whose interrupt waits for the end of their section
_sent: set[int] = set()  # threads whose interrupt was raised into them and has not landed


class Interrupted(BaseException):
    """Raised into the master's share by the watchdog; turned into a synk error, never
    shown to the user as itself. A BaseException so that ``except Exception`` in user code
    does not swallow it."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        _sent.discard(threading.get_ident())  # (landed; made in the thread it lands in)


def interrupt(thread_id: int) -> None:
    """Raise ``Interrupted`` in thread ``thread_id`` at its next bytecode or, if it is
    inside ``uninterruptible()``, as it leaves."""
    with _lock:
        if _sections.get(thread_id):
            _held.add(thread_id)
            return
        _sent.add(thread_id)
        _set_async_exc(ctypes.c_ulong(thread_id), ctypes.py_object(Interrupted))


def take_back(thread_id: int) -> None:
    """Cancel the interrupt of ``thread_id`` that has not landed yet, if any."""
    with _lock:
        _held.discard(thread_id)
        if thread_id in _sent:
            _sent.discard(thread_id)
            _set_async_exc(ctypes.c_ulong(thread_id), None)


@contextlib.contextmanager
def uninterruptible() -> Iterator[None]:
    """Run the block to its end: the watchdog's interrupt of this thread, and Ctrl-C in the main
    thread, are raised after it (for code that frees what a thread holds). The watchdog's
    ``Interrupted`` (``PyThreadState_SetAsyncExc``) lands at the thread's next bytecode, wherever it
    is. Inside code that frees something it can leave the thing neither in use nor freed: a
    communicator's abort cut between letting go of its handle and freeing it leaves it allocated,
    its shared memory mapped, until the process ends."""
    me = threading.get_ident()
    ident = ctypes.c_ulong(me)
    with _lock:
        depth = _sections.get(me, 0)
        # no bytecode below lets a sent interrupt land before it is taken back (CPython
        # checks for one after a call returns, and the first call here takes it back)
        _sections[me] = depth + 1
        if me in _sent:
            _set_async_exc(ident, None)
            _sent.discard(me)
            _held.add(me)
    try:
        with deferred():
            yield
    finally:
        with _lock:
            if depth:
                _sections[me] = depth
                raise_now = False
            else:
                del _sections[me]
                raise_now = me in _held
                _held.discard(me)
        if raise_now:
            raise Interrupted()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
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
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None
                      else previous)  # (None: a handler set outside Python, which Python
        # cannot set again: its own default, Ctrl-C as KeyboardInterrupt, stands for it)
        if caught:
            if previous is signal.default_int_handler:
                raise KeyboardInterrupt
            if callable(previous):
                previous(signal.SIGINT, caught[0])
