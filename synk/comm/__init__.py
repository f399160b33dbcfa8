"""``synk.comm``: communication between the ranks from inside a synk function.

Call these only inside a function wrapped with ``synk.function``, while it runs: every
rank of the call takes part. Collectives must be called by every rank, in the same order.
Messages belong to their call: what one call sent cannot be received by the next.

    def step(x, w):
        g = grad(x, w)                      # this rank's rows
        g = synk.comm.allreduce(g, "sum")   # summed over every rank
        w -= lr * g

On CPU ranks a socketpair joins every two ranks, served by a progress thread in each rank,
and large arrays (128 KiB and more on 2 ranks, 64 KiB and more in larger groups) travel
through shared memory (``host/shm_channel.py``): the receiver reads them where the sender
put them. When all the ranks are on one host, ``allreduce`` and ``barrier`` meet on a shared
board instead (``host/shm_board.py``), with no message; between hosts the messages go over
MPI (``host/mpi_mesh.py``). On GPU ranks, device arrays are reduced and gathered on NCCL
(``nccl/``), on the rank's stream, and come back as device arrays; numpy arrays still take
the host communicator. Each function is one line: the communicator of its array
(``route``: the host one, NCCL, or the host-staged one, ``host/staged_comm.py``, all of the
one interface in ``communicator.py``) does it; what is written once over that interface
(the fused allreduce, rooted collectives, alltoall, groups) is in ``algorithms/``, and the
gradients through the collectives for torch and JAX in ``autograd/``.
If a rank's function raises, the other ranks' waits in that call raise ``CommAborted``.
A rank that skips a collective makes the others wait: give the call a ``timeout=``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .._reduction import LOC_OPS, OPS, canonical
from ..errors import CommAborted, CommError
from . import autograd, route as _route
from .algorithms import (
    alltoall as _alltoall,
    fused as _fused,
    groups as _groups,
    moves as _moves,
    out as _out,
    rooted as _rooted,
)
from .algorithms.groups import Group
from .context import require as _require
from .handle import Handle
from .host.mailbox import ANY
from .status import Status

_WITH_LOC = OPS + LOC_OPS  # allreduce's and reduce's ops: the array ops, maxloc and minloc
_STRUCTURES = (list, tuple, dict)  # what the fused allreduce takes apart (exactly these types)

__all__ = [
    "rank", "size", "allreduce", "broadcast", "allgather", "reduce_scatter", "send", "recv",
    "sendrecv", "iallreduce", "ibroadcast", "iallgather", "ireduce_scatter", "isend", "irecv",
    "barrier",
    "reduce", "ireduce", "gather", "igather", "scatter", "iscatter",
    "alltoall", "ialltoall", "scan", "iscan", "exscan", "iexscan", "split", "new_group",
    "Group",
    "broadcast_object", "allgather_object", "gather_object", "scatter_object",
    "probe", "iprobe", "ibarrier", "Status", "ANY", "ANY_SOURCE", "ANY_TAG",
    "Handle", "CommError", "CommAborted",
]


def _on(name: str, x, params: dict, **options):
    """``name`` on torch tensors or JAX arrays (``autograd``)."""
    return autograd.run(_PLAIN, name, x, params, **options)


def rank() -> int:
    """This rank's number in the running call (0 is the master)."""
    return _require("rank").rank


def size() -> int:
    """The number of ranks in the running call."""
    return _require("size").size


