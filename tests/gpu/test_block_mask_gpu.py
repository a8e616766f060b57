"""Run-time block masks on a GPU: the BLOCK_MASK kernel against brute force on random masks, and the block-sparse
forward of every tier against float64 (document masks of random sizes, unequal documents, dilated masks, rows
that see no key), odd sizes and M != N."""

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
    with pytest.raises(NotImplementedError, match="a block-sparse forward has no backward"):
        k(q.requires_grad_(), kk, v, block_mask=fagen.create_block_mask(document, None, None, 100, 100))


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
