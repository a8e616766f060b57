"""FlexAttention-style mask_mod / score_mod functions, written with torch operators and functions, trace into
the same proven programs as fagen's own helpers."""

import math

import pytest
import sympy as sp

import fagen
from fagen.ir import exprs, variants
from fagen.ir.exprs import ExprError

torch = pytest.importorskip("torch")

q, k, b, h = (exprs.INDICES[n] for n in "qkbh")
S = exprs.SCORE


def _same(a, c) -> bool:
    """Equal at every point of a grid of integer indices and a range of scores (floats from the user's
    function may stand where fagen writes rationals)."""
    import itertools

    bias, bias_h = exprs.tensor("bias"), sp.Symbol("bias_h")
    syms = [q, k, b, h, S, bias_h]
    f, g = (sp.lambdify(syms, sp.sympify(x).xreplace({bias[h]: bias_h}), modules="math") for x in (a, c))
    for qi, ki, si in itertools.product(range(0, 200, 7), range(0, 200, 11), (-13.5, -1.0, 0.0, 0.7, 42.0)):
        x, y = f(qi, ki, 0, 1, si, 0.25), g(qi, ki, 0, 1, si, 0.25)
        if isinstance(x, bool) or isinstance(y, bool):
            if bool(x) != bool(y):
                return False
        elif abs(float(x) - float(y)) > 1e-9 * (1 + abs(float(y))):
            return False
    return True


@pytest.mark.parametrize(
    "mask_mod, expected",
    [
        (lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, sp.Ge(q, k)),
        (lambda b, h, q_idx, kv_idx: (q_idx // 64) == (kv_idx // 64), sp.Eq(sp.floor(q / 64), sp.floor(k / 64))),
        (lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 256), sp.And(q >= k, q - k <= 256)),
        (lambda b, h, q_idx, kv_idx: torch.logical_or(kv_idx < 4, q_idx >= kv_idx), sp.Or(k < 4, q >= k)),
        (lambda b, h, q_idx, kv_idx: ~(kv_idx > q_idx), sp.Not(k > q)),
        (lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 3 != 1, sp.Ne(sp.Mod(q - k, 3), 1)),
    ],
)
def test_torch_style_masks(mask_mod, expected):
    assert _same(variants.trace_mask(mask_mod), expected)


@pytest.mark.parametrize(
    "score_mod, expected",
    [
        (lambda score, b, h, q_idx, kv_idx: 30 * torch.tanh(score / 30), 30 * sp.tanh(S / 30)),
        (lambda score, b, h, q_idx, kv_idx: score.tanh() * 30, 30 * sp.tanh(S)),
        (
            lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, score - 5.0),
            sp.Piecewise((S, q >= k), (S - 5, True)),
        ),
        (lambda score, b, h, q_idx, kv_idx: score - torch.abs(q_idx - kv_idx) * 0.5, S - sp.Abs(q - k) / 2),
        (lambda score, b, h, q_idx, kv_idx: torch.clamp(score, min=-10.0, max=10.0), sp.Min(sp.Max(S, -10), 10)),
        (lambda score, b, h, q_idx, kv_idx: score * torch.sigmoid(score), S / (1 + sp.exp(-S))),
        (lambda score, b, h, q_idx, kv_idx, bias: score + bias[h], S + exprs.tensor("bias")[h]),
        (lambda s, b, h, q, k: fagen.where(q >= k, torch.exp(s), s), sp.Piecewise((sp.exp(S), q >= k), (S, True))),
    ],
)
def test_torch_style_scores(score_mod, expected):
    assert _same(variants.trace_score(score_mod), expected)


def test_a_torch_softcap_is_fagens_softcap():
    traced = variants.build(score_mod=lambda s, b, h, q, k: 20.0 * torch.tanh(s / 20.0))
    shipped = variants.build(softcap=20.0)
    (t,) = [n.attr("fn") for n in traced.nodes() if n.op.value == "score_mod"]
    (c,) = [n.attr("fn") for n in shipped.nodes() if n.op.value == "score_mod"]
    assert _same(t, c)


