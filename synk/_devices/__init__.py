"""The device layer: what a rank's arrays live on and the host it runs on. ``open(backend,
device_id)`` gives a rank its ``Device`` (``cpu``: numpy; ``cuda``: CuPy, or the CUDA simulator
under ``SYNK_SIMULATE_GPUS=N``), ``gpu_status()`` and ``describe()`` say what is available, and
``host_threads`` caps the BLAS/OpenMP threads of each rank.
"""
from .base import Device, TransferCounters
from .discovery import (
           GpuStatus,
           GpuUnavailableError,
           array_module,
           describe,
           gpu_status,
           open,
           require_gpu,
           resolve_backend,
)
from .host_threads import THREAD_VARS, MasterThreadLimit, cpu_count, threads_per_rank, worker_env

__all__ = ["THREAD_VARS", "MasterThreadLimit", "cpu_count",
           "threads_per_rank", "worker_env", "Device", "TransferCounters", "GpuStatus",
           "GpuUnavailableError", "array_module", "describe", "gpu_status", "open",
           "require_gpu", "resolve_backend"]
