"""Split-KV decode on the GPU against a float64 reference (FlashAttention's tolerance rule): cache lengths from
1 to several thousand (shorter than q_len included), q_len 1..16, GQA and MHA, causal and not, one split and
many, outputs and workspace poisoned with NaN. Each case runs on both split kernels: the mma tier's (tensor
cores, the default for f16/bf16) and the simt tier's (its fallback)."""

import functools

import numpy as np
import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu


TIERS = ["mma", "simt"]


@functools.cache
def kernel(causal, dim=128, dtype="bf16", alibi=False, tier=None):
    k_ = fagen.compile(dim, causal=causal, dtype=dtype, decode=True, alibi=alibi, tier=tier)
    assert tier is None or k_.spec.tier == tier, (k_.spec.tier, tier)
    return k_


def _assert_ok(r, what):
    assert r.finite, f"{what}: non-finite output"
    assert r.lse_inf_match, f"{what}: lse -inf/NaN pattern differs from the reference"
    assert r.err <= r.bound, f"{what}: max|O - ref| {r.err:.3e} > bound {r.bound:.3e} (naive {r.err_naive:.3e})"
    assert r.lse_err <= r.lse_bound, f"{what}: max|lse - ref| {r.lse_err:.3e} > {r.lse_bound:.3e}"


LENGTHS = [1, 2, 7, 64, 333, 1000, 4097]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("M", [1, 2, 5, 16])
@pytest.mark.parametrize("H, Hkv", [(32, 8), (4, 4)])
@pytest.mark.parametrize("num_splits", [1, 7, None, "flex"])
@pytest.mark.parametrize("tier", TIERS)
def test_decode_matches_reference(causal, M, H, Hkv, num_splits, tier):
    k_ = kernel(causal, tier=tier)
    seqlens = LENGTHS if M * H <= 128 else LENGTHS[:4] + [4097]
    r = testing.check_decode(k_, B=len(seqlens), M=M, H=H, Hkv=Hkv, N=4100, seqlens=seqlens, num_splits=num_splits)
    _assert_ok(r, f"{k_.name} M={M} H={H}/{Hkv} splits={num_splits}")


@pytest.mark.parametrize("tier", [None, "simt"])  # None: the default (mma for f16/bf16, simt for f32)
@pytest.mark.parametrize("dim, dtype", [(64, "f16"), (96, "bf16"), (256, "bf16"), (160, "f16"), (128, "f32")])
def test_decode_other_dims_and_dtypes(dim, dtype, tier):
    k_ = kernel(True, dim, dtype, tier=tier)
    assert k_.spec.tier == (tier or ("simt" if dtype == "f32" else "mma"))
    r = testing.check_decode(k_, B=3, M=3, H=8, Hkv=2, N=2000, seqlens=[2, 500, 2000], num_splits=5)
    _assert_ok(r, k_.name)


@pytest.mark.parametrize("tier", TIERS)
def test_decode_with_a_call_time_tensor(tier):
    k_ = kernel(False, alibi=True, tier=tier)
    r = testing.check_decode(k_, B=2, M=2, H=8, Hkv=2, N=900, seqlens=[17, 900], num_splits=4)
    _assert_ok(r, k_.name)


