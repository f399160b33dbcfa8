"""The rules of the collectives' gradients: the ``Rule`` interface, the table of rules by name
(``RULES``) each collective's module registers in, and what rules share.

::

    collectives' modules --register--> RULES[name]: a Rule (forward, adjoint, avals)
    torch_function, jax_primitive --RULES[name].forward--> the operation, on native arrays
                                  --RULES[adjoint]-------> its gradient
"""
from __future__ import annotations

from ... import _tree
from ..._devices.discovery import array_module as xp
from ...errors import SynkError
from ..frame_marks import marked, unmark

GRAD = "synk.grad"  # first item of the tags of the gradients' messages


def grad_tag(*key) -> tuple:
    return (GRAD, *key)


class NotDifferentiable(SynkError):
    """The gradient of an operation that has none (max, min, prod, bitwise...)."""


def one(xs: list):
    """What ``synk.comm`` takes: the leaf itself, or a list of them (fused)."""
    return xs[0] if len(xs) == 1 else list(xs)


def many(result, n: int) -> list:
    return [result] if n == 1 else list(result)


def rows_of(shape) -> int:
    return shape[0] if len(shape) else 1


def no_gradient(what: str, op: str):
    raise NotDifferentiable(
        f"synk.comm.{what} with op {op!r} has no gradient in synk: only 'sum' and 'mean' are "
        "differentiable (max, min and prod would need the ranks' values and ties, and the "
        "bitwise and logical ops are not smooth), and synk never gives a silently wrong "
        f"gradient. Use op='sum' or 'mean', or detach the input first (x.detach() in torch, "
        "jax.lax.stop_gradient(x) in JAX)")


def dummy(x):
    """The 0-d zero a rank gets where an operation gives it nothing (``xp`` of ``x``)."""
    return xp(x).zeros((), x.dtype)


def like(value, shape, dtype):
    """``value`` (an array received) in ``shape`` and ``dtype``."""
    value = value.reshape(shape)
    return value if value.dtype == dtype else value.astype(dtype)


class Rule:
    """One operation: ``forward`` on native arrays (numpy, CuPy; a Handle of them with
    ``wait=False``, where ``wait`` is taken), run through ``synk.comm``'s own functions (its
    family's module's, or another's), its ``adjoint`` (a rule's name and parameters, or
    ``NotDifferentiable``), and ``avals``: its outputs' (shape, dtype) from its inputs' (for
    JAX's tracing)."""

    name = ""
    math = False  # bfloat16 inputs as float32 (it does arithmetic on them)
    receives = False  # its outputs are (native, Frame or None): the sender's frames

    def forward(self, xs: list, p: dict, wait: bool = True):
        raise NotImplementedError

    def located(self, x, p: dict, wait: bool):
        """``maxloc``/``minloc`` of ``x``: what the operation gives (``(values, ranks)``,
        or None off a root), or a Handle of it (``wait=False``)."""
        raise NotImplementedError

    def writes_into(self, p: dict) -> bool:
        """Whether ``forward`` takes ``into=``: arrays of its outputs' shapes and dtypes
        that it writes its result into (JAX's output buffers under ``jax.jit``)."""
        return False

    def adjoint(self, p: dict, xs_avals: list) -> tuple:
        """The operation's transpose across the ranks (a rule's name and parameters, or
        ``NotDifferentiable`` for ops that are not linear): each rank's gradient is the
        derivative of the sum of every rank's loss with respect to its own input
        (mpi4torch's convention; each rule's, docs/frameworks.md)."""
        raise NotImplementedError

    def avals(self, avals: list, p: dict, rank: int, size: int) -> list:
        return list(avals)


RULES: dict = {}


def register(cls):
    RULES[cls.name] = cls()
    return cls


class Received(list):
    """The leaves a broadcast or a scatter brought, unmarked: [(native, Frame or None)],
    and their structure (``template``)."""

    template = None


def received(got, copy: bool = False) -> Received:
    """``got`` unmarked (``copy``: the root's own, copied off its input's memory)."""
    leaves, template = _tree.flatten(got)
    out = Received(unmark(leaf)[:2] if marked(leaf) else (leaf, None) for leaf in leaves)
    if copy:
        out[:] = [(n.copy(), f) for n, f in out]
    out.template = template
    return out
