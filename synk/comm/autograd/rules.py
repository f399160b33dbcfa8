"""The adjoint of every collective of ``synk.comm``, written once: each ``Rule`` runs an
operation on native arrays (numpy, CuPy) through ``synk.comm`` itself (``plain``, the
functions of ``synk.comm``, handed in by it), says which rule is its adjoint, and what
shapes it gives (for JAX's tracing). torch's ``autograd.Function`` (``_torch``) and JAX's
primitive (``_jax``) are both written over this table.

Each rank's gradient is the derivative of the sum of every rank's loss with respect to its
own input (mpi4torch's convention), so an operation's adjoint is its transpose across the
ranks: allreduce(sum) <-> allreduce(sum); a weighted mean <-> (w_r / W) allreduce(sum);
broadcast <-> reduce(sum) to the root (zeros elsewhere); reduce <-> broadcast from the root;
allgather <-> reduce_scatter(sum) (by each rank's own rows, which may differ);
reduce_scatter <-> allgather; scatter <-> gather; alltoall <-> alltoall with the counts
transposed; scan(sum) <-> a suffix sum; send <-> a receive of the gradient (on a tag of
synk's own); sendrecv <-> sendrecv the other way. Ops that are not linear (max, min, prod,
the bitwise and logical ops, maxloc) have no rule: their gradient raises ``SynkError``.
"""
from __future__ import annotations

from . import _messages, _moving, _reductions  # (each fills the table with its rules)
from ._base import GRAD, RULES, NotDifferentiable, Rule, grad_tag
from ._moving import received

__all__ = ["GRAD", "RULES", "NotDifferentiable", "Rule", "grad_tag", "received", "_messages",
           "_moving", "_reductions"]
