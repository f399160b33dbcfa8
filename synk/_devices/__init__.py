"""The device layer: what a rank's arrays live on and the host it runs on. ``open(backend,
device_id)`` gives a rank its ``Device`` (``cpu``: numpy; ``cuda``: CuPy, or the CUDA simulator
under ``SYNK_SIMULATE_GPUS=N``), ``gpu_status()`` and ``describe()`` say what is available, and
``host_threads`` caps the BLAS/OpenMP threads of each rank.
"""
from .discovery import (
           GpuUnavailableError,
           array_module,
           describe,
           gpu_status,
           open,
           resolve_backend,
)

__all__ = ["GpuUnavailableError", "array_module", "describe", "gpu_status", "open",
           "resolve_backend"]
