"""Attention variants as IR programs: the shipped ones (causal, sliding windows, ALiBi, logit softcapping,
prefix-LM) and the user's own mask and score functions.

A Python mask or score function is *traced*: called once with symbolic stand-ins (`Traced`, each wrapping a
SymPy expression) for its arguments, so what it returns is an expression tree, which is then checked against
the same whitelist as text programs (`exprs.check_expr`); nothing the user wrote is pasted into CUDA.

    mask(b, h, q, k)            -> condition: True where query q may see key k
    score_mod(s, b, h, q, k)    -> number: the score s (already scaled) as the softmax should see it
These are FlexAttention's `mask_mod(b, h, q_idx, kv_idx)` and `score_mod(score, b, h, q_idx, kv_idx)`, and they
may be written as FlexAttention users write them, computing as torch computes:
- Python operators: arithmetic, comparisons (`==` and `!=` build conditions), `//`, `%`, constant powers; `&`, `|`,
  `^`, `~` are logical on conditions (and bool tensors' elements) and integer bit operations on integers (the
  indices: Morton-order masks `(q ^ k) >> 4 == 0`), `<<` and `>>` shift integers by constants. A condition used as
  a number is 1 or 0 (`(q >= k) * 2`, `(q < k) // 2`); two conditions compare as conditions.
- torch functions and Tensor methods (`_TORCH`, `_METHODS`; they reach the stand-ins through `__torch_function__`
  and `Traced.__getattr__`): where, minimum/maximum, clamp/clip, abs, neg, sign, exp, exp2, log, log2, log1p,
  sqrt, rsqrt, pow, sigmoid, silu, tanh, erf, gelu (exact and tanh), softplus, sin, cos, tan, floor_divide,
  remainder, fmod (C's, the sign of the dividend), comparisons, logical and bitwise and/or/xor/not and shifts;
  constants (new_ones/new_zeros/new_full, zeros_like/ones_like/full_like: any shape, the value broadcasts) and casts
  (`.to(dtype)`, `.int()`, `.long()`, `.float()`, `.bool()`: to bool a number is `!= 0`, to a number a condition
  is 1 or 0, to an integer a float rounds toward zero). torch's `and_masks`, `or_masks` and `noop_mask` trace.
- Python helper functions, and numbers from closures and modules (constants of the kernel); fagen's own helpers
  below.
A score function that gives -inf (`torch.where(q_idx >= kv_idx, score, -inf)`) masks those keys
(trace_score_and_mask). Anything else (a torch function, a Tensor method, an operand the construct does not take)
is refused with an ExprError naming it; no exception of SymPy's escapes as anything else.

Tensors are read as name[i0, ...] (1 to 4 integer index expressions of b, h, q, k, M, N and constants: doc_id[q],
pos[b, q], bias[h, q - k + 4096]): further parameters name tensors passed at call time, and a tensor the function
reads from its closure or its module's globals (FlexAttention's `doc_id[q_idx] == doc_id[kv_idx]`), or that a
helper function it reaches so reads (and the masks and_masks composes), is *captured*: `captured(fn)` names it
(the variable's name; captured_<var> where that is a keyword of the kernel's calls, CALL_KEYWORDS) and the kernel is
passed the object the variable holds at each call, where the program reads it. Its dtype is part of the kernel; its
values are not, nor its sizes unless the function reads them (doc_ids.shape[0], x.size(-1), len(x): constants of
the kernel, the function keyed by them). A captured 0-d tensor is a number, its element (name[0]); a list or tuple of
numbers (or of such lists) from the closure or module of the function or of a helper it reaches, indexed by a
symbolic index, is a constant table of the kernel.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import math
import numbers
import operator
import types
from dataclasses import dataclass

import sympy as sp

from . import exprs
from .core import Node, Op, Program, TensorType
from .exprs import ExprError
from .verify import verify

_q, _k, _b, _h = (exprs.INDICES[n] for n in "qkbh")
_M, _N = exprs.DIMS["M"], exprs.DIMS["N"]


# --- the symbolic stand-in a traced function computes with ----------------------------------------------
_TRUTH = "Python's and/or/not and if need a definite truth value; use & | ~ and fagen.where (or torch.where)"


def _is_cond(e) -> bool:
    return isinstance(e, sp.logic.boolalg.Boolean) and not isinstance(e, sp.Expr)


def _sym(x):
    """The SymPy expression of a stand-in, a SymPy object or a Python number; anything else is refused."""
    if isinstance(x, Traced):
        return x.e
    if isinstance(x, (sp.Basic, bool, int, float)):
        return sp.sympify(x)
    if isinstance(x, numbers.Real):  # a NumPy scalar
        return sp.sympify(int(x) if isinstance(x, numbers.Integral) else float(x))
    if isinstance(x, _Row):
        raise ExprError(
            f"a row of {len(x.items)} elements of the tensor {x.label} is used as one number; reduce it "
            "(.sum(-1), .mean(-1), .amax(-1), .norm(dim=-1)) or index it"
        )
    if isinstance(x, (_TableMixin, _TableRow)):
        raise ExprError(f"the list {x.var} is used as a number; index it (a nested list by each of its levels)")
    if isinstance(x, _TracedTensor):
        label = x.base.label
        if x.prefix:
            raise ExprError(f"tensor {label} is read with {len(x.prefix)} of its {x.rank} indices")
        raise ExprError(f"tensor {label} must be indexed, e.g. {label}[h] or {label}[q_idx] (a 0-d tensor is not read)")
    if isinstance(helper := _helper_tensor(x), Traced):  # a 0-d tensor a helper function reads
        return helper.e
    kind = type(x).__module__.split(".")[0]
    if kind in ("torch", "cupy", "numpy"):
        raise ExprError(
            "a tensor is read that is neither a parameter of the function nor a variable of its closure or module "
            "or of a helper function's (one made in the function, or passed as an argument?); read a variable, or "
            "pass it as a parameter (e.g. score_mod(s, b, h, q, k, bias) -> s + bias[h, q - k + 64])"
        )
    raise ExprError(f"cannot use a {type(x).__name__} in a traced function")


def _num(x):
    """A number's SymPy expression: a condition used as a number is 1 where it holds, else 0 (torch's bool to
    int), so (q >= k) * 2 and (q < k) // 2 compute."""
    e = _sym(x)
    return sp.Piecewise((1, e), (0, True)) if _is_cond(e) else e


def _cond(x):
    """A condition's SymPy expression: a number used as one (a bool mask tensor's element, an integer) is != 0."""
    e = _sym(x)
    return e if _is_cond(e) else sp.Ne(e, 0)


def _wrap(e, *inputs):
    """A stand-in when any input was one (so torch functions keep reaching __torch_function__), else SymPy."""
    return Traced(e) if any(isinstance(i, Traced) for i in inputs) else e


def _logical(name: str, a, b):
    """a and b, a or b, a xor b of conditions."""
    a, b = _cond(a), _cond(b)
    if name == "and":
        return sp.And(a, b)
    if name == "or":
        return sp.Or(a, b)
    return sp.Or(sp.And(a, sp.Not(b)), sp.And(sp.Not(a), b))


def _bitwise(name: str, a, b) -> Traced:
    """&, |, ^ as torch computes them: of conditions (and bool tensors' elements), the logical and/or/xor; of
    integers (index expressions), the integer bit operation (a condition among them is 1 or 0)."""
    ea, eb = _sym(a), _sym(b)
    if all(_is_cond(x) or isinstance(x, sp.Indexed) for x in (ea, eb)):
        return Traced(_logical(name, ea, eb))
    ia, ib = _num(ea), _num(eb)
    if not (exprs.is_int_valued(ia) and exprs.is_int_valued(ib)):
        sign = {"and": "&", "or": "|", "xor": "^"}[name]
        raise ExprError(
            f"bitwise {sign} of {exprs.to_text(ia)} and {exprs.to_text(ib)}: it takes two conditions or two integers "
            "(index expressions: b, h, q, k and integer constants)"
        )
    return Traced(exprs.bitwise(name, ia, ib))


def _invert(x) -> Traced:
    """~x: of a condition (or a bool tensor's element) its negation; of an integer, -x - 1 (all bits flipped)."""
    e = _sym(x)
    if _is_cond(e) or isinstance(e, sp.Indexed):
        return Traced(sp.Not(_cond(e)))
    if not exprs.is_int_valued(e):
        raise ExprError(f"~{exprs.to_text(e)}: ~ takes a condition or an integer (an index expression)")
    return Traced(-e - 1)


