"""The CUDA C of CuPy's ``ElementwiseKernel`` and ``ReductionKernel`` bodies, read and run on
numpy arrays: what the simulator models of user kernels (see ``_kernels``)::

    body (C text) --parse--> tree of tuples --run / evaluate on a Scope--> numpy arrays
"""
from __future__ import annotations

import math
import re

import numpy as np

from .. import _core, _float_minmax, _flush

C_TYPES = {
    "bool": np.bool_, "char": np.int8, "signed char": np.int8, "unsigned char": np.uint8,
    "short": np.int16, "unsigned short": np.uint16, "int": np.int32, "unsigned int": np.uint32,
    "unsigned": np.uint32, "long": np.int64, "unsigned long": np.uint64,
    "long long": np.int64, "unsigned long long": np.uint64, "float": np.float32,
    "double": np.float64, "half": np.float16, "float16": np.float16, "size_t": np.uint64,
    "ptrdiff_t": np.int64, "int8_t": np.int8, "int16_t": np.int16, "int32_t": np.int32,
    "int64_t": np.int64, "uint8_t": np.uint8, "uint16_t": np.uint16, "uint32_t": np.uint32,
    "uint64_t": np.uint64,
}
_TYPE_WORDS = {"bool", "char", "signed", "unsigned", "short", "int", "long", "float",
               "double", "half", "float16", "size_t", "ptrdiff_t", "const", "auto"} | {
                   t for t in C_TYPES if t.endswith("_t")}


def _vectorized(fn):
    ufunc = np.frompyfunc(fn, 1, 1)
    return lambda x: np.asarray(ufunc(x)).astype(np.result_type(x, np.float32))


_fmax, _fmin = _float_minmax.fmax, _float_minmax.fmin  # (CUDA's: NaN loses, +0.0 > -0.0)


def _rsqrt(x):
    return 1 / np.sqrt(x)


FUNCTIONS = {
    "exp": np.exp, "exp2": np.exp2, "exp10": lambda x: np.power(10.0, x), "expm1": np.expm1,
    "log": np.log, "log2": np.log2, "log10": np.log10, "log1p": np.log1p,
    "sqrt": np.sqrt, "rsqrt": _rsqrt, "cbrt": np.cbrt,
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "asin": np.arcsin, "acos": np.arccos,
    "atan": np.arctan, "atan2": np.arctan2, "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh,
    "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh,
    "pow": np.power, "fabs": np.abs, "abs": np.abs, "floor": np.floor, "ceil": np.ceil,
    "round": lambda x: np.where(x >= 0, np.floor(x + 0.5), np.ceil(x - 0.5)).astype(
        np.result_type(x)), "rint": np.rint, "trunc": np.trunc, "fmod": np.fmod,
    "max": _fmax, "min": _fmin, "fmax": _fmax, "fmin": _fmin, "hypot": np.hypot,
    "copysign": np.copysign, "signbit": np.signbit, "isnan": np.isnan, "isinf": np.isinf,
    "isfinite": np.isfinite, "erf": _vectorized(math.erf), "erfc": _vectorized(math.erfc),
    "lgamma": _vectorized(math.lgamma), "tgamma": _vectorized(math.gamma),
}
# CUDA's reinterpretations of a value's bits (CUDA Math API, "Type Casting Intrinsics"):
# moves, which no -ftz touches
BITS = {
    "__float_as_uint": lambda x: np.asarray(x, np.float32).view(np.uint32),
    "__float_as_int": lambda x: np.asarray(x, np.float32).view(np.int32),
    "__uint_as_float": lambda x: np.asarray(x).astype(np.uint32).view(np.float32),
    "__int_as_float": lambda x: np.asarray(x).astype(np.int32).view(np.float32),
    "__double_as_longlong": lambda x: np.asarray(x, np.float64).view(np.int64),
    "__longlong_as_double": lambda x: np.asarray(x).astype(np.int64).view(np.float64),
}
# names of CUDA's headers a kernel may use
CONSTANTS = {"true": True, "false": False, "INFINITY": np.float32(np.inf),
             "NAN": np.float32(np.nan), "CUDART_INF": np.float64(np.inf),
             "CUDART_INF_F": np.float32(np.inf), "CUDART_NAN": np.float64(np.nan),
             "CUDART_NAN_F": np.float32(np.nan), "CUDART_PI": np.float64(np.pi),
             "CUDART_PI_F": np.float32(np.pi), "M_PI": np.float64(np.pi)}
