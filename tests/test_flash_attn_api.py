"""FlashAttention's semantics, checked on the CPU: the programs flash_attn_func compiles run in the float64
executor against direct NumPy formulas (softcap before ALiBi, ALiBi as -slope·|i + N - M - j|, causal and
window aligned bottom-right, M != N both ways); fagen's own alibi + softcap composes in the same order; the
drop-ins map FlashAttention's arguments onto fagen's (layout views, no copies) and refuse what is not done."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sympy as sp

import fagen
from fagen.backend.printer import to_c
from fagen.ir import exprs
from fagen.ir.variants import build, flash_attn_program
from fagen.passes import fuse
from fagen.request import Flash
from fagen.tools import executor


def numpy_flash(q, k, v, *, causal=False, window=(-1, -1), softcap=0.0, slopes=None, scale=None):
    """FlashAttention's reference, written out: scores scaled, softcapped, masked (bottom-right), + ALiBi."""
    B, H, M, D = q.shape
    N = k.shape[2]
    s = np.einsum("bhmd,bhnd->bhmn", q, k) * (1 / math.sqrt(D) if scale is None else scale)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i = np.arange(M)[:, None] + N - M
    j = np.arange(N)[None, :]
    left, right = window
    right = 0 if causal else right
    keep = np.ones((M, N), bool)
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    if slopes is not None:  # [H], or [B, H] per batch
        s = s - (slopes[None, :, None, None] if slopes.ndim == 1 else slopes[:, :, None, None]) * np.abs(i - j)
    s = np.where(keep, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return p @ v


def rand(B, H, M, N, D, seed):
    g = np.random.default_rng(seed)
    return g.standard_normal((B, H, M, D)), g.standard_normal((B, H, N, D)), g.standard_normal((B, H, N, D))


def run_program(program, q, k, v, tensors, fused: bool):
    if fused:
        program, _ = fuse.fuse_with_proofs(program)
    return executor.run(program, dict(q=q, k=k, v=v), tensors=tensors, block_m=4, block_n=3).outputs["o"]


SIZES = [(7, 5), (5, 7), (1, 9), (9, 1), (17, 17)]
MASKS = [
    (False, (-1, -1)),
    (True, (-1, -1)),
    (False, (2, 1)),
    (False, (3, -1)),
    (False, (-1, 0)),
    (False, (0, 0)),
    (True, (2, -1)),
    (True, (0, 5)),
]


@pytest.mark.parametrize("M,N", SIZES)
@pytest.mark.parametrize("causal,window", MASKS)
def test_flash_program_matches_the_formula(M, N, causal, window):
    """softcap 3, ALiBi and the mask: the program, unfused and fused (tiled with the proven rule), equals
    FlashAttention's formula, with M < N, M > N (rows that see no key give 0) and M = N."""
    q, k, v = rand(2, 3, M, N, 8, seed=M * 31 + N)
    q *= 3  # scores past the cap
    slopes = np.array([0.5, 0.25, 0.125])
    program = flash_attn_program(causal=causal, window=window, softcap=3.0, alibi=True)
    want = numpy_flash(q, k, v, causal=causal, window=window, softcap=3.0, slopes=slopes)
    for fused in (False, True):
        got = run_program(program, q, k, v, {"slopes": slopes}, fused)
        np.testing.assert_allclose(got, want, atol=1e-12, err_msg=f"fused={fused}")


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (2, 1))])
def test_flash_program_with_per_batch_slopes_matches_the_formula(causal, window):
    """alibi_slopes [B, H]: batch b's heads take row b (slopes[b, h]); each row differs, so a program reading
    slopes[h] (row 0 for all) would fail."""
    q, k, v = rand(2, 3, 6, 9, 8, seed=11)
    slopes = np.array([[0.5, 0.25, 0.125], [2.0, 1.0, 0.75]])
    program = flash_attn_program(causal=causal, window=window, softcap=3.0, alibi_per_batch=True)
    assert program.name.endswith("alibi_abs_bh")
    want = numpy_flash(q, k, v, causal=causal, window=window, softcap=3.0, slopes=slopes)
    for fused in (False, True):
        got = run_program(program, q, k, v, {"slopes": slopes}, fused)
        np.testing.assert_allclose(got, want, atol=1e-12, err_msg=f"fused={fused}")
    assert np.abs(want - numpy_flash(q, k, v, causal=causal, window=window, softcap=3.0, slopes=slopes[0])).max() > 1e-3
    assert fuse.tensor_index(fuse.fuse_with_proofs(program)[0], "slopes") == "bh"


