"""What a receive or a probe of ``synk.comm`` found out about a message."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .host.mailbox import ANY


class Status:
    """A message's envelope, as mpi4py's ``MPI.Status``: ``source`` (the rank that sent
    it), ``tag``, and the ``shape`` and ``dtype`` of the array it holds (as the receiver
    gets it: a device array's for one sent from a device), with ``count`` its number of
    elements. ``probe`` returns one; ``recv(..., status=s)`` fills ``s`` in. Until then
    ``source`` and ``tag`` are ``ANY`` and ``dtype`` None."""

    __slots__ = ("source", "tag", "shape", "dtype")

    def __init__(self) -> None:
        self.source: int = ANY
        self.tag: Any = ANY
        self.shape: tuple = ()
        self.dtype: np.dtype | None = None

    @property
    def count(self) -> int:
        """The number of elements of the message's array (0 before one is described)."""
        return 0 if self.dtype is None else math.prod(self.shape)

    def __repr__(self) -> str:
        return (f"Status(source={self.source}, tag={self.tag!r}, shape={self.shape}, "
                f"dtype={self.dtype})")
