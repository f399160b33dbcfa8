"""What every collective's module shares: a framework value handed to ``autograd``, a
result delivered into ``out=``, and the ops the reductions take."""
from __future__ import annotations

from ..._reduction import LOC_OPS, OPS
from .. import autograd
from ..algorithms import out as _out
from ..handle import Handle

WITH_LOC = OPS + LOC_OPS  # allreduce's, reduce's and scan's ops: the array ops, maxloc, minloc

def on(name: str, x, params: dict, **options):
    """The collective ``name`` on torch tensors or JAX arrays (``autograd.run``)."""
    return autograd.run(name, x, params, **options)


def into(result, out, what: str):
    """``result`` (or a Handle of it) delivered into ``out``, if given."""
    if out is None:
        return result
    if isinstance(result, Handle):
        return Handle(lambda: _out.deliver(result.wait(), out, what))
    return _out.deliver(result, out, what)
