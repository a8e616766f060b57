"""Index math stays integer in the CUDA: the printed C, compiled on the host, against Python's ints.

Masks with // and %, rational coefficients, huge constants; the key-range block of the templates (rendered
from templates/key_range.cu.jinja itself) for sequence lengths near 2^31; the executor on the same masks.
The helpers are the device text of templates/index_math.cu.jinja, compiled with g++ under a small shim.
"""

import itertools
import shutil
import subprocess

import numpy as np
import pytest
import sympy as sp

import fagen
from fagen import resources
from fagen.backend import codegen
from fagen.backend.printer import to_c
from fagen.ir import exprs, variants
from fagen.ir.exprs import ExprError, parse_expr
from fagen.math import bounds
from fagen.tools import executor

q, k, b, h = (exprs.INDICES[n] for n in "qkbh")
M, N = exprs.DIMS["M"], exprs.DIMS["N"]
BIG = 2**31 - 1

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to run printed C on the host")

# Host shim: the device helpers as plain C++; min/max as CUDA has them for one type only per call (a mixed
# int/long long call fails to deduce here, as it is ambiguous in NVRTC).
SHIM = r"""
#include <cstdio>
#include <cstdlib>
#define __device__
#define __forceinline__ inline
template <typename T> T min(T a, T b) { return a < b ? a : b; }
template <typename T> T max(T a, T b) { return a > b ? a : b; }
"""


def helpers_text() -> str:
    return (resources.templates_dir() / "index_math.cu.jinja").read_text()


