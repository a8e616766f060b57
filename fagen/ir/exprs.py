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
from collections.abc import Callable, Collection, Mapping

import sympy as sp
from sympy.codegen.cfunctions import log1p
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

# Named tensors passed at call time (or captured by a traced function): read as name[i0, ..., i{r-1}], 1 to
# MAX_TENSOR_RANK integer index expressions of b, h, q, k, M, N, integer constants and reads of integer tensors
# (slopes[h], doc_id[q], bias[h, q - k + 4096], rel[(q - k) // 16 + 64], offsets[doc[q]], table[h, dist[q, k]]).
# The kernels gather the element, each index clamped to [0, size - 1] of its dimension, inner reads' included (so
# no read leaves the tensor; FlexAttention checks neither). A read inside an index is an *index read*: its tensor
# must hold integers (int32 or int64, checked where the dtypes are bound: contract.tensor_args), its element is
# taken saturated to [-INDEX_READ_MAX, INDEX_READ_MAX] (no dimension a kernel reads is longer), and nothing is
# known of it statically (no key range, no proof, no gradient comes from it).
TENSOR_INDICES = (INDICES["h"], INDICES["b"])  # the 1-D per-head / per-batch reads (deterministic gradients)
TENSOR_INDEX_NAMES = {**INDICES, "M": DIMS["M"], "N": DIMS["N"]}
MAX_TENSOR_RANK = 4
RESERVED = set(DIMS) | set(INDICES) | {"s", "True", "False", "where", "min", "max"}
_C_KEYWORDS = {
    "auto",
    "break",
    "case",
    "char",
    "const",
    "continue",
    "default",
    "do",
    "double",
    "else",
    "enum",
    "extern",
    "float",
    "for",
    "goto",
    "if",
    "inline",
    "int",
    "long",
    "register",
    "return",
    "short",
    "signed",
    "sizeof",
    "static",
    "struct",
    "switch",
    "typedef",
    "union",
    "unsigned",
    "void",
    "volatile",
    "while",
    "bool",
    "true",
    "false",
    "class",
    "new",
    "delete",
    "this",
    "template",
}


INDEX_READ_MAX = 2**31 - 1  # an index read's element is taken in [-INDEX_READ_MAX, INDEX_READ_MAX] (saturated)


def tensor(name: str, *, index: bool = False) -> sp.IndexedBase:
    """A call-time tensor named `name` (its reads: name[index, ...], see check_tensor_read); with `index`, the same
    tensor as read inside another read's index (an integer: see is_index_read)."""
    if (
        not isinstance(name, str)
        or not name.isidentifier()
        or name in RESERVED
        or name in _C_KEYWORDS
        or name.startswith("_")
        or len(name) > 40
    ):
        raise ExprError(
            f"tensor name {name!r}: expected a plain identifier other than "
            f"{', '.join(sorted(RESERVED))} (and not a C keyword)"
        )
    return sp.IndexedBase(name, integer=True) if index else sp.IndexedBase(name, real=True)


def is_index_read(e) -> bool:
    """Whether `e` is a tensor read inside another read's index (offsets[doc[q]]: doc[q]), an integer."""
    return isinstance(e, sp.Indexed) and e.base.label.is_integer is True


def as_index(e: sp.Basic) -> sp.Basic:
    """An index expression with every tensor read in it, at any depth, an index read (is_index_read): the form a
    read inside an index takes, from text and from traced functions alike."""
    if not isinstance(e, sp.Basic) or not e.has(sp.Indexed):
        return e
    return e.replace(
        lambda x: isinstance(x, sp.Indexed) and not is_index_read(x),
        lambda x: tensor(str(x.base.label), index=True)[x.indices],
    )


def index_tensors(*exprs_: sp.Basic) -> tuple[str, ...]:
    """Names of the tensors the expressions read inside another read's index (integer tensors), sorted."""
    return tuple(sorted({str(r.base.label) for e in exprs_ for r in e.atoms(sp.Indexed) if is_index_read(r)}))


def tensors_in(expr: sp.Basic) -> tuple[str, ...]:
    """Names of the call-time tensors an expression reads, sorted."""
    return tuple(sorted({str(i.base.label) for i in expr.atoms(sp.Indexed)}))


def tensor_ranks(*exprs_: sp.Basic) -> dict[str, int]:
    """Each call-time tensor's rank (number of indices) in the expressions; a tensor read with two ranks is
    refused."""
    ranks: dict[str, int] = {}
    for e in exprs_:
        for read in sorted(e.atoms(sp.Indexed), key=str):
            name, r = str(read.base.label), len(read.indices)
            if ranks.setdefault(name, r) != r:
                lo, hi = sorted((ranks[name], r))
                raise ExprError(f"tensor {name} is read with {lo} and with {hi} indices; use one rank")
    return ranks


SLOT_INDICES = ("h", "b", "bh")  # slot_index's answers