def test_flash_alibi_is_symmetric_without_a_causal_mask():
    """Non-causal ALiBi penalises keys after the diagonal as much as keys before it (|.|, not k - q)."""
    q, k, v = rand(1, 1, 4, 6, 8, seed=3)
    slopes = np.array([2.0])
    got = run_program(flash_attn_program(alibi=True), q, k, v, {"slopes": slopes}, fused=True)
    np.testing.assert_allclose(got, numpy_flash(q, k, v, slopes=slopes), atol=1e-12)
    signed = numpy_flash(q, k, v) * 0  # the k - q form differs: the test can fail
    s = np.einsum("bhmd,bhnd->bhmn", q, k) / math.sqrt(8)
    i, j = np.arange(4)[:, None] + 2, np.arange(6)[None, :]
    e = np.exp(s + 2.0 * (j - i))
    signed = (e / e.sum(-1, keepdims=True)) @ v
    assert np.abs(got - signed).max() > 1e-2


@pytest.mark.parametrize("M,N", [(7, 5), (5, 7)])
def test_fagen_alibi_and_softcap_compose_as_flash_attention(M, N):
    """fagen.compile(alibi=True, softcap=C): C·tanh(s/C) + slopes[h]·(k - q), not C·tanh((s + bias)/C)."""
    q, k, v = rand(1, 2, M, N, 8, seed=5)
    q *= 4
    slopes = np.array([0.5, 1.5])
    got = run_program(build(causal=True, alibi=True, softcap=2.0), q, k, v, {"slopes": slopes}, fused=True)
    s = np.einsum("bhmd,bhnd->bhmn", q, k) / math.sqrt(8)
    i, j = np.arange(M)[:, None], np.arange(N)[None, :]
    bias = slopes[None, :, None, None] * (j - i)

    def softmax_v(x):
        x = np.where(j <= i, x, -np.inf)
        m = np.max(x, -1, keepdims=True)
        e = np.exp(x - np.where(np.isfinite(m), m, 0))
        t = e.sum(-1, keepdims=True)
        return np.divide(e, t, out=np.zeros_like(e), where=t > 0) @ v

    np.testing.assert_allclose(got, softmax_v(2.0 * np.tanh(s / 2.0) + bias), atol=1e-12)
    assert np.abs(got - softmax_v(2.0 * np.tanh((s + bias) / 2.0))).max() > 1e-2  # the other order differs


def test_alibi_distance_prints_as_integer_abs():
    """|q + N - M - k| is index math: printed as an integer abs (llabs where 64 bits are needed)."""
    q, k, M, N = (exprs.INDICES["q"], exprs.INDICES["k"], exprs.DIMS["M"], exprs.DIMS["N"])
    d = sp.Abs(q + N - M - k)
    assert exprs.is_int_valued(d)
    names = {q: "q_idx", k: "k_idx", M: "seqlen_q", N: "seqlen_k"}
    assert to_c(d, names) == "abs(seqlen_q - seqlen_k + k_idx - q_idx)"
    assert to_c(d, names, index_type="long long") == "llabs(seqlen_q - seqlen_k + k_idx - q_idx)"
    score = exprs.SCORE - exprs.tensor("slopes")[exprs.INDICES["h"]] * d  # float times an integer abs
    assert to_c(score, {**names, exprs.SCORE: "s", exprs.INDICES["h"]: "h"}) == (
        "s - abs(seqlen_q - seqlen_k + k_idx - q_idx)*fagen_read(tensor_slopes, fagen_at(h, tensor_slopes_size_0, "
        "tensor_slopes_stride_0))"
    )
    score = flash_attn_program(alibi=True)
    assert "abs(" in str(score) and fuse.tensor_index(fuse.fuse_with_proofs(score)[0], "slopes") == "h"


