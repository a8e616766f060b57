"""The C printer: SymPy expressions (the proven rule, masks, key-range bounds) as C for the kernels.

Nothing a user typed reaches CUDA as raw text: this printer's output is made of whitelisted functions,
operators, numbers and the C names the caller maps each symbol to. Index arithmetic prints as exact integer C.
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy as sp
from sympy.codegen.ast import float32, real
from sympy.printing.c import C99CodePrinter
from sympy.printing.precedence import PRECEDENCE

from ..ir.exprs import (
    INDICES,
    INT32_MAX,
    INT64_MAX,
    INT_OPS,
    ExprError,
    _ratio,
    exact_index_form,
    int_range,
    is_index_read,
    is_int_valued,
    to_text,
)
from .contract import c_tensor_name


class fma(sp.Function):
    """a·b + c kept whole, printed as fmaf(a, b, c): the multiply cannot be computed apart from the add. Where b
    does not depend on the add's other operand (ALiBi's slope times k - q, added to q.k), nvcc may otherwise
    compute every element's a·b ahead of the q.k it is added to and hold them all in registers (the d64 forward's
    raw values spilled 888 bytes so, none as fmaf; NVRTC 13.0)."""

    nargs = 3


class CPrinter(C99CodePrinter):
    """SymPy's C99 printer in single precision, with no macro or header dependency.

    - `2**x` prints as `exp2f(x)` (the base-2 form the fused kernels use), `log(x)/log(2)` as `log2f(x)`;
    - ±oo prints as `±FAGEN_INFINITY`, which every template defines (NVRTC has no math.h);
    - Piecewise prints as one nested ternary;
    - every symbol must be named in `names` (its C spelling); an unnamed symbol is an error;
    - index math prints as exact integer C (see "Index arithmetic" above): integer-valued subexpressions in
      `int` or `long long`, floor(a/b) as floor_div(a, b), Mod(a, b) as floor_mod(a, b) (as C's a / b and
      a % b where SymPy proves a >= 0 and b > 0: the same value, fewer instructions), comparisons of
      indices with integer coefficients. With `index_type="long long"` the integer symbols are long long
      C variables already (the key-range bounds) and every integer expression is computed in 64 bits.
    - with `float_indices` (a score function's value), an index expression that is a float operand and linear in
      q and k, a·(k - q) + b·q + r, prints from the float copies the kernels pass (`k_minus_q`, `q_f`) and r as
      integer C, so that a kernel can compute them cheaper than an int-to-float conversion (I2F, an eighth of the
      FMA rate on sm_90) a score element. Masks, gathers' indices and comparisons stay integer C (see
      CPrinter._float_index).
    """

    # No math.h macros (M_LN2 ...): NVRTC has no math.h. A class attribute, so that C89CodePrinter.__init__ does
    # not build SymPy's macro table (a dozen expressions, evaluated as the default of a settings.pop) per printer.
    math_macros: dict = {}

    def __init__(
        self,
        names: Mapping[sp.Symbol, str],
        settings=None,
        *,
        exp2: str = "exp2f",
        tanh: str = "tanhf",
        constants=frozenset(),
        index_type: str = "auto",
        varying=frozenset(),
        float_indices: bool = False,
        fixed: dict | None = None,
    ):
        super().__init__({"type_aliases": {real: float32}, **(settings or {})})
        self.float_indices = float_indices  # print float operands linear in q, k from k_minus_q and q_f
        self.fixed = fixed  # C text -> name of the values a kernel computes once a work tile (CPrinter._fixed_value)
        self._in_fixed = False  # printing a fixed value's own text
        self.c_names = dict(names)
        self.exp2 = exp2
        self.tanh = tanh
        self.constants = frozenset(constants)  # symbols that are compile-time constants (constexpr)
        self.varying = frozenset(varying)  # symbols that change from one score element to the next
        if index_type not in ("auto", "long long"):
            raise ValueError(f"index_type: expected 'auto' or 'long long', got {index_type!r}")
        self.index_type = index_type
        self._int: str | None = None  # None (float context), "int" or "ll": the C type being printed

    # -- integer index math --
    def _print(self, expr, **kwargs):
        if self._int is None and isinstance(expr, sp.Expr) and is_int_valued(expr):
            if (text := self._float_index(expr)) is not None:
                return text
            if not isinstance(expr, sp.Symbol):
                return self._print_int(expr)
        return super()._print(expr, **kwargs)

    def _print_Add(self, expr, order=None):
        """A float sum's integer terms in q and k print together, as one index expression (_float_index): s + q - k
        is s - k_minus_q, not s - (k_minus_q + q_f) + q_f."""
        if self.float_indices and self._int is None and not is_int_valued(expr):
            q, k = INDICES["q"], INDICES["k"]
            ints = [a for a in expr.args if is_int_valued(a) and a.free_symbols & {q, k}]
            if len(ints) > 1 and (text := self._float_index(sp.Add(*ints))) is not None:
                rest = self._print(sp.Add(*[a for a in expr.args if a not in ints]))
                return f"{text} - {rest[1:]}" if rest.startswith("-") else f"{text} + {rest}"
        return super()._print_Add(expr, order=order)

    def _float_index(self, e) -> str | None:
        """`e` (integer-valued, a float operand) from the kernels' float copies of the indices, where it is
        linear in q and k with integer coefficients: a·(k - q) + b·q + r (r free of q and k) prints as
        a*k_minus_q + b*q_f + (r), r in integer C (computed once a tile by the compiler, as it does not change
        between elements); |E| of an Abs as fabsf of the same. The backward kernels and the wgmma forward compute
        k_minus_q as (float)(k0 - q0) + c, one conversion a tile and c a constant of the unrolled loop (the other
        forward kernels convert k - q an element): every value is the float of an exact integer while |k - q| and q
        stay below 2^24, so the result equals (float)E there, and is within an ulp or so of it beyond. Inside
        comparisons and a gather's indices this is off: those stay integer C."""
        if not self.float_indices:
            return None
        if isinstance(e, sp.Abs):
            inner = self._float_index(e.args[0])
            return None if inner is None else f"fabsf({inner})"
        q, k = INDICES["q"], INDICES["k"]
        if not (e.free_symbols & {q, k}):
            return None
        for node in sp.preorder_traversal(e):  # q, k only under + and * by integers
            if not isinstance(node, (sp.Add, sp.Mul, sp.Symbol, sp.Integer)) and node.free_symbols & {q, k}:
                return None
        ex = sp.expand(e)
        a, b = ex.coeff(k, 1), ex.coeff(q, 1)
        rest = sp.expand(ex - a * k - b * q)
        if not (a.is_Integer and b.is_Integer) or rest.free_symbols & {q, k}:
            return None
        terms = [(int(a), "k_minus_q"), (int(a + b), "q_f")]  # a·k + b·q = a·(k - q) + (a + b)·q
        parts = [name if c == 1 else f"-{name}" if c == -1 else f"{c}*{name}" for c, name in terms if c]
        if rest != 0:
            parts.append(f"({self._print(rest)})")
        text = " + ".join(parts).replace("+ -", "- ")
        return text if len(parts) == 1 else f"({text})"

    def _print_int(self, expr) -> str:
        """`expr` (integer-valued) as integer C, in the narrowest of int / long long that holds every value
        computed while evaluating it as printed."""
        extent = self._extent(expr)
        if extent > INT64_MAX:
            raise ExprError(f"index expression {to_text(expr)} needs more than 64 bits (values up to {extent})")
        ll = self.index_type == "long long" or extent > INT32_MAX
        self._int = "ll" if ll else "int"
        try:
            text = super()._print(expr)
        finally:
            self._int = None
        if ll and expr.is_Integer and self.index_type != "long long":
            text += "LL"
        return text

    def _extent(self, e) -> int:
        """The largest magnitude of any value computed while evaluating `e` as this printer prints it
        (C evaluates a + b + c as (a + b) + c: every prefix of a sum or product counts)."""
        lo, hi = int_range(e)
        out = max(abs(lo), abs(hi))
        if isinstance(e, (sp.Add, sp.Mul)):
            if isinstance(e, sp.Add):
                parts, join = self._as_ordered_terms(e, order=None), sp.Add
            else:
                c, rest = e.as_coeff_Mul()
                parts, join = sp.Mul(abs(c), rest, evaluate=False).as_ordered_factors(), sp.Mul
            for n in range(2, len(parts)):
                lo, hi = int_range(join(*parts[:n]))
                out = max(out, abs(lo), abs(hi))
            return max([out] + [self._extent(a) for a in e.args])
        if isinstance(e, (sp.floor, sp.ceiling)):
            num, den = _ratio(e.args[0])
            return max(out, self._extent(num), self._extent(den))
        if isinstance(e, sp.Pow):
            lo, hi = int_range(e.base)
            return max(out, abs(lo), abs(hi), self._extent(e.base))
        if isinstance(e, (sp.Mod, sp.Min, sp.Max, sp.Abs, sp.sign, *INT_OPS)):
            return max([out] + [self._extent(a) for a in e.args])
        if isinstance(e, sp.Piecewise):
            return max([out] + [self._extent(v) for v, _ in e.args])
        return out

    def _int_arg(self, e) -> str:
        """An argument of an integer helper: a bare constant gets LL in long long code, so both arguments
        have one type (CUDA's min/max and floor_div/floor_mod overloads would be ambiguous otherwise)."""
        text = self._print(e)
        return text + "LL" if self._int == "ll" and e.is_Integer and self.index_type != "long long" else text

    def _operand(self, e) -> str:
        """An operand of C's / or %: parenthesized unless it is a symbol or a constant."""
        text = self._int_arg(e)
        return text if e.is_Atom or isinstance(e, INT_OPS) else f"({text})"  # a bit operation prints parenthesized

    def _print_Integer(self, e):
        return str(int(e))

    def _print_floor(self, e):
        if self._int is None:
            return super()._print_floor(e)
        num, den = _ratio(e.args[0])
        if num.is_nonnegative and den.is_positive:  # C's division truncates: floor for these, and cheaper
            return f"({self._operand(num)} / {self._operand(den)})"
        return f"floor_div({self._int_arg(num)}, {self._int_arg(den)})"

    def _print_ceiling(self, e):
        if self._int is None:
            return super()._print_ceiling(e)
        num, den = _ratio(e.args[0])
        return f"(-floor_div({self._int_arg(-num)}, {self._int_arg(den)}))"

    def _print_Mod(self, e):
        if self._int is None:
            return self._print_float_Mod(e)
        num, den = e.args
        if num.is_nonnegative and den.is_positive:  # C's remainder is Python's for these, and cheaper
            return f"({self._operand(num)} % {self._operand(den)})"
        return f"floor_mod({self._int_arg(num)}, {self._int_arg(den)})"

    def _print_float_Mod(self, e) -> str:
        """Python's remainder of floats (torch.remainder: the sign of the divisor), from C's fmodf (exact): r, or
        r + b where r is not 0 and its sign is not b's."""
        a, b = (self._print(x) for x in e.args)
        r = f"fmodf({a}, {b})"
        return f"((({r}) != 0.0f && (({r}) < 0.0f) != (({b}) < 0.0f)) ? ({r}) + ({b}) : ({r}))"

    def _print_int_op(self, e, op: str) -> str:
        if self._int is None:  # by construction integer-valued (exprs.bitwise, exprs.check_expr)
            raise ExprError(f"{to_text(e)}: {op} takes integer operands (index expressions)")
        a, b = e.args
        return f"({self._operand(a)} {op} {self._operand(b)})"

    def _print_bitwise_and(self, e):
        return self._print_int_op(e, "&")

    def _print_bitwise_or(self, e):
        return self._print_int_op(e, "|")

    def _print_bitwise_xor(self, e):
        return self._print_int_op(e, "^")

    def _print_fmod(self, e):
        """C's fmod: on integers C's % (it truncates: the sign of the dividend), on floats fmodf."""
        if self._int is None:
            return f"fmodf({self._print(e.args[0])}, {self._print(e.args[1])})"
        return self._print_int_op(e, "%")

    def _print_NumberSymbol(self, e):  # pi, E (in derivatives: erf's): a float constant, no math.h macro
        return f"{float(e)!r}f"

    _print_Pi = _print_Exp1 = _print_NumberSymbol

    def _print_minmax(self, e, fn):
        if self._int is None:
            return super()._print_Max(e) if fn == "max" else super()._print_Min(e)
        args = [self._int_arg(a) for a in e.args]
        text = args[0]
        for a in args[1:]:
            text = f"{fn}({text}, {a})"
        return text

    def _print_Min(self, e):
        return self._print_minmax(e, "min")

    def _print_Max(self, e):
        return self._print_minmax(e, "max")

    def _print_Abs(self, e):
        if self._int is None:
            return super()._print_Abs(e)
        return f"{'llabs' if self._int == 'll' else 'abs'}({self._print(e.args[0])})"

    def _print_Relational(self, e):
        exact = exact_index_form(e)
        lhs, op, rhs = exact if exact is not None else (e.lhs, e.rel_op, e.rhs)
        outer, self._int = self._int, None  # each side picks its own integer type
        floats, self.float_indices = self.float_indices, False  # index comparisons stay integer C
        try:
            return f"{self._print(lhs)} {op} {self._print(rhs)}"
        finally:
            self._int, self.float_indices = outer, floats

    def _print_tanh(self, e):
        return f"{self.tanh}({self._print(e.args[0])})"

    def _print_Symbol(self, e):
        if e not in self.c_names:
            raise ExprError(f"internal: symbol {e} has no C name")
        if self._int == "ll" and self.index_type != "long long":
            return f"(long long){self.c_names[e]}"
        return self.c_names[e]

    def _print_Indexed(self, e):
        """A gather: fagen_read(tensor_x, fagen_at(i0, size_0, stride_0) + ...), each index computed in exact
        integers (int or long long, as any index expression) and clamped to [0, size - 1] by fagen_at
        (templates/rule.cu.jinja), so no read leaves the tensor. A read inside an index (exprs.is_index_read:
        offsets[doc[q]]'s doc[q]) is read first, its own indices clamped, and taken as an int saturated to
        [-INDEX_READ_MAX, INDEX_READ_MAX] by fagen_index (long long where its expression is computed in 64 bits)."""
        name = c_tensor_name(str(e.base.label))
        outer, self._int = self._int, None
        floats, self.float_indices = self.float_indices, False  # a gather's indices stay integer C
        try:
            terms = [f"fagen_at({self._print(i)}, {name}_size_{d}, {name}_stride_{d})" for d, i in enumerate(e.indices)]
        finally:
            self._int, self.float_indices = outer, floats
        read = f"fagen_read({name}, {' + '.join(terms)})"
        if not is_index_read(e):
            return read
        if self._int is None:
            raise ExprError(f"internal: the index read {e} is printed outside integer index math")
        return f"(long long)fagen_index({read})" if self._int == "ll" else f"fagen_index({read})"

    def _print_Pow(self, e):
        if self._int is not None:  # an integer power of an integer: repeated multiplication
            return "(" + "*".join([self.parenthesize(e.base, 50)] * int(e.exp)) + ")" if e.exp else "1"
        if e.base == 2:
            return f"{self.exp2}({self._print(e.exp)})"
        if e.exp.is_Integer and 2 <= e.exp <= 4:  # powf is a library routine: fagen_pow2..4 multiply, in float
            return f"fagen_pow{int(e.exp)}({self._print(e.base)})"
        if e.exp == -sp.S.Half:
            return f"rsqrtf({self._print(e.base)})"
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
        if self._int is None and self.varying:
            if not (e.free_symbols & self.varying) and (name := self._fixed_value(e.args)) is not None:
                return name
            gathered = self._gathered_Mul(e)
            if gathered is not None:
                return gathered
        # x / (compile-time constant) -> x * (1.0f / constant): folded by the compiler, no division at run time
        if den != 1 and not den.is_Number and den.free_symbols and den.free_symbols <= self.constants:
            inv = self._print(den) if den.is_Symbol else f"({self._print(den)})"
            return f"{self.parenthesize(num, 50)}*(1.0f/{inv})"
        return super()._print_Mul(e)

    def _gathered_Mul(self, e):
        """A product whose factors that do not change from one score element to the next (no `varying` symbol:
        constants, slopes[h], scale_log2) are two or more: those first, as one parenthesized product, so that the
        compiler computes it once outside the element loop (C multiplies left to right; it may not reassociate
        floats). kLog2e*(k - q)*slopes[h] prints as (kLog2e*slopes[h])*(k - q): one multiply an element, not two.
        Reassociating the product changes its float rounding by an ulp or so; the value proven is the same.
        A division among them (the raw value's 1/scale_log2) goes with the factors that read no tensor, in a product
        of its own: a division of kernel arguments and constants, which the compiler computes once, not one an
        element (a tensor read may not move across the kernels' memory barriers)."""
        coeff, factors = e.as_coeff_mul()
        fixed = [f for f in factors if not (f.free_symbols & self.varying)]
        moving = [f for f in factors if f.free_symbols & self.varying]
        if not moving or len(fixed) + (abs(coeff) != 1) < 2:
            return None
        pure = [f for f in fixed if not f.has(sp.Indexed)]
        divides = any(f.is_Pow and f.exp.is_negative for f in pure)

        def gather():
            if divides and len(pure) < len(fixed):
                # (a sum of reads, g[0] + 0.3: parenthesized, as a factor of the product)
                reads = "*".join(self.parenthesize(f, PRECEDENCE["Mul"]) for f in fixed if f.has(sp.Indexed))
                return f"({self._print(sp.Mul(abs(coeff), *pure))})*{reads}"
            return self._print(sp.Mul(abs(coeff), *fixed))

        name = self._fixed_value(fixed, gather)
        gathered = name if name is not None else f"({gather()})"
        rest = "*".join(self._print(f) if f.is_Atom or f.is_Function else f"({self._print(f)})" for f in moving)
        return f"{'-' if coeff < 0 else ''}{gathered}*{rest}"

    def _fixed_value(self, factors, text=None) -> str | None:
        """The name of a value the kernels compute once a work tile, before their key loop, for a product of
        `factors` that do not change between score elements and that read a tensor (slopes[h]) or divide by a
        kernel argument (1/scale_log2): `fixed_0`, `fixed_1`, ... in the order first printed, the same name for
        the same text. A tensor read cannot move across the kernels' memory barriers, so the compiler would
        otherwise read and divide again on every key tile (the d64 ALiBi forward held four copies of its element
        loop so). None where no `fixed` table was given, or for factors of another kind; `text` prints the
        product (default: as a product)."""
        if self.fixed is None or self._in_fixed:
            return None
        if not any(
            f.has(sp.Indexed) or (f.is_Pow and f.exp.is_negative and f.free_symbols - self.constants) for f in factors
        ):
            return None
        self._in_fixed = True
        try:
            c = text() if text is not None else self._print(sp.Mul(*factors))
        finally:
            self._in_fixed = False
        return self.fixed.setdefault(c, f"fixed_{len(self.fixed)}")

    def _print_fma(self, e):
        a, b, c = e.args
        return f"fmaf({self._fixed_product(a)}, {self._print(b)}, {self._print(c)})"

    def _fixed_product(self, a) -> str:
        """A product that does not change between elements, its factors that read no tensor first and apart (a
        division among them is then one of kernel arguments and constants, computed once)."""
        coeff, factors = a.as_coeff_mul()
        reads = [f for f in factors if f.has(sp.Indexed)]
        pure = sp.Mul(coeff, *[f for f in factors if not f.has(sp.Indexed)])

        def product():
            if not reads or pure == 1:
                return self._print(a)
            head = self._print(pure)
            head = head if pure.is_Atom else f"({head})"
            return "*".join([head, *(self._print(f) for f in reads)])

        name = self._fixed_value(factors, product)
        return name if name is not None else product()

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