def allreduce(x: Any, op: str = "sum", *, weight: float | None = None, out=None) -> Any:
    """``x`` combined over every rank with ``op`` (``"sum"``, ``"prod"``, ``"max"``,
    ``"min"``, ``"mean"``; bitwise ``"band"``, ``"bor"``, ``"bxor"`` of integers and bools;
    logical ``"land"``, ``"lor"``, ``"lxor"``, giving bools; any case), on every rank.
    Booleans sum to counts, as in numpy. A device array (GPU ranks) is reduced on NCCL and
    the result is a device array (NCCL lacks the bitwise and logical ops: synk gathers the
    ranks' arrays on NCCL and combines them on the device).

    ``"maxloc"``, ``"minloc"`` (MPI's MAXLOC, MINLOC; one array or number, real, no
    ``weight``) give a pair ``(values, ranks)``: each element's largest (smallest) value
    and the lowest rank holding it, ``ranks`` int64 of ``x``'s shape and kind.

    ``x`` may also be a list, tuple or dict of arrays (nested too), such as a model's
    gradients: they are reduced in one fused buffer per dtype (one collective each, not
    one per array) and come back in the same structure. Every rank must pass the same
    structure.

    ``weight`` (with ``op="mean"``): this rank's share of the average, typically the rows
    it processed, so that uneven shares average exactly: the result is
    ``sum(weight_r * x_r) / sum(weight_r)``, for weights of any size. A rank with weight 0
    contributes nothing. A mean, weighted or not, is scaled and summed in ``x``'s own float
    dtype (float16's in float32), one collective of the data's own bytes, within a few ulps
    of float64's answer per rank; ``"exact_mean"`` accumulates in float64 on every back
    end, the same bits everywhere (see "How mean is computed").

        grads = synk.comm.allreduce(grads, "mean", weight=len(x))

    Python ints are combined as int64, as Python's: a sum or product past its range
    raises ``OverflowError`` rather than wrap.

    ``out``: an array (or a structure of them, as ``x``) of the result's shape and dtype
    to write the result into and return, e.g. ``x`` itself for an allreduce in place. Host
    arrays (into another array than ``x``) and NCCL (other ops than mean) write it there
    directly; elsewhere the result is copied into it.

    Raises:
        ValueError: the ranks passed different ops, shapes, dtypes or structures (on every
            rank, naming what each passed), ``op`` is unknown, ``weight`` is given with
            another op, is negative or not finite, or is given on some ranks only, the
            weights sum to 0, or ``out`` names the same memory twice.
        TypeError: an array is not numeric (bool, integers, floats, complex), is not of
            an integer or bool dtype for a bitwise op or is complex for maxloc/minloc, or
            device and host arrays are mixed.
        OverflowError: a sum or product of Python ints leaves int64's range.
    """
    return _allreduce(x, op, weight, out, True, "allreduce")


def iallreduce(x: Any, op: str = "sum", *, weight: float | None = None,
               out=None) -> Handle:
    """Non-blocking ``allreduce`` (structures and ``weight`` as there); ``wait()`` returns
    the result. On device arrays the reduction runs on NCCL's own stream while the rank's
    stream computes, and ``wait()`` waits on the CUDA event recorded after it (the small
    exchange that checks structures and weights is done before returning)."""
    return _allreduce(x, op, weight, out, False, "iallreduce")


def _allreduce(x, op: str, weight, out, wait: bool, what: str):
    op = canonical(op, _WITH_LOC)
    weight = _fused.check_weight(weight, op)
    if type(x) in _STRUCTURES and (out is None or not autograd.framed(out)):
        laid = _fused.known(x, op, weight is not None)
        if laid is not None:  # a structure laid out before: checked then
            return _into(_fused.allreduce(_route.for_arrays(laid[0], what), x, op, weight,
                                          wait=wait, laid=laid), out, what)
    if autograd.framed(x) or autograd.framed(out):
        return _on("allreduce", x, {"op": op, "weight": weight}, wait=wait, out=out,
                   direct=lambda v, o: allreduce(v, op, weight=weight, out=o))
    return _into(_fused.allreduce(_route.numbers(x, what, op), x, op, weight, wait=wait,
                                  out=out), out, what)


def _into(result, out, what: str):
    """``result`` (or a Handle of it) delivered into ``out``, if given (``_out``)."""
    if out is None:
        return result
    if isinstance(result, Handle):
        return Handle(lambda: _out.deliver(result.wait(), out, what))
    return _out.deliver(result, out, what)