def test_flash_program_arguments():
    with pytest.raises(ValueError, match="window_size: expected a pair"):
        flash_attn_program(window=5)
    with pytest.raises(ValueError, match=r"window_size \(left\): expected an integer >= -1"):
        flash_attn_program(window=(-2, 0))
    with pytest.raises(TypeError, match="causal: expected True or False"):
        flash_attn_program(causal="bottom_right")
    with pytest.raises(ValueError, match="softcap: expected a positive number"):
        flash_attn_program(softcap=-1.0)
    assert flash_attn_program(window=(-1, -1)).name == "flash"
    assert flash_attn_program(causal=True, window=(-1, 7)).name == "flash_causal_br"  # causal: right is 0
    assert flash_attn_program(causal=True, window=(4, 7)).name == "flash_causal_br_window4_0"
    assert flash_attn_program(softcap=0.0) == flash_attn_program()


def test_flash_program_compiles_with_nvrtc():
    """A FlashAttention program with every option renders and compiles (NVRTC, no GPU needed)."""
    kernel = fagen.compile(
        64, ir=flash_attn_program(causal=True, window=(5, -1), softcap=30.0, alibi=True), dtype="bf16", arch="sm_80"
    )
    assert kernel.tensors == ("slopes",) and kernel.tensor_index == {"slopes": "h"}
    assert kernel.resources.spills == 0


# --- the drop-ins, with the kernel double -----------------------------------------------------------------
@pytest.fixture
def compiled(monkeypatch):
    """The compiler behind fagen's memo replaced by the kernel double: the (request, kernel) pairs it made."""
    torch = pytest.importorskip("torch")
    from .attention_double import install

    yield install(monkeypatch)
    torch._dynamo.reset()


def bshd(B, M, H, D, seed, grad=True):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, M, H, D, generator=g).requires_grad_(grad)


@pytest.mark.parametrize(
    "causal,window,softcap,alibi",
    [(False, (-1, -1), 0.0, None), (True, (3, -1), 5.0, "h"), (False, (2, 1), 0.0, "h"), (True, (-1, -1), 0.0, "bh")],
)
def test_flash_attn_func_gradients(compiled, causal, window, softcap, alibi):
    """[B, N, H, D] in and out (views, no copies), GQA, M > N; gradients as float64 autograd of the formula;
    alibi_slopes [H] or [B, H]."""
    torch = pytest.importorskip("torch")
    from .attention_double import assert_close, reference

    q, k, v = bshd(2, 9, 4, 16, 0), bshd(2, 6, 2, 16, 1), bshd(2, 6, 2, 16, 2)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    if alibi == "bh":
        slopes = torch.stack([slopes, slopes.flip(0) * 3])
    o = fagen.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    assert o.shape == q.shape and o.stride() == q.stride()
    request, kernel = compiled[0]
    assert request.source == Flash(causal, window, softcap, alibi)
    assert kernel.calls[0][1] == (2, 4, 9, 16), "the kernel saw a [B, H, M, D] view"
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    t = [x.double().transpose(1, 2) for x in (q, k, v)]
    ref = reference(*t, causal=causal, window=window, softcap=softcap, slopes=slopes)[0].transpose(1, 2)
    assert_close(o, ref, what="o")
    want = torch.autograd.grad(ref, (q, k, v), do.double())
    for a, b, name in zip(got, want, ("dq", "dk", "dv")):
        assert_close(a, b, what=name)


