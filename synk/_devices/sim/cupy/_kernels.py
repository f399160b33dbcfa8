"""User kernels under the simulator, as CuPy 14.2 runs them: ``cupy.ElementwiseKernel`` and
``cupy.ReductionKernel`` run from their source strings (read by ``_cexpr``), and
``cupy.fuse``.
"""
from __future__ import annotations

import contextlib

import numpy as np

from .. import _core, _flush
from . import _cexpr
from ._ndarray import launch, ndarray, unwrap
from ._ufuncs import check_operands


class _Param:
    """One item of an argument list (CuPy's ``ParameterInfo``)."""

    def __init__(self, text: str) -> None:
        words = text.split()
        if len(words) < 2:
            raise Exception(f"Syntax error: {text}")  # (CuPy raises exactly this)
        t, self.name = words[-2:]
        self.raw = False
        for word in words[:-2]:
            if word == "raw":
                self.raw = True
            elif word != "_non_const":
                raise Exception(f'Unknown keyword "{word}"')
        self.ctype = t if len(t) == 1 else None
        self.dtype = None if len(t) == 1 else np.dtype(t)


def _params(text: str) -> list:
    return [] if not text.strip() else [_Param(p) for p in text.strip().split(",")]


def _decide_types(ins: list, outs: list, in_values: list, out_values: list) -> tuple:
    """(the dtypes of the inputs, of the outputs, the type letters' dtypes), as CuPy's
    ``_decide_params_type_core``."""
    letters: dict = {}
    for p, a in zip(outs, out_values):
        if a is None:
            continue
        if not isinstance(a, ndarray):
            raise TypeError("Output arguments must be cupy.ndarray")
        _bind(p, a.dtype, letters)
    for p, a in zip(ins, in_values):
        if isinstance(a, ndarray):
            _bind(p, a.dtype, letters)
    missing = [p.ctype for p in ins + outs if p.dtype is None and p.ctype not in letters]
    if missing:
        raise TypeError(f"the type {missing[0]!r} of the kernel's arguments is given by no "
                        "array argument")
    pick = [p.dtype if p.dtype is not None else letters[p.ctype] for p in ins + outs]
    return pick[:len(ins)], pick[len(ins):], letters


def _bind(p: _Param, dtype, letters: dict) -> None:
    if p.dtype is not None:
        if np.dtype(dtype) != p.dtype:
            raise TypeError(f"Type is mismatched. {p.name} {dtype} {p.dtype}")
    elif p.ctype in letters:
        if np.dtype(letters[p.ctype]) != np.dtype(dtype):
            raise TypeError(f"Type is mismatched. {p.name} {dtype} {letters[p.ctype]} "
                            f"{p.ctype}")
    else:
        letters[p.ctype] = np.dtype(dtype)


def _check_args(kind: str, name: str, args: tuple, nin: int, nout: int) -> None:
    if len(args) != nin and len(args) != nin + nout:
        raise TypeError(f"Wrong number of arguments for {name!r}. It must be either {nin} or "
                        f"{nin + nout} (with outputs), but given {len(args)}."
                        if kind == "elementwise" else f"Wrong number of arguments for {name}")


def _broadcast_shape(params: list, values: list) -> tuple:
    arrays = [v for p, v in zip(params, values) if isinstance(v, ndarray) and not p.raw]
    return np.broadcast_shapes(*[a.shape for a in arrays]) if arrays else ()


def _host_views(params: list, values: list, dtypes: list, shape: tuple, reads: list):
    """Each argument as numpy data: arrays (broadcast unless raw), scalars cast."""
    views, raw = [], {}
    for p, v, dtype in zip(params, values, dtypes):
        if isinstance(v, ndarray):
            data = unwrap(v, reads)
            if p.raw:
                raw[p.name] = data
                views.append(data)
            else:
                views.append(np.broadcast_to(data, shape))
        else:
            if isinstance(v, np.ndarray):
                raise TypeError(f"Unsupported type {type(v)}")
            views.append(np.asarray(v).astype(dtype))
    return views, raw


def _outputs(outs: list, given: list, dtypes: list, shape: tuple, sized: bool = False) -> list:
    """The outputs: made in the call's shape, or the ones given, checked (CuPy's
    ``_get_out_args_with_params``)."""
    from ._ndarray import _new

    if all(a is None for a in given):
        if any(p.raw for p in outs) and not sized:
            raise ValueError("Output array size is Undecided")
        return [_new(shape, dtype) for dtype in dtypes]
    for p, a in zip(outs, given):
        if not isinstance(a, ndarray):
            raise TypeError("Output arguments type must be cupy.ndarray")
        if not p.raw and a.shape != tuple(shape):
            raise ValueError("Out shape is mismatched")
    return list(given)


