"""Expressions: the one place where text becomes SymPy and SymPy becomes text or C.

User expressions (scale factors, masks, score functions in `ir/` files) are *parsed* here with Python's
`ast` module and a whitelist, then built into SymPy objects directly. Nothing is ever `eval`-ed
(SymPy's `sympify` on a string calls `eval`), and nothing a user typed reaches CUDA as raw text: CUDA is
printed from the SymPy tree by `CPrinter`, whose output is made of whitelisted functions, operators,
numbers and the C names the caller maps each symbol to.
"""
from __future__ import annotations

import ast
import math
from typing import Callable, Collection, Mapping

import sympy as sp
from sympy.codegen.ast import float32, real
from sympy.printing.c import C99CodePrinter
from sympy.printing.str import StrPrinter


class ExprError(ValueError):
    """A user expression that fagen refuses, with the reason and the offending construct."""


# --- The symbols fagen knows -----------------------------------------------------------------------------
# Problem sizes (positive integers), indices (non-negative integers) and the attention score (real).
DIMS = {name: sp.Symbol(name, integer=True, positive=True) for name in ("B", "H", "M", "N", "D")}
INDICES = {name: sp.Symbol(name, integer=True, nonnegative=True) for name in ("b", "h", "q", "k")}
SCORE = sp.Symbol("s", real=True)

# Names each kind of expression may use.
SCALE_NAMES = {"D": DIMS["D"]}
MASK_NAMES = {**INDICES, "M": DIMS["M"], "N": DIMS["N"]}
SCORE_NAMES = {"s": SCORE, **INDICES, "M": DIMS["M"], "N": DIMS["N"]}

# Named tensors passed at call time, indexed per head or per batch (ALiBi's slopes[h]).
TENSOR_INDICES = (INDICES["h"], INDICES["b"])
RESERVED = set(DIMS) | set(INDICES) | {"s", "True", "False", "where", "min", "max"}
_C_KEYWORDS = {"auto", "break", "case", "char", "const", "continue", "default", "do", "double", "else", "enum",
               "extern", "float", "for", "goto", "if", "inline", "int", "long", "register", "return", "short",
               "signed", "sizeof", "static", "struct", "switch", "typedef", "union", "unsigned", "void",
               "volatile", "while", "bool", "true", "false", "class", "new", "delete", "this", "template"}


def tensor(name: str) -> sp.IndexedBase:
    """A per-head or per-batch float tensor named `name`, passed to the kernel at call time."""
    if not isinstance(name, str) or not name.isidentifier() or name in RESERVED or name in _C_KEYWORDS \
            or name.startswith("_") or len(name) > 40:
        raise ExprError(f"tensor name {name!r}: expected a plain identifier other than "
                        f"{', '.join(sorted(RESERVED))} (and not a C keyword)")
    return sp.IndexedBase(name, real=True)


def tensors_in(expr: sp.Basic) -> tuple[str, ...]:
    """Names of the call-time tensors an expression reads, sorted."""
    return tuple(sorted({str(i.base.label) for i in expr.atoms(sp.Indexed)}))


from .backend.contract import c_tensor_name  # noqa: E402  (the C name of a call-time tensor)


MAX_TEXT = 2000
MAX_NODES = 400
MAX_POWER = 16


def _sigmoid(x):
    return 1 / (1 + sp.exp(-x))


def _where(c, a, b):
    return sp.Piecewise((a, c), (b, True))


# Whitelisted functions: name -> (arity, builder). Nothing else can be called.
FUNCTIONS: dict[str, tuple[int | None, Callable]] = {
    "sqrt": (1, sp.sqrt),
    "exp": (1, sp.exp),
    "log": (1, sp.log),
    "tanh": (1, sp.tanh),
    "sigmoid": (1, _sigmoid),
    "abs": (1, sp.Abs),
    "floor": (1, sp.floor),
    "min": (None, sp.Min),
    "max": (None, sp.Max),
    "where": (3, _where),
}