def test_flash_attn_varlen_func_gradients_and_compile(compiled):
    """Packed sequences, ALiBi [1, H] (viewed as [H]); eager and torch.compile(fullgraph) agree."""
    torch = pytest.importorskip("torch")
    from .attention_double import assert_close, reference

    g = torch.Generator().manual_seed(4)
    q = torch.randn(11, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(9, 4, 16, generator=g, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 4, 11], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625]])

    def f(q, k, v):
        return fagen.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, causal=True, alibi_slopes=slopes)

    o = f(q, k, v)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    parts = []
    for (q0, q1), (k0, k1) in (((0, 4), (0, 6)), ((4, 11), (6, 9))):
        view = (x.double()[a:b].permute(1, 0, 2)[None] for x, (a, b) in zip((q, k, v), ((q0, q1), (k0, k1), (k0, k1))))
        parts.append(reference(*view, causal=True, slopes=slopes[0])[0][0].permute(1, 0, 2))
    want = torch.autograd.grad(torch.cat(parts), (q, k, v), do.double())
    for a, b, name in zip(got, want, ("dq", "dk", "dv")):
        assert_close(a, b, what=name)
    traced = torch.autograd.grad(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v), (q, k, v), do)
    for a, b, name in zip(traced, got, ("dq", "dk", "dv")):
        assert_close(a, b, what=f"compiled {name}")


def test_return_attn_probs_gives_out_lse_and_none(compiled):
    """FlashAttention's return_attn_probs=True without dropout: (out, softmax_lse [B, H, M], None), lse the
    natural log of each row's sum of exp(scores), -inf for a row that sees no key; out keeps its gradient."""
    torch = pytest.importorskip("torch")
    from .attention_double import assert_close, reference

    q, k, v = bshd(2, 7, 4, 16, 0), bshd(2, 5, 2, 16, 1), bshd(2, 5, 2, 16, 2)
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [1.0, 0.75, 0.5, 0.25]])
    o, lse, probs = fagen.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 7) and lse.dtype == torch.float32
    t = [x.double().transpose(1, 2) for x in (q, k, v)]
    ref_o, ref_lse = reference(*t, causal=True, slopes=slopes)
    assert_close(o, ref_o.transpose(1, 2), what="o")
    assert torch.isneginf(lse[:, :, :2]).all(), "rows 0, 1 face keys -2, -1: they see none"
    assert_close(lse[:, :, 2:], ref_lse[:, :, 2:], what="lse")
    assert o.grad_fn is not None and not lse.requires_grad
    plain = fagen.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
    assert torch.equal(plain, o)


def test_varlen_return_attn_probs_and_per_batch_slopes(compiled):
    """Varlen: lse [H, total_q]; alibi_slopes [B, H] give sequence b row b, and its gradient (asked for) is
    per (sequence, head)."""
    torch = pytest.importorskip("torch")
    from .attention_double import assert_close, reference

    g = torch.Generator().manual_seed(5)
    q = torch.randn(11, 4, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(9, 4, 16, generator=g, requires_grad=True) for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 4, 11], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    slopes = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [2.0, 1.0, 0.75, 0.5]], requires_grad=True)
    o, lse, probs = fagen.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, 7, 6, causal=True, alibi_slopes=slopes, return_attn_probs=True
    )
    assert probs is None and lse.shape == (4, 11)
    parts, lses = [], []
    for b, ((q0, q1), (k0, k1)) in enumerate((((0, 4), (0, 6)), ((4, 11), (6, 9)))):
        view = (x.double()[a:c].permute(1, 0, 2)[None] for x, (a, c) in zip((q, k, v), ((q0, q1), (k0, k1), (k0, k1))))
        ob, lb = reference(*view, causal=True, slopes=slopes[b : b + 1].double())
        parts.append(ob[0].permute(1, 0, 2))
        lses.append(lb[0])
    want = torch.cat(parts)
    assert_close(o, want, what="o")
    want_lse = torch.cat(lses, 1)
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert_close(lse[seen], want_lse[seen], what="lse")
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v, slopes), do)
    expected = torch.autograd.grad(want, (q, k, v, slopes), do.double())
    for a, b, name in zip(got, expected, ("dq", "dk", "dv", "dslopes")):
        assert_close(a, b, what=name)


