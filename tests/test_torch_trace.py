"""FlexAttention-style mask_mod / score_mod functions, written with torch operators and functions, trace into
the same proven programs as fagen's own helpers."""

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
