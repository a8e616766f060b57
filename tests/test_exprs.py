"""Expressions: parsed with a whitelist, never evaluated; printed back as text and as C."""

import pytest
import sympy as sp

from fagen.backend import printer
from fagen.backend.printer import to_c
from fagen.ir import exprs
from fagen.ir.exprs import ExprError, parse_expr, to_text

q, k, s = exprs.INDICES["q"], exprs.INDICES["k"], exprs.SCORE
M, N, D = exprs.DIMS["M"], exprs.DIMS["N"], exprs.DIMS["D"]


def test_parse_builds_sympy_directly():
    assert parse_expr("1/sqrt(D)", exprs.SCALE_NAMES) == 1 / sp.sqrt(D)
    assert parse_expr("k <= q + N - M", exprs.MASK_NAMES) == sp.Le(k, q + N - M)
    assert parse_expr("(k <= q) and (q - k < 256)", exprs.MASK_NAMES) == sp.And(k <= q, q - k < 256)
    assert parse_expr("30 * tanh(s / 30)", exprs.SCORE_NAMES) == 30 * sp.tanh(s / 30)
    assert parse_expr("where(k > q, s, 0)", exprs.SCORE_NAMES) == sp.Piecewise((s, k > q), (0, True))
    assert parse_expr("0 <= k < 5", exprs.MASK_NAMES) == sp.And(0 <= k, k < 5)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("__import__('os')", "function '__import__' is not allowed"),
        ("__import__('os').system('true')", "only plain calls"),
        ("s.__class__", "construct Attribute is not allowed"),
        ("(lambda: 1)()", "only plain calls"),
        ("'a' + 'b'", "constant of type str"),
        ("open('x')", "function 'open' is not allowed"),
        ("x + 1", "unknown name 'x'"),
        ("s ** 100", "integer literal exponent"),
        ("s ** s", "integer literal exponent"),
        ("[s]", "construct List"),
        ("s; s", "cannot parse"),
        ("s / 0", "division by zero"),
        ("k <= q and 3", "expected a condition"),
        ("tanh(k < q)", "expected a number"),
        ("max(s)", "at least 2 arguments"),
        ("1e999 * s", "non-finite"),
    ],
)
def test_refuses_with_a_clear_message(text, fragment):
    with pytest.raises(ExprError) as e:
        parse_expr(text, exprs.SCORE_NAMES, what="score_mod")
    assert fragment in str(e.value)
    assert str(e.value).startswith("score_mod:")


def test_refuses_oversized_input():
    with pytest.raises(ExprError, match="longer than"):
        parse_expr("s+" * 2000 + "s", exprs.SCORE_NAMES)
    with pytest.raises(ExprError, match="too large"):
        parse_expr("+".join(["s"] * 300), exprs.SCORE_NAMES)


@pytest.mark.parametrize(
    "text",
    [
        "k <= q",
        "(k <= q) and (q - k <= 255)",
        "(k < 128) or (k <= q)",
        "not (k > q)",
        "30*tanh(s/30)",
        "where(k > q, s, -s)",
        "max(s, 0) + min(s, 1) + abs(s)",
        "s*sigmoid(s)",
        "(q) % (4) == 0",
        "floor(q/64) >= floor(k/64)",
        "log(1 + exp(s))",
    ],
)
def test_text_round_trip(text):
    e = parse_expr(text, exprs.SCORE_NAMES)
    assert parse_expr(to_text(e), exprs.SCORE_NAMES) == e


def test_c_printer_exact_strings():
    m, x, l_ = sp.symbols("m x l", real=True)
    names = {m: "m_i", x: "s", l_: "l_i", q: "q_idx", k: "k_idx", N: "seqlen_k", M: "seqlen_q"}
    assert to_c(2 ** (x - m), names) == "exp2f(-m_i + s)"
    assert to_c(sp.log(l_) / sp.log(2), names) == "log2f(l_i)"
    assert to_c(sp.Piecewise((0, sp.Eq(l_, 0)), (1 / l_, True)), names) == "((l_i == 0) ? (0) : (1.0f/l_i))"
    assert to_c(-sp.oo, names) == "(-FAGEN_INFINITY)"
    assert to_c(sp.Le(k, q + N - M), names) == "k_idx <= -seqlen_q + seqlen_k + q_idx"
    assert to_c(sp.Max(x, m), names) == "fmaxf(m_i, s)"
    assert to_c(sp.Rational(1, 3) * x, names) == "(1.0f/3.0f)*s"
    assert to_c(sp.Float(0.5) * x, names) == "0.5f*s"
    # small powers multiply, in float (powf is a library routine of ~40 instructions: softcap's backward had one an
    # entry); the helper takes a float, so an int base (a tensor read) converts before the product cannot overflow
    assert to_c(1 - sp.tanh(x) ** 2, names) == "1 - fagen_pow2(tanhf(s))"
    assert to_c((x + m) ** 3, names) == "fagen_pow3(m_i + s)"
    assert to_c(x**5, names) == "powf(s, 5)" and to_c(x**-2, names) == "powf(s, -2)"