def _eq(a, b, equal: bool = True) -> Traced:
    """a == b (a != b): of two conditions, whether they agree; else of numbers (a condition among them 1 or 0)."""
    ea, eb = _sym(a), _sym(b)
    if _is_cond(ea) and _is_cond(eb):
        same = _logical("xor", ea, eb)
        return Traced(sp.Not(same) if equal else same)
    return Traced((sp.Eq if equal else sp.Ne)(_num(ea), _num(eb)))


def _arith(fn, a, b):
    """fn of two numbers as a stand-in; of a row of a captured tensor (means[q_idx] of a 2-d means) and a number
    or a row, the row of fn of each element (_Row)."""
    ra, rb = _as_row(a), _as_row(b)
    if ra is not None or rb is not None:
        return _Row.elementwise(fn, a if ra is None else ra, b if rb is None else rb)
    return Traced(fn(_num(a), _num(b)))


class _NoMethod(ExprError, AttributeError):
    """A Tensor method or attribute a stand-in does not have (an AttributeError too, so that hasattr is False)."""


class _Arithmetic:
    """+ - * / on a stand-in (either side): _arith builds the expression, or refuses what _sym refuses (a tensor read
    with fewer indices than its rank: means[q_idx] - means[kv_idx], naming the tensor and the indices it lacks)."""

    __slots__ = ()

    def __add__(self, o):
        return _arith(operator.add, self, o)

    def __radd__(self, o):
        return _arith(operator.add, o, self)

    def __sub__(self, o):
        return _arith(operator.sub, self, o)

    def __rsub__(self, o):
        return _arith(operator.sub, o, self)

    def __mul__(self, o):
        return _arith(operator.mul, self, o)

    def __rmul__(self, o):
        return _arith(operator.mul, o, self)

    def __truediv__(self, o):
        return _arith(operator.truediv, self, o)

    def __rtruediv__(self, o):
        return _arith(operator.truediv, o, self)


class Traced(_Arithmetic):
    """A symbolic value: Python operators, torch functions and Tensor methods on it build the SymPy expression it
    wraps (the method table: _METHODS; the functions: _TORCH)."""

    __slots__ = ("e",)
    __hash__ = None  # type: ignore[assignment]  # == builds a condition, so a stand-in is no dictionary key

    def __init__(self, e):
        self.e = e

    def _sympy_(self):  # SymPy functions take a stand-in as its expression
        return self.e

    def __repr__(self):
        return f"Traced({self.e})"

    def __floordiv__(self, o):
        return _arith(_floordiv, self, o)

    def __rfloordiv__(self, o):
        return _arith(_floordiv, o, self)

    def __mod__(self, o):
        return _arith(_mod, self, o)

    def __rmod__(self, o):
        return _arith(_mod, o, self)

    def __pow__(self, o):
        return _arith(exprs.power, self, o)

    def __rpow__(self, o):
        return _arith(exprs.power, o, self)

    def __lshift__(self, o):
        return _arith(lambda a, b: exprs.shift(a, b, True), self, o)

    def __rlshift__(self, o):
        return _arith(lambda a, b: exprs.shift(a, b, True), o, self)

    def __rshift__(self, o):
        return _arith(lambda a, b: exprs.shift(a, b, False), self, o)

    def __rrshift__(self, o):
        return _arith(lambda a, b: exprs.shift(a, b, False), o, self)

    def __neg__(self):
        return Traced(-_num(self))

    def __pos__(self):
        return Traced(_num(self))

    def __abs__(self):
        return Traced(sp.Abs(_num(self)))

    # SymPy's own comparisons (floor(x) >= n becomes x >= n)
    def __lt__(self, o):
        return _arith(operator.lt, self, o)

    def __le__(self, o):
        return _arith(operator.le, self, o)

    def __gt__(self, o):
        return _arith(operator.gt, self, o)

    def __ge__(self, o):
        return _arith(operator.ge, self, o)

    def __eq__(self, o):  # type: ignore[override]
        return _eq(self, o)

    def __ne__(self, o):  # type: ignore[override]
        return _eq(self, o, False)

    def __and__(self, o):
        return _bitwise("and", self, o)

    def __rand__(self, o):
        return _bitwise("and", o, self)

    def __or__(self, o):
        return _bitwise("or", self, o)

    def __ror__(self, o):
        return _bitwise("or", o, self)

    def __xor__(self, o):
        return _bitwise("xor", self, o)

    def __rxor__(self, o):
        return _bitwise("xor", o, self)

    def __invert__(self):
        return _invert(self)

    def __bool__(self):
        raise ExprError(_TRUTH)

    def __float__(self):
        raise ExprError("a numeric function was called on a symbolic value; use torch functions or fagen.tanh, ...")

    __int__ = __float__

    def __index__(self):
        raise ExprError(
            "a symbolic value was used as a Python integer (range(), a list made inside the function indexed by it, "
            "...); index a list of numbers from the closure or module, or a tensor (offsets = torch.tensor(values))"
        )

    def __getattr__(self, name):
        """Tensor methods (score.tanh(), q_idx.clamp(0, 64), b.new_ones((), dtype=torch.bool), x.to(torch.bool))
        and the attributes dtype, device, shape, ndim; anything else is refused, naming it."""
        if name.startswith("_"):
            raise AttributeError(name)
        method = _METHODS.get(name)
        if method is not None:
            return functools.partial(method, self)
        if name in ("dtype", "device", "shape", "ndim"):
            return _attribute(self, name)
        raise _NoMethod(f"Tensor.{name} is not among the Tensor methods a traced mask or score may use")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        rule = _TORCH.get(name[len("special_") :] if name.startswith("special_") else name)
        if rule is None:
            raise ExprError(f"torch.{name} is not among the functions a traced mask or score may use")
        return rule(*args, **(kwargs or {}))


class _Element(Traced):
    """A captured 0-d tensor's stand-in: its element, name[0], a number (not a sequence, so no __getitem__ on
    Traced itself: SymPy takes an object that has one as a sequence)."""

    __slots__ = ()

    def __getitem__(self, index):
        raise ExprError(f"{exprs.to_text(self.e)} is a number, not indexed (a 0-d tensor is read as its element)")


def _divisor(op: str, a, b):
    """Refuse a division by zero, and an integer division whose divisor may be zero (q // (k < 5))."""
    if b.is_zero or (exprs.is_int_valued(a) and exprs.is_int_valued(b) and _may_be_zero(b)):
        raise ExprError(f"{_operand(a)} {op} {_operand(b)}: the divisor may be zero")


def _operand(e) -> str:
    return exprs.to_text(e) if e.is_Atom or isinstance(e, sp.Function) else f"({exprs.to_text(e)})"


def _may_be_zero(e) -> bool:
    lo, hi = exprs.int_range(e)
    return lo <= 0 <= hi


def _floordiv(a, b):
    _divisor("//", a, b)
    return sp.floor(a / b)


def _mod(a, b):
    _divisor("%", a, b)
    return sp.Mod(a, b)


def _fmod(a, b):
    _divisor("fmod", a, b)
    return exprs.fmod(a, b)


# --- functions for traced code (symbolic where Python's own would ask for a number) ---------------------
def where(condition, a, b):
    """`a` where `condition` holds, else `b` (of two conditions, a condition)."""
    c, ea, eb = _cond(condition), _sym(a), _sym(b)
    if _is_cond(ea) and _is_cond(eb):
        return _wrap(sp.Or(sp.And(c, ea), sp.And(sp.Not(c), eb)), condition, a, b)
    return _wrap(sp.Piecewise((_num(ea), c), (_num(eb), True)), condition, a, b)


def minimum(a, b):
    return _wrap(sp.Min(_num(a), _num(b)), a, b)


def maximum(a, b):
    return _wrap(sp.Max(_num(a), _num(b)), a, b)


def tanh(x):
    return _wrap(sp.tanh(_num(x)), x)


def exp(x):
    return _wrap(sp.exp(_num(x)), x)


def log(x):
    return _wrap(sp.log(_num(x)), x)


def sigmoid(x):
    return _wrap(1 / (1 + sp.exp(-_num(x))), x)


def eq(a, b):
    """a == b as a condition (on stand-ins `==` does the same)."""
    return _wrap(_eq(a, b).e, a, b)


