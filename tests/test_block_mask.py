"""Run-time block sparsity on the CPU: the block mask's classification (the executor's NumPy version of the
BLOCK_MASK kernel) against brute force on random masks, and the new kinds rendered and compiled on every tier."""

import numpy as np
import pytest

import fagen
from fagen import builders, pipeline
from fagen.backend import build, codegen, contract, plan
from fagen.backend.contract import Kind
from fagen.passes import fuse
from fagen.request import for_block_mask
from fagen.tools import executor

from .lowered import lowered


def _templates(gen):
    """A random mask_mod from % and // of q and k with random constants, alone or with affine comparisons."""
    a, b, c = (int(x) for x in gen.integers(2, 70, 3))
    split = int(gen.integers(1, a))

    def same_side(x):  # two documents of unequal sizes in each period of a: [0, split) and [split, a)
        return x % a < split

    return [
        lambda bb, h, q, k: q // a == k // a,  # documents of a keys
        lambda bb, h, q, k: (q // a == k // a) & (q >= k),  # causal documents
        lambda bb, h, q, k: (q // a == k // a) & (same_side(q) & same_side(k) | ~same_side(q) & ~same_side(k)),
        lambda bb, h, q, k: q % b == k % b,  # dilated
        lambda bb, h, q, k: (q % b == k % b) & (q >= k) & (q - k <= c * b),
        lambda bb, h, q, k: ((q // a == k // a) & (k <= q + 3)) | (k < c),  # documents plus a global prefix
        lambda bb, h, q, k: (k % a < split) & (q - k <= c),
        lambda bb, h, q, k: (q + h) // a == (k + 2 * bb) // a,  # reads b and h
        lambda bb, h, q, k: (q // a == k // a) & (q < k),  # the last row of each document sees no key
        lambda bb, h, q, k: (k <= q) & (q - k < c),  # affine: ranges and full tiles proven, nothing evaluated inside
    ]


def brute_force(mask_mod, B, H, M, N, block_m, block_n):
    """The block mask from the Python function itself on NumPy index grids: per tile, any and all kept pairs."""
    bb, h, q, k = np.ogrid[:B, :H, :M, :N]
    kept = np.broadcast_to(np.asarray(mask_mod(bb, h, q, k), bool), (B, H, M, N))
    tm, tn = -(-M // block_m), -(-N // block_n)
    count = np.zeros((B, H, tm), np.int32)
    listed = np.full((B, H, tm, tn), -1, np.int32)
    for i in range(tm):
        for j in range(tn):
            tile = kept[:, :, i * block_m : (i + 1) * block_m, j * block_n : (j + 1) * block_n]
            for b in range(B):
                for hh in range(H):
                    if tile[b, hh].any():
                        listed[b, hh, i, count[b, hh, i]] = 2 * j + bool(tile[b, hh].all())
                        count[b, hh, i] += 1
    return count, listed


def test_block_mask_classification_matches_brute_force():
    gen = np.random.default_rng(2026)
    for trial in range(30):
        masks = _templates(gen)
        index = int(gen.integers(len(masks)))
        mask_mod = masks[index]
        B, H = int(gen.integers(1, 3)), int(gen.integers(1, 4))
        M, N = (int(x) for x in gen.integers(1, 400, 2))
        block_m, block_n = (int(gen.choice([16, 32, 64, 128])) for _ in range(2))
        fused = pipeline.lower(pipeline.load_program(mask=mask_mod), "f32")[-1].program
        got = executor.block_mask(fused, B, H, M, N, block_m, block_n)
        want = brute_force(mask_mod, B, H, M, N, block_m, block_n)
        what = f"trial {trial}: mask {index}, B={B} H={H} M={M} N={N} tiles {block_m}x{block_n}"
        np.testing.assert_array_equal(got[0], want[0], err_msg=what)
        np.testing.assert_array_equal(got[1], want[1], err_msg=what)


def test_affine_masks_are_classified_from_the_proven_ranges_alone(monkeypatch):
    """Causal: tiles past the diagonal are outside the proven range and those below it proven full, so the mask
    is evaluated only on the diagonal tiles (the run-time mask refines the proven ranges, never widens them)."""
    fused = pipeline.lower(pipeline.load_program(causal=True), "f32")[-1].program
    evaluated = []
    real = executor._evaluate
    monkeypatch.setattr(executor, "_evaluate", lambda e, v: evaluated.append(1) or real(e, v))
    count, listed = executor.block_mask(fused, 1, 1, 256, 256, 64, 64)
    assert count.tolist() == [[[1, 2, 3, 4]]] and len(evaluated) == 4
    assert listed[0, 0, 3].tolist() == [1, 3, 5, 6]  # three full tiles, then the diagonal one (partial)


def _doc(b, h, q, k):
    return (q // 512 == k // 512) & (q >= k)


@pytest.mark.parametrize(
    "tier, arch", [("wgmma", "sm_90a"), ("mma", "sm_80"), ("mma", "sm_90a"), ("simt", "sm_80"), ("simt", "sm_90a")]
)
def test_block_sparse_forward_compiles_on_every_tier(tier, arch, tmp_path):
    dense = fagen.compile(128, mask=_doc, arch=arch, tier=tier, cache_dir=tmp_path)
    sparse = fagen.compile(128, mask=_doc, arch=arch, tier=tier, block_sparse=True, cache_dir=tmp_path)
    assert sparse.spec.kind is Kind.FORWARD_SPARSE and sparse.name.startswith("flash_fwd_sparse_")
    assert (sparse.spec.block_m, sparse.spec.block_n) == (dense.spec.block_m, dense.spec.block_n)
    assert "kv_list" in sparse.source and "kv_list" not in dense.source
    assert "warning" not in sparse.binary.log and not sparse.resources.spills, sparse.resources
    assert sparse.block_sparse and not dense.block_sparse


def _mask_request(mask):
    """The request of a block-mask kernel of `mask` (its program does not depend on the device or the tiles)."""
    return for_block_mask(mask=mask, device=("torch", "cpu", None), tiles=(64, 64))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("tiles", [(128, 128), (64, 32), (128, 176), (17, 33)])
def test_block_mask_kernel_compiles(arch, tiles, tmp_path):
    fused, variant, rng, _ = pipeline.block_mask_program(_mask_request(_doc))
    launch = builders.build_block_mask_launch(fused, variant, arch, *tiles, key_range=rng, cache_dir=tmp_path)
    assert launch.spec.kind is Kind.BLOCK_MASK and (launch.spec.block_m, launch.spec.block_n) == tiles
    assert "warning" not in launch.binary.log and not launch.binary.resources.spills
    assert "rule::keep(b, h, q_idx, k_idx, seqlen_q, seqlen_k)" in launch.source


def test_block_mask_kernel_of_an_unmasked_or_tensor_program(tmp_path):
    """A mask the compiler proves always true lists every tile as full; a mask reading a call-time tensor takes
    it as a parameter (contract.READS_TENSORS)."""
    fused, variant, rng, _ = pipeline.block_mask_program(_mask_request(lambda b, h, q, k: q >= 0))
    launch = builders.build_block_mask_launch(fused, variant, "sm_90a", 64, 64, key_range=rng, cache_dir=tmp_path)
    assert not launch.binary.resources.spills
    low = lowered(dict(mask=lambda b, h, q, k, t: q * t[h] >= k), "f32")
    program = low.program
    spec = plan.choose("t", 64, "f32", "sm_90a", "simt", kind=Kind.BLOCK_MASK).spec
    src = codegen.render(spec, low)
    assert "const float* __restrict__ tensor_t" in src and contract.Kind.BLOCK_MASK in contract.READS_TENSORS
    binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert "warning" not in binary.log and not binary.resources.spills
    assert tuple(fuse.tensors_of(program)) == ("t",)


def test_block_mask_kernel_gathers_a_captured_tensor(tmp_path):
    """FlexAttention's document mask as written for it (doc_id captured from the enclosing scope): the block-mask
    kernel takes the tensor with its dtype, strides and sizes, and its values are packed from the object the
    variable holds (fagen.runtime.block_mask.values)."""
    torch = pytest.importorskip("torch")
    from fagen.runtime import block_mask
    from fagen.runtime.arrays import Array

    doc_id = torch.tensor([0, 0, 1, 2, 2, 2], dtype=torch.int32)

    def doc_causal(b, h, q_idx, kv_idx):
        return (doc_id[q_idx] == doc_id[kv_idx]) & (q_idx >= kv_idx)

    fused, variant, rng, dtypes = pipeline.block_mask_program(_mask_request(doc_causal))
    assert dtypes == {"doc_id": "i32"}
    launch = builders.build_block_mask_launch(
        fused, variant, "sm_90a", 64, 64, key_range=rng, tensor_dtypes=dtypes, cache_dir=tmp_path
    )
    assert "const int* __restrict__ tensor_doc_id" in launch.source
    assert "warning" not in launch.binary.log and not launch.binary.resources.spills
    names = [p.name for p in launch.params]
    assert {"tensor_doc_id", "tensor_doc_id_stride_0", "tensor_doc_id_size_0"} <= set(names)
    t = Array("torch", None, 1234, (6,), (1,), None, "int32", 0)
    values = block_mask.values(launch.params, 1, 2, 6, 6, {"doc_id": t})
    assert (values["tensor_doc_id"], values["tensor_doc_id_size_0"], values["tensor_doc_id_stride_0"]) == (1234, 6, 1)
    with pytest.raises(TypeError, match="tensor_doc_id"):
        block_mask.values(launch.params, 1, 2, 6, 6, {})


def test_a_block_mask_goes_to_a_block_sparse_kernel_only(tmp_path):
    dense = fagen.compile(64, mask=_doc, tier="simt", arch="sm_80", cache_dir=tmp_path)
    sparse = fagen.compile(64, mask=_doc, tier="simt", arch="sm_80", block_sparse=True, cache_dir=tmp_path)
    x = np.zeros((1, 1, 4, 64), np.float32)
    with pytest.raises(TypeError, match="block_mask: kernel .* reads no block mask"):
        dense(x, x, x, block_mask=object())
    with pytest.raises(TypeError, match="block_mask: kernel .* was compiled with block_sparse=True"):
        sparse(x, x, x)
    with pytest.raises(TypeError, match="block_sparse: expected True or False"):
        fagen.compile(64, mask=_doc, block_sparse=1)
    with pytest.raises(ValueError, match="block_sparse: a decode kernel"):
        fagen.compile(64, mask=_doc, block_sparse=True, decode=True)


def test_flex_views_split_partial_and_full_tiles():
    torch = pytest.importorskip("torch")
    from fagen.runtime.block_mask import BlockTiles

    fused = pipeline.lower(pipeline.load_program(mask=_doc), "f32")[-1].program
    count, listed = executor.block_mask(fused, 1, 1, 1100, 1100, 128, 128)
    tiles = BlockTiles(128, 128, torch.as_tensor(count), torch.as_tensor(np.maximum(listed, 0)))
    kv_num, kv_idx, full_num, full_idx = tiles.flex_views()
    for i in range(count.shape[2]):
        entries = listed[0, 0, i, : count[0, 0, i]]
        partial, full = [e // 2 for e in entries if e % 2 == 0], [e // 2 for e in entries if e % 2 == 1]
        assert kv_num[0, 0, i] == len(partial) and kv_idx[0, 0, i, : len(partial)].tolist() == partial
        assert full_num[0, 0, i] == len(full) and full_idx[0, 0, i, : len(full)].tolist() == full


def test_a_mask_that_reads_h_or_b_needs_its_size():
    with pytest.raises(ValueError, match="H: mask_mod reads h"):
        fagen.create_block_mask(lambda b, h, q, k: (q + h) // 5 == k // 5, None, None, 64, 64, device="cpu")
    with pytest.raises(ValueError, match="B: mask_mod reads b"):
        fagen.create_block_mask(lambda b, h, q, k: q >= k + b, None, 2, 64, 64, device="cpu")
    bm = fagen.create_block_mask(lambda b, h, q, k: q >= k + b, 2, None, 64, 64, device="cpu")
    assert bm.shape == (2, None, 64, 64) and not bm.built  # no GPU asked for: built on first use


def test_block_tables_belong_to_the_stream_that_built_them(monkeypatch):
    """A block mask's tables are kept per stream: a call on another stream (which nothing orders after the build)
    builds its own, and tables built inside a CUDA-graph capture serve that capture alone."""
    from fagen import flex
    from fagen.runtime import block_mask

    bm = fagen.create_block_mask(lambda b, h, q, k: q >= k, 1, 1, 64, 64, device="cpu")
    now = {"stream": 1, "capturing": False}
    monkeypatch.setattr(block_mask, "current_stream", lambda where: (now["stream"], now["capturing"]))
    monkeypatch.setattr(flex, "_build", lambda mask, bm_, bn, kind, device: object())
    monkeypatch.setattr(flex, "_current_device", lambda: 0)
    first = bm.tiles(64, 64)
    assert bm.tiles(64, 64) is first
    now["stream"] = 2
    other = bm.tiles(64, 64)
    assert other is not first and bm.tiles(64, 64) is other
    now["capturing"] = True
    captured = [bm.tiles(64, 64) for _ in range(2)]
    assert captured[0] is not captured[1] and bm.captured == captured and len(bm.built) == 2
    now.update(stream=1, capturing=False)
    assert bm.tiles(64, 64) is first