# the float forms (expf, sqrtf, fabsf, fmaxf...): the same, in float32
for _name in list(FUNCTIONS):
    FUNCTIONS.setdefault(_name + "f", FUNCTIONS[_name])
_FLOAT_FORMS = {n + "f" for n in FUNCTIONS if not n.endswith("f")}

_TOKEN = re.compile(r"""
    (?P<space>\s+|//[^\n]*|/\*.*?\*/)
  | (?P<number>0[xX][0-9a-fA-F]+[uUlL]*|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[fFuUlL]*)
  | (?P<name>[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)*)
  | (?P<op><<=|>>=|\+\+|--|->|&&|\|\||<=|>=|==|!=|<<|>>|\+=|-=|\*=|/=|%=|&=|\|=|\^=
         |[-+*/%<>=!~&|^?:;,()\[\]{}.])
""", re.S | re.X)


def tokens(source: str) -> list:
    out, pos = [], 0
    while pos < len(source):
        found = _TOKEN.match(source, pos)
        if found is None:
            raise _core.not_modelled(f"a kernel with {source[pos:pos + 20]!r} (the simulator "
                                     "reads C expressions and assignments only)")
        pos = found.end()
        if found.lastgroup != "space":
            out.append((found.lastgroup, re.sub(r"\s+", "", found.group())))
    out.append(("end", ""))
    return out


# ---------------------------------------------------------------- parsing

_BINARY = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="),
           ("<<", ">>"), ("+", "-"), ("*", "/", "%")]
_ASSIGN = ("=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>=")