def ne(a, b):
    """a != b as a condition."""
    return _wrap(_eq(a, b, False).e, a, b)


def _clamp(x, min=None, max=None):
    out = x
    if min is not None:
        out = maximum(out, min)
    if max is not None:
        out = minimum(out, max)
    return Traced(_num(out))


def _unary(fn):
    """A torch function of one number (its other arguments refused)."""

    def rule(x, *, out=None, inplace=False):
        if out is not None or inplace:
            raise ExprError("out= and inplace=True are not supported in a traced function")
        return Traced(fn(_num(x)))

    return rule


def _gelu(x, approximate="none"):
    """torch's gelu: x·Φ(x), Φ by erf ('none') or by tanh ('tanh')."""
    x = _num(x)
    if approximate == "none":
        return Traced(x * (1 + sp.erf(x * sp.Float(1 / math.sqrt(2)))) / 2)
    if approximate == "tanh":
        inner = sp.Float(math.sqrt(2 / math.pi)) * (x + sp.Float(0.044715) * x**3)
        return Traced(x * (1 + sp.tanh(inner)) / 2)
    raise ExprError(f"gelu: approximate={approximate!r}; expected 'none' or 'tanh'")


def _softplus(x, beta=1.0, threshold=20.0):
    """torch's softplus: log(1 + exp(beta·x)) / beta, and x itself where beta·x > threshold."""
    x, beta, threshold = _num(x), _num(beta), _num(threshold)
    if not (beta.is_Number and threshold.is_Number and beta != 0):
        raise ExprError("softplus: beta and threshold must be constants (beta not 0)")
    beta, threshold = (sp.Integer(int(c)) if c.is_Float and float(c).is_integer() else c for c in (beta, threshold))
    return Traced(sp.Piecewise((x, beta * x > threshold), (exprs.log1p(sp.exp(beta * x)) / beta, True)))


def _trunc(e):
    """Rounding toward zero (a float cast to an integer type)."""
    return e if exprs.is_int_valued(e) else sp.Piecewise((sp.floor(e), e >= 0), (sp.ceiling(e), True))


def _kind(e) -> str:
    """'bool', 'int' or 'float': the dtype kind a stand-in's value has."""
    return "bool" if _is_cond(e) else "int" if exprs.is_int_valued(e) else "float"


def _dtype_kind(dtype) -> str | None:
    """'bool', 'int' or 'float' for a torch dtype (or Python's bool, int, float; or a stand-in: its own); None for
    what casts nothing (a device)."""
    if isinstance(dtype, Traced):
        return _kind(dtype.e)
    if dtype in (bool, int, float):
        return dtype.__name__
    if type(dtype).__name__ == "dtype" and type(dtype).__module__.startswith("torch"):
        if dtype.is_complex:
            raise ExprError(f"a cast to {dtype} (complex) is not supported in a traced function")
        return "bool" if str(dtype) == "torch.bool" else "float" if dtype.is_floating_point else "int"
    if isinstance(dtype, str) or type(dtype).__name__ == "device":
        return None
    raise ExprError(f"cannot cast to {dtype!r} in a traced function")


def _cast(x, kind: str | None) -> Traced:
    """x as a value of that kind: to bool a number is != 0; to int or float a condition is 1 or 0, and to int a
    float rounds toward zero (a tensor's element keeps its value: the kernels read integer tensors as integers)."""
    e = _sym(x)
    if kind == "bool":
        return Traced(_cond(e))
    e = _num(e)
    if kind == "int" and not isinstance(e, sp.Indexed):
        e = _trunc(e)
    return Traced(e)


def _to(x, *args, dtype=None, **_ignored):
    """Tensor.to(dtype), .to(device), .to(other), .to(device, dtype): the cast the dtype says."""
    kinds = [k for k in (_dtype_kind(a) for a in (*args, dtype) if a is not None) if k is not None]
    return _cast(x, kinds[-1] if kinds else None)


def _full(like, value, dtype=None) -> Traced:
    """A constant shaped like `like` (any shape broadcasts: the value is a scalar), of dtype `dtype` (default:
    like's)."""
    kind = _dtype_kind(dtype) if dtype is not None else _kind(_sym(like))
    return _cast(value, kind)


def _new(value):
    def rule(x, *size, dtype=None, **_ignored):  # size (any shape, the value broadcasts), device, requires_grad
        return _full(x, value, dtype)

    return rule


def _new_full(x, size, fill_value, *, dtype=None, **_ignored):
    return _full(x, fill_value, dtype)


def _like(value):
    def rule(x, dtype=None, **_ignored):  # layout, device, requires_grad, memory_format
        return _full(x, value, dtype)

    return rule


def _full_like(x, fill_value, dtype=None, **_ignored):
    return _full(x, fill_value, dtype)


def _item(x: Traced) -> Traced:
    """x.item() of a tensor's element (a captured 0-d tensor's: scale.item()); of the indices or the score, under
    FlexAttention's vmap, torch raises, and so does fagen."""
    if isinstance(x.e, sp.Indexed):
        return x
    raise _NoMethod("Tensor.item is not among the Tensor methods a traced mask or score may use (but of a 0-d tensor)")


def _attribute(x: Traced, name: str):
    """A stand-in's dtype (bool, int64 or float32, by what it holds), device (None), shape (()) and ndim (0)."""
    if name == "dtype":
        import torch

        return {"bool": torch.bool, "int": torch.int64, "float": torch.float32}[_kind(x.e)]
    return {"device": None, "shape": (), "ndim": 0}[name]


def _binary(fn):
    return lambda a, b: _arith(fn, a, b)


def _reflected(fn):
    return lambda a, b: _arith(fn, b, a)


def _shift(left: bool):
    return lambda a, b: _arith(lambda x, n: exprs.shift(x, n, left), a, b)


def _div(a, b, rounding_mode=None):
    if rounding_mode is None:
        return _arith(operator.truediv, a, b)
    if rounding_mode == "floor":
        return _arith(_floordiv, a, b)
    if rounding_mode == "trunc":
        return _arith(lambda x, y: _trunc(x / y), a, b)
    raise ExprError(f"div: rounding_mode={rounding_mode!r}; expected None, 'floor' or 'trunc'")


def _not_captured(name):
    def refuse(*args, **kwargs):
        for a in args:
            _sym(a)  # a captured tensor among the arguments: refused, saying so
        raise ExprError(f"torch.{name} is not among the functions a traced mask or score may use")

    return refuse


