"""Gathered call-time tensors on a GPU, against float64: document masks (random lengths, length-1 documents
included) read from captured int tensors, relative-position tables, full bias tensors, bool masks, 2-D
neighbourhoods, on every tier; SDPA's attn_mask (bool and additive, broadcast); gradients of a float bias table;
a decode reading a gathered tensor."""

import functools

import numpy as np
import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu

TIERS = [("simt", "f32", 64), ("mma", "bf16", 128), ("wgmma", "bf16", 128)]


def _doc_ids(n, seed):
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < n:
        lens.append(int(rng.choice([1, 1, 2, 7, 33, 150, 400])))
    return np.repeat(np.arange(len(lens)), lens)[:n]


def _check(kernel, tensors, B, H, M, N, seed=0):
    """kernel(q, k, v, **tensors) on fresh random inputs, outputs poisoned, against float64 (the program's mask
    and score evaluated by the float64 executor on the same tensors) with FlashAttention's rule."""
    import torch

    D = kernel.spec.head_dim
    q, k, v = testing.random_qkv(B, H, M, N, D, kernel.spec.dtype, seed=seed)
    keep = testing.keep_matrix(kernel, B, H, M, N, tensors)
    score = testing.score_function(kernel, B, H, M, N, tensors)
    out = torch.full((B, H, M, D), float("nan"), dtype=q.dtype, device="cuda")
    out_lse = torch.full((B, H, M), float("nan"), dtype=torch.float32, device="cuda")
    o, lse = kernel(q, k, v, return_lse=True, out=out, out_lse=out_lse, **tensors)
    torch.cuda.synchronize()
    sc = kernel.default_scale
    ref = testing.reference(q, k, v, keep, sc, score=score)
    naive = testing.reference(q, k, v, keep, sc, dtype=q.dtype, score=score)
    return testing.compare(o, lse, ref, naive, kernel.spec.dtype)


def _tier_ok(tier):
    import torch

    return tier != "wgmma" or torch.cuda.get_device_capability() == (9, 0)


DOC = None  # the captured tensor of `document` (rebound by the tests)


def document(b, h, q_idx, kv_idx):
    return (DOC[q_idx] == DOC[kv_idx]) & (q_idx >= kv_idx)


