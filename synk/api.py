"""fork, close and the small helpers of the public API."""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import warnings
from collections.abc import Sequence

from . import _interrupts, _settings
from ._arrays import seeds
from ._data_blocks import free_all
from ._devices import discovery, host_threads as _devices
from ._engine import mpi_job as _mpi
from ._engine.group import Group
from ._engine.mpi_launch import MpiLaunch
from ._process import PROCESS
from ._wire import shm as _shm
from .errors import SynkError, WorkerStartError
from .function import check_timeout
from .shared import replicas_to_host


def fork(n: int | None = None, *, backend: str = "auto", devices: Sequence[int] | None = None,
         start_timeout: float = 120.0, seed: int | None = None, restarts: int = 0) -> int:
    """Start a group of ranks; return once every worker has reported ready.

    This process becomes rank 0 and computes its own share of every call; ``n - 1`` worker
    processes become ranks 1 to ``n - 1``. Each worker is a fresh interpreter, never a fork
    of this one, started with this process's interpreter, environment and working
    directory, from a thread of the group's own (so that the kernel's parent-death signal
    does not depend on which thread called ``fork()``). The working directory is kept off
    the worker's ``sys.path`` until the worker has authenticated this process; then its
    ``sys.path`` is this process's ``sys.path`` at this moment. So a script needs no
    ``if __name__ == "__main__":`` guard. The BLAS/OpenMP thread variables are set in the
    workers' environment, and CPU ranks that go round the cores run on cores of their own,
    this process on rank 0's until ``close()`` (see [Threads](index.md#threads) and
    [Environment variables](api/environment.md)).

    Before starting, shared-memory blocks left behind by synk processes that are gone are
    removed: those whose owner's lock file (``synk-<pid>-<random>-lock``) is no longer
    locked, and, for blocks of older versions without one, those whose pid no longer
    exists; another user's blocks are skipped (said once on the ``synk`` logger at DEBUG
    level). Every ``SYNK_*`` variable is checked. The workers have 120 seconds to
    report ready. Afterwards ``synk.rank()`` is 0 and ``synk.size()`` is ``n``. After a
    failed start nothing is left running, and ``fork()`` may be called again.

    **Under MPI** (the script was started by ``mpiexec`` or ``srun`` as several processes;
    see [Many hosts](cluster.md)), the job's processes are the ranks: in world rank 0
    ``fork()`` returns as above, once every other process has connected and reported ready;
    in every other process it never returns: the process serves the master until
    ``close()``, then exits, without running the rest of the script. ``n`` must then be
    None or the number of processes, and a job runs one group (a second ``fork()`` raises
    ``SynkError``). A group that breaks there (a rank died, a call timed out) ends the MPI
    job with ``MPI_Abort``.

    Called in the main thread while SIGTERM still has its default action, it installs a
    SIGTERM handler that kills the workers and frees this process's shared memory, then
    lets the process die by SIGTERM as it would have. A handler of your own is never
    replaced (call ``synk.close()`` from it); ``close()`` restores the default. Called from
    another thread, where Python lets no handler be installed, it starts a small guardian
    process instead, which removes the group's and this process's shared memory if this
    process dies (by SIGTERM, or any other way) without closing the group.

    Args:
        n: the number of ranks **including this process**. Default: the CPU cores this
            process may run on (``os.sched_getaffinity``, else ``os.cpu_count()``).
            ``n = 1`` runs everything in the master. More ranks than cores work, with a
            ``RuntimeWarning``.
        backend: ``"gpu"``: one rank per visible CUDA device (``CUDA_VISIBLE_DEVICES``
            honoured), rank 0 on the first; each rank's inputs arrive as CuPy arrays on its
            device. ``"cpu"``: one rank per CPU core, numpy arrays. ``"auto"`` (default):
            ``"gpu"`` when CuPy is importable and sees a device (or the CUDA simulator is
            on, ``SYNK_SIMULATE_GPUS=N``), else ``"cpu"``; ``synk.backend()`` says which
            and why.
        devices: GPU backend only: the CUDA devices to use, in rank order (a subset of the
            visible ones); default all of them. With ``n`` larger than the devices, ranks
            are placed on them round-robin: NCCL (from 2.30, with
            ``NCCL_MULTI_RANK_GPU_ENABLE=1``, which synk sets) joins them, or, where it
            cannot, a communicator that stages device arrays through host memory;
            ``synk.backend()`` says which.
        start_timeout: seconds every rank has to start and, on GPUs, to join the NCCL
            communicator; past it ``WorkerStartError`` names what did not finish.
        seed: None (default: each worker's generators seeded as a fresh interpreter seeds
            them, from the OS), or a non-negative int: every rank, this process (rank 0)
            included, seeds Python's ``random``, numpy's global generator, torch's (when
            its function loads torch) and, on GPU ranks, CuPy's, with its own seed made
            from ``seed`` and its rank (numpy's ``SeedSequence([seed, rank])``), so that
            two runs give the same bits and no two ranks draw the same numbers; see
            [Random numbers](frameworks.md#random-numbers).

    ``restarts=N``: a call during which a worker dies (any signal, an exit, an OOM kill) or
    its GPU fails is run again, up to N times in all, on a new group of the same ranks,
    from the state every rank had when it began (see [When a rank
    dies](reliability.md#when-a-rank-dies)); each replacement warns with
    ``synk.RankReplacedWarning``. Under MPI the job's processes are fixed: ``restarts`` is
    refused with a warning and a death ends the job as without it.

    Returns:
        ``n``, the number of ranks.

    Raises:
        GpuUnavailableError: ``backend="gpu"`` without a usable CUDA device; the message
            says what is missing (CuPy, the driver, a visible device) and how to install it
            (``pip install "synk[gpu]"``).
        ValueError: under MPI, ``n`` differs from the number of processes of the job (the
            message says how many there are and how to launch more). Also: ``backend`` is
            not ``"auto"``, ``"cpu"`` or ``"gpu"``; ``devices`` names no visible device;
            ``n`` is not a
            positive ``int`` (a ``bool`` is refused too); or a ``SYNK_*`` variable is set
            to a value outside its range or form, ``SYNK_SIMULATE_GPUS`` included, whatever
            the ``backend`` (the message names the variable, its value and the valid range;
            see [Environment variables](api/environment.md)).
        SynkError: a working group already exists ("synk.fork() was
            already called; call synk.close() first"). A broken group (a worker died, or a
            call was interrupted) is closed and replaced instead. Under MPI: a second
            ``fork()`` in the job; a launcher without mpi4py ("pip install "synk[mpi]""); or
            a launcher whose tasks are not one MPI world (Slurm without ``--mpi=pmix``).
        WorkerStartError: a worker exited during start-up ("rank R failed to start (exit
            code C); its error output is above", chained from a ``WorkerDiedError``),
            raised an exception while starting (chained from it), failed the key check on
            its control channel ("rank R failed authentication ..."), or did not answer
            within 120 s.
    """
    group = PROCESS.group
    if group is not None:
        if group.broken is None and not group.closed:
            raise SynkError("synk.fork() was already called; call synk.close() first")
        close()  # the last group broke: clear it away and start afresh
    if not isinstance(restarts, int) or isinstance(restarts, bool) or restarts < 0:
        raise ValueError(f"restarts must be an int >= 0, got {restarts!r}")
    job = _mpi.detect()
    if job is not None:  # launched by mpiexec / srun: the job's processes are the ranks
        if job.rank != 0:
            job.serve()  # never returns: this process serves the master, then exits
        if restarts:
            warnings.warn(
                "synk.fork(restarts=...) is not available under MPI: the job's processes "
                "are fixed (mpiexec and srun start no process in their place), so a rank "
                "that dies ends the job with a typed error, as without it", RuntimeWarning,
                stacklevel=2)
        return _fork_mpi(job, n, backend, devices, start_timeout, seed)
    start_timeout, settings, gpu = _checked(n, backend, devices, start_timeout)
    seed = seeds.check(seed)
    ids = None
    if gpu:
        ids = discovery.device_ids(n, devices)
        n = len(ids)
    cores = _devices.cpu_count()
    if n is None:
        n = cores
    if n > cores:
        warnings.warn(
            f"synk.fork(n={n}) starts more ranks than the {cores} CPU cores available; "
            "they will share cores", RuntimeWarning, stacklevel=2,
        )
    return _start(lambda: Group(n, backend="cpu" if ids is None else "cuda", device_ids=ids,
                                settings=settings, start_timeout=start_timeout, seed=seed),
                  seed, restarts)