def slot_index(reads) -> str | None:
    """'h', 'b' or 'bh' when a tensor's reads (in a score) are the one read name[h], name[b] or name[b, h]: a
    per-head, per-batch or per-(batch, head) tensor, whose gradient the backward kernels reduce
    deterministically (per block, batch and head); else None (a gathered tensor, whose gradient is
    scatter-added)."""
    reads = list(reads)
    if len(reads) != 1:
        return None
    for name in SLOT_INDICES:
        if tuple(reads[0].indices) == tuple(INDICES[i] for i in name):
            return name
    return None


def _at(what: str | None) -> str:
    return f"{what}: " if what else ""


def as_condition(x):
    """A tensor read used as a condition (a bool mask tensor, m[b, h, q, k]) is `m[...] != 0`; other values
    are returned as they are."""
    return sp.Ne(x, 0) if isinstance(x, sp.Indexed) else x


def check_tensor_index(name: str, index, what: str | None = None) -> sp.Basic:
    """One index of a tensor read: an integer expression of b, h, q, k, M, N, integer constants and index reads
    of other tensors (offsets[doc[q]], each itself check_tensor_read), built from +, -, *, //, %, min, max, abs and
    where (no float): printed as exact integer C."""
    index = sp.sympify(index)
    if isinstance(index, sp.logic.boolalg.Boolean) and not isinstance(index, sp.Expr):
        raise ExprError(f"{_at(what)}tensor {name} is indexed by a condition ({index}); expected an integer index")
    reads = index.atoms(sp.Indexed)
    for read in sorted(reads, key=str):
        if not is_index_read(read):  # parse_expr and the tracer make every read in an index one (as_index)
            label = str(read.base.label)
            raise ExprError(
                f"{_at(what)}tensor {name} is indexed by {to_text(index)}, whose read {read} is not an integer read; "
                f"build it as tensor({label!r}, index=True)[...] (parsed text and traced functions do)"
            )
        check_tensor_read(read, what)
    allowed = set(TENSOR_INDEX_NAMES.values())
    plain = index.xreplace({r: sp.Dummy(integer=True) for r in reads})  # the reads' own indices are checked
    bad = sorted(str(s) for s in plain.free_symbols if s not in allowed and not isinstance(s, sp.Dummy))
    if bad:
        raise ExprError(
            f"{_at(what)}tensor {name} is indexed by {to_text(index)}, which reads {', '.join(bad)}; "
            "an index reads only b, h, q, k, M, N, integer constants and integer tensors"
        )
    if not is_int_valued(index):
        raise ExprError(
            f"{_at(what)}tensor {name} is indexed by {to_text(index)}, which is not integer arithmetic; use "
            "+, -, *, //, %, min, max, abs on b, h, q, k, integer constants and integer tensors"
        )
    lo, hi = int_range(index)
    if max(abs(lo), abs(hi)) > INT64_MAX:
        raise ExprError(f"{_at(what)}tensor {name}'s index {to_text(index)} needs more than 64 bits")
    return index


def check_tensor_read(read: sp.Indexed, what: str | None = None) -> None:
    """A tensor read name[i0, ...]: a valid name, 1 to MAX_TENSOR_RANK indices, each check_tensor_index."""
    label = read.base.label
    if not isinstance(label, sp.Symbol) or type(read.base) is not sp.IndexedBase:
        raise ExprError(f"{_at(what)}{read} is not a call-time tensor")
    tensor(str(label))
    if not 1 <= len(read.indices) <= MAX_TENSOR_RANK:
        raise ExprError(
            f"{_at(what)}tensor {label} is read with {len(read.indices)} indices; expected 1 to {MAX_TENSOR_RANK}"
        )
    for i in read.indices:
        check_tensor_index(str(label), i, what)


MAX_TEXT = 2000
MAX_NODES = 400
MAX_POWER = 16


def _sigmoid(x):
    return 1 / (1 + sp.exp(-x))


def _where(c, a, b):
    return sp.Piecewise((a, c), (b, True))


# --- Integer bit operations and C's fmod -----------------------------------------------------------------
# torch's bitwise and/or/xor on integers (Morton-order masks: (q ^ k) >> 4 == 0) and fmod (the remainder with the
# sign of the dividend). SymPy has no function for them: each is a Function printed as C's operator (CPrinter),
# by its name in text (parse_expr reads it back) and evaluated on constants. Where an existing construct says the
# same exactly, that one is built instead, so that the bounds and the key ranges can reason about it: x & (2^n - 1)
# is x % 2^n, x << n is x * 2^n, x >> n is x // 2^n (an arithmetic shift is a floor division), ~x is -x - 1.
class _IntOp(sp.Function):
    """An integer operation of two integer-valued expressions (bitwise_and, bitwise_or, bitwise_xor)."""

    nargs = 2
    c_op = ""

    @staticmethod
    def _value(a: int, b: int) -> int:
        raise NotImplementedError

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sp.Integer(cls._value(int(a), int(b)))
        return None

    def _eval_is_integer(self):
        return True if all(a.is_integer for a in self.args) else None

    def _eval_is_nonnegative(self):
        if self.is_integer and all(a.is_nonnegative for a in self.args):
            return True  # & | ^ of non-negative integers
        return None