class Parser:
    """C statements into a tree of tuples; ``types``: the kernel's type names (``T``...)."""

    def __init__(self, source: str, types: set) -> None:
        self.toks, self.i, self.types, self.source = tokens(source), 0, types, source

    # -- tokens
    def peek(self, k: int = 0):
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def take(self):
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expect(self, value: str) -> None:
        kind, text = self.take()
        if text != value:
            raise self.refuse(f"expected {value!r}, found {text or 'the end'!r}")

    def refuse(self, why: str):
        return _core.not_modelled(f"a kernel whose code the simulator cannot read ({why}, in "
                                  f"{self.source.strip()!r})")

    def is_type(self, k: int = 0) -> bool:
        kind, text = self.peek(k)
        return kind == "name" and (text in _TYPE_WORDS or text in self.types)

    # -- statements
    def statements(self, until: str = "") -> list:
        body = []
        while self.peek()[1] != until and self.peek()[0] != "end":
            body.extend(self.statement())
        return body

    def statement(self) -> list:
        kind, text = self.peek()
        if text == ";":
            self.take()
            return []
        if text == "{":
            self.take()
            body = self.statements("}")
            self.expect("}")
            return body
        if kind == "name" and text == "if":
            return [self.branch()]
        if kind == "name" and text in ("for", "while", "do", "return", "goto", "switch",
                                       "break", "continue", "__syncthreads"):
            raise self.refuse(f"{text!r}")
        if self.is_type() and self.peek(1)[0] == "name":  # (``unsigned int x``: a name too)
            return self.declaration()
        found = [self.expression_statement()]
        while self.peek()[1] == ",":
            self.take()
            found.append(self.expression_statement())
        if self.peek()[1] != "end" and self.peek()[0] != "end":
            self.expect(";")
        return found

    def branch(self):
        self.take()
        self.expect("(")
        cond = self.expression()
        self.expect(")")
        then = self.statement()
        other: list = []
        if self.peek()[1] == "else":
            self.take()
            other = self.statement()
        return ("if", cond, then, other)

    def type_name(self) -> str:
        words: list[str] = []
        while self.is_type() and not (words and self.peek()[1] in self.types):
            word = self.take()[1]
            if word != "const":
                words.append(word)
            if word in self.types:
                break
        return " ".join(words)

    def declaration(self) -> list:
        ctype = self.type_name()
        found = []
        while True:
            kind, name = self.take()
            if kind != "name":
                raise self.refuse(f"a declaration of {name!r}")
            if self.peek()[1] == "[" or self.peek()[1] == "*" or self.peek()[1] == "&":
                raise self.refuse("arrays, pointers and references")
            value = None
            if self.peek()[1] == "=":
                self.take()
                value = self.expression()
            found.append(("declare", ctype, name, value))
            if self.peek()[1] != ",":
                break
            self.take()
        if self.peek()[0] != "end":
            self.expect(";")
        return found

    def expression_statement(self):
        start = self.i
        kind, name = self.peek()
        if kind == "name" and self.peek(1)[1] in _ASSIGN:
            self.take()
            op = self.take()[1]
            return ("assign", name, op, self.expression())
        if kind == "name" and self.peek(1)[1] in ("++", "--"):
            self.take()
            op = self.take()[1]
            return ("assign", name, "+=" if op == "++" else "-=", ("num", 1))
        if kind == "name" and self.peek(1)[1] == "[":
            target = self.postfix(self.primary())
            if target[0] == "index" and self.peek()[1] in _ASSIGN:
                op = self.take()[1]
                return ("store", target[1][1], target[2], op, self.expression())
            self.i = start
        return ("expr", self.expression())

    # -- expressions
    def expression(self):
        cond = self.binary(0)
        if self.peek()[1] == "?":
            self.take()
            yes = self.expression()
            self.expect(":")
            no = self.expression()
            return ("?", cond, yes, no)
        return cond

    def binary(self, level: int):
        if level == len(_BINARY):
            return self.unary()
        left = self.binary(level + 1)
        while self.peek()[1] in _BINARY[level]:
            op = self.take()[1]
            left = ("bin", op, left, self.binary(level + 1))
        return left

    def unary(self):
        kind, text = self.peek()
        if text in ("-", "+", "!", "~"):
            self.take()
            return ("un", text, self.unary())
        if text == "(" and self.is_type(1):
            self.take()
            ctype = self.type_name()
            self.expect(")")
            return ("cast", ctype, self.unary())
        if kind == "name" and text in ("static_cast", "reinterpret_cast"):
            if text != "static_cast":
                raise self.refuse(text)
            self.take()
            self.expect("<")
            ctype = self.type_name()
            self.expect(">")
            self.expect("(")
            inner = self.expression()
            self.expect(")")
            return ("cast", ctype, inner)
        return self.postfix(self.primary())

    def primary(self):
        kind, text = self.take()
        if kind == "number":
            return ("num", _number(text))
        if kind == "name":
            if self.peek()[1] == "(":
                self.take()
                args = []
                while self.peek()[1] != ")":
                    args.append(self.expression())
                    if self.peek()[1] == ",":
                        self.take()
                self.expect(")")
                return ("call", text, args)
            return ("name", text)
        if text == "(":
            inner = self.expression()
            self.expect(")")
            return inner
        raise self.refuse(f"{text or 'the end'!r}")

    def postfix(self, node):
        while True:
            text = self.peek()[1]
            if text == "[":
                self.take()
                index = self.expression()
                self.expect("]")
                node = ("index", node, index)
            elif text == "." and self.peek(1)[0] == "name" and self.peek(2)[1] == "(":
                self.take()
                method = self.take()[1]
                self.expect("(")
                self.expect(")")
                node = ("method", node, method)
            else:
                return node


def _number(text: str):
    lower = text.lower()
    if lower.startswith("0x"):
        return int(lower.rstrip("ul"), 16)
    if any(c in lower for c in ".e"):
        if lower.endswith("f"):
            return np.float32(float(lower[:-1]))
        return np.float64(float(lower.rstrip("l")))
    return int(lower.rstrip("ul"))


def parse(source: str, types: set) -> list:
    """The statements of ``source`` (a kernel body, a map or post-map expression): assignments
    (``x[i] = ...`` on a ``raw`` output, compound ones too), declarations (``T d = x - y;``,
    ``float w;``), ``if``/``else`` with assignments inside, and C expressions: literals (``2.f``,
    ``1e-3``, ``0x1F``), names, ``x[expr]`` on ``raw`` arguments, unary operators, casts
    (``(float)x``, ``static_cast<T>(x)``), C's binary operators and precedence, ``?:`` and the
    math library (CUDA's ``max``/``min`` of floats are ``fmaxf``/``fminf``, which ignore NaN).
    The rest (loops, pointers, other calls, ``__syncthreads``...) raises ``NotModelled`` naming
    it when the kernel is first called, as CuPy compiles it then."""
    return Parser(source, types).statements()