# torch functions by name, as __torch_function__ sees them (torch.clamp(x, ...), F.gelu(x), torch.special.erf(x))
_TORCH = {
    "where": lambda c, a, b: Traced(_sym(where(c, a, b))),
    "minimum": minimum,
    "maximum": maximum,
    "fmin": minimum,
    "fmax": maximum,
    "clamp": _clamp,
    "clip": _clamp,
    "clamp_min": lambda x, min: _clamp(x, min=min),
    "clamp_max": lambda x, max: _clamp(x, max=max),
    "abs": _unary(sp.Abs),
    "absolute": _unary(sp.Abs),
    "neg": _unary(operator.neg),
    "negative": _unary(operator.neg),
    "sign": _unary(sp.sign),
    "sgn": _unary(sp.sign),
    "square": _unary(lambda x: x**2),
    "exp": _unary(sp.exp),
    "exp2": _unary(lambda x: 2**x),
    "log": _unary(sp.log),
    "log2": _unary(lambda x: sp.log(x) / sp.log(2)),
    "log10": _unary(lambda x: sp.log(x) / sp.log(10)),
    "log1p": _unary(exprs.log1p),
    "sqrt": _unary(sp.sqrt),
    "rsqrt": _unary(lambda x: 1 / sp.sqrt(x)),
    "reciprocal": _unary(lambda x: 1 / x),
    "sigmoid": _unary(lambda x: 1 / (1 + sp.exp(-x))),
    "silu": _unary(lambda x: x / (1 + sp.exp(-x))),
    "expit": _unary(lambda x: 1 / (1 + sp.exp(-x))),
    "tanh": _unary(sp.tanh),
    "erf": _unary(sp.erf),
    "sin": _unary(sp.sin),
    "cos": _unary(sp.cos),
    "tan": _unary(sp.tan),
    "relu": _unary(lambda x: sp.Max(x, 0)),
    "floor": _unary(sp.floor),
    "ceil": _unary(sp.ceiling),
    "trunc": _unary(_trunc),
    "fix": _unary(_trunc),
    "gelu": _gelu,
    "softplus": _softplus,
    "pow": lambda a, b: _arith(exprs.power, a, b),
    "float_power": lambda a, b: _arith(exprs.power, a, b),
    "eq": eq,
    "ne": ne,
    "not_equal": ne,
    "lt": _binary(operator.lt),
    "less": _binary(operator.lt),
    "le": _binary(operator.le),
    "less_equal": _binary(operator.le),
    "gt": _binary(operator.gt),
    "greater": _binary(operator.gt),
    "ge": _binary(operator.ge),
    "greater_equal": _binary(operator.ge),
    "logical_and": lambda a, b: Traced(_logical("and", a, b)),
    "logical_or": lambda a, b: Traced(_logical("or", a, b)),
    "logical_xor": lambda a, b: Traced(_logical("xor", a, b)),
    "logical_not": lambda a: Traced(sp.Not(_cond(a))),
    "bitwise_and": lambda a, b: _bitwise("and", a, b),
    "bitwise_or": lambda a, b: _bitwise("or", a, b),
    "bitwise_xor": lambda a, b: _bitwise("xor", a, b),
    "bitwise_not": _invert,
    "bitwise_left_shift": _shift(True),
    "bitwise_right_shift": _shift(False),
    "add": lambda a, b, alpha=1: _arith(lambda x, y: x + alpha * y, a, b),
    "sub": lambda a, b, alpha=1: _arith(lambda x, y: x - alpha * y, a, b),
    "subtract": lambda a, b, alpha=1: _arith(lambda x, y: x - alpha * y, a, b),
    "mul": _binary(operator.mul),
    "multiply": _binary(operator.mul),
    "div": _div,
    "divide": _div,
    "true_divide": _binary(operator.truediv),
    "floor_divide": _binary(_floordiv),
    "remainder": _binary(_mod),
    "fmod": _binary(_fmod),
    "zeros_like": _like(0),
    "ones_like": _like(1),
    "full_like": _full_like,
    "__getitem__": lambda obj, index: _getitem(obj, index),
    # a torch tensor's operators (a 0-d tensor a helper function reads, `scale * s`; any other is refused by _sym)
    **{f"__{n}__": _binary(getattr(operator, n)) for n in ("add", "sub", "mul", "truediv", "lt", "le", "gt", "ge")},
    **{f"__r{n}__": _reflected(getattr(operator, n)) for n in ("add", "sub", "mul", "truediv")},
    "__eq__": eq,
    "__ne__": ne,
}

# Tensor methods by name (x.clamp(0, 64), score.exp2()): the functions above with the tensor first, and the methods
# torch has no function for
_METHODS = {
    **{n: f for n, f in _TORCH.items() if not n.startswith("_") and n not in ("where", "fmin", "fmax", "expit")},
    "where": lambda x, condition, y: _TORCH["where"](condition, x, y),
    "new_ones": _new(1),
    "new_zeros": _new(0),
    "new_full": _new_full,
    "to": _to,
    "type_as": lambda x, other: _cast(x, _dtype_kind(other)),
    "bool": lambda x: _cast(x, "bool"),
    **{n: (lambda x: _cast(x, "int")) for n in ("int", "long", "short", "char", "byte")},
    **{n: (lambda x: _cast(x, "float")) for n in ("float", "double", "half", "bfloat16")},
    **{n: (lambda x: x) for n in ("clone", "detach", "contiguous")},
    "item": lambda x: _item(x),
}


def _structural_comparisons(code) -> list[str]:
    """`is` / `in` in a function's bytecode (and nested code): on stand-ins they give plain bools."""
    import dis

    found = []
    for ins in dis.get_instructions(code):
        if ins.opname in ("IS_OP", "CONTAINS_OP"):
            found.append({"IS_OP": "is", "CONTAINS_OP": "in"}[ins.opname])
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            found += _structural_comparisons(const)
    return found


# --- tensors captured from the enclosing scope -----------------------------------------------------------------
def is_array(x) -> bool:
    """A PyTorch tensor, CuPy or NumPy array: what a traced function may capture and read as a tensor."""
    mod = type(x).__module__.split(".")[0]
    return (
        mod in ("torch", "cupy", "numpy")
        and hasattr(x, "shape")
        and hasattr(x, "dtype")
        and not isinstance(x, numbers.Number)  # a NumPy scalar is a number
    )


@dataclass(frozen=True)
class Captured:
    """A tensor a traced function reads from its closure (`where` = "closure") or its module's globals
    ("global"), by the variable `var`; `name` is its name in the program and the kernel (`var`, or
    `captured_<var>` where `var` is not a valid tensor name or is a keyword of the kernel's calls (CALL_KEYWORDS:
    `scale`, `out`, ...), or `var_2`, ... where another tensor has it). A tensor
    a helper function reads (a function the traced one calls, or one of the masks torch's and_masks composes) has
    a `path`: the steps from the traced function to that one, each ("closure" or "global", variable) or ("item",
    position in a tuple or list)."""

    name: str
    where: str
    var: str
    path: tuple = ()

    def raw(self, fn):
        """The object the variable holds now."""
        for kind, key in self.path:
            fn = _variable(fn, kind, key)
        return _variable(fn, self.where, self.var)

    def value(self, fn):
        """The tensor the kernel reads at this call: the object the variable holds now, a 0-d one as a 1-element
        view of it (read as name[0]; a float one's gradient flows back through the view)."""
        x = self.raw(fn)
        return x.reshape(1) if len(getattr(x, "shape", (1,))) == 0 else x


def _variable(fn, kind: str, key):
    if kind == "closure":
        return fn.__closure__[fn.__code__.co_freevars.index(key)].cell_contents
    if kind == "global":
        return fn.__globals__[key]
    return fn[key]