def _fork_mpi(job, n, backend, devices, start_timeout, seed) -> int:
    """``fork()`` in world rank 0 of an MPI job (see ``_engine/mpi.py``)."""
    try:
        start_timeout, settings, gpu = _checked(n, backend, devices, start_timeout)
        seed = seeds.check(seed)
        size = job.check_size(n)
        if devices is not None:
            devices = [int(d) for d in devices]
    except BaseException as err:
        job.refuse(f"{type(err).__name__}: {err}")  # the workers wait in fork(): release them
        raise
    launch = MpiLaunch(job, spin_us=settings.spin_us, devices=devices)
    return _start(lambda: Group(size, backend="cuda" if gpu else "cpu", settings=settings,
                                start_timeout=start_timeout, launch=launch, seed=seed), seed)


def _checked(n, backend: str, devices, start_timeout) -> tuple:
    """``fork()``'s arguments and the ``SYNK_*`` variables checked, locally and under MPI
    alike: (start_timeout in seconds, the settings, whether the backend is the GPU's)."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"n must be a positive int (ranks including the master), got {n!r}")
    start_timeout = check_timeout(start_timeout) or 1e6  # None: no limit (11 days)
    settings = _settings.read()
    gpu = discovery.resolve_backend(backend) == "gpu"
    if devices is not None and not gpu:
        raise ValueError("devices= picks CUDA devices, for backend='gpu' only")
    return start_timeout, settings, gpu


def _start(make_group, seed: int | None, restarts: int = 0) -> int:
    """Start the group ``make_group()`` builds, as this process's, rank 0's generators
    seeded from ``seed`` as the workers' are; returns its size. ``restarts``: how many times
    a broken group may be replaced by another of ``make_group()``'s (``_replaced``)."""
    _shm.sweep_orphans()
    generation = PROCESS.next_generation()
    with _sigterm_handled():
        group = make_group()
    group.generation = group.lineage = generation
    group.restarts_left = restarts
    group.replacement = lambda: _replaced(group, make_group)
    PROCESS.group_started(group, group.size)
    seeds.seed_rank(seed, 0, group.device)
    return group.size


