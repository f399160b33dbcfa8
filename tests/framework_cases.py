"""The gradient cases of the torch and JAX tests: each synk.comm operation on every rank's
input, and the same operation written in one process over every rank's input at once, so
that each rank's gradient of the sum of every rank's loss (mpi4torch's convention) can be
checked against the single-process one.

A case gives, for rank r of n, its input (``inputs``) and what the rank computes from it
with synk.comm (``ranked``); the reference computes every rank's output from all the
inputs with plain array math (``whole``). Every rank's loss is ``sum(out_r * c_r)`` with
coefficients ``c_r`` drawn from the rank's seed, so that each gradient differs."""
import numpy as np


def rows(r: int) -> int:
    return r + 1  # uneven: rank r has r + 1 rows


def inputs(case: str, r: int, n: int) -> list:
    """Rank r's inputs (numpy float64) for ``case``."""
    rng = np.random.default_rng(1000 + 17 * r + n)
    shape = {"allgather": (rows(r), 2), "gather": (rows(r), 2)}.get(case, (n + 2, 3))
    if case == "scatter":
        return [rng.standard_normal((rows(p), 2)) for p in range(n)] if r == 0 else []
    if case == "alltoall_list":
        return [rng.standard_normal((p + r + 1, 2)) for p in range(n)]
    if case == "alltoall_counts":
        return [rng.standard_normal((sum(_counts(r, n)), 2))]
    if case == "dict":
        return [rng.standard_normal((2, 3)), rng.standard_normal(4)]
    return [rng.standard_normal(shape)]


def _counts(r: int, n: int) -> list:
    return [(r + p) % 3 for p in range(n)]  # rows rank r sends to each rank


def reduce_scatter_counts(n: int) -> list:
    return [p + 1 for p in range(n)][:n - 1] + [n + 2 - sum(range(1, n))]


CASES = ["allreduce_sum", "allreduce_mean", "allreduce_weighted", "dict", "broadcast",
         "broadcast_none", "reduce_sum", "reduce_mean", "allgather", "reduce_scatter",
         "reduce_scatter_mean", "scatter", "gather", "alltoall_list", "alltoall_counts",
         "scan", "exscan", "sendrecv", "send_recv", "isend_irecv", "iallreduce"]


def ranked(comm, case: str, xs: list, r: int, n: int):
    """What rank r computes with ``comm`` (synk.comm) from its inputs ``xs`` (framework
    values); a list of outputs, the last a value to add to the loss as it is (or None)."""
    nxt, prv = (r + 1) % n, (r - 1) % n
    if case == "allreduce_sum":
        return [comm.allreduce(xs[0])]
    if case == "allreduce_mean":
        return [comm.allreduce(xs[0], "mean")]
    if case == "allreduce_weighted":
        return [comm.allreduce(xs[0], "mean", weight=r + 1)]
    if case == "dict":
        got = comm.allreduce({"a": xs[0], "b": xs[1]})
        return [got["a"], got["b"]]
    if case == "broadcast":
        return [comm.broadcast(xs[0], root=1 % n)]
    if case == "broadcast_none":
        return [comm.broadcast(xs[0] if r == 1 % n else None, root=1 % n)]
    if case == "reduce_sum":
        return [comm.reduce(xs[0], "sum", root=0)]
    if case == "reduce_mean":
        return [comm.reduce(xs[0], "mean", root=n - 1)]
    if case == "allgather":
        return [comm.allgather(xs[0])]
    if case == "reduce_scatter":
        return [comm.reduce_scatter(xs[0], "sum", counts=reduce_scatter_counts(n))]
    if case == "reduce_scatter_mean":
        return [comm.reduce_scatter(xs[0], "mean")]
    if case == "scatter":
        return [comm.scatter(xs if r == 0 else None, root=0)]
    if case == "gather":
        return [comm.gather(xs[0], root=1 % n)]
    if case == "alltoall_list":
        return list(comm.alltoall(xs))
    if case == "alltoall_counts":
        return [comm.alltoall(xs[0], counts=_counts(r, n))]
    if case == "scan":
        return [comm.scan(xs[0])]
    if case == "exscan":
        return [comm.exscan(xs[0])]
    if case == "sendrecv":
        return [comm.sendrecv(xs[0], nxt, prv)]
    if case == "send_recv":
        sent = comm.send(xs[0], nxt, tag=5)
        return [comm.recv(prv, tag=5), sent]
    if case == "isend_irecv":
        handle = comm.isend(xs[0], nxt, tag=6)
        got = comm.irecv(prv, tag=6).wait()
        return [got, handle.wait()]
    if case == "iallreduce":
        return [comm.iallreduce(xs[0], "sum").wait()]
    raise AssertionError(case)


def whole(case: str, X: list, n: int, ops) -> list:
    """Every rank's outputs from every rank's inputs ``X`` (``X[r]``: rank r's list), in one
    process; ``ops``: the array module's functions (``concat``, ``zeros``)."""
    cat, zeros = ops
    out = []
    for r in range(n):
        prv = (r - 1) % n
        first = [x[0] for x in X if x]
        if case in ("allreduce_sum", "iallreduce"):
            out.append([sum(first)])
        elif case == "allreduce_mean":
            out.append([sum(first) / n])
        elif case == "allreduce_weighted":
            w = [q + 1 for q in range(n)]
            out.append([sum(wq * xq for wq, xq in zip(w, first)) / sum(w)])
        elif case == "dict":
            out.append([sum(x[0] for x in X), sum(x[1] for x in X)])
        elif case in ("broadcast", "broadcast_none"):
            out.append([X[1 % n][0]])
        elif case == "reduce_sum":
            out.append([sum(first)] if r == 0 else [zeros(())])
        elif case == "reduce_mean":
            out.append([sum(first) / n] if r == n - 1 else [zeros(())])
        elif case == "allgather":
            out.append([cat(first)])
        elif case in ("reduce_scatter", "reduce_scatter_mean"):
            counts = (reduce_scatter_counts(n) if case == "reduce_scatter"
                      else np.diff(_bounds(n + 2, n)).tolist())
            start = sum(counts[:r])
            total = sum(first) if case == "reduce_scatter" else sum(first) / n
            out.append([total[start:start + counts[r]]])
        elif case == "scatter":
            out.append([X[0][r]])
        elif case == "gather":
            out.append([cat(first)] if r == 1 % n else [zeros(())])
        elif case == "alltoall_list":
            out.append([X[p][r] for p in range(n)])
        elif case == "alltoall_counts":
            parts = []
            for p in range(n):
                c = _counts(p, n)
                parts.append(X[p][0][sum(c[:r]):sum(c[:r + 1])])
            out.append([cat(parts)])
        elif case == "scan":
            out.append([sum(first[:r + 1])])
        elif case == "exscan":
            out.append([sum(first[:r]) if r else zeros(first[0].shape)])
        elif case in ("sendrecv", "send_recv", "isend_irecv"):
            out.append([X[prv][0]] + ([] if case == "sendrecv" else [None]))
        else:
            raise AssertionError(case)
    return out


def _bounds(rows: int, n: int) -> list:
    """synk's split (docs/api/calls.md): shares differ by one row at most, the first ranks take
    the extra ones, as np.array_split does."""
    return np.cumsum([0] + [len(part) for part in np.array_split(np.arange(rows), n)]).tolist()


def coefficients(r: int, i: int, shape) -> np.ndarray:
    """The coefficients of rank r's loss on its output ``i``."""
    return np.random.default_rng(500 + 7 * r + i).standard_normal(shape)