def _loop_size_decided(params: list, values: list) -> None:
    if not any(isinstance(v, ndarray) and not p.raw for p, v in zip(params, values)):
        raise ValueError("Loop size is undecided.")


class ElementwiseKernel:
    """``cupy.ElementwiseKernel``, as CuPy 14.2's (cupy/_core/_kernel.pyx
    ``ElementwiseKernel.__call__``, ``_decide_params_type_core``): ``operation`` is read
    (``_cexpr``) at the first call, as CuPy compiles it then. Parameters are ``[raw] type
    name``: a one-letter type is the dtype of the first array given for it (another dtype there
    is "Type is mismatched", a ``TypeError``), any other a numpy dtype name (``float`` is
    float64); scalars take their parameter's dtype; arrays not ``raw`` broadcast together, and
    outputs are made in that shape (or given, and checked); a zero-size call launches nothing.
    It runs on ``stream`` (default: the current one), under the race rules."""

    def __init__(self, in_params, out_params, operation, name="kernel", reduce_dims=True,
                 preamble="", no_return=False, return_tuple=False, **kwargs):
        if not str(name).isidentifier():
            raise ValueError(f'Invalid kernel name: "{name}"')
        self.in_params, self.out_params = _params(in_params), _params(out_params)
        self.nin, self.nout = len(self.in_params), len(self.out_params)
        self.nargs = self.nin + self.nout
        if "i" in [p.name for p in self.in_params + self.out_params]:
            raise ValueError("Can not use 'i' as a parameter name")
        self.operation, self.name, self.__name__ = operation, name, name
        self.preamble, self.no_return, self.return_tuple = preamble, no_return, return_tuple
        self.kwargs = kwargs
        self._body = None
        unmodelled = [k for k in ("loop_prep", "after_loop") if kwargs.get(k)]
        if preamble and preamble.strip() or unmodelled:
            self._refused = _core.not_modelled(
                f"ElementwiseKernel {name!r} with {'a preamble' if preamble else unmodelled[0]}"
                " (code outside the loop body)")
        else:
            self._refused = None

    def _letters(self) -> set:
        return {p.ctype for p in self.in_params + self.out_params if p.ctype}

    def __call__(self, *args, **kwargs):
        size = kwargs.pop("size", -1)
        stream = kwargs.pop("stream", None)
        block_size = kwargs.pop("block_size", 128)
        if kwargs:
            raise TypeError(f"Wrong arguments {kwargs}")
        if block_size <= 0:
            raise ValueError("block_size must be greater than zero")
        _check_args("elementwise", self.name, args, self.nin, self.nout)
        check_operands(args)  # (cupy/_core/_kernel.pyx line 881: _preprocess_args)
        if self._refused is not None:
            raise self._refused
        if self._body is None:
            self._body = _cexpr.parse(self.operation, self._letters())
        ins, outs = list(args[:self.nin]), list(args[self.nin:]) or [None] * self.nout
        shape = _loop_shape(size, self.in_params + self.out_params, ins + outs)
        in_types, out_types, letters = _decide_types(self.in_params, self.out_params, ins,
                                                     outs)
        with _stream(stream):
            out_arrays = _outputs(self.out_params, outs, out_types, shape, size != -1)
            result = self._result(out_arrays)
            if 0 in shape:
                return result
            values, raw, out_views = _launch(self.in_params, ins, in_types, shape, out_arrays)
            for p, view in zip(self.out_params, out_views):
                if p.raw:
                    raw[p.name] = view
                else:
                    values[p.name] = view.copy()
            size_now = int(np.prod(shape))
            scope = _cexpr.Scope(values, letters, raw, {
                "i": lambda: np.arange(size_now).reshape(shape),
                "_ind": lambda: size_now})
            scope.writable = {p.name for p in self.out_params if p.raw}
            with np.errstate(all="ignore"):
                _cexpr.run(self._body, scope)
                for p, view in zip(self.out_params, out_views):
                    if not p.raw:
                        value = _flush.converted(np.asarray(scope.values[p.name]), view.dtype)
                        np.copyto(view, np.broadcast_to(value, shape), casting="unsafe")
        return result

    def _result(self, out_arrays: list):
        """What a call returns: None, its one output or the tuple of them."""
        if self.no_return:
            return None
        if not self.return_tuple and self.nout == 1:
            return out_arrays[0]
        return tuple(out_arrays)


def _loop_shape(size: int, params: list, values: list) -> tuple:
    """The shape an elementwise kernel runs over: ``size``, or its arrays' broadcast."""
    if size != -1:
        if any(isinstance(a, ndarray) and not p.raw for p, a in zip(params, values)):
            raise ValueError("Specified 'size' can be used only if all of the ndarray "
                             "are 'raw'.")
        return (int(size),)
    _loop_size_decided(params, values)
    return _broadcast_shape(params, values)