def test_c_printer_gathers_the_factors_that_stay_the_same_over_a_tile():
    """A product prints its factors without a `varying` symbol first, as one product the compiler computes once
    outside the element loop (C multiplies left to right and may not reassociate floats)."""
    h, x, c, t = exprs.INDICES["h"], *sp.symbols("x c t", real=True)
    slopes = sp.IndexedBase("slopes")
    names = {h: "h", x: "s", c: "kLog2e", t: "scale_log2", q: "q_idx", k: "k_idx"}
    alibi = c * (k - q) * slopes[h] + x
    slope = "fagen_read(tensor_slopes, fagen_at(h, tensor_slopes_size_0, tensor_slopes_stride_0))"
    assert to_c(alibi, names) == f"kLog2e*(k_idx - q_idx)*{slope} + s"  # two multiplies an element
    assert to_c(alibi, names, varying={x, q, k}) == f"(kLog2e*{slope})*(k_idx - q_idx) + s"  # one
    # a division by a compile-time constant joins the gathered product; a coefficient's sign stays in front
    dqk = -3 * x * t * (1 - x**2) / c
    assert to_c(dqk, names, varying={x}, constants={c}) == "-((3*scale_log2)*(1.0f/kLog2e))*s*(1 - fagen_pow2(s))"
    # nothing to gather: one fixed factor, or none that varies
    for e in (c * x, 2 * c * h, c * (k - q) * x):
        assert to_c(e, names, varying={x, q, k}) == to_c(e, names)


def test_c_printer_names_the_products_a_kernel_computes_once_a_work_tile():
    """With a `fixed` table, a product that stays the same over a work tile and reads a tensor or divides by a
    kernel argument prints as a name (fixed_0, ...), and the table keeps its C text: the kernels compute it once,
    before their key loop (a tensor read cannot move across their memory barriers). Constants alone, and divisions
    by compile-time constants, print as before."""
    b_, h, x, c, t = exprs.INDICES["b"], exprs.INDICES["h"], *sp.symbols("x c t", real=True)
    slopes, bias = sp.IndexedBase("slopes"), sp.IndexedBase("bias")
    names = {b_: "b", h: "h", x: "qk", c: "kLog2e", t: "scale_log2", q: "q_idx", k: "k_idx"}
    slope = "fagen_read(tensor_slopes, fagen_at(h, tensor_slopes_size_0, tensor_slopes_stride_0))"
    varying = {x, q, k}
    fixed = {}
    alibi = c * (k - q) * slopes[h] + x * t
    assert to_c(alibi, names, varying=varying, fixed=fixed) == "fixed_0*(k_idx - q_idx) + scale_log2*qk"
    assert fixed == {f"kLog2e*{slope}": "fixed_0"}
    # the raw value's coefficient (a division of kernel arguments and a read), a new name; the same text, the same
    raw = printer.fma(c * slopes[h] / t, k - q, x)
    assert to_c(raw, names, varying=varying, fixed=fixed) == "fmaf(fixed_1, k_idx - q_idx, qk)"
    assert fixed[f"(kLog2e/scale_log2)*{slope}"] == "fixed_1"
    assert to_c(-alibi, names, varying=varying, fixed=fixed).startswith("-fixed_0*(k_idx - q_idx)")
    assert len(fixed) == 2
    # a wholly fixed term: a per-(batch, head) bias
    assert to_c(x * t + c * bias[b_, h], names, varying=varying, fixed=fixed) == "fixed_2 + scale_log2*qk"
    assert (
        fixed[
            "kLog2e*fagen_read(tensor_bias, fagen_at(b, tensor_bias_size_0, tensor_bias_stride_0) + "
            "fagen_at(h, tensor_bias_size_1, tensor_bias_stride_1))"
        ]
        == "fixed_2"
    )
    # nothing to name: constants and kernel arguments alone, a division by a constant, an element's own read
    for e in (c * t * x, x * t / c, c * slopes[k - q] * x):
        assert to_c(e, names, varying=varying, fixed=fixed, constants={c}) == to_c(
            e, names, varying=varying, constants={c}
        )
    assert len(fixed) == 3
    assert to_c(alibi, names, varying=varying) == f"(kLog2e*{slope})*(k_idx - q_idx) + scale_log2*qk"  # no table