@functools.cache
def _kernel(name, tier, dtype, dim):
    W = 31
    progs = {
        "document": dict(mask=document),
        "relative": dict(score_mod=lambda s, b, h, q, k, rel: s + rel[h, (q - k) // 8 + 200]),
        "full_bias": dict(score_mod=lambda s, b, h, q, k, bias: s + bias[b, h, q, k]),
        "bool_mask": dict(mask=lambda b, h, q, k, m: m[b, h, q, k] | (q == k)),
        "neighbourhood": dict(mask=lambda b, h, q, k: (abs(q // W - k // W) <= 2) & (abs(q % W - k % W) <= 3)),
    }
    dtypes = {"full_bias": {"bias": "f16"}, "bool_mask": {"m": "bool"}}.get(name)
    return fagen.compile(dim, dtype=dtype, tier=tier, tensor_dtypes=dtypes, **progs[name])


@pytest.mark.parametrize("tier, dtype, dim", TIERS)
@pytest.mark.parametrize("M", [1, 17, 1000])
def test_document_mask_from_a_captured_tensor(tier, dtype, dim, M):
    import torch

    global DOC
    if not _tier_ok(tier):
        pytest.skip("wgmma needs sm_90a")
    DOC = torch.tensor(_doc_ids(M, M), dtype=torch.int32, device="cuda")
    k = _kernel("document", tier, dtype, dim)
    assert k.tensors == ("DOC",)
    testing.assert_ok(_check(k, {"DOC": DOC}, 2, 3, M, M), f"{k.name} M={M}")
    DOC = torch.tensor(_doc_ids(M, M + 1), dtype=torch.int32, device="cuda")  # new values, no recompile
    testing.assert_ok(_check(k, {"DOC": DOC}, 2, 3, M, M, seed=1), f"{k.name} M={M}, new ids")
    o_captured = k(*testing.random_qkv(1, 2, M, M, dim, dtype, seed=5))  # the captured object is read by itself
    o_named = k(*testing.random_qkv(1, 2, M, M, dim, dtype, seed=5), DOC=DOC)
    assert torch.equal(o_captured, o_named)


@pytest.mark.parametrize("tier, dtype, dim", TIERS)
@pytest.mark.parametrize("name", ["relative", "full_bias", "bool_mask", "neighbourhood"])
def test_gathered_tables_on_every_tier(tier, dtype, dim, name):
    import torch

    if not _tier_ok(tier):
        pytest.skip("wgmma needs sm_90a")
    B, H, M, N = 2, 3, 700, 333
    k = _kernel(name, tier, dtype, dim)
    g = torch.Generator(device="cuda").manual_seed(7)
    tensors = {
        "relative": lambda: {"rel": torch.randn(H, 250, device="cuda", generator=g)},  # indices past 249 clamp
        "full_bias": lambda: {"bias": torch.randn(B, H, M, N, device="cuda", generator=g).half()},
        "bool_mask": lambda: {"m": torch.rand(1, H, M, N, device="cuda", generator=g).lt(0.2).expand(B, H, M, N)},
        "neighbourhood": lambda: {},
    }[name]()
    testing.assert_ok(_check(k, tensors, B, H, M, N), f"{k.name}")


def test_sdpa_attn_mask_bool_and_additive_with_broadcasting():
    import torch

    B, H, L, S, D = 2, 4, 257, 300, 64
    q, k, v = testing.random_qkv(B, H, L, S, D, "bf16", seed=3)
    g = torch.Generator(device="cuda").manual_seed(3)
    sparse = torch.rand(B, 1, L, S, device="cuda", generator=g) < 0.1
    sparse[:, :, 5] = False  # fully masked rows
    for mask in (
        torch.rand(L, S, device="cuda", generator=g) < 0.7,  # bool [L, S]
        sparse,  # bool [B, 1, L, S]
        torch.randn(1, H, 1, S, device="cuda", generator=g).bfloat16(),  # additive [1, H, 1, S]
        torch.randn(B, H, L, S, device="cuda", generator=g).bfloat16(),  # additive, full
    ):
        o = fagen.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.cuda.synchronize()
        full = mask.expand(B, H, L, S)
        if mask.dtype == torch.bool:
            keep, score = full.cpu().numpy(), None
        else:
            keep, score = np.ones((B, H, L, S), bool), (lambda s, m=full: s + m.to(s.dtype))  # noqa: E731
        sc = 1 / D**0.5
        ref = testing.reference(q, k, v, keep, sc, score=score)
        naive = testing.reference(q, k, v, keep, sc, dtype=q.dtype, score=score)
        r = testing.compare(o, ref[1], ref, naive, "bf16")  # o only: SDPA returns no lse
        assert r.finite and r.err <= r.bound, f"attn_mask {tuple(mask.shape)} {mask.dtype}: {r}"
        if mask.dtype == torch.bool:
            empty = ~full.any(-1)
            assert bool((o[empty] == 0).all())  # PyTorch gives NaN there
    with pytest.raises(ValueError, match="does not broadcast"):
        fagen.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(3, S, dtype=torch.bool, device="cuda"))


@pytest.mark.parametrize(
    "tier, dtype, dim, table_dtype",
    [("simt", "f32", 64, "f32"), ("mma", "bf16", 128, "f32"), ("mma", "bf16", 128, "bf16")],
)
def test_gradient_of_a_gathered_bias_table(tier, dtype, dim, table_dtype):
    """d128 on the mma tier: the main backward kernel steps down to 32 query rows a step (its stack frame), and a
    bf16 table is read as bf16 there too."""
    import torch

    B, H, M, N = 2, 3, 300, 257
    kern = fagen.compile(
        dim,
        dtype=dtype,
        tier=tier,
        causal=False,
        score_mod=lambda s, b, h, q, k, bias: s + bias[h, q - k + 256],
        tensor_dtypes={"bias": table_dtype},
    )
    q, k, v = testing.random_qkv(B, H, M, N, dim, dtype, seed=11)
    table = (torch.randn(H, 600, device="cuda") * 0.5).to(getattr(torch, testing.TORCH_DTYPE[table_dtype]))
    o, lse = kern(q, k, v, return_lse=True, bias=table)
    do = torch.randn_like(q)
    g = kern.backward(q, k, v, o, lse, do, bias=table)
    torch.cuda.synchronize()

    def grads(dt):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        t = table.detach().to(torch.float64 if dt == torch.float64 else torch.float32).requires_grad_()
        i = torch.arange(M, device="cuda")[:, None]
        j = torch.arange(N, device="cuda")[None, :]
        s = leaves[0] @ leaves[1].transpose(-1, -2) * kern.default_scale + t[:, (i - j + 256).clamp(0, 599)].to(dt)
        o = torch.softmax(s, -1) @ leaves[2]
        (o * do.to(dt)).sum().backward()
        return t.grad.double(), leaves[0].grad.double()

    ref_t, ref_q = grads(torch.float64)
    naive_t, naive_q = grads(q.dtype if dtype != "f32" else torch.float32)
    floor = testing.FLOOR[dtype] * max(1.0, float(ref_t.abs().max()))
    err, bound = (
        float((g.tensors["bias"].double() - ref_t).abs().max()),
        2 * float((naive_t - ref_t).abs().max()) + floor,
    )
    assert g.tensors["bias"].shape == table.shape and err <= bound, f"dbias {err:.3e} > {bound:.3e}"
    errq = float((g.dq.double() - ref_q).abs().max())
    assert errq <= 2 * float((naive_q - ref_q).abs().max()) + testing.FLOOR[dtype] * max(1.0, float(ref_q.abs().max()))
    with pytest.raises(ValueError, match="deterministic: the gradient of bias"):
        kern.backward(q, k, v, o, lse, do, deterministic=True, bias=table)
    # through autograd: fagen.attention with a table that requires grad
    t = table.clone().requires_grad_()
    x = [y.detach().requires_grad_() for y in (q, k, v)]
    fagen.attention(*x, score_mod=lambda s, b, h, q, k, bias: s + bias[h, q - k + 256], bias=t).backward(do)
    stored = float(ref_t.abs().max()) * 2.0**-8 if table_dtype == "bf16" else 0.0  # autograd's grad is bf16 there
    assert t.grad.dtype == table.dtype and float((t.grad.double() - ref_t).abs().max()) <= bound + stored


def test_decode_reads_a_gathered_tensor():
    import torch

    B, H, Hkv, M, N, D = 2, 8, 2, 3, 1500, 128
    kern = fagen.compile(D, dtype="bf16", causal=True, decode=True, score_mod=lambda s, b, h, q, k, kb: s + kb[b, k])
    q4, k4, v4 = testing.random_qkv(B, H, M, N, D, "bf16", Hkv=Hkv, layout="bshd", seed=2)
    q, kc, vc = q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2)
    seqlens = [1500, 701]
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    kb = torch.randn(B, N, device="cuda")
    o, lse = kern.decode(q, kc, vc, lens, return_lse=True, kb=kb)
    torch.cuda.synchronize()
    for bi, L in enumerate(seqlens):
        tensors = {"kb": kb[bi : bi + 1]}
        keep = testing.keep_matrix(kern, 1, H, M, L, tensors)
        score = testing.score_function(kern, 1, H, M, L, tensors)
        args = (q4[bi : bi + 1], k4[bi : bi + 1, :, :L], v4[bi : bi + 1, :, :L], keep, kern.default_scale)
        ref = testing.reference(*args, score=score)
        naive = testing.reference(*args, dtype=q.dtype, score=score)
        r = testing.compare(o[bi : bi + 1].transpose(1, 2), lse[bi : bi + 1], ref, naive, "bf16")
        testing.assert_ok(r, f"decode b={bi}")


def test_sdpa_bool_mask_runs_block_sparse(monkeypatch):
    """A bool attn_mask on inputs that need no gradient goes through a run-time block mask built from it (the
    block-sparse forward): a causal document mask [L, S] and per-batch document masks [B, 1, L, S] with rows
    that see no key, odd sizes, M != N, against float64."""
    import torch

    from fagen import flex

    taken = []
    inner = flex._sdpa_block_sparse
    monkeypatch.setattr(flex, "_sdpa_block_sparse", lambda *a: taken.append(1) or inner(*a))
    B, H, L, S, D = 2, 4, 1000, 1333, 128
    q, k, v = testing.random_qkv(B, H, L, S, D, "bf16", seed=11)
    gen = np.random.default_rng(11)

    def documents(n):
        ids = np.repeat(np.arange(n), gen.integers(1, 300, n))
        return torch.tensor(ids[:S] if len(ids) >= S else np.pad(ids, (0, S - len(ids)), constant_values=n))

    doc = documents(40).cuda()
    causal_docs = (doc[:L, None] == doc[None, :]) & torch.ones(L, S, dtype=torch.bool, device="cuda").tril(S - L)
    per_batch = torch.stack([(d[:L, None] == d[None, :]) for d in (documents(30).cuda(), documents(9).cuda())])[:, None]
    per_batch[:, :, 7] = False  # rows that see no key
    for mask in (causal_docs, per_batch):
        o = fagen.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        torch.cuda.synchronize()
        full = mask.expand(B, H, L, S)
        keep = full.cpu().numpy()
        sc = 1 / D**0.5
        ref = testing.reference(q, k, v, keep, sc)
        naive = testing.reference(q, k, v, keep, sc, dtype=q.dtype)
        r = testing.compare(o, ref[1], ref, naive, "bf16")  # o only: SDPA returns no lse
        assert r.finite and r.err <= r.bound, f"attn_mask {tuple(mask.shape)}: {r}"
        assert bool((o[~full.any(-1)] == 0).all())
    assert len(taken) == 2