class bitwise_and(_IntOp):  # noqa: N801 - printed by its name: torch's
    c_op = "&"

    @staticmethod
    def _value(a, b):
        return a & b

    def _eval_is_nonnegative(self):  # x & y with y >= 0 lies in [0, y]
        return True if self.is_integer and any(a.is_nonnegative for a in self.args) else None


class bitwise_or(_IntOp):  # noqa: N801
    c_op = "|"

    @staticmethod
    def _value(a, b):
        return a | b


class bitwise_xor(_IntOp):  # noqa: N801
    c_op = "^"

    @staticmethod
    def _value(a, b):
        return a ^ b


class fmod(sp.Function):  # noqa: N801
    """C's fmod (torch.fmod): a - b * trunc(a / b), the remainder with the sign of the dividend. On integers C's %
    computes it; on floats fmodf."""

    nargs = 2

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer and b != 0:
            r = abs(int(a)) % abs(int(b))
            return sp.Integer(-r if a < 0 else r)
        if a.is_Number and b.is_Number and b != 0:
            return sp.Float(math.fmod(float(a), float(b)))
        return None

    def _eval_is_integer(self):
        return True if all(a.is_integer for a in self.args) else None

    def _eval_is_nonnegative(self):
        return True if self.args[0].is_nonnegative and self.args[1].is_real else None


INT_OPS = (bitwise_and, bitwise_or, bitwise_xor, fmod)
BITWISE = {"and": bitwise_and, "or": bitwise_or, "xor": bitwise_xor}
MAX_SHIFT = 62


def _low_bits(c) -> int | None:
    """n where the integer c is 2^n - 1 (n >= 0), else None."""
    return (int(c) + 1).bit_length() - 1 if c.is_Integer and c >= 0 and (int(c) & (int(c) + 1)) == 0 else None


def bitwise(name: str, a, b) -> sp.Expr:
    """a & b, a | b or a ^ b (name 'and', 'or', 'xor') of integer-valued expressions; x & (2^n - 1) is x % 2^n,
    x ^ -1 is -x - 1, x & 0 is 0 and x | 0, x ^ 0 are x."""
    a, b = sp.sympify(a), sp.sympify(b)
    for x in (a, b):
        if not is_int_valued(x):
            raise ExprError(f"bitwise {name} takes integers (index expressions) or conditions, got {to_text(x)}")
    if a.is_Integer and not b.is_Integer:
        a, b = b, a
    if b.is_Integer and not a.is_Integer:
        if name == "and" and (n := _low_bits(b)) is not None:
            return sp.Mod(a, 2**n) if n else sp.Integer(0)
        if b == 0:
            return a
        if name == "xor" and b == -1:
            return -a - 1
    return BITWISE[name](a, b)


def shift(a, n, left: bool) -> sp.Expr:
    """a << n (a * 2^n) or a >> n (a // 2^n, the arithmetic shift) for an integer-valued a and a constant n in
    [0, MAX_SHIFT]."""
    a, n = sp.sympify(a), sp.sympify(n)
    op = "<<" if left else ">>"
    if not is_int_valued(a):
        raise ExprError(f"shift {op} takes integers (index expressions), got {to_text(a)}")
    if not (n.is_Integer and 0 <= n <= MAX_SHIFT):
        raise ExprError(
            f"shift {to_text(a)} {op} {to_text(n)}: the shift must be an integer constant from 0 to {MAX_SHIFT}"
        )
    return a * 2**n if left else sp.floor(a / 2**n)


def power(a, b):
    """a ** b: b a constant (an integer of at most MAX_POWER in size, or a fraction or float), or a a positive
    constant (2 ** s, exp2)."""
    a, b = sp.sympify(a), sp.sympify(b)
    if b.is_Float and float(b).is_integer():
        b = sp.Integer(int(b))
    if b.is_Integer:
        if abs(int(b)) > MAX_POWER:
            raise ExprError(f"power {to_text(a)}**{b}: expected an integer literal exponent of at most {MAX_POWER}")
        return a**b
    if b.is_Number or (a.is_Number and a.is_positive):
        return a**b
    raise ExprError(f"power {to_text(a)}**({to_text(b)}): the exponent must be a constant, or the base a positive one")


# Whitelisted functions: name -> (arity, builder). Nothing else can be called.
FUNCTIONS: dict[str, tuple[int | None, Callable]] = {
    "sqrt": (1, sp.sqrt),
    "exp": (1, sp.exp),
    "log": (1, sp.log),
    "tanh": (1, sp.tanh),
    "sigmoid": (1, _sigmoid),
    "abs": (1, sp.Abs),
    "floor": (1, sp.floor),
    "ceiling": (1, sp.ceiling),
    "min": (None, sp.Min),
    "max": (None, sp.Max),
    "where": (3, _where),
    "log1p": (1, log1p),
    "log2": (1, lambda x: sp.log(x) / sp.log(2)),
    "exp2": (1, lambda x: 2**x),
    "erf": (1, sp.erf),
    "sin": (1, sp.sin),
    "cos": (1, sp.cos),
    "tan": (1, sp.tan),
    "sign": (1, sp.sign),
    "fmod": (2, fmod),
    "bitwise_and": (2, lambda a, b: bitwise("and", a, b)),
    "bitwise_or": (2, lambda a, b: bitwise("or", a, b)),
    "bitwise_xor": (2, lambda a, b: bitwise("xor", a, b)),
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
    ast.Lt: sp.Lt,
    ast.LtE: sp.Le,
    ast.Gt: sp.Gt,
    ast.GtE: sp.Ge,
    ast.Eq: sp.Eq,
    ast.NotEq: sp.Ne,
}


