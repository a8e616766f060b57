"""fagen.flex_attention and scaled_dot_product_attention on a GPU: FlexAttention-style functions written with
torch ops, against float64 references computed by calling the very same functions on index grids."""

import math

import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu


def document(b, h, q_idx, kv_idx):
    return (q_idx // 100 == kv_idx // 100) & (q_idx >= kv_idx)


def sliding(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx >= 0) & (q_idx - kv_idx <= 64)


def softcap(score, b, h, q_idx, kv_idx):
    import torch

    return 20 * torch.tanh(score / 20)


def relative(score, b, h, q_idx, kv_idx):
    import torch

    return torch.where(q_idx >= kv_idx, score - 0.01 * (q_idx - kv_idx), score)


CASES = [(None, None), (None, document), (softcap, document), (relative, sliding), (softcap, None)]


@pytest.mark.parametrize("score_mod, mask_mod", CASES, ids=lambda f: getattr(f, "__name__", "none"))
@pytest.mark.parametrize("L, S, H, Hkv", [(300, 300, 4, 4), (257, 513, 4, 2), (1000, 17, 2, 1)])
def test_flex_attention_matches_the_functions(score_mod, mask_mod, L, S, H, Hkv):
    import torch

    B, D = 2, 64
    q, k, v = testing.random_qkv(B, H, L, S, D, "bf16", Hkv=Hkv)
    bm = fagen.create_block_mask(mask_mod, None, None, L, S) if mask_mod else None
    o, lse = fagen.flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=H != Hkv, return_lse=True)
    torch.cuda.synchronize()
    b, h, qi, ki = testing.index_grids(B, H, L, S, q.device)
    keep = (mask_mod(b, h, qi, ki) if mask_mod else torch.ones(1, 1, L, S, dtype=torch.bool, device=q.device)).expand(
        B, H, L, S
    )
    score = (lambda s: score_mod(s, b, h, qi, ki).to(s.dtype)) if score_mod else None  # kept in the score's dtype
    keep_np = keep.cpu().numpy()
    scale = 1 / math.sqrt(D)
    ref = testing.reference(q, k, v, keep_np, scale, score=score)
    naive = testing.reference(q, k, v, keep_np, scale, dtype=q.dtype, score=score)
    testing.assert_ok(testing.compare(o, lse, ref, naive, "bf16"), f"flex {score_mod} {mask_mod} L={L} S={S}")


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_matches_pytorch_where_rows_see_keys(is_causal):
    import torch.nn.functional as F

    q, k, v = testing.random_qkv(2, 4, 333, 333, 128, "f16")
    o = fagen.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=is_causal)
    naive = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    err, err_naive = (float((x.double() - want).abs().max()) for x in (o, naive))
    assert err <= 2 * err_naive + testing.FLOOR["f16"], (err, err_naive)


def test_flex_gradients_follow_the_functions():
    """dq, dk, dv against float64 autograd of the same functions, with FlashAttention's rule: the error is at
    most twice that of the naive computation in bf16, plus a floor."""
    import torch

    B, H, L, S, D = 1, 2, 200, 300, 64
    q, k, v = (x.requires_grad_() for x in testing.random_qkv(B, H, L, S, D, "bf16"))
    bm = fagen.create_block_mask(document, None, None, L, S)
    o = fagen.flex_attention(q, k, v, score_mod=softcap, block_mask=bm)
    do = torch.randn_like(o)
    o.backward(do)
    b, h, qi, ki = testing.index_grids(B, H, L, S, q.device)
    keep = document(b, h, qi, ki).expand(B, H, L, S).cpu().numpy()

    def grads(dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out, _ = testing.reference(*xs, keep, 1 / math.sqrt(D), dtype=dtype, score=lambda s: softcap(s, b, h, qi, ki))
        out.backward(do.to(dtype))
        return [x.grad for x in xs]

    want, naive = grads(torch.float64), grads(torch.bfloat16)
    for name, got, w, n in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want, naive):
        assert torch.isfinite(got).all(), name
        err = float((got.double() - w).abs().max())
        bound = 2 * float((n.double() - w).abs().max()) + testing.FLOOR["bf16"]
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"
