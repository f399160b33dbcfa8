"""Shipping functions to the workers, again when what they captured changed (``captures``),
so that no worker computes with a stale copy; so too the master's JAX and torch settings
(``_arrays.framework_settings``), whenever they differ from the workers' last.
"""
from __future__ import annotations

from .._arrays import framework_settings, pickling_hint, shippable
from .._process import PROCESS
from .._wire import protocol as P
from .._wire.arrays import dumps_by_value
from ..errors import DistributeError
from . import replica_tensors
from .captures import Captures
from .kept import ask, install
from .port import Port


def stale(f) -> str | None:
    """What ``f`` (a ``Function``) captured that changed since it was shipped, or None
    (raises for a function the workers import by name whose globals changed)."""
    captures = getattr(f, "captures", None)
    return None if captures is None else captures.changed()


def ship(port: Port, functions: list) -> None:
    """Send ``functions`` to the workers in one pickle; on failure ship them one by one, so
    that the good ones arrive and the error names the ones that cannot."""
    try:
        _ship_now(port, functions)
        return
    except (TypeError, DistributeError) as err:
        if len(functions) == 1:
            functions[0].ship_error = err
            raise
    errors = []
    for f in functions:
        try:
            _ship_now(port, [f])
        except (TypeError, DistributeError) as err:
            f.ship_error = err
            errors.append(err)
    if errors:
        raise errors[0]


def _ship_now(port: Port, functions: list) -> None:
    entries = {f.fid: (shippable(f.fn), f.name, f.reduce) for f in functions}
    names = ", ".join(f.name for f in functions)
    found: dict = {}  # the shared variables of the shared modules' tensors captured
    reduce = None
    if PROCESS.replica_tensors:
        def reduce(obj):
            return replica_tensors.reduce_tensor(obj, found)
    try:
        blob = dumps_by_value(entries, reduce)
    except Exception as err:
        raise TypeError(f"cannot pickle {names} to ship it to the workers: {err}"
                        f"{pickling_hint(err)}") from err
    for f in functions:  # (after pickling: what pickling itself changes is no change)
        f.captures = Captures(f.fn, f.name, f.captures)
    forget = tuple(PROCESS.forgotten)
    del PROCESS.forgotten[:]
    if found:  # every rank's replicas as rank 0's, before the tensors are made over them
        variables = list(found.values())
        for variable in variables:
            variable._installed = -1
        install(port, variables)
    if port.size > 1:
        port.send(port.workers, P.request(P.SHIP, blob, forget),
                  "while shipping functions", port.clock.next_round())
        replies = port.recv(port.workers, "while shipping functions")
        for rank, reply in sorted(replies.items()):
            exc = P.failure(reply, rank)
            if exc is not None:
                raise DistributeError(f"could not ship {names} to the workers: {exc}") from exc
    for f in functions:
        f.shipped_generation = PROCESS.generation
        f.ship_error = None


def send_settings(port: Port) -> None:
    """The master's JAX and torch settings to the workers if they changed since they were
    last sent (read at every call: see ``framework_settings``)."""
    settings = framework_settings.read()
    if settings == port.framework_settings:
        return
    if port.size > 1:
        ask(port, port.workers, P.request(P.SETTINGS, settings),
            "while setting the workers' JAX and torch as the master's")
    port.framework_settings = settings