def _launch(in_params: list, ins: list, in_types: list, shape: tuple,
            out_arrays: list) -> tuple[dict, dict, list]:
    """Launch a kernel on ``ins`` and ``out_arrays``: (the inputs not raw by name, the raw
    ones by name, the outputs), as host views."""
    reads: list = []
    views, raw = _host_views(in_params, ins, in_types, shape, reads)
    writes: list = []
    out_views = [unwrap(a, writes) for a in out_arrays]
    launch(reads + writes, writes)
    values = {p.name: v for p, v in zip(in_params, views) if not p.raw}
    return values, raw, out_views


class ReductionKernel:
    """``cupy.ReductionKernel``, as CuPy 14.2's (cupy/_core/_reduction.pyx), its expressions read
    at the first call; parameters, types and ``stream`` as ``ElementwiseKernel``'s. It maps each
    element with ``map_expr``, folds with ``reduce_expr`` (``a``, ``b``) from ``identity``
    (``''``: ``_type_reduce()``, 0, and an error for a zero-size input) and writes
    ``post_map_expr`` (``a``: the result) over ``axis`` (all by default) with ``keepdims``;
    ``reduce_type`` defaults to the first output's type. Folds whose order CuPy leaves open are
    pairwise, and an identity that is not neutral is applied once (on a GPU, once per thread)."""

    def __init__(self, in_params, out_params, map_expr, reduce_expr, post_map_expr,
                 identity, name="reduce_kernel", reduce_type=None, reduce_dims=True,
                 preamble="", options=()):
        if not str(name).isidentifier():
            raise ValueError(f'Invalid kernel name: "{name}"')
        self.in_params, self.out_params = _params(in_params), _params(out_params)
        self.nin, self.nout = len(self.in_params), len(self.out_params)
        self.nargs = self.nin + self.nout
        self.name, self.identity = name, "" if identity is None else str(identity)
        self.map_expr, self.reduce_expr, self.post_map_expr = map_expr, reduce_expr, post_map_expr
        self.reduce_type = self.out_params[0].ctype or str(self.out_params[0].dtype) \
            if reduce_type is None else reduce_type
        self.preamble, self.options, self.reduce_dims = preamble, options, reduce_dims
        self._parsed = None

    def _parse(self):
        letters = {p.ctype for p in self.in_params + self.out_params if p.ctype}
        letters.add("_type_reduce")
        if self.preamble and self.preamble.strip():
            raise _core.not_modelled(f"ReductionKernel {self.name!r} with a preamble")
        mapped = _cexpr.parse_expression(self.map_expr, letters)
        fold = _cexpr.parse_expression(self.reduce_expr, letters)
        post = _cexpr.parse(self.post_map_expr, letters)
        identity = (_cexpr.parse_expression(self.identity, letters)
                    if self.identity.strip() else None)
        return mapped, fold, post, identity

    def __call__(self, *args, **kwargs):
        out = kwargs.pop("out", None)
        axis = kwargs.pop("axis", None)
        keepdims = kwargs.pop("keepdims", False)
        stream = kwargs.pop("stream", None)
        if kwargs:
            raise TypeError(f"Wrong arguments {kwargs}")
        _check_args("reduction", self.name, args, self.nin, self.nout)
        check_operands(args)  # (cupy/_core/_reduction.pyx lines 825-826: _preprocess_args)
        outs = self._outs(list(args[self.nin:]), out)
        if self._parsed is None:
            self._parsed = self._parse()
        mapped, fold, post, identity = self._parsed
        ins = list(args[:self.nin])
        _loop_size_decided(self.in_params, ins)
        shape = _broadcast_shape(self.in_params, ins)
        axes = _axes(axis, len(shape))
        out_shape = tuple(1 if d in axes else n for d, n in enumerate(shape) if keepdims or
                          d not in axes)
        in_types, out_types, letters = _decide_types(self.in_params, self.out_params, ins,
                                                     outs)
        reduce_dtype = letters.get(self.reduce_type) or np.dtype(
            _cexpr.C_TYPES.get(self.reduce_type, self.reduce_type))
        letters = dict(letters, _type_reduce=reduce_dtype)
        with _stream(stream):
            out_arrays = _outputs(self.out_params, outs, out_types, out_shape)
            result = out_arrays[0] if self.nout == 1 else tuple(out_arrays)
            if int(np.prod(out_shape)) == 0:
                return result
            if identity is None and 0 in shape:
                raise ValueError(f"zero-size array to reduction operation {self.name} which "
                                 "has no identity")
            values, raw, out_views = _launch(self.in_params, ins, in_types, shape, out_arrays)
            in_size, out_size = int(np.prod(shape)), int(np.prod(out_shape))
            specials = {"_in_ind": lambda: in_size, "_out_ind": lambda: out_size}
            with np.errstate(all="ignore"):
                scope = _cexpr.Scope(values, letters, raw, specials)
                each = np.broadcast_to(np.asarray(_cexpr.evaluate(mapped, scope)).astype(
                    reduce_dtype), shape)
                start = (np.zeros((), reduce_dtype) if identity is None else np.asarray(
                    _cexpr.evaluate(identity, scope)).astype(reduce_dtype))
                folded = _fold(fold, each, axes, start, reduce_dtype, letters)
                if keepdims:
                    folded = folded.reshape(out_shape)
                post_values = {"a": folded}
                for p, view in zip(self.out_params, out_views):
                    post_values[p.name] = view.copy()
                scope = _cexpr.Scope(post_values, letters, raw, specials)
                _cexpr.run(post, scope)
                for p, view in zip(self.out_params, out_views):
                    np.copyto(view, np.broadcast_to(scope.values[p.name], out_shape),
                              casting="unsafe")
        return result

    def _outs(self, outs: list, out) -> list:
        """The outputs given, after the inputs or as ``out`` (None each where not given)."""
        if out is not None:
            if self.nout != 1:
                raise NotImplementedError("")
            if outs:
                raise ValueError("cannot specify 'out' as both a positional and keyword "
                                 "argument")
            outs = [out]
        return outs or [None] * self.nout