def broadcast(x, root: int = 0, *, out=None) -> Any:
    """Rank ``root``'s ``x`` on every rank (the others may pass None); a device array
    everywhere when it is one at the root. ``x`` may be a list, tuple or dict of arrays
    (nested too), such as a model's parameters: they travel in one fused buffer, one
    collective in all, and every rank gets the same structure. ``out``: an array of the
    result's shape and dtype to receive it into (as ``allreduce``'s)."""
    if autograd.framed(x) or autograd.framed(out):
        return _on("broadcast", x, {"root": root}, out=out,
                   direct=lambda v, o: broadcast(v, root, out=o))
    got = _moves.broadcast(x, root, out=out)
    if out is not None:  # (the root's framework value, into this rank's buffer)
        got = autograd.unmarked(got, "broadcast")
    got = _into(got, out, "broadcast")
    return got if type(got) is np.ndarray and got.dtype.names is None else autograd.arrived(
        _PLAIN, "broadcast", got, {"root": root})


def ibroadcast(x, root: int = 0, *, out=None) -> Handle:
    """Non-blocking ``broadcast``; ``wait()`` returns the result."""
    if autograd.framed(x) or autograd.framed(out):
        return _on("broadcast", x, {"root": root}, wait=False, out=out,
                   direct=lambda v, o: broadcast(v, root, out=o))
    begun = _moves.broadcast(x, root, wait=False, out=out)
    handle = begun if out is None else Handle(lambda: _out.deliver(  # (as broadcast's)
        autograd.unmarked(begun.wait(), "ibroadcast"), out, "ibroadcast"))
    return Handle(lambda: autograd.arrived(_PLAIN, "broadcast", handle.wait(), {"root": root}))


def allgather(x, *, out=None) -> Any:
    """Every rank's ``x`` joined along axis 0 in rank order (lengths may differ; 0-d values
    become one row each), on every rank. ``x`` may be a list, tuple or dict of arrays (the
    same structure on every rank): each leaf is joined so, all of them in one fused
    collective. ``out``: an array of the result's shape and dtype to join the parts into
    (as ``allreduce``'s)."""
    if autograd.framed(x) or autograd.framed(out):
        return _on("allgather", x, {}, out=out, direct=lambda v, o: allgather(v, out=o))
    if isinstance(x, (list, tuple, dict)):
        return _into(_moves.allgather_structure(x), out, "allgather")
    return _into(_route.for_array(x, "allgather").allgather(x, out=out), out, "allgather")


def iallgather(x, *, out=None) -> Handle:
    """Non-blocking ``allgather``; ``wait()`` returns the result."""
    if autograd.framed(x) or autograd.framed(out):
        return _on("allgather", x, {}, wait=False, out=out,
                   direct=lambda v, o: allgather(v, out=o))
    if isinstance(x, (list, tuple, dict)):
        return _into(_moves.allgather_structure(x, wait=False), out, "iallgather")
    return _into(_route.for_array(x, "iallgather").iallgather(x, out=out), out, "iallgather")


def reduce_scatter(x, op: str = "sum", counts=None, *, out=None) -> np.ndarray:
    """Split ``x`` along axis 0 into one part per rank; rank r gets part r combined over
    every rank with ``op``. ``counts``: each rank's rows (MPI's ``recvcounts``: the same
    list on every rank, adding up to ``len(x)``); by default split as synk splits rows.
    ``x`` must be numeric (as for ``allreduce``), else TypeError. ``out``: an array of the
    result's shape and dtype to write it into (as ``allreduce``'s)."""
    op = canonical(op)
    if autograd.framed(x) or autograd.framed(out):
        return _on("reduce_scatter", x, {"op": op, "counts": autograd.counts(counts)},
                   out=out, direct=lambda v, o: reduce_scatter(v, op, counts, out=o))
    communicator = _route.numbers(x, "reduce_scatter", op)  # (its dtype first: numbers)
    bounds = _alltoall.reduce_scatter_bounds(x, counts, "reduce_scatter")
    return _into(communicator.reduce_scatter(x, op, bounds, out), out, "reduce_scatter")