_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: sp.floor(a / b),
    ast.Mod: lambda a, b: sp.Mod(a, b),
    ast.BitAnd: lambda a, b: sp.And(a, b),
    ast.BitOr: lambda a, b: sp.Or(a, b),
}
_COMPARE = {
    ast.Lt: sp.Lt, ast.LtE: sp.Le, ast.Gt: sp.Gt, ast.GtE: sp.Ge, ast.Eq: sp.Eq, ast.NotEq: sp.Ne,
}


def parse_expr(text: str, names: Mapping[str, sp.Basic], *, what: str = "expression",
               tensors: bool = False) -> sp.Basic:
    """Parse `text` into SymPy using only whitelisted constructs and the given `names`.

    `what` names the argument in error messages ("mask", "scale factor", ...). With `tensors`, `name[h]`
    and `name[b]` read a call-time tensor.
    """
    if not isinstance(text, str):
        raise ExprError(f"{what}: expected a string, got {type(text).__name__}")
    if len(text) > MAX_TEXT:
        raise ExprError(f"{what}: expression longer than {MAX_TEXT} characters")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ExprError(f"{what}: cannot parse {text!r}: {e.msg}") from None
    count = sum(1 for _ in ast.walk(tree))
    if count > MAX_NODES:
        raise ExprError(f"{what}: expression too large ({count} nodes, at most {MAX_NODES})")
    return _Builder(names, what, text, tensors).build(tree.body)


class _Builder:
    def __init__(self, names, what, text, tensors=False):
        self.names, self.what, self.text, self.tensors = names, what, text, tensors

    def fail(self, node, why):
        col = getattr(node, "col_offset", None)
        where = f" at column {col + 1}" if col is not None else ""
        raise ExprError(f"{self.what}: {why}{where} in {self.text!r}")

    def build(self, node):  # noqa: C901 - one case per allowed construct
        if isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool):
                return sp.true if v else sp.false
            if isinstance(v, int):
                return sp.Integer(v)
            if isinstance(v, float):
                if not math.isfinite(v):
                    self.fail(node, "non-finite constant")
                return sp.Float(v)
            self.fail(node, f"constant of type {type(v).__name__} is not allowed")
        if isinstance(node, ast.Name):
            if node.id in self.names:
                return self.names[node.id]
            allowed = ", ".join(sorted(self.names)) or "none"
            self.fail(node, f"unknown name {node.id!r} (allowed names: {allowed})")
        if isinstance(node, ast.UnaryOp):
            x = self.build(node.operand)
            if isinstance(node.op, ast.USub):
                return -self._number(node, x)
            if isinstance(node.op, ast.UAdd):
                return self._number(node, x)
            if isinstance(node.op, (ast.Not, ast.Invert)):
                return sp.Not(self._boolean(node, x))
        if isinstance(node, ast.BinOp):
            a, b = self.build(node.left), self.build(node.right)
            if isinstance(node.op, ast.Pow):
                b = self._number(node, b)
                if not (b.is_Integer and abs(int(b)) <= MAX_POWER):
                    self.fail(node, f"'**' takes an integer literal exponent of at most {MAX_POWER}")
                return self._number(node, a) ** b
            op = _BINOPS.get(type(node.op))
            if op is None:
                self.fail(node, f"operator {type(node.op).__name__} is not allowed")
            if isinstance(node.op, (ast.BitAnd, ast.BitOr)):
                return op(self._boolean(node, a), self._boolean(node, b))
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and self._number(node, b).is_zero:
                self.fail(node, "division by zero")
            return op(self._number(node, a), self._number(node, b))
        if isinstance(node, ast.BoolOp):
            parts = [self._boolean(node, self.build(v)) for v in node.values]
            return sp.And(*parts) if isinstance(node.op, ast.And) else sp.Or(*parts)
        if isinstance(node, ast.Compare):
            left = self._number(node, self.build(node.left))
            terms = []
            for op, comp in zip(node.ops, node.comparators):
                right = self._number(node, self.build(comp))
                rel = _COMPARE.get(type(op))
                if rel is None:
                    self.fail(node, f"comparison {type(op).__name__} is not allowed")
                terms.append(rel(left, right))
                left = right
            return sp.And(*terms)
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.keywords:
                self.fail(node, "only plain calls of whitelisted functions are allowed")
            name = node.func.id
            if name not in FUNCTIONS:
                allowed = ", ".join(sorted(FUNCTIONS))
                self.fail(node, f"function {name!r} is not allowed (allowed: {allowed})")
            arity, fn = FUNCTIONS[name]
            args = [self.build(a) for a in node.args]
            if arity is not None and len(args) != arity:
                self.fail(node, f"{name}() takes {arity} argument(s), got {len(args)}")
            if arity is None and len(args) < 2:
                self.fail(node, f"{name}() takes at least 2 arguments")
            if name == "where":
                return fn(self._boolean(node, args[0]), self._number(node, args[1]),
                          self._number(node, args[2]))
            return fn(*[self._number(node, a) for a in args])
        if isinstance(node, ast.Subscript):
            if not self.tensors:
                self.fail(node, "indexing is not allowed here")
            if not isinstance(node.value, ast.Name):
                self.fail(node, "only a named tensor can be indexed (name[h] or name[b])")
            index = self.build(node.slice)
            if index not in TENSOR_INDICES:
                self.fail(node, f"tensor {node.value.id!r} must be indexed by h or b")
            try:
                return tensor(node.value.id)[index]
            except ExprError as e:
                self.fail(node, str(e))
        if isinstance(node, ast.IfExp):
            return _where(self._boolean(node, self.build(node.test)),
                          self._number(node, self.build(node.body)),
                          self._number(node, self.build(node.orelse)))
        self.fail(node, f"construct {type(node).__name__} is not allowed")

    def _number(self, node, x):
        if isinstance(x, sp.logic.boolalg.Boolean) and not isinstance(x, sp.Expr):
            self.fail(node, "expected a number, got a condition")
        return x

    def _boolean(self, node, x):
        if isinstance(x, sp.logic.boolalg.Boolean) and not isinstance(x, sp.Expr):
            return x
        self.fail(node, "expected a condition, got a number")


