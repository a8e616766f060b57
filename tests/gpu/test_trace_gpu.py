"""The tracer's Tensor surface on a GPU (issue 40): masks and scores written with Tensor methods, casts, integer bit
operations, torch's and_masks/or_masks and the math functions, against float64 references computed by calling the
very same functions on index grids (FlashAttention's error rule)."""

import math

import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def morton(b, h, q_idx, kv_idx):
    return ((q_idx ^ kv_idx) >> 5) == 0


def clamped(b, h, q_idx, kv_idx):
    return q_idx.clamp(max=150) + 20 >= kv_idx


def fmod_band(b, h, q_idx, kv_idx):
    import torch

    return (torch.fmod(q_idx - kv_idx, 9).abs() < 5) & (kv_idx.new_ones((), dtype=torch.bool))


def _composed():
    import torch
    from torch.nn.attention.flex_attention import and_masks, or_masks

    ids = (torch.arange(1024, device="cuda") // 170).to(torch.int32)  # documents of 170 tokens, read by a helper

    def document(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    return {
        "and_masks(causal, morton)": and_masks(causal, morton),
        "or_masks(morton, document)": or_masks(morton, document),
        "and_masks(causal, or_masks(document, clamped))": and_masks(causal, or_masks(document, clamped)),
    }


def exp2_score(score, b, h, q_idx, kv_idx):
    import torch

    return torch.exp2(score * 0.5)


def erf_score(score, b, h, q_idx, kv_idx):
    import torch

    return 3 * torch.erf(score / 3)


def gelu_score(score, b, h, q_idx, kv_idx):
    import torch.nn.functional as F

    return F.gelu(score) + F.gelu(score, approximate="tanh")


def softplus_score(score, b, h, q_idx, kv_idx):
    import torch.nn.functional as F

    return F.softplus(score) - F.softplus(-score, beta=2)


def clamp_fmod_score(score, b, h, q_idx, kv_idx):
    import torch

    return score.clamp(-2, 2) + torch.fmod(q_idx - kv_idx, 7) * 0.25 + ((q_idx ^ kv_idx) & 3).float() * 0.125


def _check(score_mod, mask_mod, L, S, dtype="bf16", H=4, Hkv=4):
    import torch

    B, D = 2, 64
    q, k, v = testing.random_qkv(B, H, L, S, D, dtype, Hkv=Hkv)
    bm = fagen.create_block_mask(mask_mod, None, None, L, S) if mask_mod else None
    o, lse = fagen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=H != Hkv, return_lse=True)
    torch.cuda.synchronize()
    b, h, qi, ki = testing.index_grids(B, H, L, S, q.device)
    keep = (mask_mod(b, h, qi, ki) if mask_mod else torch.ones(1, 1, L, S, dtype=torch.bool, device=q.device)).expand(
        B, H, L, S
    )
    score = (lambda s: score_mod(s, b, h, qi, ki).to(s.dtype)) if score_mod else None
    keep_np = keep.cpu().numpy()
    scale = 1 / math.sqrt(D)
    ref = testing.reference(q, k, v, keep_np, scale, score=score)
    naive = testing.reference(q, k, v, keep_np, scale, dtype=q.dtype, score=score)
    testing.assert_ok(testing.compare(o, lse, ref, naive, dtype), f"{score_mod} {mask_mod} L={L} S={S}")


@pytest.mark.parametrize(
    "name",
    ["and_masks(causal, morton)", "or_masks(morton, document)", "and_masks(causal, or_masks(document, clamped))"],
)
@pytest.mark.parametrize("L, S", [(300, 300), (257, 513)])
def test_composed_masks_match_the_functions(name, L, S):
    _check(None, _composed()[name], L, S)


@pytest.mark.parametrize("mask_mod", [morton, clamped, fmod_band], ids=lambda f: f.__name__)
def test_new_masks_match_the_functions(mask_mod):
    _check(None, mask_mod, 333, 400, H=4, Hkv=2)


def window_by_inf_score(score, b, h, q_idx, kv_idx):  # masks where it gives -inf (FlashAttention-4's eager form)
    import torch

    return torch.where((q_idx - kv_idx).abs() <= 40, score * 0.5, float("-inf"))


SCORES = [exp2_score, erf_score, gelu_score, softplus_score, clamp_fmod_score, window_by_inf_score]


@pytest.mark.parametrize("score_mod", SCORES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_new_scores_match_the_functions(score_mod, dtype):
    _check(score_mod, causal, 300, 300, dtype=dtype)


@pytest.mark.parametrize("score_mod", [erf_score, gelu_score, softplus_score], ids=lambda f: f.__name__)
def test_gradients_of_the_new_scores_follow_the_functions(score_mod):
    """dq, dk, dv against float64 autograd of the same functions (a Morton mask composed with causal), with
    FlashAttention's rule: the error is at most twice that of the naive computation in bf16, plus a floor."""
    import torch
    from torch.nn.attention.flex_attention import and_masks

    mask_mod = and_masks(causal, morton)
    B, H, L, S, D = 1, 2, 200, 300, 64
    q, k, v = (x.requires_grad_() for x in testing.random_qkv(B, H, L, S, D, "bf16"))
    bm = fagen.create_block_mask(mask_mod, None, None, L, S)
    o = fagen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm)
    do = torch.randn_like(o)
    o.backward(do)
    b, h, qi, ki = testing.index_grids(B, H, L, S, q.device)
    keep = mask_mod(b, h, qi, ki).expand(B, H, L, S).cpu().numpy()

    def grads(dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        score = lambda s: score_mod(s, b, h, qi, ki)  # noqa: E731
        out, _ = testing.reference(*xs, keep, 1 / math.sqrt(D), dtype=dtype, score=score)
        out.backward(do.to(dtype))
        return [x.grad for x in xs]

    want, naive = grads(torch.float64), grads(torch.bfloat16)
    for name, got, w, n in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want, naive):
        assert torch.isfinite(got).all(), name
        err = float((got.double() - w).abs().max())
        bound = 2 * float((n.double() - w).abs().max()) + testing.FLOOR["bf16"]
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"
