"""synk's exceptions, and the wrapper that carries a remote traceback back to the master."""
from __future__ import annotations

import os
import pickle
import signal
import sys
import time
import traceback
import types

import cloudpickle


def outside_synk() -> int:
    """``warnings.warn``'s ``stacklevel`` of the first caller outside synk, from the function
    that warns: the user's line (Python shows a warning once per line that it names)."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_SYNK):
        frame, level = frame.f_back, level + 1
    return level


_SYNK = os.path.dirname(os.path.abspath(__file__)) + os.sep  # (the package's folder)


class SynkError(RuntimeError):
    """Base class of synk's own errors; a ``RuntimeError``.

    Raised directly for ``fork()`` while a working group exists, ``fork(backend="gpu")``,
    use of a freed ``Data``, and changing the shape of a ``Data`` this process does not own.
    """


class NotForkedError(SynkError):
    """A ``Function`` was called, or ``distribute()`` was, while no group is running.

    The message says to call ``synk.fork()``, and mentions it when the last group was
    closed.
    """


class GroupBrokenError(SynkError):
    """The group can no longer be used; ``synk.fork()`` starts a new one.

    Raised by a ``Function`` call or ``distribute()`` after a worker died ("this group of
    ranks is broken (...); call synk.fork() again", chained from the ``WorkerDiedError``)
    or after the workers were killed because a call was interrupted ("this group of ranks
    was closed; call synk.fork() again").
    """


#: The exit status of a worker that stopped itself because its NCCL communicator was aborted
#: while a thread of it was inside an NCCL call ("poisoned": see ``POISONED``).
POISONED_EXIT = 75
POISONED = ("its NCCL communicator was aborted while a thread was blocked inside an NCCL "
            "call, which NCCL leaves undefined for the blocking communicators CuPy makes (\"the "
            "thread can possibly get stuck inside NCCL calls ... might hang forever\"), so "
            "the process cannot be reused")


class WorkerDiedError(GroupBrokenError):
    """A worker process died, or closed its connection, while the master was sending to
    it or waiting for it; the other workers have been killed and the group's shared memory
    removed.

    That covers a call, ``distribute()`` and combining large outputs; a worker that died
    while idle is noticed at the next call. The message reads "worker rank R was killed by
    SIGNAL", "worker rank R exited with code C" or "worker rank R closed its connection
    (exit status unknown)", followed by where it happened (for example "during a call of
    loss") and "the other ranks were stopped". It pickles with ``rank`` and ``exitcode``.

    Under MPI the message names the rank's host ("worker rank R on host H closed its
    connection ..."): a rank on another machine is not this process's child, so its exit
    status is unknown, and the MPI job is ended (see [Many hosts](cluster.md)). A rank
    whose connection went silent (its host vanished, lost power or network, or the
    process froze: ``SYNK_PEER_TIMEOUT`` seconds without an answer to TCP's probes) reads
    "worker rank R on host H stopped answering: its connection timed out ...".

    Attributes:
        rank: the rank that died.
        exitcode: its exit status; negative when killed by a signal; None when it did not
            exit within 5 seconds of closing its connection, or is not this process's child
            (MPI).
        signal_name: the decoded signal, such as ``"SIGKILL"`` or ``"SIGSEGV"``, or None
            when it was not killed by a signal.
        host: the rank's host under MPI, else None.
        timed_out: the connection timed out (MPI), rather than being closed.
    """

    def __init__(self, rank: int, exitcode: int | None, during: str = "",
                 host: str | None = None, timed_out: bool = False) -> None:
        self.rank, self.exitcode, self.host = rank, exitcode, host
        self.timed_out = timed_out
        self.signal_name = decode_signal(exitcode)
        if self.signal_name:
            how = f"was killed by {self.signal_name}"
        elif timed_out:
            how = ("stopped answering: its connection timed out (no answer within "
                   "SYNK_PEER_TIMEOUT seconds: its host vanished, lost power or its network, "
                   "or the process froze)")
        elif host is not None:
            how = ("closed its connection (it died or was killed; it is not this process's "
                   "child, so its exit status is unknown here: the MPI launcher reports it)")
        elif exitcode is None:
            how = "closed its connection (exit status unknown)"
        elif exitcode == POISONED_EXIT:
            how = f"stopped itself: {POISONED}"
        else:
            how = f"exited with code {exitcode}"
        where = f" {during}" if during else ""
        who = f"worker rank {rank}" + ("" if host is None else f" on host {host!r}")
        then = ("the MPI job is ending (MPI_Abort)." if host is not None
                else "the other ranks were stopped. Call synk.fork() to start a new group.")
        super().__init__(f"{who} {how}{where}; {then}")

    def __reduce__(self):
        return type(self), (self.rank, self.exitcode, "", self.host, self.timed_out)


# cudaGetErrorName of the CUDA errors that corrupt a context ("sticky": every later call of
# the process fails with them; CUDA Runtime API, cudaError_t)
_CUDA_STICKY = {700: "cudaErrorIllegalAddress", 710: "cudaErrorAssert",
                714: "cudaErrorHardwareStackError", 715: "cudaErrorIllegalInstruction",
                716: "cudaErrorMisalignedAddress", 717: "cudaErrorInvalidAddressSpace",
                718: "cudaErrorInvalidPc", 719: "cudaErrorLaunchFailure"}


def sticky_cuda_error(status) -> str | None:
    """CUDA's name for ``status`` when it is a sticky error, one that leaves the process's
    CUDA context unusable until the process ends (700, an illegal address, ...); else
    None."""
    return _CUDA_STICKY.get(status) if isinstance(status, int) else None


class DeviceFailedError(GroupBrokenError):
    """A rank's GPU failed with a CUDA error that leaves its context unusable, such as 700
    (cudaErrorIllegalAddress, an illegal memory access in a kernel): every later CUDA call
    of that rank's process fails with it too. The group is stopped; ``synk.fork()`` starts
    a new one, unless the rank was 0: the master's own CUDA context stays unusable until
    its process ends, so a GPU group can start again only in a new process (``fork()``
    raises ``GpuUnavailableError`` saying so).

    Attributes:
        rank: the rank whose GPU failed.
        status: CUDA's error code (``cudaError_t``).
    """

    def __init__(self, rank: int, status: int, during: str = "") -> None:
        self.rank, self.status, self.during = rank, status, during
        name = _CUDA_STICKY.get(status, "a CUDA error")
        then = ("call synk.fork() again" if rank else
                "rank 0 is this process (the master), so no GPU group can start in it again: "
                "restart the program (synk.fork(backend='cpu') still works)")
        super().__init__(
            f"the GPU of rank {rank} failed with CUDA error {status} ({name})"
            + (f" {during}" if during else "") + ": its CUDA context is unusable until its "
            f"process ends, so the group was stopped; {then}")

    def __reduce__(self):
        return type(self), (self.rank, self.status, self.during)


class CallTimeoutError(GroupBrokenError, TimeoutError):
    """A call did not finish within its ``timeout``; the group was stopped.

    Also a builtin ``TimeoutError``. The message reads "rank(s) [R, ...] did not finish
    during a call of NAME within T s; the group was stopped. ..."; see
    [Timeouts](api/calls.md#timeouts).

    Attributes:
        ranks: the tuple of late ranks, rank 0 included when the master's own share was
            the late one.
    """

    def __init__(self, message: str, ranks: tuple = ()) -> None:
        self.ranks = tuple(ranks)
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.ranks)


class StuckRanksWarning(RuntimeWarning):
    """The ranks of a running call have waited ``SYNK_STUCK_REPORT`` seconds (default 30)
    for some that are behind: its text names them, says where every rank is in the call
    (the ``synk.comm`` collective each entered last, or the end of its share) and gives the
    late ranks' Python stacks. Said once a call, on the master; nothing is stopped (a call's
    ``timeout=`` stops it, and its ``CallTimeoutError`` says the same). See
    [Timeouts](api/calls.md#timeouts)."""


class RankReplacedWarning(RuntimeWarning):
    """A rank died (or its GPU failed) and, ``fork(restarts=N)`` allowing it, the group was
    started again and the call run again from its start: its text names the rank, the
    cause, the call, how long the recovery took and the restarts left. See [When a rank
    dies](reliability.md#when-a-rank-dies)."""


class ReentrantCallError(SynkError):
    """A synk function (or distribute, a collective, ``set_value``) was called while another
    call runs on the group, from inside that call: the ranks are busy with it."""


class EarlierCallFailedError(SynkError):
    """A submitted call (``Function.submit``) was submitted after one that failed, before
    that failure was read: it ran on what the failed call left (on GPU ranks it may have
    stopped part way), so its result is not given; its changes are not undone.
    ``__cause__`` is the earlier error."""


class StepClosedError(SynkError):
    """A bound step (``Function.bind``) was called after ``close()``, or in another group
    than the one it was bound in."""


class WorkerStartError(SynkError):
    """A worker failed to start during ``synk.fork()``; the cause is chained when there is
    one. ``fork()`` lists the messages."""


class ShmSpaceError(SynkError):
    """A shared-memory segment did not fit in ``/dev/shm``, or in the machine's memory.

    ``what`` says what the segment was for (and on which rank), ``needed`` its size in
    bytes, ``free`` the bytes free in ``/dev/shm`` at that moment (None if unknown), and
    ``available`` the machine's available memory (``MemAvailable``) when that was what
    was short, else None, and ``usable`` the most of it one block may take (synk leaves a
    margin to the processes). Nothing was half-made: the group stays usable.
    """

    def __init__(self, what: str, needed: int, free: int | None,
                 available: int | None = None, usable: int | None = None) -> None:
        self.what, self.needed, self.free = what, needed, free
        self.available, self.usable = available, usable
        if available is not None:
            keep = "" if usable is None else (
                f", of which synk leaves {_bytes(available - usable)} to the processes "
                "themselves")
            super().__init__(
                f"not enough memory for {what}: it needs {_bytes(needed)} of shared memory, "
                f"and the machine has {_bytes(available)} available{keep}. A larger "
                "/dev/shm would not help: free synk.Data you no longer need (and other "
                "memory), use smaller data or batches (batch=, num_slices=) or a smaller "
                "oversize, or use a machine with more memory"
            )
            return
        have = "which has an unknown amount free" if free is None else (
            f"which has {_bytes(free)} free" if free < needed else
            f"which ran out while it was reserved, as other shared memory was made at the "
            f"same moment ({_bytes(free)} are free now)")
        super().__init__(
            f"not enough shared memory for {what}: it needs {_bytes(needed)} in /dev/shm, "
            f"{have}. Make /dev/shm larger (docker run --shm-size=16g ..., "
            "or mount -o remount,size=16g /dev/shm), free synk.Data you no longer need, or "
            "use smaller data or batches (batch=, num_slices=)"
        )

    def __reduce__(self):
        return type(self), (self.what, self.needed, self.free, self.available, self.usable)


def _bytes(n: int) -> str:
    return f"{n:,} bytes ({n / 2**20:.1f} MiB)"


class DistributeError(SynkError):
    """A worker could not unpickle a function shipped by ``distribute()`` or by a first
    call. The message names the function and the rank and says that the workers must be
    able to import every module the function uses."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a worker, chained as its ``__cause__``.

    Not exported at the top level. The text (also ``str()`` and the attribute ``tb``)
    starts with ``Traceback from rank R:`` followed by the worker's traceback, so a normal
    traceback printout shows the worker's traceback first, then "The above exception was
    the direct cause of the following exception", then the master's.
    """

    def __init__(self, tb: str) -> None:
        self.tb = tb
        super().__init__(tb)


class RemoteError(SynkError):
    """Stands in for an exception raised on a worker that could not be sent back as itself.

    Either it could not be pickled and unpickled on the worker (message
    ``"TypeName: message"``), or the master could not rebuild it ("an exception from rank R
    could not be rebuilt: ..."). Its ``__cause__`` is a ``RemoteTraceback`` like any other
    remote exception's.
    """


# -- synk.comm's errors (raised inside functions; the call turns them into the ones above) --
class CommError(SynkError):
    """A message could not be exchanged: a peer rank is gone. The call then raises
    ``WorkerDiedError``."""


class CommAborted(CommError):
    """Another rank of this call failed, so the message waited for will not come.

    The call raises the first real failure instead, and lists the aborted ranks in its
    note.
    """


class CollectiveError(CommError):
    """An NCCL operation failed (``status``: NCCL's result code); the communicator was
    aborted, so no rank waits inside it."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self):
        return type(self), (str(self), self.status)


class CommInitError(CommError):
    """A rank could not join the communicator (set-up failed or was abandoned)."""


class CommInitTimeout(CommInitError, TimeoutError):
    """Communicator set-up did not finish by its deadline: a rank died or hung."""


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
    when = failed_at(exc)
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


def failed_at(exc: BaseException) -> float:
    """When ``exc``'s rank failed (machine-wide monotonic seconds): the time stamped on it
    first (``stamp_failure``), else now. The earliest of a call's failures is its error."""
    return getattr(exc, "_synk_failed_at", None) or time.monotonic()


def stamp_failure(exc: BaseException) -> None:
    """Note on ``exc`` that its rank fails now, unless it is noted already: a rank that
    refuses its value of a collective stamps the error before its peers can read the
    refusal, so that their errors, which follow from it, come after it."""
    if getattr(exc, "_synk_failed_at", None) is None:
        try:
            exc._synk_failed_at = time.monotonic()  # type: ignore[attr-defined]
        except AttributeError:
            pass


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where notes are kept but not printed)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]


def first_failure(failures: list) -> BaseException:
    """The earliest of ``failures`` [(time, rank, exc)], noting the others on it. A rank
    that only stopped because another failed (``CommAborted``) comes after the others."""
    failures = sorted(failures, key=lambda f: (isinstance(f[2], CommAborted), f[0]))
    when, rank, exc = failures[0]
    if len(failures) > 1:
        others = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for _, r, e in failures[1:])
        add_note(exc, f"synk: ranks {[r for _, r, _ in failures]} raised, rank {rank} first "
                      f"(shown); the others: {others}")
    return exc