def _replaced(old, make_group):
    """A new group of ``make_group()``'s in place of ``old``, which broke when a rank died:
    the old one stopped (the ``Data`` and the shared variables stay), the new one started in
    the same lineage, with one restart less. Rank 0's generators are not seeded again."""
    with _interrupts.deferred():
        PROCESS.group = None
        old.health.kill()
        replicas_to_host()
        PROCESS.group_ended()
    left = old.restarts_left - 1
    while True:
        generation = PROCESS.next_generation()
        try:
            with _sigterm_handled():
                group = make_group()
            break
        except WorkerStartError:  # (a rank of the new group died while it started: that
            if not left:  # costs a restart too; nothing of it is left running)
                raise
            left -= 1
    group.generation, group.lineage = generation, old.lineage
    group.restarts_left = left
    group.outstanding().carry(old.outstanding())
    group.replacement = lambda: _replaced(group, make_group)
    PROCESS.group_started(group, group.size)
    return group


def restarts_left() -> int:
    """How many more times the running group may be replaced after a rank dies
    (``fork(restarts=N)``); 0 when no group runs."""
    group = PROCESS.group
    return 0 if group is None else group.restarts_left


def close() -> None:
    """End the group and free all shared memory of this process.

    Asks every worker to exit, waits up to 5 seconds, then kills those that remain
    (SIGKILL); a broken group's workers are killed at once. Removes every shared-memory
    block of the group (staging and output blocks), and frees every live ``Data`` created
    by this process, even when no group is running: using one afterwards raises
    ``SynkError``. Restores the master's thread-pool limits and resets ``rank()`` to 0 and
    ``size()`` to 1, and SIGTERM's default action if ``fork()`` installed synk's handler;
    ``SYNK_MEAN`` is read again on its next use.

    Called while a call runs (from another thread, or from inside the call), it stops the
    group instead: the call raises ``GroupBrokenError``, and the group's descriptors are
    closed once that call has let go of them. In a child made by ``os.fork()`` it does
    nothing to the parent's group or ``Data`` (the child forgets them).

    Under MPI, once every worker has acknowledged, it finalizes MPI (``MPI_Finalize``) in
    this process too, so that the workers' processes end at once; MPI cannot be used
    afterwards.

    Idempotent, and registered with ``atexit``, so it also runs when the interpreter exits.
    ``fork()`` may be called again afterwards. Raises nothing of its own. Ctrl-C inside it
    cuts short its wait for the workers to exit; the group and the ``Data`` are released
    all the same, and then the ``KeyboardInterrupt`` is raised.
    """
    group = PROCESS.group
    try:
        PROCESS.group = None  # (an interrupt before this line leaves the group to close again)
        if group is not None and group.pid == os.getpid():
            inside = False  # called from inside the group's running call: it tears the
            try:  # group down once the call lets go of it
                inside = group.close()  # (its wait for the workers may be interrupted)
            finally:
                with _interrupts.deferred():  # what must be released is, Ctrl-C or not
                    if not inside:
                        group.health.kill()
                    replicas_to_host()
    finally:
        with _interrupts.deferred():
            free_all()
            PROCESS.group_ended()
            _settings.forget_mean_rule()
            _restore_sigterm()