def run_host(body: str, cases: list[tuple], tmp_path) -> list[list[int]]:
    """Compile `body` (defining `void eval_case(const long long* in, long long* out)` and `N_OUT`) with the
    helpers, run it on every case (a tuple of ints), return the outputs."""
    src = (
        SHIM
        + helpers_text()
        + body
        + r"""
int main() {
    long long in[16], out[64];
    int n;
    while (scanf("%d", &n) == 1) {
        for (int i = 0; i < n; ++i) if (scanf("%lld", &in[i]) != 1) return 1;
        eval_case(in, out);
        for (int i = 0; i < N_OUT; ++i) printf("%lld ", out[i]);
        printf("\n");
    }
    return 0;
}
"""
    )
    (tmp_path / "t.cpp").write_text(src)
    exe = tmp_path / "t"
    r = subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O1",
            "-Wall",
            "-Werror",
            "-Wno-unused-function",
            "-Wno-unused-parameter",
            "-Wno-unused-variable",
            "-o",
            str(exe),
            str(tmp_path / "t.cpp"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr + "\n" + src
    stdin = "".join(f"{len(c)} " + " ".join(str(x) for x in c) + "\n" for c in cases)
    r = subprocess.run([str(exe)], input=stdin, capture_output=True, text=True, check=True)
    return [[int(x) for x in line.split()] for line in r.stdout.splitlines()]


# --- the helpers -------------------------------------------------------------------------------------------
@needs_gxx
def test_floor_div_and_mod_helpers_are_pythons(tmp_path):
    body = """
constexpr int N_OUT = 4;
void eval_case(const long long* in, long long* out) {
    const int a = (int)in[0], d = (int)in[1];
    out[0] = floor_div(a, d); out[1] = floor_mod(a, d);
    out[2] = floor_div(in[2], in[3]); out[3] = floor_mod(in[2], in[3]);
}
"""
    small = [-BIG, -BIG + 1, -101, -100, -99, -51, -50, -49, -7, -1, 0, 1, 6, 7, 49, 50, 51, 99, 100, 101, BIG - 1, BIG]
    divisors = [1, 2, 3, 7, 50, 64, -1, -3, -7, -50, BIG, -BIG]
    wide = [-(2**62), -(2**62) + 1, -(2**40) - 3, -5, 0, 5, 2**40 + 3, 2**62 - 1, 2**62]
    wide_div = [1, 3, 64, -7, 2**31, -(2**33) - 1]
    cases = [
        (a, d, x, y)
        for (a, d), (x, y) in zip(
            itertools.product(small, divisors), itertools.cycle(itertools.product(wide, wide_div))
        )
    ]
    cases += [(1, 1, x, y) for x, y in itertools.product(wide, wide_div)]
    for (a, d, x, y), got in zip(cases, run_host(body, cases, tmp_path)):
        assert got == [a // d, a % d, x // y, x % y], (a, d, x, y)


# --- masks: printed C against Python on boundary values -------------------------------------------------
MASKS = [
    "((k - q) // 50) >= -1",
    "q // 64 >= k // 64",
    "(q - k) % 7 == 3",
    "(k - q) % 5 != 0",
    "((q + N - M) // 128) >= (k // 128)",
    "k * 3 <= q * 2",
    "k < q / 2",
    "k <= q * 0.5",
    "abs(q - k) <= 5",
    "max(q, k) % 3 == 1",
    "((q * k) % 1000) < 500",
    "k <= 2147483647 * q",
    "k < 99999999999",
    "q - k <= 2147483647",
    "k - q <= 4611686018427387904",
    "(k + 1) // (q + 1) == 0",
    "((k - q) // 3) * 3 >= -q",
    "where(q > 1000, k // 7, q % 11) <= 5",
    "q // N + k % M < 2",
    "(q - k) // -7 >= 0",
    "(q - k) % -7 > -3",
]
TRACED = {  # the same through Python operators on symbols (fagen.compile(mask=...))
    "((k - q) // 50) >= -1": lambda b, h, q, k: ((k - q) // 50) >= -1,
    "q // 64 >= k // 64": lambda b, h, q, k: q // 64 >= k // 64,
    "(q - k) % 7 == 3": lambda b, h, q, k: fagen.eq((q - k) % 7, 3),
    "k < q / 2": lambda b, h, q, k: k < q / 2,
    "(q - k) // -7 >= 0": lambda b, h, q, k: (q - k) // -7 >= 0,
}
NAMES = {q: "q_idx", k: "k_idx", M: "seqlen_q", N: "seqlen_k", b: "b", h: "h"}


def _boundary_cases():
    near = [0, 1, 2, 6, 7, 49, 50, 51, 63, 64, 65, 127, 128, 129, 999, 1000, 1001, 4095, 4096, 4097]
    top = [BIG - 1 - d for d in (0, 1, 49, 50, 63, 64, 127, 128)] + [2**30, 2**30 - 1, 2**24 + 1, 10**7 + 1]
    values = near + top
    cases = []
    for qv, kv in itertools.product(values, values):
        for Mv, Nv in {(qv + 1, kv + 1), (BIG, BIG), (qv + 1, BIG), (BIG, kv + 1)}:
            cases.append((qv, kv, Mv, Nv))
    return cases


CASES = _boundary_cases()


def _python(text, qv, kv, Mv, Nv):
    env = {
        "q": qv,
        "k": kv,
        "M": Mv,
        "N": Nv,
        "abs": abs,
        "max": max,
        "min": min,
        "where": lambda c, x, y: x if c else y,
    }
    return bool(eval(text, {"__builtins__": {}}, env))  # our own literal texts, in Python ints


def _mask_body(exprs_c):
    lines = "\n".join(f"    out[{i}] = ({c}) ? 1 : 0;" for i, c in enumerate(exprs_c))
    return f"""
constexpr int N_OUT = {len(exprs_c)};
void eval_case(const long long* in, long long* out) {{
    const int q_idx = (int)in[0], k_idx = (int)in[1], seqlen_q = (int)in[2], seqlen_k = (int)in[3];
    const int b = 0, h = 0;
{lines}
}}
"""


@needs_gxx
def test_printed_masks_match_python_on_boundaries(tmp_path):
    keeps = [parse_expr(t, exprs.MASK_NAMES) for t in MASKS]
    keeps += [variants.trace_mask(fn) for fn in TRACED.values()]
    texts = MASKS + list(TRACED)
    printed = [to_c(e, NAMES) for e in keeps]
    for c in printed:
        assert "f" not in c.replace("floor_div", "").replace("floor_mod", ""), c  # no float math: no 1.0f, floorf
    results = run_host(_mask_body(printed), CASES, tmp_path)
    for case, got in zip(CASES, results):
        want = [int(_python(t, *case)) for t in texts]
        bad = [(t, p) for t, p, g, w in zip(texts, printed, got, want) if g != w]
        assert not bad, (case, bad)


def test_the_issue_masks_print_as_integers():
    keep = variants.trace_mask(lambda b, h, q, k: ((k - q) // 50) >= -1)
    assert keep == sp.Ge(k / 50 - q / 50, -1)  # SymPy's rewrite; printed after multiplying by 50
    assert to_c(keep, NAMES) == "k_idx - q_idx >= -50"
    assert to_c(parse_expr("q // 64", exprs.MASK_NAMES), NAMES) == "(q_idx / 64)"  # q >= 0: C's division is floor
    assert to_c(parse_expr("(k + 1) // (q + 1)", exprs.MASK_NAMES), NAMES) == "((k_idx + 1) / (q_idx + 1))"
    assert to_c(parse_expr("(q - k) // 64", exprs.MASK_NAMES), NAMES) == "floor_div(-k_idx + q_idx, 64)"
    assert to_c(parse_expr("(q - k) % 7", exprs.MASK_NAMES), NAMES) == "floor_mod(-k_idx + q_idx, 7)"
    # past 32 bits the arithmetic is 64-bit, constants suffixed where they are helper arguments
    assert to_c(parse_expr("k * 3 <= q * 2", exprs.MASK_NAMES), NAMES) == "3*(long long)k_idx <= 2*(long long)q_idx"
    assert (
        to_c(parse_expr("(q * k) % 1000", exprs.MASK_NAMES), NAMES) == "(((long long)k_idx*(long long)q_idx) % 1000LL)"
    )
    # the bottom-right causal mask stays int: -seqlen_q + seqlen_k + q_idx <= seqlen_k - 1 since q_idx < seqlen_q
    assert to_c(sp.Le(k, q + N - M), NAMES) == "k_idx <= -seqlen_q + seqlen_k + q_idx"


def test_scores_keep_index_subexpressions_integer():
    s = exprs.SCORE
    e = parse_expr("s + slopes[h] * (k - q) + q // 64 + (k % 3)", exprs.SCORE_NAMES, tensors=True)
    c = to_c(e, {**NAMES, s: "s"})
    assert "(q_idx / 64)" in c and "(k_idx % 3)" in c and "floorf" not in c  # int operands: C's integer / and %
    # a comparison that mixes in a float value stays float
    mixed = parse_expr("k <= q + bias[h]", exprs.MASK_NAMES, tensors=True)
    assert to_c(mixed, NAMES) == (
        "k_idx <= q_idx + fagen_read(tensor_bias, fagen_at(h, tensor_bias_size_0, tensor_bias_stride_0))"
    )


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("sqrt(q) <= k", "not integer arithmetic"),
        ("log(k + 1) < 3", "not integer arithmetic"),
        ("k <= q * 0.1", "not exact in integer index math"),
        ("k < 100000000000000000000", "needs more than 64 bits"),
        ("k * 4611686018427387904 < q", "needs more than 64 bits"),
    ],
)
def test_float_rewrites_of_index_math_are_refused(text, fragment):
    keep = parse_expr(text, exprs.MASK_NAMES)
    with pytest.raises(ExprError, match=fragment):
        to_c(keep, NAMES)


def test_executor_agrees_with_python_on_boundaries():
    grid = {q: np.array(sorted({c[0] for c in CASES}))[:, None], k: np.array(sorted({c[1] for c in CASES}))[None, :]}
    for text in MASKS:
        keep = parse_expr(text, exprs.MASK_NAMES)
        Mv = Nv = BIG
        got = np.broadcast_to(executor._evaluate(keep, {**grid, M: Mv, N: Nv}), (grid[q].size, grid[k].size))
        for i, qv in enumerate(grid[q][:, 0]):
            for j, kv in enumerate(grid[k][0]):
                assert bool(got[i, j]) == _python(text, int(qv), int(kv), Mv, Nv), (text, qv, kv)


# --- key ranges: the template's block on the host, for sizes near 2^31 -----------------------------------
def _key_range_body(keep):
    rng = bounds.key_range(keep)
    bounds.prove(keep, rng)
    terms = [
        dict(
            text=exprs.to_text(sp.And(*t.conjuncts)) if t.conjuncts else "no affine bound",
            begins=[codegen.bound_c(e) for e in t.begins],
            ends=[codegen.bound_c(e) for e in t.ends],
            full_begins=[codegen.bound_c(e) for e in t.full_begins],
            full_ends=[codegen.bound_c(e) for e in t.full_ends],
            exact=t.exact,
        )
        for t in rng.terms
    ]
    block = codegen._env().get_template("key_range.cu.jinja").render(key_terms=terms, full_ranges=True)
    exact = [i for i, t in enumerate(rng.terms) if t.exact]
    outs = "\n".join(
        f"    out[{2 + 2 * n}] = full_begin_{n}; out[{3 + 2 * n}] = full_end_{n};" for n in range(len(exact))
    )
    body = f"""
constexpr int N_OUT = {2 + 2 * len(exact)};
void eval_case(const long long* in, long long* out) {{
    const int q_lo = (int)in[0], q_hi = (int)in[1], seqlen_q = (int)in[2], seqlen_k = (int)in[3];
{block}
    out[0] = kv_begin; out[1] = kv_end;
{outs}
}}
"""
    return rng, body


def _python_range(rng, q_lo, q_hi, Mv, Nv):
    env = {bounds.q_lo: q_lo, bounds.q_hi: q_hi, M: Mv, N: Nv}
    lo, hi = Nv, 0
    fulls = []
    for t in rng.terms:
        begin = max([0] + [int(e.xreplace(env)) for e in t.begins])
        end = min([Nv] + [int(e.xreplace(env)) for e in t.ends])
        if begin < end:
            lo, hi = min(lo, begin), max(hi, end)
        if t.exact:
            fulls += [
                max([0] + [int(e.xreplace(env)) for e in t.full_begins]),
                min([Nv] + [int(e.xreplace(env)) for e in t.full_ends]),
            ]
    return [lo, hi] + fulls


KEY_MASKS = {
    "window_max": variants.window_mask(BIG, 0) & sp.Le(k, q),
    "window_huge": variants.window_mask(2147483000, 2147483000),
    "window_2^62": variants.window_mask(2**62, 2**62),
    "prefix_huge": variants.prefix_mask(99999999999),
    "prefix_2^62": variants.prefix_mask(2**62),
    "causal_br": variants.causal_mask("bottom_right"),
    "floor_window": variants.trace_mask(lambda b, h, q, k: ((k - q) // 50) >= -1),
    "sliding": parse_expr("(k <= q) and (q - k <= 255)", exprs.MASK_NAMES),
}


@needs_gxx
@pytest.mark.parametrize("name", sorted(KEY_MASKS))
def test_key_range_block_is_exact_near_int_max(name, tmp_path):
    keep = KEY_MASKS[name]
    rng, body = _key_range_body(keep)
    cases = []
    for Mv, Nv in [(BIG, BIG), (BIG - 5, BIG), (BIG, 1000), (1000, BIG), (1, BIG), (BIG, 1), (4097, 4097)]:
        for q_lo in {0, 1, Mv // 2, max(0, Mv - 128), Mv - 1}:
            for tile in (1, 64, 128):
                q_hi = min(q_lo + tile, Mv) - 1
                cases.append((q_lo, q_hi, Mv, Nv))
    for case, got in zip(cases, run_host(body, cases, tmp_path)):
        want = _python_range(rng, *case)
        # the kernel clamps the hull to [0, seqlen_k]; full ranges are only compared with key tiles in it
        assert got[:2] == want[:2], (name, case, got, want)
        for fb, fe, gb, ge in zip(want[2::2], want[3::2], got[2::2], got[3::2]):
            assert (gb, ge) == (fb, fe), (name, case, got, want)


def test_the_key_range_hull_is_everything_for_a_maximal_window():
    rng = bounds.key_range(KEY_MASKS["window_max"])
    assert _python_range(rng, BIG - 128, BIG - 1, BIG, BIG)[:2] == [0, BIG]


def test_floor_masks_get_exact_key_ranges():
    """k/50 - q/50 >= -1 is k >= q - 50: an exact bound, proven, instead of no bound at all."""
    (t,) = bounds.key_range(KEY_MASKS["floor_window"]).terms
    assert t.exact and t.begins == (bounds.q_lo - 50,) and t.full_begins == (bounds.q_hi - 50,)


# --- the variants: huge values compile, values past 2^62 are refused by name ------------------------------
@pytest.mark.parametrize("tier, dtype", [("mma", "bf16"), ("simt", "f32")])
@pytest.mark.parametrize(
    "options",
    [
        dict(window=2**31 - 1),
        dict(causal=True, window=2147483000),
        dict(prefix=99999999999),
        dict(window=(2**62, 3)),
        dict(prefix=2**62),
    ],
    ids=["window_int_max", "window_2147483000", "prefix_huge", "window_2^62", "prefix_2^62"],
)
def test_huge_windows_and_prefixes_compile(options, tier, dtype):
    kern = fagen.compile(64, dtype=dtype, arch="sm_90a", tier=tier, **options)
    assert "long long hull_begin" in kern.source


@pytest.mark.parametrize(
    "options, fragment",
    [
        (dict(window=2**62 + 1), r"window \(left\): expected at most"),
        (dict(window=(5, 2**63)), r"window \(right\): expected at most"),
        (dict(prefix=10**20), "prefix: expected at most"),
    ],
)
def test_values_past_the_maximum_are_refused_by_name(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        variants.build(**options)


def test_executor_window_int_max_is_everything():
    gen = np.random.default_rng(0)
    x = {n: gen.standard_normal((1, 2, 37, 16)) for n in "qkv"}
    wide = executor.run(variants.build(causal=True, window=2**31 - 1), x).outputs["o"]
    causal = executor.run(variants.build(causal=True), x).outputs["o"]
    assert np.allclose(wide, causal)


@pytest.mark.parametrize("tier, dtype", [("mma", "bf16"), ("mma", "f16"), ("simt", "f32"), ("simt", "bf16")])
def test_floor_and_mod_masks_compile_with_integer_masks(tier, dtype):
    kern = fagen.compile(
        64,
        dtype=dtype,
        arch="sm_90a",
        tier=tier,
        mask=lambda b, h, q, k: (((k - q) // 50) >= -1) & fagen.ne((q - k) % 7, 3) & (q // 64 >= k // 64),
    )
    src = kern.source
    assert "k_idx - q_idx >= -50" in src and "floor_mod(-k_idx + q_idx, 7) != 3" in src
    assert "floorf" not in src and "1.0f/50" not in src and "1.0f/64" not in src


@pytest.mark.parametrize(
    "mask, python",
    [
        (lambda b, h, q, k: fagen.ne(((q - k) // 3) % 4, 1), lambda q, k: ((q - k) // 3) % 4 != 1),
        (lambda b, h, q, k: (q + 2 * k) // 7 >= (q - k) // 5, lambda q, k: (q + 2 * k) // 7 >= (q - k) // 5),
    ],
)
def test_the_reference_floors_ratios_of_indices_in_integers(mask, python):
    """The NumPy oracle must not compute floor((q - k)/3) as floor(-k/3 + q/3) in floats (0.9999... -> 0)."""
    import numpy as np

    from fagen.passes import fuse
    from fagen.tools import executor

    keep = fuse.fused_node(fagen.compile(64, mask=mask, arch="sm_90a").program).attr("keep")
    M = N = 1000
    values = {**executor._index_grids(dict(B=1, H=1, M=M, N=N)), exprs.DIMS["M"]: M, exprs.DIMS["N"]: N}
    got = np.broadcast_to(np.asarray(executor._evaluate(keep, values), bool), (1, 1, M, N))[0, 0]
    q, k = np.arange(M)[:, None], np.arange(N)[None, :]
    assert (got == python(q, k)).all()
