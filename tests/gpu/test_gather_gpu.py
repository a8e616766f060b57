"""Gathered call-time tensors on a GPU, against float64: document masks (random lengths, length-1 documents
included) read from captured int tensors, relative-position tables, full bias tensors, bool masks, 2-D
neighbourhoods, on every tier; SDPA's attn_mask (bool and additive, broadcast); gradients of a float bias table;
a decode reading a gathered tensor; gathers of gathers (offsets[doc[q]] forward, backward and block masks, and the
gradient of a table read as table[h, dist[q, k]] or table[h, bucket[q - k + 512]])."""

import functools

import numpy as np
import pytest

import fagen
from fagen.tools import testing

from ..test_block_mask import brute_force
from .test_block_mask_gpu import _valid

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
    that see no key, odd sizes, M != N, against float64; then another [L, S] mask over other documents, which shares
    the first one's kernel (before, that call read the first mask on its partial tiles)."""
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
    other_docs = (doc[:L, None] // 2 == doc[None, :] // 2) & torch.ones(L, S, dtype=torch.bool, device="cuda").tril(
        S - L
    )
    for mask in (causal_docs, per_batch, other_docs):
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
    assert len(taken) == 3


# --- gathers of gathers: offsets[doc[q]], table[h, dist[q, k]], bias[h, bucket[q - k + 512]] -----------------------
def _documents(n, seed, sizes=(1, 2, 7, 33, 150, 400, 1000)):
    """Document ids [n] and offsets [documents + 1] for documents of mixed sizes (length 1 included, the last one
    cut at n), as int32 and int64 CUDA tensors."""
    import torch

    rng = np.random.default_rng(seed)
    lens: list[int] = []
    while sum(lens) < n:
        lens.append(int(rng.choice(sizes)))
    lens[-1] -= sum(lens) - n
    doc = np.repeat(np.arange(len(lens)), lens)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    return torch.tensor(doc, dtype=torch.int32, device="cuda"), torch.tensor(offsets, dtype=torch.int64, device="cuda")


DOC_IDS = OFFSETS = None  # the tensors `offsets_document` captures (rebound by the tests)


def offsets_document(b, h, q_idx, kv_idx):
    """FlexAttention's document mask written from offsets: a query sees the keys of its document up to itself."""
    return (kv_idx >= OFFSETS[DOC_IDS[q_idx]]) & (kv_idx <= q_idx)


def _set_documents(M, N, seed):
    global DOC_IDS, OFFSETS
    DOC_IDS, OFFSETS = _documents(max(M, N), seed)
    return {"DOC_IDS": DOC_IDS, "OFFSETS": OFFSETS}


@functools.cache
def _offsets_kernel(tier, dtype, dim, block_sparse=False):
    return fagen.compile(dim, dtype=dtype, tier=tier, mask=offsets_document, block_sparse=block_sparse)


def _grads_check(kern, tensors, B, H, M, N, seed=0):
    """kern.backward against float64 autograd of the naive program (the mask evaluated by the float64 executor on
    `tensors`), FlashAttention's rule per gradient of q, k, v."""
    import torch

    q, k, v = testing.random_qkv(B, H, M, N, kern.spec.head_dim, kern.spec.dtype, seed=seed)
    keep = testing.keep_matrix(kern, B, H, M, N, tensors)
    o, lse = kern(q, k, v, return_lse=True, **tensors)
    do = torch.randn(q.shape, device="cuda", generator=testing.generator(seed + 1)).to(q.dtype)
    g = kern.backward(q, k, v, o, lse, do, **tensors)
    torch.cuda.synchronize()
    ref = testing.reference_grads(kern, q, k, v, do, {}, keep, kern.default_scale)
    naive = testing.reference_grads(kern, q, k, v, do, {}, keep, kern.default_scale, dtype=q.dtype)
    errors = {}
    for name, x in (("dq", g.dq), ("dk", g.dk), ("dv", g.dv)):
        r = ref[name]
        err = float((x.double() - r).abs().max())
        err_naive = float((naive[name].double() - r).abs().nan_to_num(0.0).max())
        errors[name] = (err, err_naive, 2 * err_naive + testing.FLOOR[kern.spec.dtype] * max(1.0, float(r.abs().max())))
    finite = all(bool(torch.isfinite(x).all()) for x in (g.dq, g.dk, g.dv))
    return testing.GradCheckResult(errors, finite)


@pytest.mark.parametrize("tier, dtype, dim", TIERS)
@pytest.mark.parametrize("M, N", [(1, 1), (17, 17), (1000, 1000), (700, 1333), (1333, 700)])
def test_offsets_document_mask_forward_and_backward(tier, dtype, dim, M, N):
    """offsets[doc[q]]: documents of mixed sizes (length 1 included), odd lengths, M != N, against float64; new
    offsets at the next call without a recompile."""
    if not _tier_ok(tier):
        pytest.skip("wgmma needs sm_90a")
    tensors = _set_documents(M, N, M + N)
    k = _offsets_kernel(tier, dtype, dim)
    assert k.tensors == ("DOC_IDS", "OFFSETS")
    testing.assert_ok(_check(k, tensors, 2, 3, M, N), f"{k.name} M={M} N={N}")
    r = _grads_check(k, tensors, 2, 3, M, N)
    testing.assert_grads_ok(r, f"{k.name} backward M={M} N={N}: {r}")
    tensors = _set_documents(M, N, M + N + 1)
    testing.assert_ok(_check(k, tensors, 1, 2, M, N, seed=1), f"{k.name} M={M} N={N}, new documents")


def _nested_score(name):
    return {
        "dist": lambda s, b, h, q, k, table, dist: s + table[h, dist[q, k]],
        "bucket": lambda s, b, h, q, k, table, bucket: s + table[h, bucket[q - k + 512]],
    }[name]