def ireduce_scatter(x, op: str = "sum", counts=None, *, out=None) -> Handle:
    """Non-blocking ``reduce_scatter``; ``wait()`` returns the result."""
    op = canonical(op)
    if autograd.framed(x) or autograd.framed(out):
        return _on("reduce_scatter", x, {"op": op, "counts": autograd.counts(counts)},
                   wait=False, out=out, direct=lambda v, o: reduce_scatter(v, op, counts, out=o))
    communicator = _route.numbers(x, "ireduce_scatter", op)  # (its dtype first: numbers)
    bounds = _alltoall.reduce_scatter_bounds(x, counts, "ireduce_scatter")
    return _into(communicator.ireduce_scatter(x, op, bounds, out), out, "ireduce_scatter")


def alltoall(x, counts=None):
    """Rank r's part for rank p, on rank p, for every r and p: the pattern of sharded and
    expert-parallel models. ``x`` is a list of one array per rank (shapes and lengths may
    differ: MPI's ``Alltoallv``) and the result the list of what each rank sent this one, in
    rank order; or ``x`` is an array, split along axis 0 into one part per rank by
    ``counts`` (rows to each rank; by default as synk splits rows), and the result the rows
    received joined in rank order (torch.distributed's ``all_to_all_single``). Device
    arrays travel on NCCL (one group of sends and receives) and arrive as device arrays.

    Raises:
        ValueError: a list of another length, ``counts`` that do not add up to ``len(x)``,
            or ranks that pass different forms; on every rank.
    """
    if autograd.framed(x):
        return _on("alltoall", x, autograd.alltoall_params(x, counts))
    return _alltoall.alltoall(x, counts)


def ialltoall(x, counts=None) -> Handle:
    """Non-blocking ``alltoall``; ``wait()`` returns the result."""
    if autograd.framed(x):
        return _on("alltoall", x, autograd.alltoall_params(x, counts), wait=False)
    return _alltoall.alltoall(x, counts, wait=False)


def scan(x, op: str = "sum"):
    """``x`` combined with ``op`` over ranks 0 to r, on each rank r (an inclusive prefix
    reduction: MPI's ``Scan``). Ops, dtypes and shapes as ``allreduce``'s (no weights):
    ``"maxloc"``/``"minloc"`` give ``(values, ranks)`` over ranks 0 to r."""
    if autograd.framed(x):
        return _on("scan", x, {"op": canonical(op, _WITH_LOC), "exclusive": False})
    return _alltoall.scan(x, canonical(op, _WITH_LOC), exclusive=False)


def iscan(x, op: str = "sum") -> Handle:
    """Non-blocking ``scan``; ``wait()`` returns the result."""
    if autograd.framed(x):
        return _on("scan", x, {"op": canonical(op, _WITH_LOC), "exclusive": False},
                   wait=False)
    return _alltoall.scan(x, canonical(op, _WITH_LOC), exclusive=False, wait=False)


def exscan(x, op: str = "sum"):
    """``x`` combined with ``op`` over ranks 0 to r - 1, on each rank r, and None on rank 0
    (an exclusive prefix reduction: MPI's ``Exscan``)."""
    if autograd.framed(x):
        return _on("scan", x, {"op": canonical(op, _WITH_LOC), "exclusive": True})
    return _alltoall.scan(x, canonical(op, _WITH_LOC), exclusive=True)


def iexscan(x, op: str = "sum") -> Handle:
    """Non-blocking ``exscan``; ``wait()`` returns the result."""
    if autograd.framed(x):
        return _on("scan", x, {"op": canonical(op, _WITH_LOC), "exclusive": True},
                   wait=False)
    return _alltoall.scan(x, canonical(op, _WITH_LOC), exclusive=True, wait=False)


