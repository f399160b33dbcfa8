"""The one handle of a non-blocking operation, whichever communicator runs it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Handle:
    """A non-blocking operation under way, returned by the ``i...`` forms.

    ``wait()`` finishes it and returns its result, the same one on every call. Do not change
    an array being sent or reduced until ``wait()`` has returned.
    """

    __slots__ = ("_finish", "_done", "_result")
    _finish: Callable[[], Any] | None  # None once the operation has finished

    def __init__(self, finish: Callable[[], Any]) -> None:
        self._finish, self._done, self._result = finish, False, None

    @classmethod
    def done(cls, value: Any) -> Handle:
        """An operation that finished before it was returned."""
        handle = cls(None)  # type: ignore[arg-type]
        handle._done, handle._result = True, value
        return handle

    def wait(self) -> Any:
        """Finish the operation and return its result."""
        if not self._done:
            assert self._finish is not None
            self._result, self._done = self._finish(), True
            self._finish = None  # (let go of what the operation held)
        return self._result


def then(result, finish: Callable[[Any], Any], wait: bool):
    """``finish(result)``, or a Handle of it when ``result`` is one (``wait=False``)."""
    if wait:
        return finish(result)
    return Handle(lambda: finish(result.wait()))
