"""Run-time block masks on a GPU: the BLOCK_MASK kernel against brute force on random masks, the block-sparse
forward of every tier against float64 (document masks of random sizes, unequal documents, dilated masks, rows
that see no key), odd sizes and M != N, and the block-sparse backward (the wgmma tier's BWD_SPARSE over the block
mask's transposed table) against float64 by FlashAttention's rule."""

import functools

import numpy as np
import pytest

import fagen
from fagen.tools import testing

from ..test_block_mask import _templates, brute_force

pytestmark = pytest.mark.gpu


def _valid(count, listed):
    """The listed entries (those past each row's count are unspecified), as -1 elsewhere."""
    count, listed = np.asarray(count), np.asarray(listed)
    used = np.arange(listed.shape[-1]) < count[..., None]
    return np.where(used, listed, -1)


def test_block_masks_match_brute_force():
    gen = np.random.default_rng(12)
    for trial in range(16):
        masks = _templates(gen)
        index = int(gen.integers(len(masks)))
        B, H = (None if gen.random() < 0.3 else int(gen.integers(1, 3))), int(gen.integers(1, 4))
        if index == 7 and B is None:  # that mask reads b: made per batch entry
            B = 2
        M, N = (int(x) for x in gen.integers(1, 1500, 2))
        block = (int(gen.choice([16, 64, 128])), int(gen.choice([32, 64, 128, 176])))
        bm = fagen.create_block_mask(masks[index], B, H, M, N, BLOCK_SIZE=block)
        tiles = bm.tiles(*block)
        want = brute_force(masks[index], B or 1, H, M, N, *block)
        what = f"trial {trial}: mask {index} B={B} H={H} M={M} N={N} tiles {block}"
        np.testing.assert_array_equal(tiles.kv_count.cpu().numpy(), want[0], err_msg=what)
        np.testing.assert_array_equal(_valid(tiles.kv_count.cpu(), tiles.kv_list.cpu()), want[1], err_msg=what)


@pytest.mark.parametrize(
    "forward, backward",
    [((128, 128), (64, 128)), ((128, 128), (128, 128)), ((64, 64), (128, 128)), ((128, 176), (64, 88))],
)
def test_derived_tables_match_the_block_mask_kernels(forward, backward, monkeypatch):
    """A backward's tables derived on the GPU from the forward's (BlockMask.tiles at nesting tiles: the block-mask
    kernel not run again, no host synchronisation) against brute force at the backward's tiles: equal where no
    dimension refines, else partial only where the kernel's tile is empty or full; the transposed table that of
    the derived lists."""
    import torch

    from fagen import flex

    from ..test_block_sparse_backward import _states, _transposed

    gen = np.random.default_rng(44)
    for t, mask in enumerate(_templates(gen)):
        B, H = (2 if t == 7 or t % 3 else None), 3  # mask 7 reads b
        M, N = (int(x) for x in gen.integers(1, 1500, 2))
        bm = fagen.create_block_mask(mask, B, H, M, N, BLOCK_SIZE=forward)
        built = []
        monkeypatch.setattr(flex, "_build", lambda *a: built.append(a))  # not called: derived
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tiles = bm.tiles(*backward)
            table, lists = tiles.transposed(), (tiles.kv_count, tiles.kv_list)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        monkeypatch.undo()
        assert not built
        count, listed = (x.cpu().numpy() for x in lists)
        state = _states(count, listed)
        want = _states(*brute_force(mask, B or 1, H, M, N, *backward))
        what = f"mask {t}: {forward} -> {backward}, B={B} M={M} N={N}"
        if forward[0] <= backward[0] and forward[1] <= backward[1]:
            np.testing.assert_array_equal(state, want, err_msg=what)
        else:
            assert np.all((state == want) | (state == 1)), what
        q_count, q_list = _transposed(count, listed)
        np.testing.assert_array_equal(table.q_count.cpu().numpy(), q_count, err_msg=what)
        np.testing.assert_array_equal(table.q_list.cpu().numpy(), q_list, err_msg=what)