def size() -> int:
    """The number of ranks in the running group, the same in the master and in the workers;
    1 when no group is running."""
    return PROCESS.size


def rank() -> int:
    """This process's rank: 0 in the master (with or without a group); in a worker, that
    worker's rank, so inside a synk function it tells which rank is running."""
    return PROCESS.rank


def xp(x):
    """The array module for ``x``: ``cupy`` for CuPy arrays (the simulator's stand-in for
    simulated ones), otherwise ``numpy`` (a ``Data`` included), so that one function body
    serves numpy and CuPy arrays."""
    return discovery.array_module(x)


def devices() -> list:
    """One entry per rank of the running group, in rank order: its CUDA device number on a
    GPU group, None on CPU ranks; ``[None]`` when no group is running."""
    group = PROCESS.group
    if group is None:
        return [None]
    return list(group.device_ids)


def backend() -> str:
    """One line saying which backend the running group uses, or which
    ``fork(backend="auto")`` would pick here, and why (e.g. "backend 'cpu': no GPU (CuPy is
    not installed ...)")."""
    group = PROCESS.group
    if group is not None and not group.closed:
        return group.describe()
    return discovery.describe()


def _on_sigterm(signum, frame) -> None:
    """SIGTERM (kill, timeout, job schedulers): stop the group and free shared memory as
    Ctrl-C would, then die by SIGTERM, as without this handler."""
    try:
        for _ in range(3):
            try:
                group = PROCESS.group
                if group is not None and group.pid == os.getpid():
                    group.terminate()
                _shm.release_owners()  # also a group that fork() or close() is part-way through
                free_all()
                break
            except BaseException:  # e.g. the watchdog's interrupt of the master's share,
                continue  # which lands here once a worker is gone: every step may be redone
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
        os.kill(os.getpid(), signal.SIGTERM)
        os._exit(128 + signal.SIGTERM)  # not reached: the signal ends the process


@contextlib.contextmanager
def _sigterm_handled():
    """Install ``_on_sigterm`` before a group starts (a SIGTERM while its workers start must
    remove its segments too), where SIGTERM still has its default action (a handler the user
    installed is left alone; only the main thread may set handlers); give SIGTERM its
    default back if the start fails."""
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    except BaseException:
        _restore_sigterm()
        raise


def _restore_sigterm() -> None:
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is _on_sigterm):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


atexit.register(close)  # (a child made by os.fork() forgets its parent's group: _process)
