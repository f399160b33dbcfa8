"""Fault injection (``SYNK_SIM_FAULTS``) for tests of code that must survive a GPU rank
failing."""
from __future__ import annotations

from ... import _settings

KINDS = tuple(_settings.FAULT_FIELDS)


def parse(spec: str) -> list[dict]:
    """``spec`` (``SYNK_SIM_FAULTS``'s form) as one dict per fault; a bad one raises
    ``ValueError`` naming ``SYNK_SIM_FAULTS``, the fault and the form.

    Faults are separated by commas, each ``kind:key=value:...``:

    * ``kill:rank=R:collective=K``: NCCL rank R kills itself (SIGKILL) as its K-th NCCL
      operation on a communicator starts (collectives and send/recv count; default K=1);
    * ``async_error:rank=R[:collective=K][:code=C]``: rank R's K-th operation fails
      asynchronously with NCCL result C (default 2, ncclSystemError): it never completes
      and ``check_async_error()`` raises, until the communicator is aborted. It fires once
      per process: communicators made afterwards (to recover) work;
    * ``cuda_error:rank=R[:collective=K][:code=C]``: rank R's K-th operation faults in its
      kernel with CUDA error C (default 700, cudaErrorIllegalAddress): a sticky error, so
      the device's queries never return cudaSuccess again and its later calls raise
      ``CUDARuntimeError(C)`` (the process must end, as on a GPU). Once per process;
    * ``hang_init:rank=R``: rank R's ``NcclCommunicator(...)`` never returns;
    * ``kill_init:rank=R``: rank R dies inside ``NcclCommunicator(...)``.

    R is a whole number >= 0, K and C >= 1; a kind takes only the fields listed for it. The
    parsing (shared with the check at ``synk.fork()``) is ``_settings.sim_faults``."""
    return _settings.sim_faults(spec)


_fired: set = set()  # asynchronous errors this process has raised (each fires once)


def find(kind: str, rank: int, op_number: int | None = None) -> dict | None:
    """The fault of ``kind`` set for NCCL ``rank`` (at its ``op_number``-th operation)."""
    for fault in _settings.sim_faults():
        if fault["kind"] == kind and fault["rank"] == rank:
            if op_number is None or fault.get("collective", 1) == op_number:
                key = tuple(sorted(fault.items()))
                if kind in ("async_error", "cuda_error"):
                    if key in _fired:
                        continue
                    _fired.add(key)
                return fault
    return None