def reduce(x: Any, op: str = "sum", root: int = 0, *, weight: float | None = None) -> Any:
    """``x`` combined over every rank with ``op`` (as ``allreduce``: ops, ``weight=`` of a
    mean, dtypes), on rank ``root`` only; the other ranks get None. MPI's ``Reduce``,
    torch.distributed's ``reduce``. A device array is reduced on NCCL.

    Raises:
        ValueError: the ranks' shapes differ, ``root`` is not a rank, or weights are given
            on some ranks only; on every rank.
    """
    op = canonical(op, _WITH_LOC)
    weight = _fused.check_weight(weight, op)
    if autograd.framed(x):
        return _on("reduce", x, {"op": op, "root": root, "weight": weight})
    return _rooted.reduce(x, op, root, weight)


def ireduce(x: Any, op: str = "sum", root: int = 0, *, weight: float | None = None) -> Handle:
    """Non-blocking ``reduce``; ``wait()`` returns the result (None off the root)."""
    op = canonical(op, _WITH_LOC)
    weight = _fused.check_weight(weight, op)
    if autograd.framed(x):
        return _on("reduce", x, {"op": op, "root": root, "weight": weight}, wait=False)
    return _rooted.reduce(x, op, root, weight, wait=False)


def gather(x, root: int = 0):
    """Every rank's ``x`` joined along axis 0 in rank order, on rank ``root`` only (the
    others get None). Lengths may differ (MPI's ``Gatherv``); 0-d values are one row each;
    the other dimensions must agree, on every rank. torch.distributed's ``gather`` gives a
    list: ``np.split`` this at the ranks' lengths for one."""
    if autograd.framed(x):
        return _on("gather", x, {"root": root})
    return _rooted.gather(x, root)


def igather(x, root: int = 0) -> Handle:
    """Non-blocking ``gather``; ``wait()`` returns the result (None off the root)."""
    if autograd.framed(x):
        return _on("gather", x, {"root": root}, wait=False)
    return _rooted.gather(x, root, wait=False)


def scatter(chunks, root: int = 0):
    """Rank ``root``'s ``chunks[r]`` on each rank r: the root passes a list of one array
    per rank (their shapes may differ: MPI's ``Scatterv``), the others pass None. Device
    arrays at the root arrive as device arrays. torch.distributed's ``scatter``."""
    if autograd.framed(chunks):
        return _on("scatter", list(chunks), {"root": root})
    got = _rooted.scatter(chunks, root)
    return got if got.dtype.names is None else autograd.arrived(_PLAIN, "scatter", got,
                                                                {"root": root})


def iscatter(chunks, root: int = 0) -> Handle:
    """Non-blocking ``scatter``; ``wait()`` returns this rank's chunk."""
    if autograd.framed(chunks):
        return _on("scatter", list(chunks), {"root": root}, wait=False)
    handle = _rooted.scatter(chunks, root, wait=False)
    return Handle(lambda: autograd.arrived(_PLAIN, "scatter", handle.wait(), {"root": root}))


def broadcast_object(obj: Any, root: int = 0) -> Any:
    """Rank ``root``'s Python object (pickled) on every rank: metadata, shapes, dicts.
    mpi4py's ``bcast``, torch.distributed's ``broadcast_object_list``."""
    return _rooted.broadcast_object(obj, root)


def allgather_object(obj: Any) -> list:
    """Every rank's Python object (pickled), in rank order, on every rank. mpi4py's
    ``allgather``."""
    return _rooted.allgather_object(obj)


def gather_object(obj: Any, root: int = 0) -> list | None:
    """Every rank's Python object, in rank order, on rank ``root`` (None elsewhere).
    mpi4py's ``gather``."""
    return _rooted.gather_object(obj, root)