def parse_expr(
    text: str, names: Mapping[str, sp.Basic], *, what: str = "expression", tensors: bool = False
) -> sp.Basic:
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


# The constructs an expression may use, each built by the method of its name (_Builder.build)
_CONSTRUCTS = {
    ast.Constant: "_constant",
    ast.Name: "_name",
    ast.UnaryOp: "_unary",
    ast.BinOp: "_binop",
    ast.BoolOp: "_boolop",
    ast.Compare: "_compare",
    ast.Call: "_call",
    ast.Subscript: "_subscript",
    ast.IfExp: "_ifexp",
}


class _Builder:
    def __init__(self, names, what, text, tensors=False):
        self.names, self.what, self.text, self.tensors = names, what, text, tensors

    def fail(self, node, why):
        col = getattr(node, "col_offset", None)
        where = f" at column {col + 1}" if col is not None else ""
        raise ExprError(f"{self.what}: {why}{where} in {self.text!r}")

    def build(self, node):
        """The SymPy value of an AST node: one method per allowed construct (`_CONSTRUCTS`), anything else refused."""
        method = _CONSTRUCTS.get(type(node))
        if method is None:
            self.fail(node, f"construct {type(node).__name__} is not allowed")
        return getattr(self, method)(node)

    def _constant(self, node):
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

    def _name(self, node):
        if node.id in self.names:
            return self.names[node.id]
        if node.id == "pi":  # in a derivative's text (erf's)
            return sp.pi
        allowed = ", ".join(sorted(self.names)) or "none"
        self.fail(node, f"unknown name {node.id!r} (allowed names: {allowed})")

    def _unary(self, node):
        x = self.build(node.operand)
        if isinstance(node.op, ast.USub):
            return -self._number(node, x)
        if isinstance(node.op, ast.UAdd):
            return self._number(node, x)
        if isinstance(node.op, (ast.Not, ast.Invert)):
            return sp.Not(self._boolean(node, x))
        self.fail(node, f"construct {type(node).__name__} is not allowed")

    def _binop(self, node):
        a, b = self.build(node.left), self.build(node.right)
        if isinstance(node.op, ast.Pow):
            b = self._number(node, b)
            if not (b.is_Number or (a.is_Number and a.is_positive)):
                self.fail(
                    node,
                    f"'**' takes a constant exponent (an integer literal exponent of at most {MAX_POWER}, a "
                    "fraction) or a positive constant base",
                )
            try:
                return power(self._number(node, a), b)
            except ExprError as e:
                self.fail(node, str(e))
        op = _BINOPS.get(type(node.op))
        if op is None:
            self.fail(node, f"operator {type(node.op).__name__} is not allowed")
        if isinstance(node.op, (ast.BitAnd, ast.BitOr)):
            return op(self._boolean(node, a), self._boolean(node, b))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and self._number(node, b).is_zero:
            self.fail(node, "division by zero")
        return op(self._number(node, a), self._number(node, b))

    def _boolop(self, node):
        parts = [self._boolean(node, self.build(v)) for v in node.values]
        return sp.And(*parts) if isinstance(node.op, ast.And) else sp.Or(*parts)

    def _compare(self, node):
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

    def _call(self, node):
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
            return fn(self._boolean(node, args[0]), self._number(node, args[1]), self._number(node, args[2]))
        try:
            return fn(*[self._number(node, a) for a in args])
        except ExprError as e:
            self.fail(node, str(e))

    def _subscript(self, node):
        if not self.tensors:
            self.fail(node, "indexing is not allowed here")
        if not isinstance(node.value, ast.Name):
            self.fail(node, "only a named tensor can be indexed (name[q], name[h, q - k + 64], ...)")
        parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if isinstance(node.slice, ast.Slice) or any(isinstance(p, ast.Slice) for p in parts):
            self.fail(node, "a slice is not an index; read one element, name[i, j]")
        indices = [as_index(self.build(p)) for p in parts]  # a read inside an index: an integer (offsets[doc[q]])
        try:
            read = tensor(node.value.id)[tuple(indices)]
            check_tensor_read(read)
        except ExprError as e:
            self.fail(node, str(e))
        return read

    def _ifexp(self, node):
        return _where(
            self._boolean(node, self.build(node.test)),
            self._number(node, self.build(node.body)),
            self._number(node, self.build(node.orelse)),
        )

    def _number(self, node, x):
        if isinstance(x, sp.logic.boolalg.Boolean) and not isinstance(x, sp.Expr):
            self.fail(node, "expected a number, got a condition")
        return x

    def _boolean(self, node, x):
        if isinstance(x, sp.logic.boolalg.Boolean) and not isinstance(x, sp.Expr):
            return x
        if isinstance(x, sp.Indexed):  # a bool (or int) tensor read as a condition: its element != 0
            return as_condition(x)
        self.fail(node, "expected a condition, got a number")