# --- Checking an expression built elsewhere (traced from a Python function) ------------------------------
_ALLOWED_FUNCS = (sp.exp, sp.log, sp.tanh, sp.Abs, sp.floor, sp.Max, sp.Min, sp.Mod, sp.Piecewise)
_ALLOWED_ATOMS = (sp.Integer, sp.Rational, sp.Float, sp.Symbol, sp.Indexed, sp.IndexedBase, sp.Idx,
                  sp.logic.boolalg.BooleanTrue, sp.logic.boolalg.BooleanFalse, sp.core.numbers.NegativeOne,
                  sp.core.numbers.Half, sp.core.numbers.One, sp.core.numbers.Zero)


def check_expr(expr, names: Mapping[str, sp.Basic], *, what: str, condition: bool,
               tensors: Collection[str] | None = None) -> sp.Basic:
    """Refuse anything but the constructs parse_expr builds: returns expr, or raises naming the construct.

    Call-time tensors appear as `name[h]` or `name[b]`; `tensors`, when given, lists the names allowed
    (a traced function's extra parameters)."""
    if isinstance(expr, bool):
        expr = sp.true if expr else sp.false
    if isinstance(expr, (int, float)) and not isinstance(expr, bool):
        expr = sp.Integer(expr) if isinstance(expr, int) else sp.Float(expr)
    if not isinstance(expr, sp.Basic):
        raise ExprError(f"{what}: expected an expression of the arguments, got {type(expr).__name__}")
    is_cond = isinstance(expr, sp.logic.boolalg.Boolean) and not isinstance(expr, sp.Expr)
    if is_cond != condition:
        raise ExprError(f"{what}: expected {'a condition' if condition else 'a number'}, got {expr}")
    allowed = set(names.values())
    walk = sp.preorder_traversal(expr)
    for node in walk:
        if isinstance(node, sp.Symbol) and not isinstance(node, sp.Dummy):
            if node not in allowed:
                raise ExprError(f"{what}: unknown symbol {node} (allowed: {', '.join(sorted(names))})")
        elif isinstance(node, sp.Indexed):
            label = node.base.label
            if not isinstance(label, sp.Symbol) or type(node.base) is not sp.IndexedBase:
                raise ExprError(f"{what}: {node} is not a call-time tensor")
            if len(node.indices) != 1 or node.indices[0] not in TENSOR_INDICES:
                raise ExprError(f"{what}: tensor {label} must be indexed by h or b, got {node}")
            tensor(str(label))
            if tensors is not None and str(label) not in tensors:
                raise ExprError(f"{what}: tensor {label} is not one of the function's parameters "
                                f"({', '.join(tensors) or 'none'})")
            walk.skip()         # its label names the tensor and h/b were checked: not free symbols
        elif isinstance(node, sp.IndexedBase):
            raise ExprError(f"{what}: tensor {node.label} must be indexed by h or b, e.g. {node.label}[h]")
        elif isinstance(node, sp.Pow):
            if not (node.exp.is_Integer and abs(int(node.exp)) <= MAX_POWER) and node.exp != sp.Rational(1, 2) \
                    and node.exp != -sp.Rational(1, 2):
                raise ExprError(f"{what}: power {node} is not allowed (integer exponents up to {MAX_POWER})")
        elif isinstance(node, (sp.Add, sp.Mul, sp.Tuple, sp.logic.boolalg.And, sp.logic.boolalg.Or,
                               sp.logic.boolalg.Not, sp.core.relational.Relational, sp.functions.elementary
                               .piecewise.ExprCondPair) + _ALLOWED_ATOMS):
            pass
        elif isinstance(node, sp.Function) and node.func in _ALLOWED_FUNCS:
            pass
        elif isinstance(node, (sp.Max, sp.Min, sp.Piecewise)):
            pass
        elif node in (sp.oo, -sp.oo) or isinstance(node, (sp.core.numbers.Infinity, sp.core.numbers.NegativeInfinity)):
            raise ExprError(f"{what}: infinities are not allowed; mask keys out with the mask instead")
        else:
            raise ExprError(f"{what}: {type(node).__name__} is not allowed ({node}); allowed: arithmetic, "
                            "comparisons, & | ~, where, minimum, maximum, abs, exp, log, tanh, sigmoid, floor, %")
    return expr