# The parameters of the kernel's calls (fagen.runtime.kernel.Kernel: __call__, varlen, decode, backward, ...): the
# kernel is passed its captured tensors by name beside them (kernel(q, k, v, scale=..., **tensors)), so no captured
# tensor is named like one (tests/test_trace_captures.py holds this set to Kernel's signatures)
CALL_KEYWORDS = frozenset(
    {
        *("q", "k", "v", "o", "lse", "do", "k_cache", "v_cache", "cache_seqlens", "block_table", "k_new", "v_new"),
        *("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "num_splits", "validate"),
        *("scale", "return_lse", "out", "out_lse", "block_mask", "deterministic", "tensor_grads", "float32_dkv"),
    }
)


def _captured_name(var: str, what: str, taken=()) -> str:
    """A captured tensor's name: its variable's, else captured_<var> where that is no tensor name or a keyword of
    the kernel's calls (CALL_KEYWORDS), each with _2, _3, ... where another captured tensor has it."""
    for base in (var, "captured_" + var.strip("_")):
        for name in [base] + [f"{base}_{n}" for n in range(2, 10)]:
            try:
                exprs.tensor(name)
            except ExprError:
                break
            if name in CALL_KEYWORDS:
                break
            if name not in taken:
                return name
    raise ExprError(f"{what}: the captured tensor {var!r} has no usable name; rename the variable")


def _code_names(code) -> list[str]:
    """The global names a function's code reads, its nested functions' (lambdas, comprehensions) included."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += [n for n in _code_names(const) if n not in names]
    return names


def _references(fn):
    """(where, variable, value) of each closure variable of fn and each global its code reads (a closure
    variable first)."""
    code = fn.__code__
    seen = set()
    for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        seen.add(var)
        yield "closure", var, value
    module = getattr(fn, "__globals__", {})
    for var in _code_names(code):
        if var not in seen and var in module:
            yield "global", var, module[var]


def _helpers(value) -> list[tuple[tuple, types.FunctionType]]:
    """The Python functions a variable holds: itself, or those of a tuple or list (and_masks' mask_mods)."""
    if isinstance(value, types.FunctionType):
        return [((), value)]
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return [((("item", i),), v) for i, v in enumerate(value) if isinstance(v, types.FunctionType)]
    return []


MAX_HELPER_DEPTH = 4


def captured(fn, what: str = "function") -> tuple[Captured, ...]:
    """The tensors `fn` reads from its own closure and its module's globals (variables its code names that hold
    an array now), and those the Python functions it reaches so read (helpers it calls, the masks torch's and_masks
    composes; MAX_HELPER_DEPTH deep), sorted by name; one object has one name."""
    if getattr(fn, "__code__", None) is None:
        return ()
    found: dict[int, Captured] = {}  # by the object's id: one tensor, one name
    visited = {id(fn)}
    queue = [(fn, ())]  # breadth first: fn's own variables keep their names
    for depth in range(MAX_HELPER_DEPTH + 1):
        later = []
        for f, path in queue:
            for where, var, value in _references(f):
                if is_array(value):
                    if id(value) not in found:
                        name = _captured_name(var, what, {c.name for c in found.values()})
                        found[id(value)] = Captured(name, where, var, path)
                    continue
                for steps, helper in _helpers(value) if depth < MAX_HELPER_DEPTH else ():
                    if id(helper) not in visited and getattr(helper, "__code__", None) is not None:
                        visited.add(id(helper))
                        later.append((helper, path + ((where, var),) + steps))
        queue = later
    return tuple(sorted(found.values(), key=lambda c: c.name))


# The stand-ins of the tensors the traced function reaches through helpers, by the object's id, while it is traced:
# a torch tensor indexed by a stand-in reaches Traced.__torch_function__ (_getitem)
_HELPER_TENSORS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fagen_helper_tensors", default=None)


def _getitem(obj, index):
    stand_in = (_HELPER_TENSORS.get() or {}).get(id(obj))
    if stand_in is None:
        return _not_captured("__getitem__")(obj, index)
    return stand_in[index]  # a 0-d tensor's stand-in (an _Element) refuses, saying so


def _helper_tensor(x):
    """The stand-in of a tensor a helper function reads (a torch tensor reaching a torch function), else None."""
    return (_HELPER_TENSORS.get() or {}).get(id(x))


def _stand_in(c: Captured, fn) -> _TracedTensor | Traced:
    """The stand-in of a captured tensor, of the rank the object has now; a 0-d tensor is a call-time number, its
    element: name[0] (Captured.value passes the kernel a 1-element view)."""
    sizes = tuple(int(n) for n in getattr(c.raw(fn), "shape", ()))
    if not sizes:
        return _Element(_TracedTensor(exprs.tensor(c.name), 1)[0].e)
    return _TracedTensor(exprs.tensor(c.name), len(sizes), sizes=sizes)


MAX_TABLE = 64  # the most numbers of a list (or tuple) a traced function may index by a symbolic value
MAX_TABLE_DEPTH = 4  # the most levels of nested lists a table has (tab[h][q % 4])


def _is_table(value, depth: int = 1) -> bool:
    """A list or tuple of numbers (not bools alone), or of such lists (nested, MAX_TABLE_DEPTH levels at most):
    what a traced function may index by a symbolic value."""
    if type(value) not in (list, tuple) or not value or depth > MAX_TABLE_DEPTH:  # a namedtuple keeps its fields
        return False
    if all(isinstance(v, numbers.Real) for v in value):
        return not all(isinstance(v, bool) for v in value)
    return all(_is_table(v, depth + 1) for v in value)


def _numbers(table) -> int:
    """How many numbers a (nested) table holds."""
    return sum(_numbers(v) if isinstance(v, (list, tuple)) else 1 for v in table)


def _chosen(var: str, pieces: list):
    """The value at a symbolic index among `pieces` ((value, condition), the last one's True): numbers give their
    Piecewise, rows of a nested table a _TableRow (indexed on, each row alike)."""
    if all(isinstance(v, (_TableMixin, _TableRow)) for v, _ in pieces):
        return _TableRow(var, pieces)
    if any(isinstance(v, (_TableMixin, _TableRow)) for v, _ in pieces):
        raise ExprError(f"the list {var} mixes numbers and lists at one level; index it by constants there")
    vals, conds = [_num(v) for v, _ in pieces], [c for _, c in pieces[:-1]]
    return Traced(sp.Piecewise(*zip(vals, conds), (vals[-1], True)) if conds else vals[0])


class _TableMixin:
    """A list (or tuple) of numbers the traced function reads from its closure or module, as a constant table of
    the kernel: indexed by a symbolic integer it is the entry at that index, clamped to the table as tensor reads are
    (a Piecewise of the values; of a nested table's rows, a _TableRow); anything else is the list's own (a subclass of
    its type)."""

    var = ""

    def __getitem__(self, index):
        if not isinstance(index, Traced):
            return super().__getitem__(index)  # type: ignore[misc]
        i = _sym(index)
        if _is_cond(i) or not exprs.is_int_valued(i):
            raise ExprError(f"the list {self.var} is indexed by {exprs.to_text(i)}, which is not an integer")
        if (count := _numbers(self)) > MAX_TABLE:
            raise ExprError(
                f"the list {self.var} ({count} numbers) is indexed by a symbolic value; at most "
                f"{MAX_TABLE} numbers are built into the kernel: make it a tensor and index that"
            )
        rows = list(self)  # type: ignore[call-overload]
        return _chosen(self.var, [(v, sp.Le(i, n)) for n, v in enumerate(rows[:-1])] + [(rows[-1], sp.true)])


class _TableList(_TableMixin, list):
    pass


class _TableTuple(_TableMixin, tuple):
    pass


class _TableRow(_Arithmetic):
    """A row of a nested table chosen by a symbolic index (rows[h] of rows = [[...], [...]]): indexed on, the entry of
    each row at that index, chosen as the row is (arithmetic on it is refused by _sym, naming the list)."""

    __slots__ = ("var", "pieces")

    def __init__(self, var: str, pieces: list):
        self.var, self.pieces = var, pieces

    def __getitem__(self, index):
        return _chosen(self.var, [(row[index], c) for row, c in self.pieces])


def _table(var: str, value):
    """A (nested) list of numbers as a _Table, its lists too."""
    items = [_table(f"{var}[{n}]", v) if isinstance(v, (list, tuple)) else v for n, v in enumerate(value)]
    table = _TableList(items) if isinstance(value, list) else _TableTuple(items)
    table.var = var
    return table


def _with_stand_ins(fn, caps: tuple[Captured, ...]):
    """fn with each captured tensor replaced by a stand-in, and each list of numbers it reads (a closure or module
    variable) by a _Table, in fn and in the helper functions it reaches (_substituted); fn itself where there is
    nothing to replace."""
    given = {(c.where, c.var): _stand_in(c, fn) for c in caps if not c.path}  # helpers' tensors: _HELPER_TENSORS
    if not isinstance(fn, types.FunctionType):  # a bound method, a callable object: its tensors by _HELPER_TENSORS
        return fn
    needs: dict[int, bool] = {}
    if not given and not _reads_tables(fn, 0, needs):
        return fn
    return _substituted(fn, given, 0, needs, {})


def _reads_tables(fn, depth: int, needs: dict) -> bool:
    """Whether fn, or a helper function it reaches (MAX_HELPER_DEPTH deep), reads a list of numbers (memo: `needs`,
    by the function's id; a function reached again while it is looked at counts as reading none)."""
    if id(fn) not in needs:
        needs[id(fn)] = False
        needs[id(fn)] = any(
            _is_table(value)
            or (depth < MAX_HELPER_DEPTH and any(_reads_tables(f, depth + 1, needs) for _, f in _helpers(value)))
            for _, _, value in _references(fn)
        )
    return needs[id(fn)]


def _substituted(fn, given: dict, depth: int, needs: dict, done: dict):
    """A copy of fn (the original untouched) whose variables (closure cells, module globals) hold the `given`
    stand-ins, each list of numbers as a _Table, and each helper function that reads one (_reads_tables) so
    substituted, MAX_HELPER_DEPTH deep (`done`: the copies made, by the original's id; a helper reached again,
    recursion included, calls its copy)."""
    if id(fn) in done:
        return done[id(fn)]
    replaced = {}
    for where, var, value in _references(fn):
        helpers = [f for _, f in _helpers(value)] if depth < MAX_HELPER_DEPTH else []
        if (where, var) in given or _is_table(value) or any(_reads_tables(f, depth + 1, needs) for f in helpers):
            replaced[(where, var)] = value
    if not replaced:
        done[id(fn)] = fn
        return fn
    module = dict(fn.__globals__) if any(where == "global" for where, _ in replaced) else fn.__globals__
    cells = tuple(_cell_copy(c) for c in fn.__closure__ or ())
    new = types.FunctionType(fn.__code__, module, fn.__name__, fn.__defaults__, cells or None)
    new.__kwdefaults__ = getattr(fn, "__kwdefaults__", None)
    done[id(fn)] = new
    for (where, var), value in replaced.items():
        if (where, var) in given:
            value = given[(where, var)]
        elif _is_table(value):
            value = _table(var, value)
        elif isinstance(value, types.FunctionType):
            value = _substituted(value, {}, depth + 1, needs, done)
        elif type(value) in (list, tuple):  # and_masks' mask_mods
            value = type(value)(
                _substituted(f, {}, depth + 1, needs, done) if isinstance(f, types.FunctionType) else f for f in value
            )
        if where == "global":
            module[var] = value
        else:
            cells[fn.__code__.co_freevars.index(var)].cell_contents = value
    return new


def _cell_copy(cell):
    """A new closure cell holding what `cell` holds (empty where it is)."""
    try:
        return types.CellType(cell.cell_contents)
    except ValueError:
        return types.CellType()


def _trace(fn, leading: tuple[str, ...], names: dict, what: str, condition: bool) -> sp.Basic:
    result, allowed = _run(fn, leading, names, what)
    return _checked(result, names, what, condition, allowed)


def _checked(result, names: dict, what: str, condition: bool, allowed: list[str]) -> sp.Basic:
    """exprs.check_expr of a traced result; a SymPy failure in it is an ExprError naming the expression."""
    try:
        return exprs.check_expr(result, names, what=what, condition=condition, tensors=allowed)
    except ExprError:
        raise
    except Exception as e:  # SymPy failing on an expression it was given: refused, naming the expression
        raise ExprError(f"{what}: cannot use {result} ({type(e).__name__}: {e})") from None


def _run(fn, leading: tuple[str, ...], names: dict, what: str) -> tuple[object, list[str]]:
    """What `fn` returns called with stand-ins (a SymPy expression, or a Python value), and the names of the
    call-time tensors it may read."""
    if not callable(fn):
        raise TypeError(f"{what}: expected a function, got {type(fn).__name__}")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        raise TypeError(f"{what}: cannot read the function's parameters") from None
    if len(params) < len(leading) or any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        raise TypeError(
            f"{what}: expected a function of ({', '.join(leading)}[, tensors...]), "
            f"got one of ({', '.join(p.name for p in params)})"
        )
    code = getattr(fn, "__code__", None)
    if code is not None and (bad := _structural_comparisons(code)):
        raise ExprError(
            f"{what}: '{bad[0]}' compares objects in Python and gives a plain True/False; use == / != "
            "(or fagen.eq / fagen.ne)"
        )
    args: list[Traced | _TracedTensor] = [Traced(names[n]) for n in leading]
    caps = captured(fn, what)
    clash = [c.name for c in caps if c.name in {p.name for p in params}]
    if clash:
        raise ExprError(f"{what}: the captured tensor {clash[0]!r} has the name of a parameter; rename one")
    helper_tensors = {id(c.raw(fn)): _stand_in(c, fn) for c in caps}
    fn = _with_stand_ins(fn, caps)
    args += _parameter_tensors(params[len(leading) :], what)
    token = _HELPER_TENSORS.set(helper_tensors)
    try:
        result = fn(*args)
        result = _sym(result) if isinstance(result, (_Row, _TracedTensor)) else result  # refused, saying why
        result = result.e if isinstance(result, Traced) else result
    except ExprError as e:
        raise ExprError(f"{what}: {e}") from None
    except TypeError as e:
        msg = str(e)
        if "truth value" in msg or "cannot determine" in msg:
            raise ExprError(
                f"{what}: Python's and/or/not and if need a definite truth value; use & | ~ and fagen.where instead"
            ) from None
        if "convert" in msg or "float" in msg:
            raise ExprError(
                f"{what}: a numeric function was called on a symbolic value; use fagen.tanh, "
                "fagen.exp, fagen.log, fagen.minimum, fagen.maximum, fagen.where"
            ) from None
        raise ExprError(f"{what}: tracing the function failed: {e}") from None
    except Exception as e:  # the user's function raised for its own reasons
        if _in_autograd_function(e):
            raise ExprError(
                f"{what}: a torch.autograd.Function is not traced (fagen derives the backward from the forward "
                "itself); write its forward in the function instead"
            ) from None
        raise ExprError(f"{what}: tracing the function raised {type(e).__name__}: {e}") from None
    finally:
        _HELPER_TENSORS.reset(token)
    # extra parameters and captured tensors are call-time tensors: name[...] in the result, checked like any other
    # construct
    return result, [p.name for p in params[len(leading) :]] + [c.name for c in caps]


def _parameter_tensors(params, what: str) -> list[_TracedTensor]:
    """The stand-ins of a traced function's further parameters: tensors passed by name at call time."""
    out = []
    for p in params:
        if p.name in CALL_KEYWORDS:
            raise ExprError(
                f"{what}: the parameter {p.name!r} names a tensor passed by name at call time, but {p.name}= is an "
                "argument of the kernel's own; rename the parameter"
            )
        try:
            out.append(_TracedTensor(exprs.tensor(p.name)))
        except ExprError as e:
            raise ExprError(f"{what}: {e}") from None
    return out


def _in_autograd_function(e: BaseException) -> bool:
    """Whether the exception was raised inside torch.autograd.Function's machinery (Function.apply on stand-ins)."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("torch/autograd/function.py"):
            return True
        tb = tb.tb_next
    return False


MAX_ROW = (
    16  # the most elements of a captured tensor's row (means[q_idx] of means [S, 3]) a traced function computes on
)


def _as_row(x):
    """x as a _Row: itself, or a captured tensor indexed by all its indices but the last (a row of known length)."""
    if isinstance(x, _Row):
        return x
    return x._row() if isinstance(x, _TracedTensor) else None


_REDUCE = {
    "sum": lambda xs: sp.Add(*xs),
    "mean": lambda xs: sp.Add(*xs) / len(xs),
    "prod": lambda xs: sp.Mul(*xs),
    "amax": lambda xs: sp.Max(*xs),
    "amin": lambda xs: sp.Min(*xs),
    "norm": lambda xs: sp.sqrt(sp.Add(*(x**2 for x in xs))),
}


class _Row(_Arithmetic):
    """A row of a captured tensor (means[q_idx] of a [S, 3] means: means[q_idx, 0], means[q_idx, 1], ...), as a
    list of stand-ins of its elements: arithmetic, torch functions and Tensor methods apply element by element, and
    the reductions (sum, mean, prod, amax, amin, norm over its one dimension) give a number (FlexAttention's
    `(means[q_idx] - means[kv_idx]).pow(2).sum(-1).sqrt()`). Its length is a constant of the kernel (a function
    that reduces is keyed by its captured tensors' sizes: request.function_key)."""

    __slots__ = ("items", "label")

    def __init__(self, items: list, label: str):
        self.items, self.label = items, label

    @staticmethod
    def elementwise(fn, a, b) -> _Row:
        rows = [x for x in (a, b) if isinstance(x, _Row)]
        n = len(rows[0].items)
        if any(len(r.items) != n for r in rows):
            raise ExprError(f"rows of {len(rows[0].items)} and {len(rows[1].items)} elements are combined")
        ai = a.items if isinstance(a, _Row) else [a] * n
        bi = b.items if isinstance(b, _Row) else [b] * n
        return _Row([_arith(fn, x, y) for x, y in zip(ai, bi)], rows[0].label)

    def reduce(self, name: str, dim=None, keepdim=False, **kwargs):
        other = {k: v for k, v in kwargs.items() if v is not None and not (k == "p" and v in (2, 2.0, "fro"))}
        if dim not in (None, 0, -1, (0,), (-1,), [0], [-1]) or keepdim or other:
            raise ExprError(f"Tensor.{name} of a row of the tensor {self.label}: reduce over its one dimension")
        return Traced(_REDUCE[name]([_num(x) for x in self.items]))

    def __getitem__(self, index):
        if isinstance(index, int):
            return self.items[index]
        raise ExprError(f"a row of the tensor {self.label} is indexed by {index!r}; index it by an integer constant")

    def __len__(self):
        return len(self.items)

    def __neg__(self):
        return _Row([-x for x in self.items], self.label)

    def __abs__(self):
        return _Row([abs(x) for x in self.items], self.label)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _REDUCE:
            return functools.partial(self.reduce, name)
        method = _METHODS.get(name)
        if method is None:
            raise _NoMethod(f"Tensor.{name} of a row of the tensor {self.label} is not among the methods a row takes")
        return lambda *args, **kwargs: _Row.apply(lambda *a: method(*a, **kwargs), (self, *args))

    @staticmethod
    def apply(rule, args) -> _Row:
        """rule of each element: the rows among args replaced by their j-th element."""
        rows = [a for a in args if isinstance(a, _Row)]
        n = len(rows[0].items)
        if any(len(r.items) != n for r in rows):
            raise ExprError("rows of different lengths are combined")
        return _Row([rule(*(a.items[j] if isinstance(a, _Row) else a for a in args)) for j in range(n)], rows[0].label)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        kwargs = kwargs or {}
        if name in _REDUCE and isinstance(args[0], _Row):
            return args[0].reduce(name, *args[1:], **kwargs)
        return _Row.apply(lambda *a: Traced.__torch_function__(func, types, a, kwargs), args)


class _TracedTensor(_Arithmetic):
    """A call-time tensor (a parameter or a captured tensor): indexing it gives a stand-in for the element read. A
    captured tensor's rank is known: indexed by fewer indices it gives the rest of the tensor, indexed on
    (bias[b][q_idx] reads bias[b, q_idx])."""

    __slots__ = ("base", "rank", "prefix", "sizes")

    def __init__(self, base, rank: int | None = None, prefix: tuple = (), sizes: tuple | None = None):
        self.base, self.rank, self.prefix, self.sizes = base, rank, prefix, sizes

    def __getitem__(self, index):
        index = self.prefix + (tuple(_sym(i) for i in index) if isinstance(index, tuple) else (_sym(index),))
        if self.rank is not None and len(index) < self.rank:
            return _TracedTensor(self.base, self.rank, index, self.sizes)
        read = self.base[tuple(exprs.as_index(i) for i in index)]  # a read inside an index: an integer
        exprs.check_tensor_read(read)  # integer index expressions of b, h, q, k, M, N, constants and integer reads
        return Traced(read)

    def _row(self, strict: bool = False) -> _Row | None:
        """A captured tensor indexed by all its indices but the last (at least one), as a _Row (None: any other)."""
        if self.sizes is None or self.rank is None or not self.prefix or self.rank - len(self.prefix) != 1:
            return None  # a whole tensor is only indexed (x.long()[q]: refused, naming the method)
        n = self.sizes[-1]
        if n > MAX_ROW and not strict:
            return None  # arithmetic on it is refused as a read with too few indices
        if n > MAX_ROW:
            raise ExprError(
                f"a row of {n} elements of the tensor {self.base.label} is computed on; at most {MAX_ROW} (index it "
                "by all its indices)"
            )
        return _Row([self[j] for j in range(n)], str(self.base.label))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # torch.where(m[q], ...) and the like
        rows = tuple(_as_row(a) if isinstance(a, _TracedTensor) else a for a in args)
        if any(isinstance(a, _Row) for a in rows):
            return _Row.__torch_function__(
                func, types, tuple(a if a is not None else b for a, b in zip(rows, args)), kwargs
            )
        return Traced.__torch_function__(func, types, args, kwargs)

    def _shape(self, name: str) -> tuple:
        if self.sizes is None:  # a tensor passed at call time: its sizes are not known while tracing
            label = self.base.label
            raise _NoMethod(f"Tensor.{name} of the tensor {label}, a parameter: its sizes are not part of the kernel")
        return tuple(self.sizes[len(self.prefix) :])

    def __len__(self):
        return self._shape("__len__")[0]

    def __getattr__(self, name):
        """A captured tensor's sizes (doc_ids.shape[0], x.size(-1), len(x), x.numel()): constants of the kernel, as
        the object has them now (a function that reads them is keyed by them: request.function_key)."""
        if name.startswith("_"):
            raise AttributeError(name)
        if name in ("shape", "ndim"):
            shape = self._shape(name)
            return shape if name == "shape" else len(shape)
        if name in ("size", "numel", "dim"):
            shape = self._shape(name)
            return {
                "size": lambda d=None: shape if d is None else shape[d],
                "numel": lambda: math.prod(shape),
                "dim": lambda: len(shape),
            }[name]
        row = self._row(strict=True)
        if row is not None:
            return getattr(row, name)
        label = self.base.label
        raise _NoMethod(
            f"Tensor.{name} of the tensor {label}: a tensor the function reads is only indexed, e.g. "
            f"{label}[q_idx].{name}(...); its values are not part of the kernel"
        )


def trace_mask(fn) -> sp.Basic:
    return _trace(fn, ("b", "h", "q", "k"), exprs.MASK_NAMES, "mask", True)


def trace_score(fn) -> sp.Expr:
    return _trace(fn, ("s", "b", "h", "q", "k"), exprs.SCORE_NAMES, "score_mod", False)


def trace_score_and_mask(fn) -> tuple[sp.Expr, sp.Basic | None]:
    """A score function's score, and the mask it computes where it gives -inf (FlexAttention's
    `torch.where(q_idx >= kv_idx, score, -float("inf"))`): the keys it gives -inf are masked, and where they are
    not it gives the score (None: it masks nothing)."""
    what = "score_mod"
    result, allowed = _run(fn, ("s", "b", "h", "q", "k"), exprs.SCORE_NAMES, what)
    score, keep = _masked_keys(result, what)
    score = _checked(score, exprs.SCORE_NAMES, what, False, allowed)
    return score, None if keep is None else _checked(keep, exprs.MASK_NAMES, what, True, allowed)


def _masked_keys(e, what: str):
    """(score, keep) of a score expression with -inf among the values of its (folded) Piecewise: keep holds where a
    finite value is given, and the score is the Piecewise of those values (where keep fails, any). Else (e, None)."""
    if not (isinstance(e, sp.Basic) and e.has(-sp.oo)):
        return e, None
    e = sp.piecewise_fold(e)
    if e == -sp.oo:
        return exprs.SCORE, sp.false
    if not isinstance(e, sp.Piecewise):
        return e, None  # refused by check_expr, naming the infinity
    kept: list = []
    before: list = []
    for value, cond in e.args:
        if value != -sp.oo:
            kept.append((value, sp.And(cond, *[sp.Not(c) for c in before])))
        before.append(cond)
    keep = sp.Or(*[c for _, c in kept])
    if keep.has(exprs.SCORE):
        raise ExprError(f"{what}: the keys it gives -inf depend on the score ({keep}); mask by the indices and tensors")
    if not kept:
        return exprs.SCORE, sp.false
    score = sp.Piecewise(*[(v, c) for v, c in e.args if v != -sp.oo][:-1], (kept[-1][0], True))
    return score, keep


# --- the shipped variants -------------------------------------------------------------------------------
def causal_mask(align: str) -> sp.Basic:
    return sp.Le(_k, _q) if align == "top_left" else sp.Le(_k, _q + _N - _M)


def window_mask(left: int, right: int, align: str = "top_left") -> sp.Basic:
    """Query q sees keys k with q - left <= k <= q + right (FlashAttention's window_size=(left, right)).

    Aligned like the causal mask it is combined with: bottom-right (FlashAttention's) places query q at
    key q + N - M, so the last query's window ends at the last key."""
    at = _q + _N - _M if align == "bottom_right" else _q
    return sp.And(sp.Le(at - _k, left), sp.Le(_k - at, right))


def prefix_mask(length: int) -> sp.Basic:
    """Prefix-LM: the first `length` keys are seen by every query; after them, causal."""
    return sp.Or(sp.Lt(_k, length), sp.Le(_k, _q))


def alibi_score() -> sp.Expr:
    """ALiBi: s + slopes[h] * (k - q), slopes passed at call time (see alibi_slopes). Aligned top-left, and
    meant for a causal mask (FlashAttention's form, for any mask: flash_attn_alibi_score)."""
    return exprs.SCORE + exprs.tensor("slopes")[_h] * (_k - _q)


def softcap_score(cap: float) -> sp.Expr:
    """Logit softcapping: cap * tanh(s / cap)."""
    c = sp.nsimplify(cap) if float(cap).is_integer() else sp.Float(cap)
    return c * sp.tanh(exprs.SCORE / c)


def alibi_slopes(heads: int) -> list[float]:
    """The ALiBi paper's slopes: a geometric sequence starting at 2^(-8/n) (n the next power of two)."""
    n = 2 ** math.floor(math.log2(heads))
    base = [2 ** (-8 * (i + 1) / n) for i in range(n)]
    extra = [2 ** (-4 * (2 * i + 1) / n) for i in range(heads - n)]
    return base + extra


def _check_int(name, value, low=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    return value


def build(*, causal=False, window=None, alibi=False, softcap=None, prefix=None, mask=None, score_mod=None) -> Program:
    """The attention program for these options: scale, score functions, then the masks (all combined)."""
    keeps, scores, tags = [], [], []
    if not (causal is None or isinstance(causal, bool) or causal in ("top_left", "bottom_right")):
        raise ValueError(f"causal: expected False, True, 'top_left' or 'bottom_right', got {causal!r}")
    if not isinstance(alibi, bool):
        raise TypeError(f"alibi: expected True or False, got {alibi!r}")
    align = "top_left" if causal is True else causal
    if prefix is not None:
        _check_int("prefix", prefix, 1)
        if prefix > exprs.MAX_INDEX_CONSTANT:  # a prefix past every key is 'everything': any value up to 2^62
            raise ValueError(f"prefix: expected at most 2**62 = {exprs.MAX_INDEX_CONSTANT}, got {prefix!r}")
        if align == "bottom_right":
            raise ValueError("prefix: prefix-LM is causal after the prefix (top-left); drop causal='bottom_right'")
        keeps.append(prefix_mask(prefix))
        tags.append(f"prefix{prefix}")
    elif align:
        keeps.append(causal_mask(align))
        tags.append("causal" if align == "top_left" else "causal_br")
    if window is not None:
        # window=LEFT or (LEFT, RIGHT); RIGHT defaults to 0 under a causal mask, else to LEFT
        if isinstance(window, (tuple, list)) and 1 <= len(window) <= 2:
            left, right = window[0], (window[1] if len(window) == 2 else None)
        else:
            left, right = window, None
        if right is None:
            right = 0 if (align or prefix is not None) else left
        for side, value in (("left", left), ("right", right)):  # 2^31 - 1 and up: every key on that side
            _check_int(f"window ({side})", value)
            if value > exprs.MAX_INDEX_CONSTANT:
                raise ValueError(f"window ({side}): expected at most 2**62 = {exprs.MAX_INDEX_CONSTANT}, got {value!r}")
        keeps.append(window_mask(left, right, align or "top_left"))
        tags.append(f"window{left}_{right}")
    if score_mod is not None:
        score, score_keep = trace_score_and_mask(score_mod)
        scores.append(score)
        keeps.extend([score_keep] if score_keep is not None else [])
    if mask is not None:
        keeps.append(trace_mask(mask))
    _cap_then_bias(scores, tags, softcap, alibi_score() if alibi else None, "alibi")
    return program(keeps, scores, tags, custom=mask is not None or score_mod is not None)


def _cap_then_bias(scores: list, tags: list, softcap, bias, tag: str) -> None:
    """Softcap the scores, then add the ALiBi bias: C·tanh(s/C) + bias, FlashAttention's order (its
    reference computes tanh(s / C) * C, masks, then adds the bias). Both builders compose through here."""
    if softcap is not None:
        if (
            isinstance(softcap, bool)
            or not isinstance(softcap, (int, float))
            or not softcap > 0
            or not math.isfinite(softcap)
        ):
            raise ValueError(f"softcap: expected a positive number, got {softcap!r}")
        scores.append(softcap_score(softcap))
        tags.append(f"softcap{softcap:g}".replace(".", "p"))
    if bias is not None:
        scores.append(bias)
        tags.append(tag)


def flash_attn_alibi_score(per_batch: bool = False) -> sp.Expr:
    """FlashAttention's ALiBi: s - slopes[h]·|q + N - M - k|, the distance to the bottom-right-aligned diagonal
    (symmetric without a causal mask; under one it differs from slopes[h]·k by a per-row constant only).
    per_batch: slopes[b, h], FlashAttention's alibi_slopes of shape [B, H]."""
    slope = exprs.tensor("slopes")[_b, _h] if per_batch else exprs.tensor("slopes")[_h]
    return exprs.SCORE - slope * sp.Abs(_q + _N - _M - _k)


def flash_attn_program(
    *,
    causal: bool = False,
    window=(-1, -1),
    softcap=None,
    alibi: bool = False,
    alibi_per_batch: bool = False,
    leftpad: bool = False,
) -> Program:
    """The program of FlashAttention's `flash_attn_func(causal, window_size, softcap, alibi_slopes)`, with its
    semantics: the scaled scores are softcapped (C·tanh(s/C)), masked, then ALiBi's bias is added
    (flash_attn_alibi_score; alibi_per_batch: slopes [B, H] read as slopes[b, h]); the causal mask and the window
    are aligned bottom-right (query q sits at key q + N - M); window_size=(left, right) keeps keys
    q + N - M - left <= k <= q + N - M + right, -1 leaving that side unbounded, (-1, -1) no window; causal=True
    makes right 0. softcap=None or 0: none. leftpad: keys k < leftpad[b] (an int32 [B] tensor: flash_attn_with_kvcache's
    cache_leftpad) are masked too."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    for name, value in (("alibi", alibi), ("alibi_per_batch", alibi_per_batch), ("leftpad", leftpad)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected True or False, got {value!r}")
    if not (isinstance(window, (tuple, list)) and len(window) == 2):
        raise ValueError(f"window_size: expected a pair (left, right), got {window!r}")
    left, right = window
    for side, value in (("left", left), ("right", right)):
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(f"window_size ({side}): expected an integer >= -1 (-1: unbounded), got {value!r}")
        if value > exprs.MAX_INDEX_CONSTANT:
            raise ValueError(f"window_size ({side}): expected at most 2**62, got {value!r}")
    if causal:
        right = 0
    at = _q + _N - _M  # the key a query faces, bottom-right aligned
    keeps: list = []
    scores: list = []
    tags = ["flash"]
    if causal:
        keeps.append(causal_mask("bottom_right"))
        tags.append("causal_br")
    if left >= 0:
        keeps.append(sp.Le(at - _k, left))
    if right >= 0 and not causal:
        keeps.append(sp.Le(_k - at, right))
    if left >= 0 or (right >= 0 and not causal):
        tags.append(f"window{'inf' if left < 0 else left}_{'inf' if right < 0 else right}")
    if leftpad:
        keeps.append(sp.Ge(_k, exprs.tensor("leftpad")[_b]))
        tags.append("leftpad")
    if softcap == 0:
        softcap = None
    bias = flash_attn_alibi_score(alibi_per_batch) if alibi or alibi_per_batch else None
    _cap_then_bias(scores, tags, softcap, bias, "alibi_abs_bh" if alibi_per_batch else "alibi_abs")
    return program(keeps, scores, tags)


def program(keeps, scores, tags, custom=False) -> Program:
    t = TensorType
    nodes = [
        Node("q", Op.INPUT, (), t("T", ("B", "H", "M", "D"))),
        Node("k", Op.INPUT, (), t("T", ("B", "H", "N", "D"))),
        Node("v", Op.INPUT, (), t("T", ("B", "H", "N", "D"))),
        Node("s", Op.MATMUL, ("q", "k"), t("f32", ("B", "H", "M", "N")), (("transpose_b", True),)),
        Node("t", Op.SCALE, ("s",), t("f32", ("B", "H", "M", "N")), (("factor", 1 / sp.sqrt(exprs.DIMS["D"])),)),
    ]
    last = "t"
    for i, fn in enumerate(scores):
        nodes.append(Node(f"c{i}", Op.SCORE_MOD, (last,), t("f32", ("B", "H", "M", "N")), (("fn", fn),)))
        last = f"c{i}"
    if keeps:
        keep = sp.And(*keeps) if len(keeps) > 1 else keeps[0]
        nodes.append(Node("u", Op.MASK, (last,), t("f32", ("B", "H", "M", "N")), (("keep", keep),)))
        last = "u"
    nodes.append(Node("p", Op.SOFTMAX, (last,), t("f32", ("B", "H", "M", "N")), (("axis", "N"),)))
    nodes.append(Node("o", Op.MATMUL, ("p", "v"), t("T", ("B", "H", "M", "D")), (("transpose_b", False),)))
    name = "_".join(tags) or "full"
    prog = Program.build(name, nodes, ("o",))
    if custom:  # name a user's program by what it computes
        digest = hashlib.sha256(str(prog).encode()).hexdigest()[:8]
        prog = Program.build(f"{name}_custom{digest}" if tags else f"custom{digest}", nodes, ("o",))
    return verify(prog)