def test_packed_forms_are_views_of_their_parts(compiled):
    """qkv [B, S, 3, H, D] and kv [B, S, 2, Hkv, D] (and the varlen [total, 3 | 2, H, D]) run flash_attn_func /
    flash_attn_varlen_func on views of their parts: same outputs, the packed tensor's gradient assembled from the
    parts' (no copy of the inputs)."""
    torch = pytest.importorskip("torch")
    from .attention_double import assert_close, reference

    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(2, 7, 3, 4, 16, generator=g, requires_grad=True)
    o = fagen.flash_attn_qkvpacked_func(qkv, causal=True, softcap=5.0)
    q, k, v = (qkv[:, :, i] for i in range(3))
    want = fagen.flash_attn_func(q, k, v, causal=True, softcap=5.0)
    assert torch.equal(o, want)
    assert compiled[-1][1].calls[-1][1] == (2, 4, 7, 16)
    do = torch.randn_like(o)
    (dqkv,) = torch.autograd.grad(o, (qkv,), do)
    parts = torch.autograd.grad(want, (q, k, v), do)
    assert torch.equal(dqkv, torch.stack(parts, 2))

    q = torch.randn(2, 9, 4, 16, generator=g, requires_grad=True)
    kv = torch.randn(2, 6, 2, 2, 16, generator=g, requires_grad=True)  # GQA: 4 query heads on 2
    o, lse, probs = fagen.flash_attn_kvpacked_func(q, kv, causal=True, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 9)
    assert torch.equal(o, fagen.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=True))
    got = torch.autograd.grad(o, (q, kv), do := torch.randn_like(o))
    t = [x.double().transpose(1, 2) for x in (q, kv[:, :, 0], kv[:, :, 1])]
    ref = reference(*t, causal=True)[0].transpose(1, 2)
    want = torch.autograd.grad(ref, (q, kv), do.double())
    for a, b, name in zip(got, want, ("dq", "dkv")):
        assert_close(a, b, what=name)

    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    packed = torch.randn(10, 3, 4, 16, generator=g)
    o = fagen.flash_attn_varlen_qkvpacked_func(packed, cu, 7, causal=True)
    assert torch.equal(o, fagen.flash_attn_varlen_func(*packed.unbind(1), cu, cu, 7, 7, causal=True))
    qv, kvv = torch.randn(10, 4, 16, generator=g), torch.randn(8, 2, 2, 16, generator=g)
    cu_k = torch.tensor([0, 5, 8], dtype=torch.int32)
    o = fagen.flash_attn_varlen_kvpacked_func(qv, kvv, cu, cu_k, 7, 5, window_size=(2, 1))
    assert torch.equal(o, fagen.flash_attn_varlen_func(qv, *kvv.unbind(1), cu, cu_k, 7, 5, window_size=(2, 1)))


def test_packed_forms_refuse_other_shapes(compiled):
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"qkv: expected shape \[B, S, 3, H, D\] with 3 at dimension -3"):
        fagen.flash_attn_qkvpacked_func(torch.zeros(2, 7, 2, 4, 16))
    with pytest.raises(ValueError, match=r"kv: expected shape \[B, S, 2, H, D\]"):
        fagen.flash_attn_kvpacked_func(torch.zeros(2, 7, 4, 16), torch.zeros(2, 7, 4, 16))
    with pytest.raises(TypeError, match="qkv: expected a PyTorch tensor or a CuPy array"):
        fagen.flash_attn_varlen_qkvpacked_func([1, 2], torch.zeros(2, dtype=torch.int32), 1)
    assert not compiled


def test_flash_attn_func_under_torch_compile(compiled):
    torch = pytest.importorskip("torch")
    from .attention_double import assert_close

    q, k, v = bshd(1, 5, 2, 16, 0), bshd(1, 8, 2, 16, 1), bshd(1, 8, 2, 16, 2)

    def loss(q, k, v):
        return fagen.flash_attn_func(q, k, v, causal=True, softcap=10.0, deterministic=True).square().sum()

    eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
    traced = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v), (q, k, v))
    for a, b in zip(traced, eager):
        assert_close(a, b)
    assert compiled[0][1].backward_calls == [True, True]