TIERS = [
    ("wgmma", "bf16", 128),
    ("wgmma", "f16", 64),
    ("mma", "bf16", 128),
    ("mma", "f16", 64),
    ("simt", "f32", 64),
    ("simt", "bf16", 96),
]


_gen = np.random.default_rng(7)
_DOC = int(_gen.integers(20, 400))  # a random document size
_A, _SPLIT = int(_gen.integers(100, 500)), 0
_SPLIT = int(_gen.integers(1, _A))
_DIL = int(_gen.integers(2, 9))


def document(b, h, q, k):
    return (q // _DOC == k // _DOC) & (q >= k)


def unequal_documents(b, h, q, k):  # two documents of _SPLIT and _A - _SPLIT tokens in each period of _A
    return (q // _A == k // _A) & ((q % _A < _SPLIT) & (k % _A < _SPLIT) | (q % _A >= _SPLIT) & (k % _A >= _SPLIT))


def dilated(b, h, q, k):
    return (q % _DIL == k % _DIL) & (q - k <= 40 * _DIL) & (k - q <= 3 * _DIL)


def no_key_rows(b, h, q, k):  # the last row of each document sees no key: O = 0, lse = -inf
    return (q // _DOC == k // _DOC) & (q < k)


MASKS = {f.__name__: f for f in (document, unequal_documents, dilated, no_key_rows)}


@functools.cache
def kernel(mask, dim, dtype, tier):
    return fagen.compile(dim, dtype=dtype, tier=tier, mask=MASKS[mask], block_sparse=True)


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("tier, dtype, dim", TIERS)
@pytest.mark.parametrize("M, N, H, Hkv", [(1, 1, 2, 2), (17, 700, 4, 2), (1000, 1000, 2, 2), (4097, 300, 2, 1)])
def test_block_sparse_forward_matches_float64(mask, tier, dtype, dim, M, N, H, Hkv):
    import torch

    if tier == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma tier needs sm_90a")
    k = kernel(mask, dim, dtype, tier)
    B = 2
    q, kk, v = testing.random_qkv(B, H, M, N, dim, dtype, Hkv=Hkv)
    bm = fagen.create_block_mask(MASKS[mask], None, None, M, N)  # tables at 128 x 128; the kernel's built on use
    out = torch.full((B, H, M, dim), float("nan"), dtype=q.dtype, device=q.device)  # poisoned
    out_lse = torch.full((B, H, M), float("nan"), dtype=torch.float32, device=q.device)
    o, lse = k(q, kk, v, return_lse=True, out=out, out_lse=out_lse, block_mask=bm)
    torch.cuda.synchronize()
    bb, h, qi, ki = np.ogrid[:B, :H, :M, :N]
    keep = np.broadcast_to(np.asarray(MASKS[mask](bb, h, qi, ki), bool), (B, H, M, N))
    ref = testing.reference(q, kk, v, keep, k.default_scale)
    naive = testing.reference(q, kk, v, keep, k.default_scale, dtype=q.dtype)
    testing.assert_ok(testing.compare(o, lse, ref, naive, dtype), f"{k.name} {mask} M={M} N={N}")
    tiles = bm.tiles(k.spec.block_m, k.spec.block_n)  # built at this kernel's tiles, kept in the block mask
    assert bm.tiles(k.spec.block_m, k.spec.block_n) is tiles
    dense_tiles = -(-M // k.spec.block_m) * -(-N // k.spec.block_n)
    assert int(tiles.kv_count.sum()) <= dense_tiles


def test_flex_attention_reuses_one_block_mask_across_calls_and_layers():
    import torch

    B, H, L, D = 1, 4, 1500, 128
    bm = fagen.create_block_mask(document, None, None, L, L)
    for _layer in range(3):
        q, k, v = testing.random_qkv(B, H, L, L, D, "bf16")
        o = fagen.flex_attention(q, k, v, block_mask=bm)
        torch.cuda.synchronize()
        bb, h, qi, ki = np.ogrid[:B, :H, :L, :L]
        keep = np.broadcast_to(document(bb, h, qi, ki), (B, H, L, L))
        ref, _ = testing.reference(q, k, v, keep, D**-0.5)
        naive, _ = testing.reference(q, k, v, keep, D**-0.5, dtype=q.dtype)
        err, err_naive = float((o.double() - ref).abs().max()), float((naive.double() - ref).abs().max())
        assert err <= 2 * err_naive + testing.FLOOR["bf16"], (err, err_naive)
    assert len(bm.built) <= 2  # BLOCK_SIZE's tables and the kernel's, built once


def test_block_mask_shape_is_checked():
    import torch

    k = kernel("document", 64, "f16", "mma")
    q, kk, v = testing.random_qkv(1, 2, 100, 100, 64, "f16")
    with pytest.raises(ValueError, match=r"block_mask: made for .* but the inputs are \(1, 2, 100, 100\)"):
        k(q, kk, v, block_mask=fagen.create_block_mask(document, None, None, 100, 101))
    with pytest.raises(TypeError, match="block_mask: expected a fagen.BlockMask"):
        k(q, kk, v, block_mask=torch.ones(3))
    # inputs that require grad: through autograd, the backward walking the proven ranges (the mma tier has no
    # block-sparse backward) or the block mask's transposed table (the wgmma tier's: test_block_sparse_backward_*)
    o = k(q.requires_grad_(), kk, v, block_mask=fagen.create_block_mask(document, None, None, 100, 100))
    assert o.grad_fn is not None


def _documents(gen, N):
    """Random document lengths summing to N, with length-1 documents among them."""
    lengths = []
    while sum(lengths) < N:
        lengths.append(1 if gen.random() < 0.2 else int(gen.integers(2, 700)))
    lengths[-1] -= sum(lengths) - N
    return [n for n in lengths if n > 0]


@pytest.mark.parametrize("tier", ["wgmma", "mma"])
def test_document_mask_from_a_captured_tensor_with_a_block_mask(tier):
    """FlexAttention's document mask as written for it: doc_id captured from the enclosing scope. The block
    mask is built on the GPU from the tensor (the block-mask kernel gathers doc_id), the block-sparse forward
    skips other documents' tiles; against float64 with poisoned outputs, then through fagen.flex_attention."""
    import torch

    if tier == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma tier needs sm_90a")
    gen = np.random.default_rng(31)
    B, H, N, D = 2, 4, 3001, 128
    lengths = _documents(gen, N)
    doc_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).int().cuda()

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    k_ = fagen.compile(D, tier=tier, mask=doc_causal, block_sparse=True)
    bm = fagen.create_block_mask(doc_causal, None, None, N, N)
    q, kk, v = testing.random_qkv(B, H, N, N, D, "bf16")
    out = torch.full((B, H, N, D), float("nan"), dtype=q.dtype, device=q.device)  # poisoned
    out_lse = torch.full((B, H, N), float("nan"), dtype=torch.float32, device=q.device)
    o, lse = k_(q, kk, v, return_lse=True, out=out, out_lse=out_lse, block_mask=bm)
    torch.cuda.synchronize()
    d = doc_id.cpu().numpy()
    keep = (d[:, None] == d[None, :]) & np.tri(N, dtype=bool)
    keep = np.broadcast_to(keep, (B, H, N, N))
    ref = testing.reference(q, kk, v, keep, k_.default_scale)
    naive = testing.reference(q, kk, v, keep, k_.default_scale, dtype=q.dtype)
    testing.assert_ok(testing.compare(o, lse, ref, naive, "bf16"), f"{k_.name} documents {len(lengths)}")
    tiles = bm.tiles(k_.spec.block_m, k_.spec.block_n)
    tm, tn = -(-N // k_.spec.block_m), -(-N // k_.spec.block_n)
    causal_hull = sum(min(tn, -(-min(N, (i + 1) * k_.spec.block_m) // k_.spec.block_n)) for i in range(tm))
    assert int(tiles.kv_count.sum()) < causal_hull  # other documents' tiles are skipped
    if tier == "wgmma":  # the FlexAttention signature runs the same kernel
        o2 = fagen.flex_attention(q, kk, v, block_mask=bm)
        torch.cuda.synchronize()
        assert torch.equal(o2, o)


# --- the block-sparse backward (Kind.BWD_SPARSE: per key tile, the query tiles the transposed table lists) --------
_gen_b = np.random.default_rng(41)
_BLOCKS = _gen_b.random((64, 64)) < 0.3  # a random block mask over blocks of 97 x 61 (not the kernels' tiles) ...
_BLOCKS[::5] = False  # ... whose every fifth row block sees no key (rows that see nothing: O = 0, dQ = 0)


def causal(b, h, q, k):
    return q >= k


def sliding_window(b, h, q, k):
    return (q >= k) & (q - k <= 300)


def per_head_documents(b, h, q, k):  # reads h: one table per head (GQA groups read several lists)
    return ((q + 37 * h) // 211 == (k + 37 * h) // 211) & (q >= k)


BACKWARD_MASKS = {f.__name__: f for f in (document, sliding_window, causal, no_key_rows, per_head_documents)}


def _random_blocks_mask():
    import torch

    blocks = torch.as_tensor(_BLOCKS).cuda()

    def random_blocks(b, h, q, k):
        return blocks[q // 97, k // 61]

    return random_blocks, lambda bb, h, q, k: _BLOCKS[np.minimum(q // 97, 63), np.minimum(k // 61, 63)]


def _poison_allocator(nbytes: int) -> None:
    """Fill free blocks of PyTorch's caching allocator with NaN, so that outputs a backward allocates next (empty,
    not zeroed) hold NaN wherever no kernel writes them."""
    import torch

    x = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device="cuda")
    del x


def _check_sparse_backward(k, keep_fn, B, H, Hkv, M, N, bm, deterministic=False, seed=None):
    """kernel k's forward and backward with block mask bm against float64 autograd (FlashAttention's rule), with
    poisoned outputs; returns the backward's gradients."""
    import torch

    q, kk, v = testing.random_qkv(B, H, M, N, k.spec.dim, k.spec.dtype, Hkv=Hkv, seed=seed)
    o, lse = k(q, kk, v, return_lse=True, block_mask=bm)
    g_do = testing.generator(None if seed is None else seed + 1)
    do = torch.randn(o.shape, generator=g_do, device=o.device).to(o.dtype)
    _poison_allocator(4 * (3 * q.numel() + 2 * kk.numel()) + (64 << 20))
    g = k.backward(q, kk, v, o, lse, do, deterministic=deterministic, block_mask=bm)
    torch.cuda.synchronize()
    bb, h, qi, ki = np.ogrid[:B, :H, :M, :N]
    keep = np.broadcast_to(np.asarray(keep_fn(bb, h, qi, ki), bool), (B, H, M, N))
    ref = testing.reference_grads(k, q, kk, v, do, {}, keep, k.default_scale)
    naive = testing.reference_grads(k, q, kk, v, do, {}, keep, k.default_scale, dtype=q.dtype)
    what = f"{k.name} M={M} N={N} H={H}/{Hkv} deterministic={deterministic}"
    for name, got in (("dq", g.dq), ("dk", g.dk), ("dv", g.dv)):
        assert torch.isfinite(got).all(), f"{what}: {name} not finite (an unwritten or NaN element)"
        err = float((got.double() - ref[name]).abs().max())
        bound = 2 * float((naive[name].double() - ref[name]).abs().nan_to_num(0.0).max())
        bound += testing.FLOOR[k.spec.dtype] * max(1.0, float(ref[name].abs().max()))
        assert err <= bound, f"{what}: max|{name} - ref| {err:.3e} > {bound:.3e}"
    return g


def _sparse_table_built(k, bm) -> bool:
    """Whether the backward read the block mask's transposed table (made only where BWD_SPARSE runs)."""
    spec = k.backward_plan.main_sparse.spec
    return any(key[:2] == (spec.block_m, spec.block_n) and t._transposed for key, t in bm.built.items())


@pytest.mark.parametrize("mask", sorted(BACKWARD_MASKS) + ["random_blocks"])
@pytest.mark.parametrize("dim, dtype", [(64, "bf16"), (128, "bf16"), (96, "f16")])
@pytest.mark.parametrize("M, N, H, Hkv", [(1, 1, 2, 2), (17, 700, 4, 2), (1000, 777, 2, 2), (2049, 2049, 4, 1)])
def test_block_sparse_backward_matches_float64(mask, dim, dtype, M, N, H, Hkv):
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the block-sparse backward is the wgmma tier's (sm_90a)")
    if mask == "random_blocks":
        mask_mod, keep_fn = _random_blocks_mask()
    else:
        mask_mod = keep_fn = BACKWARD_MASKS[mask]
    k = fagen.compile(dim, dtype=dtype, tier="wgmma", mask=mask_mod, block_sparse=True)
    assert k.backward_plan.main_sparse is not None
    B = 2
    Hm = H if mask == "per_head_documents" else None
    bm = fagen.create_block_mask(mask_mod, None, Hm, M, N)
    _check_sparse_backward(k, keep_fn, B, H, Hkv, M, N, bm)
    assert _sparse_table_built(k, bm)


def test_block_sparse_backward_deterministic_runs_the_dense_kernel_bit_for_bit():
    """deterministic=True with a block mask runs the dense, ordered kernel: right, and equal bit for bit."""
    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the block-sparse backward is the wgmma tier's (sm_90a)")
    k = fagen.compile(128, dtype="bf16", tier="wgmma", mask=document, block_sparse=True)
    M = N = 1500
    bm = fagen.create_block_mask(document, None, None, M, N)
    g1 = _check_sparse_backward(k, document, 1, 4, 2, M, N, bm, deterministic=True, seed=3)
    assert not _sparse_table_built(k, bm)
    g2 = _check_sparse_backward(k, document, 1, 4, 2, M, N, bm, deterministic=True, seed=3)
    assert torch.equal(g1.dq, g2.dq) and torch.equal(g1.dk, g2.dk) and torch.equal(g1.dv, g2.dv)


@pytest.mark.parametrize("score_mod", [None, "softcap"])
def test_flex_attention_gradients_through_the_block_sparse_backward(score_mod):
    """fagen.flex_attention with inputs that require grad and a BlockMask (FlexAttention's document mask from a
    captured doc_id): the block-sparse forward and backward, against float64 autograd of the same functions."""
    import math

    import torch

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the block-sparse backward is the wgmma tier's (sm_90a)")
    gen = np.random.default_rng(5)
    B, H, Hkv, N, D = 1, 4, 2, 2500, 128
    lengths = _documents(gen, N)
    doc_id = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).int().cuda()

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20 * torch.tanh(score / 20)

    fn = softcap if score_mod else None
    q, k, v = (x.requires_grad_() for x in testing.random_qkv(B, H, N, N, D, "bf16", Hkv=Hkv))
    bm = fagen.create_block_mask(doc_causal, None, None, N, N)
    o = fagen.flex_attention(q, k, v, score_mod=fn, block_mask=bm, enable_gqa=True)
    do = torch.randn_like(o)
    o.backward(do)
    torch.cuda.synchronize()
    b, h, qi, ki = testing.index_grids(B, H, N, N, q.device)
    keep = doc_causal(b, h, qi, ki).expand(B, H, N, N).cpu().numpy()

    def grads(dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        score = (lambda s: softcap(s, b, h, qi, ki)) if fn else None
        out, _ = testing.reference(*xs, keep, 1 / math.sqrt(D), dtype=dtype, score=score)
        out.backward(do.to(dtype))
        return [x.grad for x in xs]

    want, naive = grads(torch.float64), grads(torch.bfloat16)
    for name, got, w, n in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want, naive):
        assert torch.isfinite(got).all(), name
        err = float((got.double() - w).abs().max())
        bound = 2 * float((n.double() - w).abs().max()) + testing.FLOOR["bf16"] * max(1.0, float(w.abs().max()))
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"
    assert any(t._transposed for t in bm.built.values())  # the backward read the transposed table