@pytest.mark.parametrize("tier", TIERS)
def test_decode_many_splits_and_cuda_graph(tier):
    import torch

    k_ = kernel(True, tier=tier)
    _assert_ok(testing.check_decode(k_, B=2, M=1, H=32, Hkv=8, N=8192, seqlens=[8192, 3], num_splits=128), "128")
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.tensor([1024, 500], dtype=torch.int32, device="cuda")
    want = k_.decode(q, kc, vc, lens)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k_.decode(q, kc, vc, lens)  # warm up on the capture stream
        with torch.cuda.graph(g, stream=s):
            got = k_.decode(q, kc, vc, lens)
    torch.cuda.current_stream().wait_stream(s)
    for _ in range(3):  # each replay starts from the split counts the last one set back to 0
        got.fill_(float("nan"))
        lens.copy_(torch.tensor([1024, 500], dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@pytest.mark.parametrize("tier", TIERS)
def test_a_decode_call_first_made_inside_a_capture(tier):
    """A decode call captured into a CUDA graph gets a workspace of its own, its split counts zeroed by the graph:
    with no call of the shape on the capture stream before, a graph captured there, then an eager call on that
    stream before the first replay, and then the replays, all give the bits of a call on the default stream."""
    import torch

    k_ = kernel(True, tier=tier)
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.tensor([1024, 500], dtype=torch.int32, device="cuda")
    want = k_.decode(q, kc, vc, lens, num_splits=16)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            got = k_.decode(q, kc, vc, lens, num_splits=16)
        eager = k_.decode(q, kc, vc, lens, num_splits=16)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    assert torch.equal(eager, want)
    for _ in range(2):
        got.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


@pytest.mark.parametrize("tier", TIERS)
def test_decode_is_reproducible_whichever_split_merges(tier):
    """The last block of a row tile to finish merges the splits, in split order: calls give the same bits
    whichever block that is (it changes from call to call), and a call with other lengths in between (other
    blocks last, other counts) leaves nothing behind."""
    import torch

    k_ = kernel(True, tier=tier)
    q = torch.randn(3, 2, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(3, 3000, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.tensor([3000, 1234, 17], dtype=torch.int32, device="cuda")
    other = torch.tensor([5, 2999, 600], dtype=torch.int32, device="cuda")
    want, want_lse = k_.decode(q, kc, vc, lens, num_splits=9, return_lse=True)
    for _ in range(20):
        k_.decode(q, kc, vc, other, num_splits=9)
        o, lse = k_.decode(q, kc, vc, lens, num_splits=9, return_lse=True)
        assert torch.equal(o, want) and torch.equal(lse, want_lse)


# --- paged caches, appended keys, flash_attn_with_kvcache ---------------------------------------------------


def _paged(B, M, H, Hkv, D, dtype, seqlens, page_size, *, new=0, paged=True, seed=0, slack=2):
    """Random q, caches and (with new > 0) new keys for sequences of `seqlens` cached keys. Paged: a pool of
    pages in shuffled order (non-contiguous, sequences interleaved), table entries past a sequence's pages
    poisoned with out-of-range ids. Returns the arrays and each sequence's logical keys and values
    [cached + new, Hkv, D] (what attention must see)."""
    import torch

    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    dt = getattr(torch, testing.TORCH_DTYPE[dtype])

    def rand(*shape):
        return torch.randn(*shape, generator=g, device="cuda").to(dt)

    q = rand(B, M, H, D)
    k_new = rand(B, new, Hkv, D) if new else None
    v_new = rand(B, new, Hkv, D) if new else None
    lens = torch.tensor(seqlens, dtype=torch.int32, device="cuda")
    if paged:
        need = [-(-(L + new) // page_size) for L in seqlens]
        max_pages = max(need) + slack
        num_pages = sum(need) + 3
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
        table = torch.full((B, max_pages), 2**30, dtype=torch.int32)
        at = 0
        for b, n in enumerate(need):
            table[b, :n] = torch.tensor(order[at : at + n], dtype=torch.int32)
            at += n
        table = table.cuda()
        k_cache, v_cache = rand(num_pages, page_size, Hkv, D), rand(num_pages, page_size, Hkv, D)
    else:
        table = None
        k_cache, v_cache = rand(B, max(seqlens) + new + slack, Hkv, D), rand(B, max(seqlens) + new + slack, Hkv, D)
    return q, k_cache, v_cache, lens, table, k_new, v_new


def _rows(cache, table, b, n, page_size):
    """Rows [0, n) of sequence b of a cache, through the page table when paged: [n, Hkv, D]."""
    if table is None:
        return cache[b, :n]
    pages = table[b].tolist()
    return cache[[pages[j // page_size] for j in range(n)], [j % page_size for j in range(n)]]


def _logical(k_cache, v_cache, table, k_new, v_new, seqlens, page_size):
    out = []
    for b, L in enumerate(seqlens):
        kb, vb = _rows(k_cache, table, b, L, page_size), _rows(v_cache, table, b, L, page_size)
        if k_new is not None:
            kb, vb = torch_cat(kb, k_new[b]), torch_cat(vb, v_new[b])
        out.append((kb, vb))
    return out


def torch_cat(a, b):
    import torch

    return torch.cat([a, b])


def _check(o, lse, q, logical, keep_of, scale, score_of, dtype):
    """(o, lse) against float64 attention over each sequence's logical keys (FlashAttention's rule); score_of(N)
    gives the score function for N keys, or score_of(N, b) for sequence b where it takes two arguments (keep_of
    likewise)."""
    import torch

    refs, naives = [], []
    for b, (kb, vb) in enumerate(logical):
        N = kb.shape[0]
        q4, k4, v4 = q[b : b + 1].transpose(1, 2), kb[None].transpose(1, 2), vb[None].transpose(1, 2)
        keep = keep_of(N, b) if keep_of.__code__.co_argcount == 2 else keep_of(N)
        score = score_of(N, b) if score_of.__code__.co_argcount == 2 else score_of(N)
        refs.append(testing.reference(q4, k4, v4, keep, scale, score=score))
        naives.append(testing.reference(q4, k4, v4, keep, scale, dtype=q.dtype, score=score))
    ref = torch.cat([r[0] for r in refs]).transpose(1, 2), torch.cat([r[1] for r in refs])
    naive = torch.cat([r[0] for r in naives]).transpose(1, 2), torch.cat([r[1] for r in naives])
    return testing.compare(o, lse, ref, naive, dtype)


def _run_decode(k_, q, k_cache, v_cache, lens, table, k_new, v_new, num_splits=None, tensors=None):
    """Kernel.decode with outputs and workspace poisoned; returns (o, lse)."""
    import torch

    B, M, H, D = q.shape
    tensors = tensors if tensors is not None else testing.call_tensors(k_, B, H)
    out = torch.full_like(q, float("nan"))
    out_lse = torch.full((B, H, M), float("nan"), dtype=torch.float32, device="cuda")
    args = dict(block_table=table, k_new=k_new, v_new=v_new, num_splits=num_splits, out=out, out_lse=out_lse)
    k_.decode(q, k_cache, v_cache, lens, **args, **tensors)  # prepares the call shape
    for entry in k_._calls.values():
        if hasattr(entry, "ws_acc"):
            entry.ws_acc.fill_(float("nan"))
            entry.ws_ml.fill_(float("nan"))
    out.fill_(float("nan"))
    out_lse.fill_(float("nan"))
    o, lse = k_.decode(q, k_cache, v_cache, lens, return_lse=True, **args, **tensors)
    torch.cuda.synchronize()
    return o, lse, tensors


PAGED_LENGTHS = [1, 15, 16, 17, 255, 256, 257, 1000, 3001]  # within a page, at and past its end, many pages


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size", [16, 256, 5, 1])
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("tier", TIERS)
def test_paged_matches_reference(causal, page_size, M, tier):
    k_ = kernel(causal, tier=tier)
    H, Hkv, D = (32, 8, 128) if M < 16 else (8, 2, 128)
    seqlens = PAGED_LENGTHS if page_size > 1 else PAGED_LENGTHS[:6]
    q, kc, vc, lens, table, _, _ = _paged(len(seqlens), M, H, Hkv, D, "bf16", seqlens, page_size, seed=M + page_size)
    for num_splits in (None, 7):
        o, lse, tensors = _run_decode(k_, q, kc, vc, lens, table, None, None, num_splits)
        logical = _logical(kc, vc, table, None, None, seqlens, page_size)
        r = _check(
            o,
            lse,
            q,
            logical,
            lambda N: testing.keep_matrix(k_, 1, H, M, N, tensors),
            k_.default_scale,
            lambda N: testing.score_function(k_, 1, H, M, N, tensors),
            "bf16",
        )
        _assert_ok(r, f"{k_.name} paged {page_size} M={M} splits={num_splits}")


@pytest.mark.parametrize("paged, page_size", [(True, 16), (True, 256), (True, 7), (False, 0)])
@pytest.mark.parametrize("M, new", [(1, 1), (4, 4), (1, 5), (16, 16), (3, 40)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tier", TIERS)
def test_append_matches_reference_and_writes_the_cache(paged, page_size, M, new, causal, tier):
    import torch

    k_ = kernel(causal, tier=tier)
    seqlens = [0, 1, 15, 16, 300, 1000]
    H, Hkv, D = 8, 2, 128
    q, kc, vc, lens, table, kn, vn = _paged(
        len(seqlens), M, H, Hkv, D, "bf16", seqlens, page_size or 1, new=new, paged=paged, seed=new + M
    )
    k_before, v_before = kc.clone(), vc.clone()
    logical = _logical(kc, vc, table, kn, vn, seqlens, page_size)  # before the call writes the cache
    o, lse, tensors = _run_decode(k_, q, kc, vc, lens, table, kn, vn, None)
    r = _check(
        o,
        lse,
        q,
        logical,
        lambda N: testing.keep_matrix(k_, 1, H, M, N, tensors),
        k_.default_scale,
        lambda N: testing.score_function(k_, 1, H, M, N, tensors),
        "bf16",
    )
    _assert_ok(r, f"{k_.name} append {new} paged={paged} {page_size} M={M}")
    assert lens.tolist() == seqlens, "cache_seqlens must not be updated in place"
    # the cache now holds the new rows at [L, L + new) of each sequence, and nothing else changed
    want_k, want_v = k_before.clone(), v_before.clone()
    host_table = table.tolist() if paged else None
    for b, L in enumerate(seqlens):
        for j in range(new):
            n = L + j
            idx = (host_table[b][n // page_size], n % page_size) if paged else (b, n)
            want_k[idx], want_v[idx] = kn[b, j], vn[b, j]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v), "the appended cache differs"


FA_OPTIONS = [  # flash_attn_with_kvcache's options, each checked against FlashAttention's definitions below
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, window_size=(100, -1)),
    dict(causal=False, window_size=(50, 20)),
    dict(causal=False, window_size=(-1, 0)),
    dict(causal=True, alibi=True),
    dict(causal=False, alibi=True),
    dict(causal=True, softcap=30.0),
    dict(causal=False, softcap=5.0, alibi=True),
    dict(causal=True, alibi="per_batch"),
    dict(causal=False, softcap=5.0, alibi="per_batch"),
]


def _fa_keep(M, N, causal, window):
    """FlashAttention's mask, bottom-right: query i sees j in [i + N - M - left, i + N - M + right]."""
    import numpy as np

    i = np.arange(M)[:, None] + N - M
    j = np.arange(N)[None, :]
    left, right = window
    right = 0 if causal else right
    keep = np.ones((M, N), bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep[None, None]


def _fa_score(M, N, softcap, slopes):
    """FlashAttention's score: softcap * tanh(s / softcap), then - slope_h * |i + N - M - j| (slopes [H])."""
    import torch

    def apply(s):
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            i = torch.arange(M, device=s.device, dtype=s.dtype)[:, None] + N - M
            j = torch.arange(N, device=s.device, dtype=s.dtype)[None, :]
            s = s - slopes.to(s.dtype)[None, :, None, None] * (i - j).abs()[None, None]
        return s

    return apply


@pytest.mark.parametrize("options", FA_OPTIONS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
@pytest.mark.parametrize("paged, new", [(True, 0), (True, 3), (False, 2)])
def test_flash_attn_with_kvcache_matches_flashattention_semantics(options, paged, new):
    import torch

    from fagen import flash_attn_with_kvcache
    from fagen.ir.variants import alibi_slopes

    opts = dict(options)
    alibi = opts.pop("alibi", False)
    window = opts.get("window_size", (-1, -1))
    seqlens = [1, 16, 200, 777]
    B, M, H, Hkv, D, page = len(seqlens), 3, 8, 2, 64, 16
    q, kc, vc, lens, table, kn, vn = _paged(B, M, H, Hkv, D, "f16", seqlens, page, new=new, paged=paged, seed=5)
    slopes = torch.tensor(alibi_slopes(H), dtype=torch.float32, device="cuda") if alibi else None
    if alibi == "per_batch":  # alibi_slopes [B, H]: a row per sequence, each different
        slopes = torch.stack([slopes * (1 + b) for b in range(B)])
    logical = _logical(kc, vc, table, kn, vn, seqlens, page)
    scale = 0.3
    o, lse = flash_attn_with_kvcache(
        q,
        kc,
        vc,
        k=kn,
        v=vn,
        cache_seqlens=lens,
        block_table=table,
        softmax_scale=scale,
        alibi_slopes=slopes,
        return_softmax_lse=True,
        **opts,
    )
    torch.cuda.synchronize()
    r = _check(
        o,
        lse,
        q,
        logical,
        lambda N: _fa_keep(M, N, opts["causal"], window),
        scale,
        lambda N, b: _fa_score(M, N, opts.get("softcap", 0.0), slopes if alibi != "per_batch" else slopes[b]),
        "f16",
    )
    _assert_ok(r, f"flash_attn_with_kvcache {options} paged={paged} new={new}")


def test_paged_append_cuda_graph():
    import torch

    k_ = kernel(True)
    seqlens = [1000, 17, 256]
    q, kc, vc, lens, table, kn, vn = _paged(3, 4, 32, 8, 128, "bf16", seqlens, 16, new=4, seed=11)
    want = k_.decode(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k_.decode(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn)  # warm up on the capture stream
        with torch.cuda.graph(g, stream=s):
            got = k_.decode(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn)
    torch.cuda.current_stream().wait_stream(s)
    got.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    # new data in the same buffers: the graph reads them (another step of the same shape)
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([1004, 21, 260], dtype=torch.int32))
    want = k_.decode(q, kc, vc, lens, block_table=table, k_new=kn, v_new=vn)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)


# --- rotary embeddings, cache_batch_idx, cache_leftpad, checked page tables, paged varlen -------------------------


def _fa_rotary(x, cos, sin, offsets, interleaved):
    """FlashAttention's apply_rotary_emb (its tests' form: x·cos + rotate_half(x)·sin over the first rotary_dim
    dims, cos and sin repeated to that width) at positions offsets[b] + s of x [B, S, H, D], computed in float32
    and rounded to x's dtype, as FlashAttention's kernel rounds."""
    import torch

    rd = 2 * cos.shape[1]
    pos = offsets.long()[:, None] + torch.arange(x.shape[1], device=x.device)[None]
    widen = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: torch.cat([t, t], -1))
    c, s = widen(cos[pos].float())[:, :, None], widen(sin[pos].float())[:, :, None]
    xr = x[..., :rd].float()
    if interleaved:
        half = torch.stack((-xr[..., 1::2], xr[..., ::2]), -1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, -1)
        half = torch.cat((-x2, x1), -1)
    return torch.cat([(xr * c + half * s).to(x.dtype), x[..., rd:]], -1)


KV_LAYOUTS = ["batch_idx", "leftpad", "batch_idx_leftpad", "paged_leftpad"]
KV_ROTARY = [None, (True, 64), (False, 64), (True, 128)]  # (interleaved, rotary_dim) at D = 128
KV_MASKS = [dict(causal=True), dict(causal=False, window_size=(50, 10)), dict(causal=False)]


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("rotary", KV_ROTARY, ids=str)
@pytest.mark.parametrize("mask", KV_MASKS, ids=str)
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_kvcache_rotary_batch_idx_leftpad_match_reference(layout, rotary, mask, dtype):
    """flash_attn_with_kvcache with rotary_cos/rotary_sin (interleaved and not, rotary_dim < D), cache_batch_idx
    (a permutation of more cache rows than batches), cache_leftpad (contiguous and paged) and new keys fewer than
    the queries: the output against float64 attention over FlashAttention's definition (q rotated row by row with
    causal or a window, else at cache_seqlens), and the caches as FlashAttention leaves them."""
    import torch

    from fagen import flash_attn_with_kvcache

    seqlens, new, page = [0, 16, 200, 777], 3, 16
    B, M, H, Hkv, D = len(seqlens), 5, 8, 2, 128
    batch_idx = "batch_idx" in layout
    paged = layout.startswith("paged")
    q, kc, vc, lens, table, kn, vn = _paged(
        B, M, H, Hkv, D, dtype, seqlens, page, new=new, paged=paged, seed=len(layout) + (rotary or (0, 0))[1]
    )
    g = torch.Generator(device="cuda").manual_seed(3)
    dt = q.dtype
    args = dict(mask, cache_seqlens=lens, softmax_scale=0.2, block_table=table, return_softmax_lse=True)
    idx = None
    if batch_idx:  # 2 more cache rows than batches, the batches on a permutation of them
        extra = torch.randn(2, *kc.shape[1:], generator=g, device="cuda").to(dt)
        kc, vc = torch.cat([kc, extra]), torch.cat([vc, extra.flip(1)])
        idx = args["cache_batch_idx"] = torch.tensor([4, 0, 3, 1], dtype=torch.int32, device="cuda")
    capacity = kc.shape[1] * (table.shape[1] if paged else 1)
    leftpad = None
    if "leftpad" in layout:
        leftpad = args["cache_leftpad"] = torch.tensor([0, 5, 199, 300], dtype=torch.int32, device="cuda")
    k_ro = kn
    rot_q = q
    if rotary is not None:
        angle = torch.rand(capacity + 7, rotary[1] // 2, generator=g, device="cuda") * 2 * np.pi
        cos, sin = angle.cos().to(dt), angle.sin().to(dt)
        args.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary[0])
        if mask["causal"] or "window_size" in mask:
            rot_q = _fa_rotary(q, cos, sin, lens, rotary[0])
        else:
            rot_q = _fa_rotary(q.reshape(B, 1, M * H, D), cos, sin, lens, rotary[0]).reshape(B, M, H, D)
        k_ro = _fa_rotary(kn, cos, sin, lens, rotary[0])
    view_k, view_v = (kc[idx.long()], vc[idx.long()]) if batch_idx else (kc, vc)
    logical = _logical(view_k, view_v, table, k_ro, vn, seqlens, page)
    untouched = [kc[r].clone() for r in (2, 5)] if batch_idx else []
    o, lse = flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, **args)
    torch.cuda.synchronize()
    window = mask.get("window_size", (-1, -1))

    def keep_of(N, b):
        keep = _fa_keep(M, N, mask["causal"], window)
        if leftpad is not None:
            keep = keep & (np.arange(N) >= int(leftpad[b]))[None, None, None, :]
        return keep

    r = _check(o, lse, rot_q, logical, keep_of, 0.2, lambda N: None, dtype)
    _assert_ok(r, f"kvcache {layout} rotary={rotary} {mask} {dtype}")
    after_k, after_v = (kc[idx.long()], vc[idx.long()]) if batch_idx else (kc, vc)
    for b, L in enumerate(seqlens):
        got_k = _rows(after_k, table, b, L + new, page)[L:]
        got_v = _rows(after_v, table, b, L + new, page)[L:]
        assert torch.equal(got_v, vn[b]), f"batch {b}: the appended values differ"
        torch.testing.assert_close(got_k, k_ro[b], atol=0, rtol=2**-7, msg=f"batch {b}: the appended keys")
    for r_, before in zip((2, 5), untouched):
        assert torch.equal(kc[r_], before), f"cache row {r_}, named by no batch, changed"


def test_block_table_out_of_range_raises():
    """An entry in use outside the pool, a sequence past its row's capacity (FlashAttention's
    test_flash_attn_kvcache_paged_block_table_bounds: RuntimeError naming block_table) and a cache_batch_idx
    outside the cache raise; exactly at capacity runs; paged varlen checks its table alike."""
    import torch

    from fagen import flash_attn_varlen_func, flash_attn_with_kvcache

    q = torch.randn(1, 1, 1, 64, device="cuda", dtype=torch.float16)
    pool = torch.randn(4, 256, 1, 64, device="cuda", dtype=torch.float16)
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    one = torch.randn(1, 1, 1, 64, device="cuda", dtype=torch.float16)
    full = torch.full((1,), 256, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, pool, pool, k=one, v=one, cache_seqlens=full, block_table=table)
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_with_kvcache(q, pool, pool, cache_seqlens=full + 1, block_table=table)
    out = flash_attn_with_kvcache(q, pool, pool, cache_seqlens=full, block_table=table)
    assert out.shape == (1, 1, 1, 64) and not out.isnan().any()
    with pytest.raises(RuntimeError, match=r"block_table: 1 of the entries in use name pages outside \[0, 4\)"):
        flash_attn_with_kvcache(q, pool, pool, cache_seqlens=full, block_table=table + 4)
    cache = torch.randn(2, 100, 1, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ValueError, match="cache_batch_idx: 1 of the entries in use name cache rows outside"):
        flash_attn_with_kvcache(
            q, cache, cache, cache_seqlens=5, cache_batch_idx=torch.tensor([-1], dtype=torch.int32, device="cuda")
        )
    qv = torch.randn(3, 1, 64, device="cuda", dtype=torch.float16)
    cu_q = torch.tensor([0, 3], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_varlen_func(
            qv, pool, pool, cu_q, torch.tensor([0, 257], dtype=torch.int32, device="cuda"), 3, 257, block_table=table
        )
    with pytest.raises(RuntimeError, match="block_table"):
        flash_attn_varlen_func(
            qv, pool, pool, cu_q, torch.tensor([0, 9], dtype=torch.int32, device="cuda"), 3, 9, block_table=table - 1
        )


@pytest.mark.parametrize("page_size", [16, 256])
@pytest.mark.parametrize(
    "options",
    [dict(causal=True), dict(causal=False, window_size=(40, 7)), dict(causal=True, softcap=5.0, alibi=True)],
    ids=str,
)
def test_varlen_block_table_matches_reference(page_size, options):
    """flash_attn_varlen_func with paged k, v (block_table): odd lengths, shuffled pages, entries past a
    sequence's pages poisoned; against float64 attention over each sequence's keys (FlashAttention's rule). The
    window given as a 2-element tensor and max_seqlen as 0-d tensors, as FlashAttention's tests pass them."""
    import torch

    from fagen import flash_attn_varlen_func
    from fagen.ir.variants import alibi_slopes

    opts = dict(options)
    alibi = opts.pop("alibi", False)
    lens_q, lens_k = [1, 37, 300, 3], [17, 251, 300, 1023]
    H, Hkv, D, B = 8, 2, 128, len(lens_q)
    q4, kc, vc, _, table, _, _ = _paged(B, 1, H, Hkv, D, "bf16", lens_k, page_size, seed=page_size)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(sum(lens_q), H, D, generator=g, device="cuda").to(torch.bfloat16)
    cum = lambda lens: torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32, device="cuda")  # noqa: E731
    slopes = torch.tensor(alibi_slopes(H), dtype=torch.float32, device="cuda") if alibi else None
    window = opts.pop("window_size", (-1, -1))
    o, lse, _ = flash_attn_varlen_func(
        q,
        kc,
        vc,
        cum(lens_q),
        cum(lens_k),
        torch.tensor(max(lens_q)),
        torch.tensor(max(lens_k)),
        window_size=torch.tensor(window),
        alibi_slopes=slopes,
        block_table=table,
        return_attn_probs=True,
        **opts,
    )
    torch.cuda.synchronize()
    refs, naives, at = [], [], 0
    for b, (Lq, Lk) in enumerate(zip(lens_q, lens_k)):
        kb, vb = _rows(kc, table, b, Lk, page_size), _rows(vc, table, b, Lk, page_size)
        q4b, k4, v4 = q[at : at + Lq].transpose(0, 1)[None], kb.transpose(0, 1)[None], vb.transpose(0, 1)[None]
        keep = _fa_keep(Lq, Lk, opts["causal"], window)
        score = _fa_score(Lq, Lk, opts.get("softcap", 0.0), slopes)
        refs.append(testing.reference(q4b, k4, v4, keep, D**-0.5, score=score))
        naives.append(testing.reference(q4b, k4, v4, keep, D**-0.5, dtype=q.dtype, score=score))
        at += Lq
    ref = torch.cat([r[0][0].transpose(0, 1) for r in refs]), torch.cat([r[1][0] for r in refs], 1)
    naive = torch.cat([r[0][0].transpose(0, 1) for r in naives]), torch.cat([r[1][0] for r in naives], 1)
    _assert_ok(testing.compare(o, lse, ref, naive, "bf16"), f"varlen paged {page_size} {options}")


def test_kvcache_with_every_argument_captures_into_a_cuda_graph():
    """flash_attn_with_kvcache with a paged cache, rotary embeddings and cache_leftpad captures into a CUDA graph
    (the page-table check, which reads the device, is skipped while capturing; the rotation runs on the device):
    each replay gives eager's bits on new data in the same buffers."""
    import torch

    from fagen import flash_attn_with_kvcache

    seqlens, page = [3, 100, 700], 16
    q, kc, vc, lens, table, kn, vn = _paged(3, 2, 8, 2, 128, "bf16", seqlens, page, new=2, seed=4)
    g = torch.Generator(device="cuda").manual_seed(8)
    angle = torch.rand(table.shape[1] * page, 32, generator=g, device="cuda") * 2 * np.pi
    cos, sin = angle.cos().to(q.dtype), angle.sin().to(q.dtype)
    leftpad = torch.tensor([0, 10, 600], dtype=torch.int32, device="cuda")
    args = dict(rotary_cos=cos, rotary_sin=sin, cache_leftpad=leftpad, block_table=table, causal=True)
    k0, v0 = kc.clone(), vc.clone()
    want = flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, **args)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, **args)  # warm up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            got = flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, **args)
    torch.cuda.current_stream().wait_stream(stream)
    kc.copy_(k0)
    vc.copy_(v0)
    got.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    q.copy_(torch.randn_like(q))
    kc.copy_(k0)
    vc.copy_(v0)
    want = flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=lens, **args)
    kc.copy_(k0)
    vc.copy_(v0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
