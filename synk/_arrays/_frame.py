"""``Frame``: what a framework value was, to give it back as such."""
from __future__ import annotations


class Frame:
    """What a framework value was, to give it back as such: ``kind`` ("torch", "jax"),
    its dtype's name ("float32", "bfloat16"), its device ("cpu", "cuda:1"), and ``grad``:
    it requires grad (torch) or is traced by a JAX transformation. Not a tuple, so that a
    structure of frames (``natives``) keeps each one as a leaf."""

    __slots__ = ("kind", "dtype", "device", "grad")

    def __init__(self, kind: str, dtype: str, device: str, grad: bool = False) -> None:
        self.kind, self.dtype, self.device, self.grad = kind, dtype, device, bool(grad)

    def _fields(self) -> tuple:
        return (self.kind, self.dtype, self.device, self.grad)

    def replace(self, **changes) -> Frame:
        fields = dict(zip(self.__slots__, self._fields()), **changes)
        return Frame(**fields)

    def __eq__(self, other) -> bool:
        return isinstance(other, Frame) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __reduce__(self):
        return Frame, self._fields()

    def __repr__(self) -> str:
        return f"Frame{self._fields()}"


_MADE: dict = {}  # fields: the Frame of them, for the few a process meets


def frame_of(kind: str, dtype: str, device: str, grad: bool = False) -> Frame:
    """The ``Frame`` of these fields, made once per process (a call's frames cross the wire
    as their fields, and a rank reads them back at every call; frames are never changed)."""
    fields = (kind, dtype, device, grad)
    frame = _MADE.get(fields)
    if frame is None:
        if len(_MADE) >= 1024:
            _MADE.clear()
        frame = _MADE[fields] = Frame(*fields)
    return frame