def parse_expression(source: str, types: set):
    parser = Parser(source, types)
    node = parser.expression()
    if parser.peek()[0] != "end":
        raise parser.refuse(f"{parser.peek()[1]!r} after the expression")
    return node


# ---------------------------------------------------------------- running

class Scope:
    """The values of a kernel's names: its arguments (numpy arrays), its locals, and the
    dtypes its type names stand for."""

    def __init__(self, values: dict, types: dict, raw: dict, specials: dict) -> None:
        self.values, self.types, self.raw, self.specials = values, types, raw, specials
        self.dtypes: dict = {}  # declared locals -> dtype
        self.writable: set = set()  # raw arrays the body may write (outputs)

    def dtype_of(self, ctype: str):
        if ctype in self.types:
            return self.types[ctype]
        if ctype in C_TYPES:
            return np.dtype(C_TYPES[ctype])
        if ctype == "auto":
            return None
        raise _core.not_modelled(f"the C type {ctype!r} in a kernel")


def run(body: list, scope: Scope, mask=None) -> None:
    """Run the statements ``body`` on every element (where ``mask`` holds), all at once as numpy
    arrays (a branch is both sides and ``numpy.where``), with C's rules where numpy's differ:
    integer ``/`` and ``%`` truncate toward zero, ``1.0`` is a double and ``1.0f`` a float,
    comparisons give bools, single-precision arithmetic, comparisons and conversions flush
    subnormals (``-ftz=true``, ``_flush``), and bit reinterpretations (``__float_as_uint``...)
    keep them."""
    for statement in body:
        kind = statement[0]
        if kind == "declare":
            _, ctype, name, value = statement
            dtype = scope.dtype_of(ctype)
            result = evaluate(value, scope) if value is not None else np.zeros((), dtype or float)
            if dtype is not None:
                result = _flush.converted(np.asarray(result), dtype)
                scope.dtypes[name] = dtype
            _store(scope, name, result, mask)
        elif kind == "assign":
            _, name, op, value = statement
            if name in scope.raw:
                raise _core.not_modelled("a kernel that assigns a raw array")
            result = evaluate(value, scope)
            if op != "=":
                result = _binary(op[:-1], _lookup(scope, name), result)
            if name in scope.dtypes:
                result = _flush.converted(np.asarray(result), scope.dtypes[name])
            _store(scope, name, result, mask)
        elif kind == "store":  # x[index] = value on a raw array: scattered, the last wins
            _, name, index, op, value = statement
            if name not in scope.writable:
                raise _core.not_modelled(f"a write to an element of {name!r}, not a raw output")
            flat = scope.raw[name].reshape(-1)
            where, result = np.broadcast_arrays(np.asarray(evaluate(index, scope)).astype(
                np.int64), evaluate(value, scope))
            if op != "=":
                result = _binary(op[:-1], flat[where], result)
            if mask is not None:
                keep = np.broadcast_to(mask, where.shape)
                where, result = where[keep], result[keep]
            flat[where.reshape(-1)] = np.asarray(result).reshape(-1)
        elif kind == "if":
            _, cond, then, other = statement
            yes = np.asarray(evaluate(cond, scope)).astype(bool)
            run(then, scope, yes if mask is None else mask & yes)
            no = ~yes
            run(other, scope, no if mask is None else mask & no)
        else:
            evaluate(statement[1], scope)


def _store(scope: Scope, name: str, value, mask) -> None:
    if mask is None or name not in scope.values:
        scope.values[name] = value
    else:
        scope.values[name] = np.where(mask, value, scope.values[name])


def _lookup(scope: Scope, name: str):
    if name in scope.values:
        return scope.values[name]
    if name in scope.specials:
        return scope.specials[name]()
    if name in CONSTANTS:
        return CONSTANTS[name]
    if name in scope.raw:
        raise _core.not_modelled(f"the raw array {name!r} used without an index in a kernel")
    raise _core.not_modelled(f"the name {name!r} in a kernel (not an argument, a local or "
                             "a special name the simulator knows)")


