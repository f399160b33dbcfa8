"""synk's exceptions, and the wrapper that carries a remote traceback back to the master."""
from __future__ import annotations

import pickle
import signal
import time
import traceback

import cloudpickle


class SynkError(RuntimeError):
    """Base class of synk's own errors (bad use, broken group)."""


class NotForkedError(SynkError):
    """A call needs running ranks, but ``synk.fork()`` has not been called (or was closed)."""


class GroupBrokenError(SynkError):
    """The group of ranks can no longer be used; call ``synk.close()`` and ``synk.fork()``."""


class WorkerDiedError(GroupBrokenError):
    """A worker process died; the other ranks have been stopped.

    ``rank`` is the rank that died, ``exitcode`` its exit status (negative: killed by a
    signal) and ``signal_name`` the decoded signal, e.g. ``"SIGKILL"``, or None.
    """

    def __init__(self, rank: int, exitcode: int | None, during: str = "") -> None:
        self.rank, self.exitcode = rank, exitcode
        self.signal_name = decode_signal(exitcode)
        if self.signal_name:
            how = f"was killed by {self.signal_name}"
        elif exitcode is None:
            how = "closed its connection (exit status unknown)"
        else:
            how = f"exited with code {exitcode}"
        where = f" {during}" if during else ""
        super().__init__(
            f"worker rank {rank} {how}{where}; the other ranks were stopped. "
            "Call synk.fork() to start a new group."
        )

    def __reduce__(self):
        return type(self), (self.rank, self.exitcode)


class CallTimeoutError(GroupBrokenError, TimeoutError):
    """A call did not finish within its ``timeout``; the group was stopped.

    ``ranks`` lists the ranks that had not finished. Also a builtin ``TimeoutError``.
    """

    def __init__(self, message: str, ranks: tuple = ()) -> None:
        self.ranks = tuple(ranks)
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.ranks)


class WorkerStartError(SynkError):
    """A rank failed to start during ``synk.fork()``."""


class DistributeError(SynkError):
    """A function could not be shipped to (unpickled in) the workers."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised on another rank, chained as ``__cause__``."""

    def __init__(self, tb: str) -> None:
        self.tb = tb
        super().__init__(tb)

    def __str__(self) -> str:
        return self.tb


class RemoteError(SynkError):
    """Stands in for an exception from another rank that could not be sent back as itself."""


def decode_signal(exitcode: int | None) -> str | None:
    """Name of the signal that a negative ``Popen.returncode`` stands for."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def pack_exception(exc: BaseException, rank: int) -> tuple[bytes, str, float]:
    """Serialise ``exc`` raised on ``rank`` with its formatted traceback and the (machine-wide
    monotonic) time it was caught, so that the first of several failures can be told."""
    when = getattr(exc, "_synk_failed_at", None) or time.monotonic()
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        data = cloudpickle.dumps(exc)
        pickle.loads(data)
    except Exception:
        data = cloudpickle.dumps(RemoteError(f"{type(exc).__name__}: {exc}"))
    return data, tb, when


def unpack_exception(data: bytes, tb: str, rank: int) -> BaseException:
    """Rebuild an exception sent by ``pack_exception``, with the remote traceback chained."""
    try:
        exc = pickle.loads(data)
    except Exception as err:  # the class may not exist here
        exc = RemoteError(f"an exception from rank {rank} could not be rebuilt: {err!r}")
    exc.__cause__ = RemoteTraceback(f'\n"""\nTraceback from rank {rank}:\n{tb}"""')
    return exc


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where notes are kept but not printed)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def first_failure(failures: list) -> BaseException:
    """The earliest of ``failures`` [(time, rank, exc)], noting the others on it. A rank
    that only stopped because another failed (``CommAborted``) comes after the others."""
    from .comm._mesh import CommAborted

    failures = sorted(failures, key=lambda f: (isinstance(f[2], CommAborted), f[0]))
    when, rank, exc = failures[0]
    if len(failures) > 1:
        others = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for _, r, e in failures[1:])
        add_note(exc, f"synk: ranks {[r for _, r, _ in failures]} raised, rank {rank} first "
                      f"(shown); the others: {others}")
    return exc