# --- Checking an expression built elsewhere (traced from a Python function) ------------------------------
_ALLOWED_FUNCS = (
    sp.exp,
    sp.log,
    log1p,
    sp.tanh,
    sp.erf,
    sp.sin,
    sp.cos,
    sp.tan,
    sp.sign,
    sp.Abs,
    sp.floor,
    sp.ceiling,
    sp.Max,
    sp.Min,
    sp.Mod,
    sp.Piecewise,
    *INT_OPS,
)
_ALLOWED_TEXT = (
    "arithmetic, comparisons, & | ^ ~ << >> (conditions, or integers), where, minimum, maximum, clamp, abs, sign, "
    "exp, exp2, log, log2, log1p, sqrt, rsqrt, constant powers, tanh, sigmoid, erf, gelu, softplus, sin, cos, "
    "tan, floor, //, %, fmod"
)
_ALLOWED_ATOMS = (
    sp.Integer,
    sp.Rational,
    sp.Float,
    sp.Symbol,
    sp.Indexed,
    sp.IndexedBase,
    sp.Idx,
    sp.logic.boolalg.BooleanTrue,
    sp.logic.boolalg.BooleanFalse,
    sp.core.numbers.NegativeOne,
    sp.core.numbers.Half,
    sp.core.numbers.One,
    sp.core.numbers.Zero,
)


def check_expr(
    expr, names: Mapping[str, sp.Basic], *, what: str, condition: bool, tensors: Collection[str] | None = None
) -> sp.Basic:
    """Refuse anything but the constructs parse_expr builds: returns expr, or raises naming the construct.

    Call-time tensors appear as `name[i0, ...]` (check_tensor_read); `tensors`, when given, lists the names
    allowed (a traced function's extra parameters and captured tensors)."""
    if isinstance(expr, bool):
        expr = sp.true if expr else sp.false
    if isinstance(expr, (int, float)) and not isinstance(expr, bool):
        expr = sp.Integer(expr) if isinstance(expr, int) else sp.Float(expr)
    if not isinstance(expr, sp.Basic):
        raise ExprError(f"{what}: expected an expression of the arguments, got {type(expr).__name__}")
    if condition:
        expr = as_condition(expr)
    try:
        tensor_ranks(expr)
    except ExprError as e:
        raise ExprError(f"{what}: {e}") from None
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
            check_tensor_read(node, what)
            for label in sorted({str(r.base.label) for r in node.atoms(sp.Indexed)}):  # inner reads' tensors too
                if tensors is not None and label not in tensors:
                    raise ExprError(
                        f"{what}: tensor {label} is not one of the function's parameters "
                        f"({', '.join(tensors) or 'none'})"
                    )
            walk.skip()  # its label names the tensor and its indices were checked: not free symbols
        elif isinstance(node, sp.IndexedBase):
            raise ExprError(f"{what}: tensor {node.label} must be indexed, e.g. {node.label}[h] or {node.label}[q]")
        elif isinstance(node, sp.Pow):
            if not (
                (node.exp.is_Integer and abs(int(node.exp)) <= MAX_POWER)
                or (node.exp.is_Number and not node.exp.is_Integer)
                or (node.base.is_Number and node.base.is_positive)
            ):
                raise ExprError(
                    f"{what}: power {node} is not allowed (constant exponents, integers up to {MAX_POWER}; or a "
                    "positive constant base)"
                )
        elif isinstance(node, sp.core.relational.Relational) and not all(isinstance(a, sp.Expr) for a in node.args):
            raise ExprError(f"{what}: comparison {node} compares a condition; compare numbers (or use & | ~)")
        elif isinstance(
            node,
            (
                sp.Add,
                sp.Mul,
                sp.Tuple,
                sp.logic.boolalg.And,
                sp.logic.boolalg.Or,
                sp.logic.boolalg.Not,
                sp.core.relational.Relational,
                sp.functions.elementary.piecewise.ExprCondPair,
            )
            + _ALLOWED_ATOMS,
        ):
            pass
        elif isinstance(node, sp.Function) and node.func in _ALLOWED_FUNCS:
            pass
        elif isinstance(node, (sp.Max, sp.Min, sp.Piecewise)):
            pass
        elif node in (sp.oo, -sp.oo) or isinstance(node, (sp.core.numbers.Infinity, sp.core.numbers.NegativeInfinity)):
            raise ExprError(f"{what}: infinities are not allowed; mask keys out with the mask instead")
        else:
            raise ExprError(f"{what}: {type(node).__name__} is not allowed ({node}); allowed: {_ALLOWED_TEXT}")
    _check_integer_math(expr, what)
    return expr