@pytest.mark.parametrize("tier, dtype, dim", TIERS)
@pytest.mark.parametrize("name", ["dist", "bucket"])
def test_gradient_of_a_table_read_through_an_index(tier, dtype, dim, name):
    """score + table[h, dist[q, k]] and score + table[h, bucket[q - k + 512]]: the table's gradient accumulates at
    the gathered element (indices out of the table clamp), against float64 autograd; and through fagen.attention."""
    import torch

    if not _tier_ok(tier):
        pytest.skip("wgmma needs sm_90a")
    B, H, M, N, buckets = 2, 3, 300, 257, 24
    fn = _nested_score(name)
    kern = fagen.compile(dim, dtype=dtype, tier=tier, score_mod=fn, tensor_dtypes={name: "i32"})
    g = torch.Generator(device="cuda").manual_seed(17)
    index = (
        torch.randint(-2, buckets + 3, (M, N), device="cuda", generator=g, dtype=torch.int32)
        if name == "dist"
        else torch.randint(-2, buckets + 3, (1024,), device="cuda", generator=g, dtype=torch.int32)
    )
    table = torch.randn(H, buckets, device="cuda", generator=g) * 0.5
    q, k, v = testing.random_qkv(B, H, M, N, dim, dtype, seed=13)
    tensors = {"table": table, name: index}
    o, lse = kern(q, k, v, return_lse=True, **tensors)
    do = torch.randn_like(q)
    got = kern.backward(q, k, v, o, lse, do, **tensors)
    torch.cuda.synchronize()
    assert set(got.tensors) == {"table"}  # the integer index tensor has no gradient
    i = torch.arange(M, device="cuda")[:, None]
    j = torch.arange(N, device="cuda")[None, :]
    at = index.long() if name == "dist" else index.long()[(i - j + 512).clamp(0, 1023)]
    at = at.clamp(0, buckets - 1)

    def grads(dt):
        leaves = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        t = table.detach().to(torch.float64 if dt == torch.float64 else torch.float32).requires_grad_()
        s = leaves[0] @ leaves[1].transpose(-1, -2) * kern.default_scale + t[:, at].to(dt)
        (torch.softmax(s, -1) @ leaves[2] * do.to(dt)).sum().backward()
        return t.grad.double(), leaves[0].grad.double()

    ref_t, ref_q = grads(torch.float64)
    naive_t, naive_q = grads(q.dtype if dtype != "f32" else torch.float32)
    bound = 2 * float((naive_t - ref_t).abs().max()) + testing.FLOOR[dtype] * max(1.0, float(ref_t.abs().max()))
    err = float((got.tensors["table"].double() - ref_t).abs().max())
    assert got.tensors["table"].shape == table.shape and err <= bound, f"dtable {err:.3e} > {bound:.3e}"
    errq = float((got.dq.double() - ref_q).abs().max())
    assert errq <= 2 * float((naive_q - ref_q).abs().max()) + testing.FLOOR[dtype] * max(1.0, float(ref_q.abs().max()))
    t = table.clone().requires_grad_()  # through autograd
    x = [y.detach().requires_grad_() for y in (q, k, v)]
    fagen.attention(*x, score_mod=fn, table=t, **{name: index}).backward(do)
    assert float((t.grad.double() - ref_t).abs().max()) <= bound


@pytest.mark.parametrize("tier, dtype, dim", TIERS)
@pytest.mark.parametrize("M, N", [(17, 17), (1000, 1000), (700, 1333), (4097, 300)])
def test_block_mask_built_from_the_offsets_mask(tier, dtype, dim, M, N):
    """create_block_mask on offsets[doc[q]]: the BLOCK_MASK kernel's tables against brute force, and the
    block-sparse forward that walks them against float64."""
    import torch

    if not _tier_ok(tier):
        pytest.skip("wgmma needs sm_90a")
    tensors = _set_documents(M, N, 3 * M + N)
    doc, offsets = DOC_IDS.cpu().numpy(), OFFSETS.cpu().numpy()

    def on_numpy(b, h, q, k):
        return (k >= offsets[doc[q]]) & (k <= q)

    for block in ((128, 128), (64, 176)):
        bm = fagen.create_block_mask(offsets_document, None, None, M, N, BLOCK_SIZE=block)
        tiles = bm.tiles(*block)
        want = brute_force(on_numpy, 1, 1, M, N, *block)
        np.testing.assert_array_equal(tiles.kv_count.cpu().numpy(), want[0], err_msg=f"tiles {block}")
        np.testing.assert_array_equal(_valid(tiles.kv_count.cpu(), tiles.kv_list.cpu()), want[1])
    k = _offsets_kernel(tier, dtype, dim, block_sparse=True)
    B, H = 2, 3
    q, kk, v = testing.random_qkv(B, H, M, N, dim, dtype, seed=4)
    out = torch.full((B, H, M, dim), float("nan"), dtype=q.dtype, device="cuda")  # poisoned
    o, lse = k(q, kk, v, return_lse=True, out=out, block_mask=bm)
    torch.cuda.synchronize()
    keep = testing.keep_matrix(k, B, H, M, N, tensors)
    ref = testing.reference(q, kk, v, keep, k.default_scale)
    naive = testing.reference(q, kk, v, keep, k.default_scale, dtype=q.dtype)
    testing.assert_ok(testing.compare(o, lse, ref, naive, dtype), f"{k.name} M={M} N={N}")
    o2 = fagen.flex_attention(q, kk, v, block_mask=bm)
    torch.cuda.synchronize()
    r = testing.compare(o2, ref[1], ref, naive, dtype)  # o only: flex_attention returns no lse here
    assert r.finite and r.err <= r.bound, f"flex_attention: {r}"