def scatter_object(objs, root: int = 0) -> Any:
    """Rank ``root``'s ``objs[r]`` (a list of one object per rank; None elsewhere) on each
    rank r. mpi4py's ``scatter``."""
    return _rooted.scatter_object(objs, root)


def barrier() -> None:
    """Wait until every rank of the call has reached this point."""
    _route.for_barrier().barrier()


def isend(x, dest: int, tag: int = 0) -> Handle:
    """Start sending array ``x`` to rank ``dest``; ``wait()`` returns once it is out.
    Do not change ``x`` before that. A device array is copied to the host first and
    arrives as a device array. ``dest`` may be this rank: the message is copied into its
    own mailbox at once. A torch tensor or a JAX array: ``wait()`` returns what ``send``
    does."""
    if autograd.framed(x):
        return _on("send", x, {"dest": dest, "tag": tag}, wait=False)
    return _route.host("isend").isend(_route.as_array(x, "isend"), dest, tag)


def send(x, dest: int, tag: int = 0) -> Any:
    """Send array ``x`` to rank ``dest`` (matched by ``recv(source, tag)`` there). Buffered,
    as MPI's: it returns once ``x`` is out or copied, even to this rank itself
    (``send(x, rank(), tag)``, then ``recv(rank(), tag)`` gets a copy of ``x``). ``tag``
    may not be ``ANY_TAG``.

    A torch tensor or a JAX array arrives as one, and ``send`` returns a 0-d zero of its
    framework (None for numpy arrays): add it to this rank's loss (``loss + sent``) so that
    autograd, on a rank that only sends, brings the receiver's gradient back to ``x``."""
    if autograd.framed(x):
        return _on("send", x, {"dest": dest, "tag": tag})
    isend(x, dest, tag).wait()
    return None


def irecv(source: int = ANY, tag: Any = ANY, *, status: Status | None = None) -> Handle:
    """Non-blocking ``recv``; ``wait()`` returns the array (and fills ``status`` in)."""
    if status is None and isinstance(source, (int, np.integer)) and source == ANY:
        status = Status()  # (a framework array's gradient goes back to its sender)
    handle = _route.host("irecv").irecv(source, tag, status)
    return Handle(lambda: autograd.received(_PLAIN, handle.wait(), source, status))


def recv(source: int = ANY, tag: Any = ANY, *, status: Status | None = None,
         like: Any = None) -> Any:
    """The next array sent to this rank by ``source`` with ``tag``, waiting for it (mpi4py's
    ``Recv``). ``ANY_SOURCE`` takes a message from any rank, ``ANY_TAG`` one with any tag
    (the defaults): the one that arrived first among those that match, and from one rank
    in the order it sent them. ``status`` (a ``Status``), if given, is filled in with the
    message's source, tag, shape and dtype. A device array sent arrives as a device array.

    ``like``: an array of the message's shape and dtype (its values are not used), and the
    result is of its kind: inside ``jax.jit``, where a receive must know its result's shape
    when JAX traces, a JAX array of that shape (mpi4jax's ``recv(x, source)``); the
    message's shape and dtype are checked against it. Under JAX's differentiation the
    result is a constant.

        status = synk.comm.Status()
        x = synk.comm.recv(synk.comm.ANY_SOURCE, status=status)
        synk.comm.send(x * 2, status.source)          # answer whoever sent it

    Raises:
        ValueError: ``source`` is not a rank; or it is this rank itself (or ``ANY_SOURCE``
            in a call of one rank) and no message from itself matches: nothing else could
            send one, so the wait would never end.
    """
    if like is not None:
        if _is_any(source) or _is_any(tag):
            raise ValueError("synk.comm.recv(like=...) takes a given source and tag (its "
                             "message is one rank's, in order), not ANY_SOURCE or ANY_TAG")
        return _on("recv_like", like, {"source": source, "tag": tag})
    return irecv(source, tag, status=status).wait()


def _is_any(value) -> bool:
    return isinstance(value, (int, np.integer)) and value == ANY