# --- Text printer: the inverse of parse_expr ------------------------------------------------------------
class TextPrinter(StrPrinter):
    """Prints SymPy in the syntax `parse_expr` reads, so IR text round-trips."""

    def _print_And(self, e):
        return " and ".join(f"({self._print(a)})" for a in e.args)

    def _print_Or(self, e):
        return " or ".join(f"({self._print(a)})" for a in e.args)

    def _print_Not(self, e):
        return f"not ({self._print(e.args[0])})"

    def _print_Max(self, e):
        return "max(" + ", ".join(self._print(a) for a in e.args) + ")"

    def _print_Min(self, e):
        return "min(" + ", ".join(self._print(a) for a in e.args) + ")"

    def _print_Abs(self, e):
        return f"abs({self._print(e.args[0])})"

    def _print_Mod(self, e):
        return f"({self._print(e.args[0])}) % ({self._print(e.args[1])})"

    def _print_Piecewise(self, e):
        *pieces, (last, cond) = e.args
        text = self._print(last) if cond == sp.true else f"where({self._print(cond)}, {self._print(last)}, 0)"
        for value, cond in reversed(pieces):
            text = f"where({self._print(cond)}, {self._print(value)}, {text})"
        return text

    def _print_Relational(self, e):
        op = {"==": "==", "!=": "!=", "<": "<", "<=": "<=", ">": ">", ">=": ">="}[e.rel_op]
        return f"{self._print(e.lhs)} {op} {self._print(e.rhs)}"

    def _print_BooleanTrue(self, e):
        return "True"

    def _print_BooleanFalse(self, e):
        return "False"


