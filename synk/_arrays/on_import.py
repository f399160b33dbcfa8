"""Code run right after a module is first imported in this process (``when_imported``): how a
worker sets up a framework when its function loads it, and never loads one for that alone.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
import warnings
from collections.abc import Callable

_LOCK = threading.Lock()
_WAITING: dict[str, dict] = {}  # module name -> {key: what to run once it is imported}


def when_imported(name: str, key: str, fn: Callable) -> None:
    """``fn(module)`` now if top-level module ``name`` is imported, else right after the first
    ``import name`` runs the module's code (``_Finder``), replacing what waits under ``key``.
    An error now is raised; one at the import is a ``RuntimeWarning`` (raising there would fail
    an import whose C extensions stay loaded)."""
    module = sys.modules.get(name)
    if module is not None and not _initializing(module):
        fn(module)
        return
    with _LOCK:
        _WAITING.setdefault(name, {})[key] = fn
        if _FINDER not in sys.meta_path:
            sys.meta_path.insert(0, _FINDER)


def _initializing(module) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _run_waiting(name: str, module) -> None:
    with _LOCK:
        waiting = _WAITING.pop(name, {})
        if not _WAITING and _FINDER in sys.meta_path:
            sys.meta_path.remove(_FINDER)
    for fn in waiting.values():
        try:
            fn(module)
        except Exception as err:
            warnings.warn(f"{type(err).__name__}: {err}", RuntimeWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module something waits for, the spec the finders after
    it give, its loader's ``exec_module`` wrapped for this import."""

    def find_spec(self, name, path, target=None):
        if name not in _WAITING:  # (every import of the process passes here: the fast way)
            return None
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec  # (no code of its own to run: a namespace package)

        def run(module):
            if getattr(module, "__name__", None) != name:  # (a loader shared with others)
                return exec_module(module)
            try:
                exec_module(module)
            finally:
                with contextlib.suppress(AttributeError):
                    del loader.exec_module  # (the loader's own method again)
            _run_waiting(name, sys.modules.get(name, module))
            return None

        with contextlib.suppress(AttributeError, TypeError):  # (a loader that cannot be wrapped)
            loader.exec_module = run  # (this loader instance only, for this import)
        return spec


_FINDER = _Finder()
