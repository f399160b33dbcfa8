"""CuPy arrays at synk's edge: they are native (GPU ranks compute on them), so this adapter
only hands device memory between CuPy and the frameworks, through DLPack, without a copy
(``cupy.from_dlpack``, the frameworks' ``from_dlpack``). A simulated device's arrays (the
CUDA simulator's) have no DLPack: frameworks get them through the host."""
from __future__ import annotations


def from_framework(x):
    """The CuPy array over a framework's CUDA array ``x`` (its memory, its device)."""
    import cupy  # (a CUDA tensor or array: CuPy is installed, with synk's gpu extra)

    return cupy.from_dlpack(x)


def is_real(value) -> bool:
    """Whether ``value`` is a real CuPy array (not the simulator's), which DLPack hands to
    a framework."""
    return type(value).__module__.split(".", 1)[0] == "cupy"
