"""What every collective's module shares: a framework value handed to ``autograd``, a
result delivered into ``out=``, and the ops the reductions take."""
from __future__ import annotations

from ... import _tree
from ..._reduction import LOC_OPS, OPS
from .. import autograd
from ..algorithms import out as _out
from ..handle import Handle

WITH_LOC = OPS + LOC_OPS  # allreduce's, reduce's and scan's ops: the array ops, maxloc, minloc

def on(name: str, x, params: dict, out=None, **options):
    """The collective ``name`` on torch tensors or JAX arrays (``autograd.run``); ``x`` and
    ``out`` taken apart here unless the collective did (``_tree.Flat``)."""
    if out is not None and type(out) is not _tree.Flat:
        out = _tree.apart(out)
    return autograd.run(name, x if type(x) is _tree.Flat else _tree.apart(x), params,
                        out=out, **options)


def into(result, out, what: str):
    """``result`` (or a Handle of it) delivered into ``out``, if given."""
    if out is None:
        return result
    flat = _tree.apart(out)
    if isinstance(result, Handle):
        return Handle(lambda: _out.deliver(result.wait(), flat, what))
    return _out.deliver(result, flat, what)