def sendrecv(x, dest: int, source: int | None = None, tag: int = 0, *,
             status: Status | None = None) -> Any:
    """Send ``x`` to rank ``dest`` and receive what rank ``source`` (default: ``dest``) sends
    this one with ``tag`` (MPI's ``Sendrecv``, mpi4jax's ``sendrecv``): halo and ring
    exchanges, which never deadlock. Differentiable on torch tensors and JAX arrays (under
    ``jax.jit`` too, where every rank must receive an array of ``x``'s shape)."""
    source = dest if source is None else source
    if autograd.framed(x):
        return _on("sendrecv", x, {"dest": dest, "source": source, "tag": tag})
    handle = isend(x, dest, tag)
    got = recv(source, tag, status=status)
    handle.wait()
    return got


ANY_SOURCE = ANY  #: ``recv``'s and ``probe``'s source for a message from any rank
ANY_TAG = ANY  #: their tag for a message with any tag (no message may be sent with it)


def probe(source: int = ANY, tag: Any = ANY) -> Status:
    """The ``Status`` (source, tag, shape, dtype) of the message ``recv(source, tag)``
    would take, waiting until one is in, without receiving it (mpi4py's ``Probe``):
    ``recv(status.source, status.tag)`` then gets that very message. Raises ``ValueError``
    as ``recv`` does when only this rank could send it."""
    return _route.host("probe").probe(source, tag)


def iprobe(source: int = ANY, tag: Any = ANY) -> Status | None:
    """``probe``'s ``Status`` if a matching message is in now (looking once, after
    receiving what has arrived), else None (mpi4py's ``Iprobe``)."""
    return _route.host("iprobe").iprobe(source, tag)


def ibarrier() -> Handle:
    """Non-blocking ``barrier``: ``wait()`` returns None once every rank has called
    ``ibarrier`` (MPI's ``Ibarrier``; torch.distributed's ``barrier(async_op=True)``).
    Like the other non-blocking collectives, every rank starts it in the same order."""
    return _route.for_barrier("ibarrier").ibarrier()


def split(color: Any, key: int = 0) -> Group | None:
    """Split the ranks into groups, one per ``color``: this rank's group, a ``Group`` of
    the ranks that passed the same color, numbered by ``key`` then by rank; None where
    ``color`` is None (MPI's ``UNDEFINED``). Every rank calls it (MPI's ``Comm.Split``).
    Groups from one split run their collectives independently, at the same time. A color
    is a value equal to itself (an int, a string): NaN raises ``ValueError`` on every rank.

        row = synk.comm.split(color=synk.comm.rank() // 2)
        partial = row.allreduce(x)      # over this rank's pair only
    """
    context = _groups.split(color, key)
    return None if context is None else Group(context)


def new_group(ranks) -> Group | None:
    """The ``Group`` of ``ranks`` (this call's ranks, numbered in the group in the order
    given), on its members; None on the other ranks. Every rank calls it, with the same
    list (torch.distributed's ``new_group``; MPI's ``Group.Incl`` then ``Comm.Create``)."""
    context = _groups.new_group(ranks)
    return None if context is None else Group(context)


for _name in ("rank", "size", "allreduce", "iallreduce", "broadcast", "ibroadcast",
              "allgather", "iallgather", "reduce_scatter", "ireduce_scatter", "reduce",
              "ireduce", "gather", "igather", "scatter", "iscatter", "alltoall", "ialltoall",
              "scan", "iscan", "exscan", "iexscan", "broadcast_object", "allgather_object",
              "gather_object", "scatter_object", "barrier", "ibarrier", "send", "isend",
              "recv", "irecv", "sendrecv", "probe", "iprobe", "split", "new_group"):
    setattr(Group, _name, _groups.method(globals()[_name]))
del _name


# What the rules of ``autograd`` call, on native arrays: synk.comm's own functions.
_PLAIN = autograd.plain(globals())