def _check_integer_math(expr: sp.Basic, what: str) -> None:
    """Refuse what would be wrong or undefined as the integer C the kernels compute: a bit operation of a
    non-integer, an integer //, % or fmod whose divisor may be zero, an index comparison not exact in integers."""
    for node in sp.preorder_traversal(expr):
        if isinstance(node, (bitwise_and, bitwise_or, bitwise_xor)) and not all(is_int_valued(a) for a in node.args):
            raise ExprError(f"{what}: {to_text(node)}: a bit operation takes integers (index expressions)")
        divisor = None
        if isinstance(node, (sp.Mod, fmod)) and all(is_int_valued(a) for a in node.args):
            divisor = node.args[1]
        elif isinstance(node, sp.floor):
            num, den = sp.together(node.args[0]).as_numer_denom()
            if is_int_valued(num) and is_int_valued(den) and not den.is_Number:
                divisor = den
        if divisor is not None:
            lo, hi = int_range(divisor)
            if lo <= 0 <= hi:
                raise ExprError(f"{what}: {to_text(node)}: the divisor {to_text(divisor)} may be zero")
        if isinstance(node, sp.core.relational.Relational):
            try:
                exact_index_form(node)
            except ExprError as e:
                raise ExprError(f"{what}: {e}") from None


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

    def _print_Float(self, e):
        """SymPy's 15 digits where they read back as the same float, else Python's shortest exact form (gelu's
        1/sqrt(2)), so that a program's text parses back to the program."""
        text = super()._print_Float(e)
        return text if float(text) == float(e) else repr(float(e))

    def _print_BooleanTrue(self, e):
        return "True"

    def _print_BooleanFalse(self, e):
        return "False"


def to_text(expr: sp.Basic) -> str:
    return TextPrinter().doprint(expr)


# --- Index arithmetic: exact integers, never floats --------------------------------------------------------
# SymPy proves over the reals; the kernels must compute index math (// % comparisons, key-range bounds) in
# integers, exactly, for every index they can see. An integer-valued subexpression (the index and size
# symbols, integer constants, floor of a ratio of integers, Mod of integers, and +, *, min, max, abs, where
# and integer powers of those) prints as integer C: in `int` when every value computed while evaluating it as
# printed fits in 32 bits for all indices and sizes up to INDEX_MAX, else in `long long` (the symbols cast),
# else it is refused. floor(a/b) prints as floor_div(a, b), Mod(a, b) as floor_mod(a, b): Python's // and %
# (templates/index_math.cu.jinja). A comparison of index expressions with rational coefficients is printed
# after multiplying both sides by the positive LCM of their denominators; one that is still not integer
# (sqrt(q) <= k, log(k) < 3) is refused: it would be a float rewrite of index math.
INDEX_MAX = 2**31 - 1  # the largest index or size a kernel sees (int)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_INDEX_CONSTANT = 2**62  # the largest constant a shipped variant takes (window, prefix); see variants.build
MAX_FLOAT_DENOMINATOR = 2**20  # a float constant in an index comparison must be a fraction this fine (0.5, 0.25)

# The query tile [q_lo, q_hi] the key-range bounds are functions of (fagen.bounds).
TILE = {name: sp.Symbol(name, integer=True, nonnegative=True) for name in ("q_lo", "q_hi")}


def _index_vertices(syms) -> list[dict]:
    """Vertices of the polytope the index symbols live in: 1 <= M, N <= INDEX_MAX; 0 <= q <= M - 1;
    0 <= q_lo <= q_hi <= M - 1; 0 <= k <= N - 1; 0 <= b, h < INDEX_MAX; 1 <= B, H, D <= INDEX_MAX.
    A linear function takes its extremes at these vertices."""
    M, N, q, k = DIMS["M"], DIMS["N"], INDICES["q"], INDICES["k"]
    lo, hi = TILE["q_lo"], TILE["q_hi"]
    groups = []
    if syms & {M, q, lo, hi}:
        groups.append(
            [
                {M: m, q: qv, lo: a, hi: b}
                for m in (1, INDEX_MAX)
                for qv in (0, m - 1)
                for a, b in ((0, 0), (0, m - 1), (m - 1, m - 1))
            ]
        )
    if syms & {N, k}:
        groups.append([{N: n, k: kv} for n in (1, INDEX_MAX) for kv in (0, n - 1)])
    for s in syms - {M, N, q, k, lo, hi}:
        if s in (INDICES["b"], INDICES["h"]):
            groups.append([{s: 0}, {s: INDEX_MAX - 1}])
        elif s in (DIMS["B"], DIMS["H"], DIMS["D"]):
            groups.append([{s: 1}, {s: INDEX_MAX}])
        else:
            raise ExprError(f"internal: no integer range known for {s}")
    vertices: list[dict] = [{}]
    for g in groups:
        vertices = [{**v, **w} for v in vertices for w in g]
    return vertices


def _is_int_symbol(e) -> bool:
    return isinstance(e, sp.Symbol) and e.is_integer is True