def evaluate(node, scope: Scope):
    """The value of the expression ``node`` (a parsed tuple: its kind, then its parts)."""
    how = _EVALUATE.get(node[0])
    if how is None:
        raise _core.not_modelled(f"{node[0]} in a kernel")
    return how(node, scope)


def _eval_unary(node, scope: Scope):
    _, op, inner = node
    value = evaluate(inner, scope)
    if op == "-":  # (neg.ftz.f32)
        return _flush.flushed(np.negative(_flush.flushed(value)))
    if op == "!":
        return np.logical_not(_flush.flushed(value))
    if op == "~":
        return np.invert(value)
    return value


def _eval_choice(node, scope: Scope):
    _, cond, yes, no = node
    return np.where(np.asarray(evaluate(cond, scope)).astype(bool), evaluate(yes, scope),
                    evaluate(no, scope))


def _eval_cast(node, scope: Scope):
    _, ctype, inner = node
    dtype = scope.dtype_of(ctype)
    value = evaluate(inner, scope)
    return value if dtype is None else _flush.converted(np.asarray(value), dtype)


def _eval_call(node, scope: Scope):
    _, name, args = node
    name = name[5:] if name.startswith("std::") else name
    if name in BITS:
        (arg,) = args
        return BITS[name](evaluate(arg, scope))
    fn = FUNCTIONS.get(name)
    if fn is None:
        raise _core.not_modelled(f"the function {name}() in a kernel")
    result = fn(*[_flush.flushed(evaluate(a, scope)) for a in args])
    if name in _FLOAT_FORMS:
        result = np.asarray(result).astype(np.float32)
    return _flush.flushed(result)


def _eval_index(node, scope: Scope):
    _, base, index = node
    if base[0] != "name" or base[1] not in scope.raw:
        raise _core.not_modelled("indexing anything but a raw argument in a kernel")
    flat = scope.raw[base[1]].reshape(-1)
    return flat[np.asarray(evaluate(index, scope)).astype(np.int64)]


def _eval_method(node, scope: Scope):
    _, base, method = node
    if method == "size" and base[0] == "name":
        if base[1] in scope.raw:
            return scope.raw[base[1]].size
        if base[1] in scope.specials:
            return scope.specials[base[1]]()
    raise _core.not_modelled(f".{method}() in a kernel")


_EVALUATE = {
    "num": lambda node, scope: node[1],
    "name": lambda node, scope: _lookup(scope, node[1]),
    "un": _eval_unary,
    "bin": lambda node, scope: _binary(node[1], evaluate(node[2], scope),
                                       evaluate(node[3], scope)),
    "?": _eval_choice,
    "cast": _eval_cast,
    "call": _eval_call,
    "index": _eval_index,
    "method": _eval_method,
}


def _binary(op: str, a, b):
    if op in ("/", "%") and _integers(a, b):
        if op == "/":
            quotient = np.floor_divide(a, b)
            return quotient + ((np.remainder(a, b) != 0) & ((np.asarray(a) < 0)
                                                             != (np.asarray(b) < 0)))
        return np.fmod(a, b)
    function = {
        "+": np.add, "-": np.subtract, "*": np.multiply, "/": np.true_divide, "%": np.fmod,
        "<": np.less, ">": np.greater, "<=": np.less_equal, ">=": np.greater_equal,
        "==": np.equal, "!=": np.not_equal, "&&": np.logical_and, "||": np.logical_or,
        "&": np.bitwise_and, "|": np.bitwise_or, "^": np.bitwise_xor, "<<": np.left_shift,
        ">>": np.right_shift,
    }.get(op)
    if function is None:
        raise _core.not_modelled(f"the operator {op!r} in a kernel")
    if op in _BITWISE:
        return function(a, b)
    return _flush.flushed(function(_flush.flushed(a), _flush.flushed(b)))


_BITWISE = ("&", "|", "^", "<<", ">>")  # (of integers: no -ftz)


def _integers(a, b) -> bool:
    return all(isinstance(v, (int, np.integer)) or (
        isinstance(v, np.ndarray) and v.dtype.kind in "iub") for v in (a, b))
