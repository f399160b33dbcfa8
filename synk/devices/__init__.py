"""The device layer: what a rank's arrays live on, and the host it runs on.

``host`` knows the CPU cores and caps the BLAS/OpenMP threads of each rank.
"""
from .host import (
    THREAD_VARS,
    MasterThreadLimit,
    choose_backend,
    cpu_count,
    threads_per_rank,
    worker_env,
)

__all__ = ["THREAD_VARS", "MasterThreadLimit", "choose_backend", "cpu_count",
           "threads_per_rank", "worker_env"]