def _ratio(arg):
    """floor(arg) is an integer floor division when arg = num/den with num, den integer-valued, den != 0."""
    num, den = sp.together(arg).as_numer_denom()
    if den.is_Integer and den < 0:
        num, den = -num, -den
    if is_int_valued(num) and is_int_valued(den) and not den.is_zero:
        lo, hi = int_range(den)
        if lo > 0 or hi < 0:
            return num, den
    return None


def is_int_valued(e) -> bool:
    """Whether `e` is built only from integer-valued pieces fagen prints as integer C."""
    if isinstance(e, sp.Integer):
        return True
    if isinstance(e, sp.Symbol):
        return _is_int_symbol(e)
    if isinstance(e, sp.Indexed):
        return is_index_read(e)
    if isinstance(e, (sp.Add, sp.Mul, sp.Min, sp.Max, sp.Abs, sp.Mod, sp.sign, *INT_OPS)):
        return all(is_int_valued(a) for a in e.args)
    if isinstance(e, sp.Pow):
        return e.exp.is_Integer and e.exp >= 0 and is_int_valued(e.base)
    if isinstance(e, (sp.floor, sp.ceiling)):
        return _ratio(e.args[0]) is not None
    if isinstance(e, sp.Piecewise):
        return all(is_int_valued(v) for v, _ in e.args)
    return False


def _corners(f, a, b):
    return [f(x, y) for x in a for y in b]