@pytest.mark.parametrize(
    "fn, what, message",
    [
        (lambda b, h, q, k: q >= k if q > 3 else q < k, "mask", "definite truth value"),
        (lambda b, h, q, k: (q >= k) and (q < k + 9), "mask", "definite truth value"),
        (lambda b, h, q, k: q is k, "mask", "'is' compares objects"),
        (lambda b, h, q, k: torch.atan2(q, k) > 0, "mask", "torch.atan2 is not among"),
        (lambda s, b, h, q, k: s + _CAPTURED[s], "score_mod", "an index reads only b, h, q, k"),
        (lambda s, b, h, q, k: s + torch.tensor(1.0), "score_mod", "neither a parameter of the function nor"),
        (lambda s, b, h, q, k: s * float(q), "score_mod", "numeric function"),
    ],
)
def test_refused_with_the_reason(fn, what, message):
    tracer = variants.trace_mask if what == "mask" else variants.trace_score
    with pytest.raises(ExprError, match=message) as e:
        tracer(fn)
    assert str(e.value).startswith(what)


_CAPTURED = torch.ones(4)
_ROWS = torch.ones(4, 3)


def test_a_document_mask_compiles_with_integer_index_math(tmp_path):
    doc = 64
    kernel = fagen.compile(
        64,
        mask=lambda b, h, q_idx, kv_idx: (q_idx // doc == kv_idx // doc) & (q_idx >= kv_idx),
        arch="sm_90a",
        cache_dir=tmp_path,
    )
    assert "return (q_idx / 64) == (k_idx / 64) && q_idx >= k_idx;" in kernel.source  # q, k >= 0: C's / is floor
    assert "floorf" not in kernel.source


# --- the Tensor surface mask and score authors use: each traced function computes what torch computes --------
import numpy as np  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks  # noqa: E402

from fagen.tools import executor  # noqa: E402

_M, _N = 70, 90


def _grid():
    """Index grids (torch, and the executor's), b = 1, h = 2, and a score grid from -9 to 9 (float64)."""
    qt, kt = torch.arange(_M)[:, None], torch.arange(_N)[None, :]
    st = torch.linspace(-9, 9, _M * _N, dtype=torch.float64).reshape(_M, _N)
    values = {q: qt.numpy(), k: kt.numpy(), b: np.int64(1), h: np.int64(2), S: st.numpy()}
    return (torch.tensor(1), torch.tensor(2), qt, kt, st), values


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 9


def _morton(b, h, q_idx, kv_idx):
    return ((q_idx ^ kv_idx) >> 4) == 0


def _plus_one(x):  # a Python helper function
    return x + 1


_WIDTH, _FRACTION = 12, 0.25  # module-level numbers: baked in when traced


def _with_helper(b, h, q_idx, kv_idx):
    return _plus_one(kv_idx) <= q_idx + _WIDTH


MASKS = {
    "clamp method": lambda b, h, q, k: q.clamp(min=20) >= k,
    "clip method": lambda b, h, q, k: q.clip(5, 40) > k.clamp_max(30),
    "clamp function": lambda b, h, q, k: torch.clamp(q - k, -3, 3) == 0,
    "abs neg sign": lambda b, h, q, k: (torch.sign(q - k) == -1) | ((k - q).neg().abs() < 3),
    "where of conditions": lambda b, h, q, k: torch.where(q > 30, k < 5, k > 40),
    "minimum maximum": lambda b, h, q, k: torch.minimum(q, k * 2) >= torch.maximum(k, q.new_full((), 10)),
    "new_ones/new_zeros": lambda b, h, q, k: (b.new_ones((), dtype=torch.bool) & (q >= k)) | b.new_zeros(1, 1).bool(),
    "like": lambda b, h, q, k: torch.zeros_like(q, dtype=torch.bool) | (torch.full_like(k, 7) > q - k),
    "ones_like number": lambda b, h, q, k: torch.ones_like(q) * 3 > k,
    "casts": lambda b, h, q, k: ((q >= k).int() + (k < 4).long() + (q - k).to(torch.bool).float()) >= 2,
    "to bool": lambda b, h, q, k: ((q - k) % 3).to(torch.bool) & (q >= k).to(torch.int32).bool(),
    "logical": lambda b, h, q, k: torch.logical_xor(q > k, k < 10) | torch.logical_not(q > 3),
    "comparison functions": lambda b, h, q, k: torch.ge(q, k) & torch.ne(q, 5) & torch.less(k, 60),
    "bool == bool": lambda b, h, q, k: (q // 16 > k // 16) == (q < k),
    "bool != bool": lambda b, h, q, k: (q > 20) != (k > 20),
    "morton": _morton,
    "bit and": lambda b, h, q, k: (q & 7) == (k & 7),
    "bit and (not a mask of low bits)": lambda b, h, q, k: (q & k & 12) == 4,
    "bit or, xor, not": lambda b, h, q, k: ((q | k) ^ ~k) > 40,
    "shifts": lambda b, h, q, k: ((k << 2) <= q + 7) & ((q - k) >> 3 >= -2),
    "shift functions": lambda b, h, q, k: torch.bitwise_right_shift(q, 2) == torch.bitwise_right_shift(k, 2),
    "bitwise functions on ints": lambda b, h, q, k: torch.bitwise_and(q, torch.bitwise_not(k)) == 0,
    "floor_divide remainder fmod": lambda b, h, q, k: (
        (torch.floor_divide(q - k, 7) + torch.remainder(q - k, 5)) == torch.fmod(q - k, 4)
    ),
    "fmod of a negative dividend": lambda b, h, q, k: torch.fmod(q - k, 7) == -3,
    "condition as a number": lambda b, h, q, k: ((q < k) // 2 == 0) & ((q >= k) * 3 + (k % 2 == 0) >= 3),
    "and_masks": and_masks(_causal, _band),
    "or_masks": or_masks(_morton, _band),
    "and_masks of or_masks": and_masks(or_masks(_causal, _morton), _band),
    "noop_mask": noop_mask,
    "helper and module numbers": _with_helper,
    "bitwise and of conditions": lambda b, h, q, k: torch.bitwise_and(q >= k, k < 50) | torch.bitwise_or(q < 2, k < 2),
}


@pytest.mark.parametrize("name", MASKS)
def test_masks_trace_to_what_torch_computes(name):
    args, values = _grid()
    keep = variants.trace_mask(MASKS[name])
    got = np.broadcast_to(np.asarray(executor._evaluate(keep, values), dtype=bool), (_M, _N))
    want = np.broadcast_to(MASKS[name](*args[:4]).numpy().astype(bool), (_M, _N))
    assert (got == want).all(), f"{name}: {int((got != want).sum())} of {_M * _N} differ ({keep})"


SCORES = {
    "exp2 log2": lambda s, b, h, q, k: torch.exp2(s / 4) + torch.log2(s.abs() + 1) + s.exp2().log2() / 8,
    "exp log log1p": lambda s, b, h, q, k: torch.exp(s / 9) + s.abs().log1p() + torch.log(s * s + 1),
    "sqrt rsqrt pow": lambda s, b, h, q, k: (
        (s * s + 1).sqrt() + torch.rsqrt(s.abs() + 1) + torch.pow(s.abs(), 1.5) + s.pow(3) / 100
    ),
    "sigmoid tanh": lambda s, b, h, q, k: torch.sigmoid(s) + s.tanh() + torch.special.expit(s / 2),
    "silu": lambda s, b, h, q, k: F.silu(s),
    "erf": lambda s, b, h, q, k: torch.erf(s / 3) + torch.special.erf(s),
    "gelu": lambda s, b, h, q, k: F.gelu(s),
    "gelu tanh": lambda s, b, h, q, k: F.gelu(s, approximate="tanh"),
    "softplus": lambda s, b, h, q, k: F.softplus(s) + F.softplus(s * 5, beta=2, threshold=10),
    "sin cos": lambda s, b, h, q, k: torch.sin(s) + s.cos(),
    "FlexAttention's _trig": lambda s, b, h, q, k: torch.sin(torch.cos(s)) + torch.tan(b.double()) + torch.tan(s / 9),
    "FlexAttention's alibi": lambda s, b, h, q, k: s + (k - q) * torch.exp2(-((h + 1) * 8.0 / 8)),
    "clamp method": lambda s, b, h, q, k: s.clamp(-5, 5) + s.clip(min=-1.5),
    "fmod remainder": lambda s, b, h, q, k: torch.fmod(s, 2.5) + torch.remainder(s, 3.0) + s.fmod(-2.0),
    "floor_divide": lambda s, b, h, q, k: torch.floor_divide(s, 2.0) + s // 3,
    "where minimum maximum": lambda s, b, h, q, k: torch.where(q >= k, torch.minimum(s, s * 0.5), s.maximum(-s)),
    "casts": lambda s, b, h, q, k: s * (q >= k).to(s.dtype) + (q - k).double() * 0.1 + (s * 3).int() - s.long(),
    "abs neg sign": lambda s, b, h, q, k: torch.abs(s) - s.neg() * torch.sign(s) + s.sign(),
    "integer bits in a score": lambda s, b, h, q, k: s + ((q ^ k) & 3) * 0.5 - torch.fmod(q - k, 5),
    "where with a number condition": lambda s, b, h, q, k: torch.where((q - k) % 2 == 1, s, 0.0),
    "closure": (lambda f: lambda s, b, h, q, k: s * f + _FRACTION * (q - k))(0.75),
}


@pytest.mark.parametrize("name", SCORES)
def test_scores_trace_to_what_torch_computes(name):
    args, values = _grid()
    fn = variants.trace_score(SCORES[name])
    got = np.broadcast_to(np.asarray(executor._evaluate(fn, values), dtype=np.float64), (_M, _N))
    want = np.broadcast_to(SCORES[name](args[4], *args[:4]).numpy().astype(np.float64), (_M, _N))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=f"{name}: {fn}")


REFUSED = [
    (lambda b, h, q, k: torch.atan2(q, k) > 0, "mask", "torch.atan2 is not among"),
    (lambda b, h, q, k: q.cumsum(0) > k, "mask", "Tensor.cumsum is not among"),
    (lambda b, h, q, k: q.view(-1) >= k, "mask", "Tensor.view is not among"),
    (lambda b, h, q, k: q.foo > k, "mask", "Tensor.foo is not among"),
    (lambda s, b, h, q, k: s.item(), "score_mod", "Tensor.item is not among"),
    (lambda s, b, h, q, k: s + (q ^ s), "score_mod", "bitwise ^ of q and s"),
    (lambda s, b, h, q, k: s + (s & 1), "score_mod", "bitwise & of s and 1"),
    (lambda s, b, h, q, k: s + ~s, "score_mod", "~s: ~ takes a condition or an integer"),
    (lambda b, h, q, k: (q << k) > 3, "mask", "the shift must be an integer constant"),
    (lambda b, h, q, k: (q >> 99) > 3, "mask", "the shift must be an integer constant"),
    (lambda b, h, q, k: (q // 64 > k // 64) | (q // (k < 5) > 2), "mask", "the divisor"),
    (lambda b, h, q, k: q % (k - 3) == 1, "mask", "q % (k - 3): the divisor may be zero"),
    (lambda b, h, q, k: torch.fmod(q, 0) == 1, "mask", "fmod 0: the divisor may be zero"),
    (lambda s, b, h, q, k: s**s, "score_mod", "the exponent must be a constant"),
    (lambda s, b, h, q, k: s**40, "score_mod", "exponent of at most 16"),
    (lambda s, b, h, q, k: s.to(torch.complex64), "score_mod", "complex"),
    (lambda s, b, h, q, k: F.gelu(s, approximate="fast"), "score_mod", "gelu: approximate='fast'"),
    (lambda s, b, h, q, k: F.softplus(s, beta=0), "score_mod", "softplus: beta and threshold"),
    (lambda s, b, h, q, k: torch.div(s, 2, rounding_mode="up"), "score_mod", "rounding_mode='up'"),
    (lambda s, b, h, q, k: torch.exp(s, out=s), "score_mod", "out= and inplace=True are not supported"),
    (lambda b, h, q, k: torch.sin(q) > k, "mask", "not integer arithmetic"),
    (lambda b, h, q, k: torch.ones(4)[q] > 0, "mask", "neither a parameter of the function nor"),
    (lambda s, b, h, q, k: s * torch.tensor(2.0), "score_mod", "neither a parameter of the function nor"),
    (lambda s, b, h, q, k: math.erf(s), "score_mod", "numeric function"),
    (lambda s, b, h, q, k: s if s > 0 else -s, "score_mod", "definite truth value"),
    (lambda b, h, q, k: {}[q], "mask", "unhashable type"),
    (lambda s, b, h, q, k: s + [0.1, 0.2][b] * k, "score_mod", "a list made inside the function indexed by it"),
    (lambda b, h, q, k: q > k + None, "mask", "cannot use a NoneType"),
    (lambda b, h, q, k: _CAPTURED.long()[q] > 0, "mask", "Tensor.long of the tensor captured_CAPTURED"),
    (lambda b, h, q, k: q < _CAPTURED.sum(), "mask", "Tensor.sum of the tensor captured_CAPTURED"),  # its sizes: read
    (
        lambda s, b, h, q, k: s + (_ROWS[q] - _ROWS[k]),
        "score_mod",
        "a row of 3 elements of the tensor captured_ROWS is used as one number; reduce it",
    ),
    (lambda s, b, h, q, k: s + float("inf") * (q < k), "score_mod", "not allowed"),
    (lambda s, b, h, q, k: torch.where(s > 0, s, -math.inf), "score_mod", "the keys it gives -inf depend on the score"),
    (lambda s, b, h, q, k: torch.where(q >= k, s, math.inf), "score_mod", "infinities are not allowed"),
    (lambda s, b, h, q, k: -torch.where(q >= k, s, -math.inf), "score_mod", "infinities are not allowed"),
]


@pytest.mark.parametrize("fn, what, fragment", REFUSED)
def test_what_is_not_supported_is_refused_naming_it(fn, what, fragment):
    """Anything outside the surface is an ExprError whose message names it, never an internal exception."""
    tracer = variants.trace_mask if what == "mask" else variants.trace_score_and_mask
    with pytest.raises(ExprError) as e:
        tracer(fn)
    assert fragment in str(e.value) and str(e.value).startswith(what + ":")


def test_a_sympy_failure_while_checking_is_an_expr_error(monkeypatch):
    def broken(*args, **kwargs):
        raise AttributeError("'StrictLessThan' object has no attribute 'as_coeff_Mul'")

    monkeypatch.setattr(exprs, "check_expr", broken)
    with pytest.raises(ExprError, match=r"mask: cannot use .*AttributeError: 'StrictLessThan'"):
        variants.trace_mask(lambda b, h, q, k: q >= k)


@pytest.mark.parametrize(
    "mask",
    [
        lambda b, h, q, k: (q // 64 > k // 64) == (q < k),  # crashed in SymPy, printing the mask (issue 40)
        lambda b, h, q, k: (q >= k) != (k // 16 == 3),
        lambda b, h, q, k: (q < k) // 2 == 0,
        lambda b, h, q, k: (q // 16 == k // 16) & (q >= k),
        lambda b, h, q, k: (q - k) // ((q >= k) + 1) < 9,
    ],
)
def test_conditions_mixed_with_floor_division_print_as_c(mask):
    from fagen.backend.printer import to_c
    from fagen.math import bounds

    keep = variants.trace_mask(mask)
    names = {q: "q_idx", k: "k_idx", b: "b", h: "h", exprs.DIMS["M"]: "seqlen_q", exprs.DIMS["N"]: "seqlen_k"}
    assert "q_idx" in to_c(keep, names)
    bounds.prove(keep, bounds.key_range(keep))
    args, values = _grid()
    want = np.broadcast_to(mask(*args[:4]).numpy().astype(bool), (_M, _N))
    assert (np.broadcast_to(executor._evaluate(keep, values), (_M, _N)) == want).all()


@pytest.mark.parametrize(
    "mask",
    [
        _morton,
        and_masks(_causal, _morton),
        lambda b, h, q, k: k <= (q | 15),
        lambda b, h, q, k: ((q & 7) == 0) | (k <= q),
        lambda b, h, q, k: (k < (q & 7) + q - 3) & (k >= q >> 1),
        lambda b, h, q, k: (torch.fmod(q - k, 16) == 0) | (q - k < 4),
    ],
)
def test_bit_operations_give_key_ranges_that_hold(mask):
    """A bit operation gives no static key range for its part (the bounds cannot reason about it), never a wrong
    one: the ranges hold against brute force on random tiles, and are proven."""
    from fagen.math import bounds

    from .test_bounds import check_against_brute_force

    keep = variants.trace_mask(mask)
    rng = bounds.key_range(keep)
    bounds.prove(keep, rng)
    check_against_brute_force(keep, trials=30)
    if mask is _morton:
        assert not any(t.begins or t.ends for t in rng.terms)  # nothing to bound it by


@pytest.mark.parametrize(
    "score",
    [
        lambda s, b, h, q, k: F.gelu(s) + torch.exp2(s * 0.5) + F.softplus(s) + torch.fmod(q - k, 7) * 0.1,
        lambda s, b, h, q, k: F.gelu(s, approximate="tanh") + torch.erf(s) + torch.sin(s) + s.clamp(-5, 5),
        lambda s, b, h, q, k: torch.log1p(s.abs()) + torch.rsqrt(s * s + 1) + s.pow(1.5) * math.pi,
    ],
)
def test_programs_of_the_new_constructs_read_back_from_their_text(score):
    """A cache hit parses the program's text (fagen.loader): the forward, the fused and the backward programs of
    the new constructs print as text that reads back as themselves (gelu's 1/sqrt(2) to the last bit)."""
    from fagen.ir import parse_program
    from fagen.passes import backward, fuse

    prog = variants.build(mask=and_masks(_causal, _morton), score_mod=score)
    fused = fuse.fuse(prog)
    for p in (prog, fused, backward.derive(fused)):
        assert parse_program(str(p)) == p


def _new_score(s, b, h, q_idx, kv_idx):
    """A score of the new constructs: erf, gelu, exp2, softplus, fmod, remainder, a clamp method, integer bits."""
    bits = ((q_idx ^ kv_idx) & 3) * 0.25 - torch.fmod(q_idx - kv_idx, 5) * 0.125
    smooth = F.gelu(s) + torch.erf(s) + torch.exp2(s * 0.5) + F.softplus(s) + s.clamp(-5, 5)
    return smooth + torch.remainder(s, 3.0) + bits


def test_the_new_constructs_compile_forward_and_backward(tmp_path):
    """The forward kernel of a Morton mask composed with torch's and_masks and a score of the new constructs, and
    its backward's main kernel, print as CUDA that NVRTC compiles (no GPU): integer operations stay integer C."""
    from fagen.backend import build, codegen, plan
    from fagen.backend.contract import Kind
    from fagen.pipeline import load_program, lower

    from .lowered import lowered

    mask = and_masks(_causal, _morton)
    kernel = fagen.compile(64, mask=mask, score_mod=_new_score, arch="sm_90a", cache_dir=tmp_path)
    src = kernel.source
    assert "((q_idx ^ k_idx) / 16) == 0 && q_idx >= k_idx" in src
    assert "erff(" in src and "log1pf(" in src and "fmodf(" in src and "((q_idx ^ k_idx) % 4)" in src
    assert "((-k_idx + q_idx) % 5)" in src  # fmod of integers: C's %, which truncates
    program = lower(load_program(mask=mask, score_mod=_new_score), "bf16")[-1].program  # remainder's gradient: 1
    spec = plan.choose(program.name, 64, "bf16", "sm_90a", "simt", causal=True, kind=Kind.BWD).spec
    src = codegen.render(spec, lowered(program, backward=True))
    binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert "warning" not in binary.log, binary.log
    assert "3.141592653589793f" in src  # erf's derivative: 2 exp(-x^2) / sqrt(pi), pi a float constant


_DOCS = torch.tensor([0] * 20 + [1] * 30 + [2] * 40)


def _document_of(ids):
    def document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    return document


def _same_doc(q_idx, kv_idx):  # a helper reading a module tensor
    return _DOCS[q_idx] == _DOCS[kv_idx]


def test_tensors_read_by_helpers_and_composed_masks_are_captured():
    """A tensor read by a helper function, or by a mask torch's and_masks/or_masks composes, is captured as a
    tensor the mask reads itself is: named by its variable (one object, one name), read anew at each call."""
    other = torch.tensor([7] * 45 + [8] * 45)
    composed = {
        "and_masks": and_masks(_causal, _document_of(_DOCS)),
        "or_masks": or_masks(_document_of(_DOCS), _document_of(other), _document_of(_DOCS)),
        "helper": lambda b, h, q, k: _same_doc(q, k) & (q >= k),
        "helper and closure": lambda b, h, q, k: _same_doc(q, k) | (other[q] == other[k]),
    }
    args, values = _grid()
    for name, mask in composed.items():
        caps = variants.captured(mask, "mask")
        keep = variants.trace_mask(mask)
        tensors = {c.name: c.value(mask).numpy() for c in caps}
        assert sorted(tensors) == sorted(exprs.tensors_in(keep)), name
        got = np.broadcast_to(executor._evaluate(keep, {**values, **tensors}), (_M, _N))
        want = np.broadcast_to(mask(*args[:4]).numpy(), (_M, _N))
        assert (got == want).all(), name
    caps = variants.captured(composed["or_masks"])
    assert [c.name for c in caps] == ["ids", "ids_2"] and [c.value(composed["or_masks"]) for c in caps] == [
        _DOCS,
        other,
    ]
    (cap,) = variants.captured(composed["helper"])
    assert cap.name == "captured_DOCS" and cap.path == (("global", "_same_doc"),)
    module = globals()
    old = module["_DOCS"]
    module["_DOCS"] = torch.zeros(90, dtype=torch.int64)
    try:
        assert cap.value(composed["helper"]) is module["_DOCS"]  # the object the variable holds at the call
    finally:
        module["_DOCS"] = old


def test_a_captured_tensor_may_be_indexed_a_dimension_at_a_time():
    """FlexAttention's own tests index captured tensors so: bias[b][q_idx], bias[0][b, h][q_idx]."""
    bias, deep = torch.randn(3, 70), torch.randn(4, 3, 2, 70)
    fns = {
        "bias[b][q]": (lambda s, b, h, q_idx, kv_idx: s + bias[b][q_idx], "bias", (b, q)),
        "deep[0][b, h][q]": (lambda s, b, h, q_idx, kv_idx: s + deep[0][b, h][q_idx], "deep", (0, b, h, q)),
    }
    for name, (fn, label, index) in fns.items():
        assert variants.trace_score(fn) == S + exprs.tensor(label)[index], name
    with pytest.raises(ExprError, match="tensor bias is read with 1 of its 2 indices"):
        variants.trace_score(lambda s, b, h, q_idx, kv_idx: s + bias[b])
    scale = torch.ones((), dtype=torch.int32)  # a 0-d tensor is a call-time number (tests/test_catalog_lifts.py)
    assert variants.trace_score(lambda s, b, h, q_idx, kv_idx: s + scale) == S + exprs.tensor("captured_scale")[0]


def test_a_composed_mask_passes_its_helpers_tensor_to_the_kernel():
    """and_masks(causal, document) where the document mask reads a tensor from its own closure: the kernel takes
    the tensor (its dtype from the object), and each call reads the object the variable holds then."""
    ids = torch.zeros(64, dtype=torch.int32)
    mask = and_masks(_causal, _document_of(ids))
    kern = fagen.compile(64, mask=mask, tier="simt", arch="sm_80", use_cache=False)
    assert kern.tensors == ("ids",) and {a.name: a.dtype for a in kern.tensor_args} == {"ids": "i32"}
    assert "const int* __restrict__ tensor_ids" in kern.source
    assert kern.with_captured({})["ids"] is ids


INF_SCORES = {  # FlashAttention-4's eager score_mods mask with -inf, as FlexAttention users do
    "causal": lambda score, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, score, float("-inf")),
    "sliding window": lambda score, b, h, q_idx, kv_idx: torch.where(
        torch.abs(q_idx - kv_idx) <= 25, score, float("-inf")
    ),
    "block diagonal": lambda score, b, h, q_idx, kv_idx: torch.where(q_idx // 16 == kv_idx // 16, score, -math.inf),
    "added": lambda score, b, h, q_idx, kv_idx: score * 2 + torch.where(q_idx >= kv_idx, 0.0, -float("inf")),
    "nested": lambda score, b, h, q_idx, kv_idx: torch.where(
        q_idx > 30, torch.where(kv_idx < 50, score, -float("inf")), score + 1
    ),
    "everything": lambda score, b, h, q_idx, kv_idx: score.new_full((), float("-inf")),
}


@pytest.mark.parametrize("name", INF_SCORES)
def test_a_score_of_minus_infinity_masks_the_key(name):
    """Where a score function gives -inf, the key is masked: the program masks it, and scores the rest as the
    function does."""
    fn = INF_SCORES[name]
    args, values = _grid()
    want = np.broadcast_to(fn(args[4], *args[:4]).numpy(), (_M, _N))
    program = variants.build(score_mod=fn)
    (keep,) = [n.attr("keep") for n in program.nodes() if n.op.value == "mask"]
    (score,) = [n.attr("fn") for n in program.nodes() if n.op.value == "score_mod"]
    kept = np.broadcast_to(executor._evaluate(keep, values), (_M, _N))
    assert (kept == np.isfinite(want)).all()
    got = np.broadcast_to(np.asarray(executor._evaluate(score, values), dtype=np.float64), (_M, _N))
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-12)


def test_a_causal_score_of_minus_infinity_gets_the_causal_key_range():
    from fagen.math import bounds

    _, keep = variants.trace_score_and_mask(INF_SCORES["causal"])
    assert keep == sp.Le(k, q) and bounds.key_range(keep).terms[0].ends == (bounds.q_hi + 1,)
