"""Simulated ``cupy.fft``: numpy.fft's functions as kernels on the current device (every
name CuPy's ``cupy.fft`` has, by the general mechanism: see ``_generic``)."""
from __future__ import annotations

from ._generic import NotModelledName, attribute

config = NotModelledName("cupy.fft.config", "cuFFT's plan cache is not modelled")


def __getattr__(name: str):
    return attribute("cupy.fft", name, globals())