def to_c(
    expr: sp.Basic,
    names: Mapping[sp.Symbol, str],
    *,
    exp2: str = "exp2f",
    tanh: str = "tanhf",
    constants=frozenset(),
    index_type: str = "auto",
    varying=frozenset(),
    float_indices: bool = False,
    fixed: dict | None = None,
) -> str:
    """C for `expr`; `exp2` and `tanh` name the functions for 2^x and tanh (the mma tier uses the
    special-function unit's approximations, as FlashAttention does); division by `constants` (constexpr
    symbols) is printed as multiplication by their reciprocal. Index math prints as exact integer C;
    `index_type="long long"` says the integer symbols are long long variables (64-bit throughout). `varying`:
    the symbols that change from one score element to the next; a product prints its other factors first,
    gathered, so that they are computed once (CPrinter._gathered_Mul). `float_indices`: float operands linear in
    q and k print from the float copies k_minus_q and q_f (CPrinter._float_index). `fixed`: a table (C text -> name)
    that collects the products computed once a work tile, printed as their names (CPrinter._fixed_value)."""
    printer = CPrinter(
        names,
        exp2=exp2,
        tanh=tanh,
        constants=constants,
        index_type=index_type,
        varying=varying,
        float_indices=float_indices,
        fixed=fixed,
    )
    return printer.doprint(expr)