def test_c_printer_parenthesizes_a_sum_of_reads_among_the_gathered_factors():
    """dL/d(q.k) of s * g + remainder(s, 0.7) * 0.3 is ds (g + 0.3) scale: the gathered product puts the division
    (scale_log2 / kLog2e) first and the factor that reads g after it, which is a sum. Before, it printed without
    parentheses, (scale_log2*(1.0f/kLog2e))*g + 0.3f, so the 0.3 lost its scale (the catalog lifts' dq on the GPU)."""
    x, c, t = sp.symbols("x c t", real=True)
    g = sp.IndexedBase("g")
    names = {x: "ds", c: "kLog2e", t: "scale_log2"}
    read = "fagen_read(tensor_g, fagen_at(0, tensor_g_size_0, tensor_g_stride_0))"
    dqk = x * (g[0] + sp.Float(0.3)) * t / c
    assert to_c(dqk, names, varying={x}) == f"((scale_log2/kLog2e)*({read} + 0.3f))*ds"
    fixed: dict = {}
    assert to_c(dqk, names, varying={x}, fixed=fixed) == "fixed_0*ds"
    assert fixed == {f"(scale_log2/kLog2e)*({read} + 0.3f)": "fixed_0"}


def test_c_printer_takes_a_scores_float_operands_linear_in_q_and_k_from_the_float_copies():
    """With float_indices (a score's value), an integer float operand a(k - q) + bq + r prints from k_minus_q and
    q_f (r in integer C): no int-to-float conversion an element. Comparisons, a gather's indices and anything
    under floor, % or a power stay integer C, as do the masks (printed without float_indices)."""
    b_, h, x, c = exprs.INDICES["b"], exprs.INDICES["h"], *sp.symbols("x c", real=True)
    M, N = exprs.DIMS["M"], exprs.DIMS["N"]
    bias = sp.IndexedBase("bias")
    names = {b_: "b", h: "h", x: "s", c: "kLog2e", q: "q_idx", k: "k_idx", M: "seqlen_q", N: "seqlen_k"}

    def fc(e):
        return to_c(e, names, float_indices=True)

    assert fc(c * (k - q) * x) == "kLog2e*s*(k_minus_q)"
    assert fc(x + (q - k)) == "-k_minus_q + s" and fc(x + 2 * k) == "(2*k_minus_q + 2*q_f) + s"
    assert fc(x * k) == "(k_minus_q + q_f)*s" and fc(x * q) == "q_f*s"
    assert fc(x * (k - q + N - M)) == "s*((k_minus_q + (-seqlen_q + seqlen_k)))"  # bottom-right: r once a tile
    assert fc(-x * sp.Abs(q + N - M - k)) == "-s*fabsf((k_minus_q + (seqlen_q - seqlen_k)))"
    assert fc(x * h) == "h*s" and fc(x + b_ * 3) == to_c(x + b_ * 3, names)  # no q or k: as before
    assert fc(k * h * x) == "h*(k_minus_q + q_f)*s"  # h stays an integer factor (the same over a tile)
    for integer in (sp.floor(k / 64) * x, sp.Mod(k, 7) * x, (k - q) ** 2 * x, sp.Min(k, q) * x):
        assert "k_minus_q" not in fc(integer) and fc(integer) == to_c(integer, names)
    gather = x + bias[k - q]
    assert "k_minus_q" not in fc(gather) and "fagen_at(k_idx - q_idx" in fc(gather)
    where = sp.Piecewise((x, k - q > 3), (2 * x, True))
    assert "k_minus_q" not in fc(where) and "k_idx - q_idx > 3" in fc(where)
    assert fc(sp.Piecewise((x * (k - q), k <= q), (x, True))) == "((k_idx <= q_idx) ? (s*(k_minus_q)) : (s))"


def test_c_printer_refuses_unnamed_symbols():
    with pytest.raises(ExprError, match="no C name"):
        to_c(sp.Symbol("evil") + 1, {})


@pytest.mark.parametrize(
    "text",
    [
        "floor(bitwise_xor(q, k)/16) == 0",
        "bitwise_and(q, k) + bitwise_or(q, 12) > k",
        "fmod(q - k, 7) == -3",
        "fmod(s, 2.5) + (s) % (3)",
        "erf(s) + log1p(abs(s)) + sin(s) + cos(s) + sign(s)",
        "2**s + s**1.5 + s**(1/3) + 1/sqrt(s)",
        "exp2(s) + log2(s)",
        "where(s > 20, s, log1p(exp(s)))",
        "ceiling(s) + floor(s)",
        "2*exp(-s**2)/sqrt(pi)",
    ],
)
def test_text_round_trip_of_the_traced_constructs(text):
    """What the tracer builds prints as text that parses back to itself (a cache hit parses the program's text)."""
    e = parse_expr(text, exprs.SCORE_NAMES)
    assert parse_expr(to_text(e), exprs.SCORE_NAMES) == e


