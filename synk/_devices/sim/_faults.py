"""Fault injection (``SYNK_SIM_FAULTS``) for tests of code that must survive a GPU rank
failing."""
from __future__ import annotations

from ... import _settings


def parse(spec: str) -> list[dict]:
    """``spec`` (``SYNK_SIM_FAULTS``'s form, ``_settings.FAULTS_FORM``) as one dict per fault,
    parsed by ``_settings.sim_faults``; a bad one raises ``ValueError`` naming the variable,
    the fault and the form. The kinds, at rank R's K-th NCCL operation on a communicator
    (send/recv count; default K=1):

    * ``kill``: SIGKILL as the operation starts;
    * ``async_error`` (code C, default ncclSystemError): the operation never completes and
      ``check_async_error()`` raises until the communicator is aborted;
    * ``cuda_error`` (code C, default 700, cudaErrorIllegalAddress): a sticky error of the
      device, whose later calls raise ``CUDARuntimeError(C)``;
    * ``hang_init`` / ``kill_init``: ``NcclCommunicator(...)`` never returns / dies.

    The two errors fire once per process, so communicators made to recover work."""
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
