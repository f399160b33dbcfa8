"""The simulator's exceptions: CUDA's and NCCL's own (same class names, status codes and
message shapes as CuPy's), and the simulator's, for the bugs a GPU would show as a hang, a
silently wrong number or an unsupported call."""
from __future__ import annotations

# cudaGetErrorName / cudaGetErrorString for the codes the simulator raises (CUDA 12).
CUDA_ERRORS = {
    1: ("cudaErrorInvalidValue", "invalid argument"),
    100: ("cudaErrorNoDevice", "no CUDA-capable device is detected"),
    101: ("cudaErrorInvalidDevice", "invalid device ordinal"),
    400: ("cudaErrorInvalidResourceHandle", "invalid resource handle"),
    600: ("cudaErrorNotReady", "device not ready"),
    700: ("cudaErrorIllegalAddress", "an illegal memory access was encountered"),
    712: ("cudaErrorHostMemoryAlreadyRegistered",
          "part or all of the requested memory range is already mapped"),
    713: ("cudaErrorHostMemoryNotRegistered",
          "pointer does not correspond to a registered memory region"),
    716: ("cudaErrorMisalignedAddress", "misaligned address"),
}

# ncclResult_t names as CuPy 14.2 spells them (its ``ERROR2`` table, codes 0-6 only: CuPy's
# NcclError(7) (ncclInProgress) and NcclError(8) raise KeyError, cupy_backends/cuda/libs/
# nccl.pyx), and ncclGetErrorString.
NCCL_ERRORS = {
    1: ("NCCL_ERROR_UNHANDLED_CUDA_ERROR",
        "unhandled cuda error (run with NCCL_DEBUG=INFO for details)"),
    2: ("NCCL_ERROR_SYSTEM_ERROR", "unhandled system error (run with NCCL_DEBUG=INFO for details)"),
    3: ("NCCL_ERROR_INTERNAL_ERROR",
        "internal error - please report this issue to the NCCL developers"),
    4: ("NCCL_ERROR_INVALID_ARGUMENT", "invalid argument (run with NCCL_DEBUG=WARN for details)"),
    5: ("NCCL_ERROR_INVALID_USAGE", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
    6: ("NCCL_ERROR_REMOTE_ERROR", "remote process exited or there was a network error"),
}
ncclUnhandledCudaError, ncclSystemError = 1, 2
ncclInvalidArgument, ncclInvalidUsage, ncclRemoteError = 4, 5, 6


class CUDARuntimeError(RuntimeError):
    """A CUDA runtime call failed (``status``: the cudaError_t code)."""

    def __init__(self, status):
        self.status = status
        name, text = CUDA_ERRORS.get(status, ("cudaErrorUnknown", "unknown error"))
        super().__init__(f"{name}: {text}")

    def __reduce__(self):
        return (_rebuilt, (type(self), self.status, self.args[0]))


class NcclError(RuntimeError):
    """An NCCL call failed (``status``: the ncclResult_t code). As CuPy 14.2's, a status
    outside its table (7: ncclInProgress, 8) raises ``KeyError`` instead."""

    def __init__(self, status):
        self.status = status
        name, text = NCCL_ERRORS[status]  # KeyError for 7 and 8, as CuPy's ERROR2[status]
        super().__init__(f"{name}: {text}")

    def __reduce__(self):
        return (_rebuilt, (type(self), self.status, self.args[0]))


def _rebuilt(cls, status: int, message: str):
    """An unpickled error of ``cls``: its status, and the message it was raised with."""
    err = cls(status)
    err.args = (message,)
    return err


def cuda_error(status: int, detail: str = "") -> CUDARuntimeError:
    """CUDA's error, with the simulator's explanation after CUDA's own message."""
    return _explained(CUDARuntimeError(status), detail)


def nccl_error(status: int, detail: str = "") -> NcclError:
    """NCCL's error, with the simulator's explanation after NCCL's own message."""
    return _explained(NcclError(status), detail)


def _explained(err, detail: str):
    if detail:
        err.args = (f"{err.args[0]} [simulator: {detail}]",)
    return err


class SimulatorError(RuntimeError):
    """A bug the CUDA simulator caught that a real GPU would not report as an error."""


class RaceError(SimulatorError):
    """Memory written (or read) on one stream is used on another with no event wait or
    synchronisation in between: on a GPU the result would depend on timing."""


class SimulatedHang(SimulatorError, TimeoutError):
    """A wait that would never return on a GPU (a collective some rank never joins, a send
    whose receive never comes); raised after ``SYNK_SIM_HANG_TIMEOUT`` seconds instead."""


class NotModelled(SimulatorError, NotImplementedError):
    """The simulator does not model this CuPy feature (CuPy itself may have it)."""
