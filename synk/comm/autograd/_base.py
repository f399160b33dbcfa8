"""What every rule shares (``rules``): the ``Rule`` interface, the table, and helpers."""
from __future__ import annotations

from ..._devices.discovery import array_module as _xp
from ...errors import SynkError
from ..handle import Handle

GRAD = "synk.grad"  # first item of the tags of the gradients' messages


def grad_tag(*key) -> tuple:
    return (GRAD, *key)


class NotDifferentiable(SynkError):
    """The gradient of an operation that has none (max, min, prod, bitwise...)."""


def _one(xs: list):
    """What ``synk.comm`` takes: the leaf itself, or a list of them (fused)."""
    return xs[0] if len(xs) == 1 else list(xs)


def _many(result, n: int) -> list:
    return [result] if n == 1 else list(result)


def _rows(shape) -> int:
    return shape[0] if len(shape) else 1


def _no_gradient(what: str, op: str):
    raise NotDifferentiable(
        f"synk.comm.{what} with op {op!r} has no gradient in synk: only 'sum' and 'mean' are "
        "differentiable (max, min and prod would need the ranks' values and ties, and the "
        "bitwise and logical ops are not smooth), and synk never gives a silently wrong "
        f"gradient. Use op='sum' or 'mean', or detach the input first (x.detach() in torch, "
        "jax.lax.stop_gradient(x) in JAX)")


def _dummy(x):
    """The 0-d zero a rank gets where an operation gives it nothing (``xp`` of ``x``)."""
    return _xp(x).zeros((), x.dtype)


def _like(value, shape, dtype):
    """``value`` (an array received) in ``shape`` and ``dtype``."""
    value = value.reshape(shape)
    return value if value.dtype == dtype else value.astype(dtype)


class Rule:
    """One operation: ``forward`` on native arrays (a Handle of them with ``wait=False``,
    where ``wait`` is taken), its ``adjoint`` (a rule's name and parameters, or
    ``NotDifferentiable``), and ``avals``: its outputs' (shape, dtype) from its inputs'."""

    name = ""
    math = False  # bfloat16 inputs as float32 (it does arithmetic on them)
    receives = False  # its outputs are (native, Frame or None): the sender's frames

    def forward(self, plain, xs: list, p: dict, wait: bool = True):
        raise NotImplementedError

    def adjoint(self, p: dict, xs_avals: list) -> tuple:
        raise NotImplementedError

    def avals(self, avals: list, p: dict, rank: int, size: int) -> list:
        return list(avals)


RULES: dict = {}


def _rule(cls):
    RULES[cls.name] = cls()
    return cls


def _then(result, finish, wait: bool):
    """``finish(result)``, or a Handle of it when ``result`` is one (``wait=False``)."""
    if wait:
        return finish(result)
    return Handle(lambda: finish(result.wait()))