def _axes(axis, ndim: int) -> tuple:
    given = tuple(range(ndim)) if axis is None else (
        tuple(axis) if isinstance(axis, (tuple, list)) else (axis,))
    for a in given:
        if not -ndim <= a < max(ndim, 1):
            raise np.exceptions.AxisError(a, ndim)
    return tuple(a % ndim if ndim else a for a in given)


# reduce expressions numpy has a reduction for: exact and fast (not max/min: CUDA's max/min
# of floats are fmaxf/fminf, whose signed zeros and NaNs numpy's fmax does not give; they
# fold pairwise through ``_cexpr``, as other expressions)
_A_B = (("name", "a"), ("name", "b"))
_KNOWN_FOLDS: dict[tuple, np.ufunc] = {
    ("bin", "+", *_A_B): np.add, ("bin", "*", *_A_B): np.multiply,
    ("bin", "|", *_A_B): np.bitwise_or, ("bin", "&", *_A_B): np.bitwise_and,
    ("bin", "^", *_A_B): np.bitwise_xor,
}


def _fold(fold, values: np.ndarray, axes: tuple, start, dtype, letters: dict) -> np.ndarray:
    """``values`` folded over ``axes`` with the expression ``fold`` of ``a`` and ``b``,
    from ``start``."""
    keep = [d for d in range(values.ndim) if d not in axes]
    moved = np.transpose(values, keep + list(axes)).reshape(
        [values.shape[d] for d in keep] + [-1])

    def combine(a, b):
        scope = _cexpr.Scope({"a": a, "b": b}, letters, {}, {})
        return np.asarray(_cexpr.evaluate(fold, scope)).astype(dtype)

    known = _KNOWN_FOLDS.get(_plain(fold))
    if moved.shape[-1] == 0:
        total = np.broadcast_to(start, moved.shape[:-1]).astype(dtype)
        return total
    if known is not None:
        total = known.reduce(moved, axis=-1).astype(dtype)
    else:
        while moved.shape[-1] > 1:
            half = moved.shape[-1] // 2
            paired = combine(moved[..., :half], moved[..., half:2 * half])
            if moved.shape[-1] % 2:
                paired = np.concatenate([paired, moved[..., 2 * half:]], axis=-1)
            moved = paired
        total = moved[..., 0]
    return combine(np.broadcast_to(start, total.shape), total)


def _plain(node):
    """A parsed node as nested tuples (a call's arguments are a list), to look it up."""
    if isinstance(node, (list, tuple)):
        return tuple(_plain(n) for n in node)
    return node


def _stream(stream):
    """``with``: ``stream`` current (None: leave the current one)."""
    return contextlib.nullcontext() if stream is None else stream


class _Fused:
    """A function ``cupy.fuse`` made: under the simulator, the function itself, each of its
    operations a kernel on the current stream (CuPy compiles them into one; the numbers are
    those of the operations one by one)."""

    def __init__(self, func, kernel_name=None) -> None:
        self.func, self.name = func, kernel_name or func.__name__
        self.__name__ = self.name
        self.__doc__ = func.__doc__

    def __call__(self, *args, **kwargs):
        return self.func(*args, **kwargs)


def fuse(*args, **kwargs):
    """``cupy.fuse``: a decorator, with or without its arguments (``kernel_name=``)."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return _Fused(args[0])
    return lambda func: _Fused(func, **kwargs)
