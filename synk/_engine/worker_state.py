"""What a worker holds between messages, and how it answers each one."""
from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import cloudpickle

from .._arrays import framework_settings, seeds
from .._call import collect as _collect, kept as _kept, share as _share
from .._call.bound_values import WorkerKept
from .._call.collect import InlineOutputs, ScratchOutputs
from .._call.mpi_collect import MpiOutputs
from .._call.rank_copies import Copies, Keep, touch_arguments
from .._call.records import Marks, ShareTask, Shipped
from .._call.share import RankEnv
from .._devices import host_threads
from .._devices.discovery import open as open_device
from .._process import PROCESS
from .._wire import protocol as P, ring as _ring, shm as _shm
from .._wire.data_updates import apply_updates
from .._wire.shm import ATTACHED
from ..comm.communicators import communicator_class
from ..comm.host.shm_mesh import Mesh
from ..errors import DistributeError
from . import whereabouts


class WorkerState:
    """This rank's device, functions shipped so far, mapped blocks, its output scratch
    block and its communicators."""

    def __init__(self, init: P.Init, job=None) -> None:
        """``job``: this process's ``mpi.Job`` when it is an MPI process (``init.mpi``)."""
        if init.cores is not None:  # (before JAX starts: XLA sizes its pool by them)
            host_threads.bind_process(init.cores)
        framework_settings.prepare_worker(init.backend, init.device_id)  # (before JAX starts)
        self.device = open_device(init.backend, init.device_id)
        self.device.bind()  # first: before any allocation, stream or communicator
        seeds.seed_rank(init.seed, init.rank, self.device)
        self.whereabouts = whereabouts.attach(init.whereabouts, init.rank)
        self.device_comm = None  # the device communicator (NCCL), once joined
        self.rank, self.size = init.rank, init.size
        self.functions: dict[int, Shipped] = {}
        self.kept = WorkerKept()  # the values of bound steps
        self.copies = Copies(init.rank)  # its replicas' copies, for a replacement group
        self.scratch = _shm.Scratch(
            init.prefix if job is None else job.scratch_prefix(init.prefix),
            f"r{init.rank}-out", f"rank {init.rank}'s outputs")
        for fd in init.peers.values():  # not for processes the user's functions start
            os.set_inheritable(fd, False)
        socks = {peer: socket.socket(fileno=fd) for peer, fd in init.peers.items()}
        self.ring = None if init.ring is None else _ring.attach(init.ring, 1, _ring.CONTROL_RING)
        self.mesh = Mesh(init.rank, init.size, socks, init.spin_s, init.prefix,
                         init.mesh_rings, init.mesh_board) if socks else None
        self.outputs: Any = ScratchOutputs(self.scratch, init.inline_output_bytes)
        self.progress: Callable[[], None] | None = None  # poked while waiting (MPI)
        if init.mpi is not None:  # an MPI process: synk.comm on MPI, inputs by host
            mesh = self.mesh = job.start_rank(init)
            self.progress = mesh.progress
            if job.collectives is not None:  # across hosts: outputs by MPI's collectives
                self.outputs = MpiOutputs(job.collectives, init.rank,
                                          init.inline_output_bytes, pack=True)
        PROCESS.became_worker(init.rank, init.size)
        self._env: RankEnv | None = None  # where a share runs here (``_call``)
        self._handlers: dict[str, Callable[..., Any]] = {  # (CALL's comes first in handle)
            P.REDUCE: self._reduce, P.SHIP: self._ship, P.COMM: self._join,
            P.SETTINGS: framework_settings.apply}

    def handle(self, data) -> tuple[bytes | None, bool]:
        """Answer the request ``data`` (its id, then the pickled request); returns the
        reply and whether to keep going."""
        rid = P.rid_of(data)
        remote = PROCESS.host_copies
        if remote is not None:
            remote.rid = rid  # the host's copies of this request's inputs are awaited
        try:
            msg = P.read(data)
            tag = msg[0]
            if tag == P.CALL:  # (the hot path first)
                return P.reply(rid, self._call(rid, *msg[1:])), True
            if tag == P.FILL:
                remote.mirrors.fill(rid, *msg[1:])
                return None, True
            if tag == P.COMBINE:
                self._collectives(self.outputs.combine, msg[1])
                return None, True
            if tag == P.EXIT:
                return None, False
            if tag == P.SHARED:
                self._shared(rid, *msg[1:])
                return P.reply(rid, None), True
            handler = self._handlers.get(tag)
            if handler is None:
                raise ValueError(f"unknown message {tag!r}")
            return P.reply(rid, handler(*msg[1:])), True
        except Exception as exc:
            return P.error_reply(rid, exc, self.rank, self.comm_state()), True

    def comm_state(self) -> str:
        """"poisoned", "aborted" or "" (see ``P.error_reply``)."""
        device_comm = self.device_comm
        if device_comm is None:
            return ""
        return "poisoned" if device_comm.poisoned else "aborted" if device_comm.aborted else ""

    def replied(self) -> None:
        """The reply is out: under MPI across hosts, the collectives of the call's large
        outputs that its CALL planned."""
        if isinstance(self.outputs, MpiOutputs) and self.outputs.expected is not None:
            self._collectives(self.outputs.settle)

    def _collectives(self, run, *args) -> None:
        """Under MPI across hosts: the collectives of the last call's large outputs. The other ranks
        wait in them for this one, and no reply says it failed: a failure here (never an error of
        the user's) ends this process, so that the master reports its death rather than wait."""
        try:
            run(*args)
        except BaseException:
            traceback.print_exc()
            print(f"synk worker (rank {self.rank}): combining the outputs with the other "
                  "ranks failed; this rank ends, the group with it", file=sys.stderr,
                  flush=True)
            _shm.release_owners()
            os._exit(70)

    def _reduce(self, tasks) -> float:
        """Phase two of combining large outputs (``_call.collect``); its seconds."""
        start = time.perf_counter()
        _collect.run_tasks(tasks)
        return time.perf_counter() - start

    def _shared(self, rid: int, items, drop, keep=None) -> None:
        PROCESS.touched.clear()
        with _share.on_device(self.device, self.rank):
            _kept.apply(items, drop, device=self.device)
            self.copies.forget(drop)
            self.copies.keep(keep, rid, self.device)

    def _ship(self, blob: bytes, forget: tuple) -> None:
        for fid in forget:
            self.functions.pop(fid, None)
        try:
            self.functions.update({fid: Shipped(*entry)
                                   for fid, entry in cloudpickle.loads(blob).items()})
        except Exception as exc:
            hint = (" A function must only use modules that the workers can import too (same "
                    "Python, same sys.path)." if isinstance(exc, (ImportError, AttributeError))
                    else "")
            raise DistributeError(
                f"rank {self.rank} failed to unpickle it: {exc!r}.{hint}") from exc

    def _join(self, how: tuple, seconds: float) -> None:
        """Make the device communicator ``how`` (("nccl", id made by rank 0) or
        ("staged",)), replacing this rank's old one."""
        if self.device_comm is not None:
            old, self.device_comm = self.device_comm, None
            old.abort("replaced")
        mesh = self.mesh
        self.device_comm = communicator_class(how[0]).join(
            self.device, how, self.size, self.rank, deadline=time.monotonic() + seconds,
            should_stop=None if mesh is None else mesh.stop_reason,
            setup_stop=None if mesh is None else mesh.gone_reason, exit_when_poisoned=True)

    def _call(self, call_id: int, task_fields: tuple, updates: tuple,
              plan: tuple | None = None, keep: Keep | None = None) -> tuple:
        """Run this rank's share of call ``call_id`` (its CALL's request id: a ``ShareTask``'s
        wire tuple, and the updates of ``Data`` to apply first; under MPI across hosts maybe
        the plan of its outputs' collectives, run once the reply is out, whatever the share
        does); a ``P.CallReply`` as a tuple."""
        PROCESS.touched.clear()
        task = self._task(call_id, task_fields, updates, plan, keep)
        marks = Marks() if task.profile else None
        moved = self.device.transfer_counts() if marks is not None else {}
        try:
            ran: Any = _share.run(self._share_env(task), self.functions[task.fid], task, marks)
        finally:  # (its replicas as the call left them, failed or not)
            with _share.on_device(self.device, self.rank):
                self.copies.keep(keep, call_id, self.device)
        result, shares = (None, tuple(None if r.share is None else r.share.wire()
                                      for r in ran)) if task.steps is not None else (
            ran, None if ran.share is None else ran.share.wire())  # (steps: each's share)
        timing = None if marks is None or result is None else marks.record(
            time.perf_counter(), result.combining, moved, self.device.transfer_counts())
        scratch = self.scratch
        return P.call_reply(share=shares,
                            retired=scratch.take_retired() if scratch.has_retired() else [],
                            timing=timing,
                            comm="" if self.device_comm is None else self.comm_state(),
                            ended=time.monotonic())

    def _task(self, call_id: int, task_fields: tuple, updates: tuple, plan: tuple | None,
              keep: Keep | None) -> ShareTask:
        """Call ``call_id``'s task, ready to run: the ``Data`` updates applied, its arguments
        touched where its replicas are kept, its outputs' ``plan`` expected."""
        try:
            released, moved_data, left = updates
            if released or moved_data or left:  # (first: what it keeps may map those blocks)
                self.kept.clear()
                if released or moved_data:
                    apply_updates(released, moved_data)
                if released or left:
                    _kept.forget(left, released)
            task = ShareTask.from_wire(task_fields, call_id, self.kept)
            if keep is not None:
                touch_arguments(task.args, task.kwargs)
            if plan is not None:
                self.outputs.expect(plan, call_id)
        except Exception as exc:  # (e.g. a block gone from /dev/shm): before the share, so
            if self.mesh is not None:  # the other ranks hear of it, as of a failed share,
                self.mesh.abort(call_id, f"{type(exc).__name__}: {exc}")  # not wait in one
            raise
        return task

    def _share_env(self, task: ShareTask) -> RankEnv:
        """This rank's ``RankEnv`` for ``task`` (made anew with the device communicator)."""
        env = self._env
        if env is None or env.device_comm is not self.device_comm:  # (made anew by _join)
            env = self._env = RankEnv(self.rank, self.size, self.device, self.mesh,
                                      self.device_comm, self.outputs)
        if task.inline_outputs:  # (a submitted call's)
            env = env._replace(outputs=InlineOutputs)
        return env

    def close(self) -> None:
        self.copies.close()
        if self.device_comm is not None:
            self.device_comm.abort("the group is closing")
        self.device.close()
        if self.mesh is not None:
            self.mesh.stop()
        if self.ring is not None:
            self.ring.close()
        remote, PROCESS.host_copies = PROCESS.host_copies, None
        if remote is not None:
            remote.close()
        ATTACHED.release_all()
        self.scratch.destroy()
        sys.stdout.flush()