def int_range(e) -> tuple[int, int]:
    """Lower and upper bound of an integer-valued expression over every index and size a kernel sees
    (exact for linear expressions, interval arithmetic elsewhere)."""
    if isinstance(e, sp.Integer):
        return int(e), int(e)
    if is_index_read(e):  # data: any value the kernels take it as (saturated)
        return -INDEX_READ_MAX, INDEX_READ_MAX
    syms = e.free_symbols
    if all(_is_int_symbol(s) for s in syms) and (not syms or e.is_polynomial(*syms)):
        poly = sp.Poly(e, *sorted(syms, key=str)) if syms else None
        if poly is not None and poly.total_degree() <= 1 and all(c.is_Integer for c in poly.coeffs()):
            gens = poly.gens
            terms = [(int(c), [i for i, p in enumerate(m) if p]) for m, c in poly.terms()]
            values = [sum(c * (v[gens[i[0]]] if i else 1) for c, i in terms) for v in _index_vertices(set(gens))]
            return min(values), max(values)
    if isinstance(e, sp.Add):  # the linear part exactly, the rest by intervals
        linear = [t for t in e.args if _is_linear_term(t)]
        rest = [t for t in e.args if not _is_linear_term(t)]
        lo, hi = int_range(sp.Add(*linear)) if linear else (0, 0)
        for t in rest:
            a, b = int_range(t)
            lo, hi = lo + a, hi + b
        return lo, hi
    if isinstance(e, sp.Mul):
        lo, hi = 1, 1
        for f in e.args:
            c = _corners(lambda x, y: x * y, (lo, hi), int_range(f))
            lo, hi = min(c), max(c)
        return lo, hi
    if isinstance(e, sp.Pow):
        lo, hi = 1, 1
        base = int_range(e.base)
        for _ in range(int(e.exp)):
            c = _corners(lambda x, y: x * y, (lo, hi), base)
            lo, hi = min(c), max(c)
        return lo, hi
    if isinstance(e, (sp.floor, sp.ceiling)):
        num, den = _ratio(e.args[0])
        div = (lambda x, y: x // y) if isinstance(e, sp.floor) else (lambda x, y: -(-x // y))
        c = _corners(div, int_range(num), int_range(den))
        return min(c), max(c)
    if isinstance(e, sp.Mod):
        lo, hi = int_range(e.args[1])
        if lo > 0:
            return 0, hi - 1
        if hi < 0:
            return lo + 1, 0
        raise ExprError(f"index expression {to_text(e)}: the divisor of % may be zero")
    if isinstance(e, (sp.Min, sp.Max)):
        r = [int_range(a) for a in e.args]
        pick = min if isinstance(e, sp.Min) else max
        return pick(a for a, _ in r), pick(b for _, b in r)
    if isinstance(e, sp.Abs):
        lo, hi = int_range(e.args[0])
        return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    if isinstance(e, sp.Piecewise):
        r = [int_range(v) for v, _ in e.args]
        return min(a for a, _ in r), max(b for _, b in r)
    if isinstance(e, sp.sign):
        lo, hi = int_range(e.args[0])
        return (lo > 0) - (lo < 0), (hi > 0) - (hi < 0)
    if isinstance(e, fmod):
        (alo, ahi), (dlo, dhi) = int_range(e.args[0]), int_range(e.args[1])
        if dlo <= 0 <= dhi:
            raise ExprError(f"index expression {to_text(e)}: the divisor of fmod may be zero")
        m = max(abs(dlo), abs(dhi)) - 1  # |fmod(a, d)| < |d|, with the sign of a
        return max(-m, min(alo, 0)), min(m, max(ahi, 0))
    if isinstance(e, INT_OPS):
        return _bit_range(e, *(int_range(a) for a in e.args))
    raise ExprError(f"internal: no integer range for {e}")


def _bit_range(e, a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    """Bounds of a & b, a | b, a ^ b for a, b in the given ranges: with n bits holding every bound (two's
    complement), the result lies in [-2^n, 2^n - 1]; non-negative operands narrow it."""
    n = max((x if x >= 0 else ~x).bit_length() for x in (*a, *b))
    lo, hi = -(2**n), 2**n - 1
    if a[0] >= 0 and b[0] >= 0:
        lo = 0
        if isinstance(e, bitwise_and):
            hi = min(a[1], b[1])
        elif isinstance(e, bitwise_or):
            lo = max(a[0], b[0])
    elif isinstance(e, bitwise_and) and (a[0] >= 0 or b[0] >= 0):
        lo, hi = 0, a[1] if a[0] >= 0 else b[1]  # & with a non-negative operand: within [0, it]
    return lo, hi


def _is_linear_term(t) -> bool:
    return (
        t.is_Number
        or _is_int_symbol(t)
        or (isinstance(t, sp.Mul) and len(t.args) == 2 and t.args[0].is_Integer and _is_int_symbol(t.args[1]))
    )


def exact_index_form(rel):
    """A comparison of index expressions as (lhs, op, rhs) with integer-valued sides: float constants made
    exact fractions, both sides multiplied by the positive LCM of their coefficients' denominators. None when
    the comparison mixes in a float (a score, a tensor value): that one stays float. Raises ExprError when it
    is index math that cannot be written in integers."""
    if rel.atoms(sp.Indexed) or any(not _is_int_symbol(s) for s in rel.free_symbols):
        return None
    floats = {}
    for f in rel.atoms(sp.Float):
        r = sp.Rational(float(f))
        if r.q > MAX_FLOAT_DENOMINATOR:
            raise ExprError(
                f"comparison {to_text(rel)}: the constant {float(f)!r} is not exact in integer index "
                "math; use integers (//, %, or multiply the other side)"
            )
        floats[f] = r
    lhs, rhs = _abs_denominators(rel.lhs.xreplace(floats)), _abs_denominators(rel.rhs.xreplace(floats))
    dens = [
        t.as_coeff_Mul()[0].q for side in (lhs, rhs) for t in sp.Add.make_args(side) if t.as_coeff_Mul()[0].is_Rational
    ]
    scale = math.lcm(*dens) if dens else 1
    if scale != 1:
        lhs = sp.Add(*[scale * t for t in sp.Add.make_args(lhs)])
        rhs = sp.Add(*[scale * t for t in sp.Add.make_args(rhs)])
    if not (is_int_valued(lhs) and is_int_valued(rhs)) and (cleared := _cleared(lhs - rhs, rel.rel_op)):
        return cleared
    if not (is_int_valued(lhs) and is_int_valued(rhs)):
        raise ExprError(
            f"comparison {to_text(rel)} of indices is not integer arithmetic (it would be computed "
            "in floats and be wrong near its boundary); use +, -, *, //, %, min, max, abs on the "
            "indices and integer constants"
        )
    return lhs, rel.rel_op, rhs


def _abs_denominators(e: sp.Basic) -> sp.Basic:
    """e with the rational coefficients' denominators taken out of each abs: abs(k/8 - q/8) -> abs(k - q)/8
    (exact: the positive LCM d of the denominators, abs(x) = abs(d·x)/d), so that clearing the comparison's
    denominators reaches inside it (natten's |q/W - k/W| <= window: |q - k| <= W·window)."""

    def pull(a):
        inner = a.args[0]
        dens = [t.as_coeff_Mul()[0].q for t in sp.Add.make_args(inner) if t.as_coeff_Mul()[0].is_Rational]
        d = math.lcm(*dens) if dens else 1
        return sp.Abs(sp.expand(inner * d)) / d if d != 1 else a

    return e.replace(lambda x: isinstance(x, sp.Abs), pull) if e.has(sp.Abs) else e


_FLIPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _cleared(diff, op: str):
    """diff op 0 as (num, op, 0) with integer-valued sides, where diff = num / den and den is integer-valued and
    never 0 (SymPy writes floor(x / d) < 9 as x / d < 9 where d is not a constant: x < 9·d for d > 0); else None."""
    num, den = sp.together(diff).as_numer_denom()
    if den.is_Number or not (is_int_valued(num) and is_int_valued(den)):
        return None
    lo, hi = int_range(den)
    if lo > 0:
        return num, op, sp.Integer(0)
    if hi < 0:
        return num, _FLIPPED[op], sp.Integer(0)
    return None


def exact_relations(expr: sp.Basic) -> sp.Basic:
    """`expr` with every comparison of indices in its integer form (see exact_index_form), for evaluators
    that would otherwise compute k/50 - q/50 >= -1 in floats (the NumPy executor)."""
    rels = {}
    for rel in expr.atoms(sp.core.relational.Relational):
        exact = exact_index_form(rel)
        if exact is not None:
            rels[rel] = sp.core.relational.Relational(exact[0], exact[2], exact[1], evaluate=False)
    return expr.xreplace(rels) if rels else expr