def test_flash_attn_argument_errors(compiled):
    torch = pytest.importorskip("torch")
    q = bshd(2, 5, 4, 16, 0, grad=False)
    with pytest.raises(NotImplementedError, match="dropout_p: fagen has no attention dropout"):
        fagen.flash_attn_func(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match=r"dropout_p: expected a probability in \[0, 1\)"):
        fagen.flash_attn_func(q, q, q, dropout_p=1.5)
    with pytest.raises(TypeError, match="return_attn_probs: expected True or False"):
        fagen.flash_attn_func(q, q, q, return_attn_probs="yes")
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \[4\] or \[2, 4\], got \[3\]"):
        fagen.flash_attn_func(q, q, q, alibi_slopes=torch.rand(3))
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \[4\] or \[2, 4\], got \[3, 4\]"):
        fagen.flash_attn_func(q, q, q, alibi_slopes=torch.rand(3, 4))
    with pytest.raises(TypeError, match="alibi_slopes: expected float32"):
        fagen.flash_attn_func(q, q, q, alibi_slopes=torch.rand(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"window_size \(right\): expected an int >= -1"):
        fagen.flash_attn_func(q, q, q, window_size=(1, -3))
    with pytest.raises(ValueError, match="window_size: expected a pair"):
        fagen.flash_attn_func(q, q, q, window_size=4)
    with pytest.raises(ValueError, match="softcap: expected a number >= 0"):
        fagen.flash_attn_func(q, q, q, softcap=-1.0)
    with pytest.raises(TypeError, match="causal: expected True or False"):
        fagen.flash_attn_func(q, q, q, causal="bottom_right")
    with pytest.raises(ValueError, match=r"q: expected 4 dimensions \[B, S, H, D\]"):
        fagen.flash_attn_func(q[0], q, q)
    with pytest.raises(ValueError, match=r"k: expected 3 dimensions \[total, H, D\]"):
        cu = torch.tensor([0, 5], dtype=torch.int32)
        fagen.flash_attn_varlen_func(q[0], q, q[0], cu, cu, 5, 5)
    assert not compiled, "nothing compiled for a refused call"


# --- paged KV in varlen (block_table), and FlashAttention's integer arguments of any type ---------------------------
def _pool(lengths, page_size, Hkv, D, seed, slack=2):
    """A shuffled pool of pages holding sequences of `lengths` keys, its block_table (entries past a sequence's
    pages poisoned with out-of-range ids), and the packed keys and values [total_k, Hkv, D] built row by row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    need = [-(-n // page_size) for n in lengths]
    num_pages = sum(need) + 3
    order = torch.randperm(num_pages, generator=g).tolist()
    table = torch.full((len(lengths), max(need) + slack), 2**30, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(order[at : at + n], dtype=torch.int32)
        at += n
    pages = [torch.randn(num_pages, page_size, Hkv, D, generator=g, requires_grad=True) for _ in range(2)]

    def packed(cache):
        rows = [cache[int(table[b, j // page_size]), j % page_size] for b, n in enumerate(lengths) for j in range(n)]
        return torch.stack(rows)

    return pages, table, packed


@pytest.mark.parametrize("page_size", [4, 5, 16])
@pytest.mark.parametrize("causal,window,alibi", [(True, (-1, -1), False), (False, (3, 2), True)])
def test_varlen_block_table_is_the_packed_call_on_the_pages(compiled, page_size, causal, window, alibi):
    """flash_attn_varlen_func(k=pages, v=pages, block_table=...): sequence b's keys are the first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys of its pages (odd lengths, a page of one key, shuffled pages): the
    output, lse and gradients (q's, and the pages' through the gather) are those of the packed call on the keys
    gathered row by row."""
    torch = pytest.importorskip("torch")
    from .attention_double import assert_close

    lengths_q, lengths_k = [3, 5, 2], [7, 1, 13]
    (k_pages, v_pages), table, packed = _pool(lengths_k, page_size, 2, 16, seed=page_size)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(lengths_q), 4, 16, generator=g, requires_grad=True)
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 8, 21], dtype=torch.int32)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    opts = dict(causal=causal, window_size=window, alibi_slopes=slopes, return_attn_probs=True)
    o, lse, _ = fagen.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 5, 13, block_table=table, **opts)
    want, want_lse, _ = fagen.flash_attn_varlen_func(q, packed(k_pages), packed(v_pages), cu_q, cu_k, 5, 13, **opts)
    assert_close(o, want, tol=1e-6, what="o")
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen) and torch.allclose(lse[seen], want_lse[seen], atol=1e-6)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k_pages, v_pages), do)
    expected = torch.autograd.grad(want, (q, k_pages, v_pages), do)
    for a, b, name in zip(got, expected, ("dq", "dk_pages", "dv_pages")):
        assert_close(a, b, tol=1e-6, what=name)
    assert expected[1].abs().sum() > 0
    calls = [c for c in compiled[0][1].calls if c[0] == "varlen"]
    assert calls[0][1] == (10, 4, 16) and calls[0][4] == 13


def test_varlen_block_table_checks(compiled):
    """block_table=None is FlashAttention's default (its tests pass it); a bad table or pages are refused with
    errors naming them, an entry in use outside the pool or a sequence past its row's capacity as
    flash_attn_with_kvcache refuses them; the poisoned entries past the pages in use are never read."""
    torch = pytest.importorskip("torch")
    from fagen.kvcache import BlockTableError

    (k_pages, v_pages), table, _ = _pool([7, 1], 4, 2, 16, seed=2)
    q = torch.randn(4, 4, 16)
    cu_q, cu_k = torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 7, 8], dtype=torch.int32)
    with torch.no_grad():
        fagen.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 2, 7, block_table=table)
        o = fagen.flash_attn_varlen_func(q, q, q, cu_q, cu_q, 2, 2, block_table=None)
        assert o.shape == q.shape
        bad = table.clone()
        bad[1, 0] = k_pages.shape[0]
        with pytest.raises(BlockTableError, match=r"block_table: 1 of the entries in use name pages outside"):
            fagen.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 2, 7, block_table=bad)
        long = torch.tensor([0, 7, 7 + 4 * table.shape[1] + 1], dtype=torch.int32)
        with pytest.raises(RuntimeError, match=r"block_table: a sequence of 17 keys passes the 16 keys"):
            fagen.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, long, 2, 17, block_table=table)
        with pytest.raises(ValueError, match=r"k: expected 4 dimensions \[num_pages, page_size, Hkv, D\]"):
            fagen.flash_attn_varlen_func(q, q, q, cu_q, cu_k, 2, 7, block_table=table)
        with pytest.raises(ValueError, match=r"block_table: expected an int32 array \[B=2, max_pages\]"):
            fagen.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 2, 7, block_table=table[:1])
        with pytest.raises(ValueError, match="block_table: expected an int32"):
            fagen.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 2, 7, block_table=table.long())
        with pytest.raises(ValueError, match=r"k, v: the paged caches' shapes"):
            fagen.flash_attn_varlen_func(q, k_pages, v_pages[:-1], cu_q, cu_k, 2, 7, block_table=table)
        with pytest.raises(ValueError, match=r"cu_seqlens_k: expected an int32 vector"):
            fagen.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k.long(), 2, 7, block_table=table)


def test_flash_attn_functions_have_flashattentions_signatures():
    import inspect

    params = list(inspect.signature(fagen.flash_attn_varlen_func).parameters)
    assert params[-3:] == ["deterministic", "return_attn_probs", "block_table"]
    assert params[:7] == ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]


def test_integers_and_numbers_of_any_type(compiled):
    """Window sides as NumPy integers, 0-d tensors or a 2-element tensor (FlashAttention's tests draw them with
    torch.randint), softcap, softmax_scale and dropout_p as NumPy or 0-d tensors, max_seqlen as either: the same
    request and numbers as Python's; a non-integer or a wrong shape is refused naming the argument."""
    torch = pytest.importorskip("torch")
    q = bshd(2, 5, 4, 16, 0, grad=False)
    want = fagen.flash_attn_func(q, q, q, window_size=(2, 1), softcap=5.0, softmax_scale=0.5)
    for window, cap, scale, p in (
        ((np.int64(2), np.int32(1)), np.float32(5.0), np.float64(0.5), np.float32(0.0)),
        (torch.tensor([2, 1]), torch.tensor(5.0), torch.tensor(0.5), torch.tensor(0.0)),
        ((torch.tensor(2), torch.tensor(1, dtype=torch.int16)), np.array(5), np.array(0.5), np.array(0)),
    ):
        got = fagen.flash_attn_func(q, q, q, p, scale, False, window, cap)
        assert torch.equal(got, want)
    assert len(compiled) == 1 and compiled[0][0].source.window == (2, 1)
    packed = q.reshape(10, 4, 16)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    want = fagen.flash_attn_varlen_func(packed, packed, packed, cu, cu, 5, 5)
    for n in (np.int64(5), torch.tensor(5), np.array(5, dtype=np.int32)):
        assert torch.equal(fagen.flash_attn_varlen_func(packed, packed, packed, cu, cu, n, n), want)
    with pytest.raises(NotImplementedError, match="dropout_p: fagen has no attention dropout"):
        fagen.flash_attn_func(q, q, q, dropout_p=torch.tensor(0.1))
    with pytest.raises(ValueError, match=r"window_size \(left\): expected an integer or a 0-d tensor"):
        fagen.flash_attn_func(q, q, q, window_size=(torch.tensor([2]), 1))
    with pytest.raises(ValueError, match=r"window_size \(right\): expected an int >= -1"):
        fagen.flash_attn_func(q, q, q, window_size=(2, torch.tensor(1.0)))
    with pytest.raises(
        ValueError, match=r"window_size: expected a pair \(left, right\), got a tensor of shape \[2, 1\]"
    ):
        fagen.flash_attn_func(q, q, q, window_size=torch.tensor([[2], [1]]))
    with pytest.raises(ValueError, match=r"softcap: expected a number or a 0-d tensor, got a tensor of shape \[1\]"):
        fagen.flash_attn_func(q, q, q, softcap=torch.tensor([5.0]))
    with pytest.raises(TypeError, match="softmax_scale: expected a number"):
        fagen.flash_attn_func(q, q, q, softmax_scale=torch.tensor(True))
    with pytest.raises(TypeError, match="max_seqlen_q: expected an integer"):
        fagen.flash_attn_varlen_func(packed, packed, packed, cu, cu, 5.0, 5)
    with pytest.raises(ValueError, match="max_seqlen_k: expected an integer or a 0-d tensor"):
        fagen.flash_attn_varlen_func(packed, packed, packed, cu, cu, 5, np.array([5]))


def test_varlen_block_table_under_torch_compile(compiled):
    """torch.compile(fullgraph=True) traces the paged varlen call (the table check, which reads the device, is
    skipped while tracing; the gather is sized B x max_seqlen_k): eager's output and gradients."""
    torch = pytest.importorskip("torch")
    from .attention_double import assert_close

    (k_pages, v_pages), table, _ = _pool([7, 1, 13], 5, 2, 16, seed=1)
    q = torch.randn(10, 4, 16, requires_grad=True)
    cu_q = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 8, 21], dtype=torch.int32)

    def f(q, k_pages, v_pages):
        return fagen.flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 5, 13, causal=True, block_table=table)

    eager = f(q, k_pages, v_pages)
    traced = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k_pages, v_pages)
    assert_close(traced, eager, tol=1e-6, what="o")
    for a, b, name in zip(
        torch.autograd.grad(traced.sum(), (q, k_pages)), torch.autograd.grad(eager.sum(), (q, k_pages)), ("dq", "dk")
    ):
        assert_close(a, b, tol=1e-6, what=name)