def to_text(expr: sp.Basic) -> str:
    return TextPrinter().doprint(expr)


# --- C printer ----------------------------------------------------------------------------------------
class CPrinter(C99CodePrinter):
    """SymPy's C99 printer in single precision, with no macro or header dependency.

    - `2**x` prints as `exp2f(x)` (the base-2 form the fused kernels use), `log(x)/log(2)` as `log2f(x)`;
    - ±oo prints as `±FAGEN_INFINITY`, which every template defines (NVRTC has no math.h);
    - Piecewise prints as one nested ternary;
    - every symbol must be named in `names` (its C spelling); an unnamed symbol is an error.
    """

    def __init__(self, names: Mapping[sp.Symbol, str], settings=None, *, exp2: str = "exp2f", tanh: str = "tanhf",
                 constants=frozenset()):
        super().__init__({"type_aliases": {real: float32}, "math_macros": {}, **(settings or {})})
        self.c_names = dict(names)
        self.exp2 = exp2
        self.tanh = tanh
        self.constants = frozenset(constants)   # symbols that are compile-time constants (constexpr)

    def _print_tanh(self, e):
        return f"{self.tanh}({self._print(e.args[0])})"

    def _print_Symbol(self, e):
        if e not in self.c_names:
            raise ExprError(f"internal: symbol {e} has no C name")
        return self.c_names[e]

    def _print_Indexed(self, e):
        return f"{c_tensor_name(str(e.base.label))}[{self._print(e.indices[0])}]"

    def _print_Pow(self, e):
        if e.base == 2:
            return f"{self.exp2}({self._print(e.exp)})"
        return super()._print_Pow(e)

    def _print_log(self, e):
        return f"logf({self._print(e.args[0])})"

    def _print_log2(self, e):
        return f"log2f({self._print(e.args[0])})"

    def _print_Mul(self, e):
        # log(x)/log(2) -> log2f(x)
        num, den = e.as_numer_denom()
        if den == sp.log(2) and isinstance(num, sp.log):
            return f"log2f({self._print(num.args[0])})"
        # x / (compile-time constant) -> x * (1.0f / constant): folded by the compiler, no division at run time
        if den != 1 and not den.is_Number and den.free_symbols and den.free_symbols <= self.constants:
            return f"{self.parenthesize(num, 50)}*(1.0f/({self._print(den)}))"
        return super()._print_Mul(e)

    def _print_Infinity(self, e):
        return "FAGEN_INFINITY"

    def _print_NegativeInfinity(self, e):
        return "(-FAGEN_INFINITY)"

    def _print_Piecewise(self, e):
        *pieces, (last, cond) = e.args
        if cond != sp.true:
            raise ExprError("internal: Piecewise without a default branch")
        text = self._print(last)
        for value, cond in reversed(pieces):
            text = f"(({self._print(cond)}) ? ({self._print(value)}) : ({text}))"
        return text

    def _print_Float(self, e):
        return f"{float(e)!r}f"

    def _print_Rational(self, e):
        if e.q == 1:
            return str(e.p)
        return f"{e.p}.0f/{e.q}.0f"


def to_c(expr: sp.Basic, names: Mapping[sp.Symbol, str], *, exp2: str = "exp2f", tanh: str = "tanhf",
         constants=frozenset()) -> str:
    """C for `expr`; `exp2` and `tanh` name the functions for 2^x and tanh (the mma tier uses the
    special-function unit's approximations, as FlashAttention does); division by `constants` (constexpr
    symbols) is printed as multiplication by their reciprocal."""
    return CPrinter(names, exp2=exp2, tanh=tanh, constants=constants).doprint(expr)