def test_integer_bit_operations():
    assert exprs.bitwise("and", q, 7) == sp.Mod(q, 8)  # the low bits: a remainder the bounds can reason about
    assert exprs.bitwise("and", 15, q) == sp.Mod(q, 16) and exprs.bitwise("and", q, 0) == 0
    assert exprs.bitwise("xor", q, -1) == -q - 1 and exprs.bitwise("or", q, 0) == q
    assert exprs.bitwise("xor", 6, 3) == 5 and exprs.bitwise("and", -8, 13) == 8 and exprs.fmod(-7, 3) == -1
    assert exprs.shift(q, 4, True) == 16 * q and exprs.shift(q - k, 4, False) == sp.floor((q - k) / 16)
    x = exprs.bitwise("xor", q, k)
    assert exprs.is_int_valued(x) and x.is_nonnegative and exprs.int_range(x) == (0, 2**31 - 1)
    assert exprs.int_range(exprs.bitwise("and", q - k, 12)) == (0, 12)
    assert exprs.int_range(exprs.bitwise("or", q - k, 12)) == (-(2**31), 2**31 - 1)
    assert exprs.int_range(exprs.fmod(q - k, 64)) == (-63, 63) and exprs.int_range(exprs.fmod(q, -5)) == (0, 4)
    for bad in (lambda: exprs.bitwise("and", s, 1), lambda: exprs.shift(q, k, True), lambda: exprs.shift(q, 63, False)):
        with pytest.raises(ExprError):
            bad()


def test_bit_operation_ranges_hold():
    """The interval of a bit operation holds for every pair of operands in the intervals given."""
    import itertools

    for a, c in itertools.product([(0, 5), (-3, 9), (-17, -2), (4, 4)], [(0, 12), (-6, 1), (3, 30)]):
        for cls in (exprs.bitwise_and, exprs.bitwise_or, exprs.bitwise_xor):
            lo, hi = exprs._bit_range(cls(q, k), a, c)
            fn = cls._value
            values = [fn(x, y) for x in range(a[0], a[1] + 1) for y in range(c[0], c[1] + 1)]
            assert lo <= min(values) and max(values) <= hi, (cls, a, c)


def test_c_printer_prints_the_traced_constructs():
    names = {s: "s", q: "q_idx", k: "k_idx"}
    assert to_c(sp.Eq(exprs.shift(exprs.bitwise("xor", q, k), 4, False), 0), names) == "((q_idx ^ k_idx) / 16) == 0"
    assert to_c(exprs.bitwise("and", q - k, 12) + s, names) == "s + ((-k_idx + q_idx) & 12)"
    assert to_c(exprs.fmod(q - k, 3), names) == "((-k_idx + q_idx) % 3)"  # C's % is fmod on integers
    assert to_c(exprs.fmod(s, 2.5), names) == "fmodf(s, 2.5f)"
    assert to_c(sp.Mod(s, 2), names) == (
        "(((fmodf(s, 2)) != 0.0f && ((fmodf(s, 2)) < 0.0f) != ((2) < 0.0f)) ? (fmodf(s, 2)) + (2) : (fmodf(s, 2)))"
    )
    assert to_c(1 / sp.sqrt(s), names) == "rsqrtf(s)" and to_c(2**s, names) == "exp2f(s)"
    assert to_c(sp.erf(s) + sp.sin(s) + exprs.log1p(s), names) == "sinf(s) + erff(s) + log1pf(s)"
    assert to_c(sp.pi * s, names) == "3.141592653589793f*s"  # no math.h macro (erf's derivative has pi)
    assert to_c(sp.Eq(sp.sign(q - k), 1), names) == "(((-k_idx + q_idx) > 0) - ((-k_idx + q_idx) < 0)) == 1"
    # SymPy writes floor(x / d) < 9 as x / d < 9: multiplied by d (never 0 here), it stays integer C
    d = sp.Piecewise((1, q >= k), (0, True)) + 1
    assert to_c(sp.Lt((q - k) / d, 9), names) == (
        "-(long long)k_idx + (long long)q_idx - 9*((k_idx <= q_idx) ? (1) : (0)) - 9 < 0"  # past int: in 64 bits
    )
