"""The block-sparse backward on the CPU: the transposed table (fagen.runtime.block_mask.transpose) against brute
force on random masks, the BWD_SPARSE kernel rendered and compiled beside a block-sparse forward's dense backward
(its signature the contract's, no spills), when a call runs it (sparse_why_not), and flex_attention's way from a
BlockMask through autograd to the backward (a double in place of the kernels)."""

import dataclasses
import re
from types import SimpleNamespace

import numpy as np
import pytest

import fagen
from fagen import builders
from fagen.backend import contract, tiers
from fagen.backend.contract import Kind
from fagen.runtime import backward
from fagen.runtime.launch import ArgPack

from .test_backward_kernels import _arrays, _signature
from .test_block_mask import _templates, brute_force

torch = pytest.importorskip("torch")


def doc(b, h, q, k):
    return (q // 512 == k // 512) & (q >= k)


def window(b, h, q, k):
    return (q >= k) & (q - k <= 300)


def _transposed(count, listed):
    """The transposed table of a block mask's lists, by brute force: per key tile, its query tiles, ascending."""
    B, H, tm, tn = listed.shape
    q_count = np.zeros((B, H, tn), np.int32)
    q_list = np.zeros((B, H, tn, tm), np.int32)
    for b, h, i in np.ndindex(B, H, tm):
        for e in listed[b, h, i, : count[b, h, i]]:
            j = e // 2
            q_list[b, h, j, q_count[b, h, j]] = 2 * i + e % 2
            q_count[b, h, j] += 1
    return q_count, q_list


@pytest.mark.parametrize("seed", range(4))
def test_transposed_table_matches_brute_force(seed):
    """Random masks (documents, dilations, rows and key tiles that see nothing, masks reading b and h) at the
    backward's tiles and odd sizes: each key tile lists the query tiles that see it, ascending, full flag kept,
    zeros past the count; int32 and contiguous, as BWD_SPARSE reads them."""
    from fagen.runtime.block_mask import BlockTiles

    gen = np.random.default_rng(seed)
    for mask in _templates(gen):
        B, H = 2, 3
        M, N = (int(x) for x in gen.integers(1, 700, 2))
        bm, bn = [(64, 128), (128, 128), (17, 33)][int(gen.integers(3))]
        count, listed = brute_force(mask, B, H, M, N, bm, bn)
        tiles = BlockTiles(bm, bn, torch.as_tensor(count), torch.as_tensor(np.maximum(listed, 0)))
        got = tiles.transposed()
        want_count, want_list = _transposed(count, listed)
        assert got.q_count.dtype == got.q_list.dtype == torch.int32 and got.q_list.is_contiguous()
        assert np.array_equal(got.q_count.numpy(), want_count)
        assert np.array_equal(got.q_list.numpy(), want_list)
        assert tiles.transposed() is got  # made once, kept with the tables (a BlockMask keeps them per stream)


def test_the_transposed_table_of_cupy_arrays(monkeypatch):
    """The CuPy branch of transpose, on NumPy arrays standing in for CuPy's (the same array API)."""
    import sys

    from fagen.runtime import arrays
    from fagen.runtime.block_mask import BlockTiles, transpose

    monkeypatch.setitem(sys.modules, "cupy", np)
    monkeypatch.setattr(arrays, "library", lambda x: "cupy")
    count, listed = brute_force(doc, 1, 2, 1500, 1300, 64, 128)
    got = transpose(BlockTiles(64, 128, count, np.maximum(listed, 0).astype(np.int32)))
    want_count, want_list = _transposed(count, listed)
    assert got.q_count.dtype == got.q_list.dtype == np.int32 and got.q_list.flags.c_contiguous
    assert np.array_equal(got.q_count, want_count) and np.array_equal(got.q_list, want_list)


def test_query_tiles_strides_broadcast_batch_and_heads():
    s = backward.query_tiles_strides(2, 3, 5, 7)
    assert s == dict(
        q_count_stride_b=21, q_count_stride_h=7, q_list_stride_b=105, q_list_stride_h=35, q_list_stride_n=5
    )
    s = backward.query_tiles_strides(1, 1, 5, 7)
    assert s["q_count_stride_b"] == s["q_count_stride_h"] == s["q_list_stride_b"] == s["q_list_stride_h"] == 0


@pytest.mark.parametrize("dim", [64, 96, 128])
@pytest.mark.parametrize("mask", [doc, window])
def test_block_sparse_backward_compiles_beside_the_dense_one(dim, mask, tmp_path):
    """A block-sparse forward's backward holds the dense main kernel (the same source as the dense forward's) and
    BWD_SPARSE at the same tiles, reading the transposed table: NVRTC sm_90a, no warning, no spill."""
    sparse = fagen.compile(dim, mask=mask, arch="sm_90a", tier="wgmma", block_sparse=True, cache_dir=tmp_path)
    dense = fagen.compile(dim, mask=mask, arch="sm_90a", tier="wgmma", cache_dir=tmp_path)
    bp = sparse.backward_plan
    main, extra = bp.main, bp.main_sparse
    assert extra is not None and extra.spec.kind is Kind.BWD_SPARSE and extra.spec.name.startswith("flash_bwd_sparse_")
    assert dataclasses.replace(extra.spec, kind=Kind.BWD) == main.spec  # the backward's tiles, on its tier
    assert main.source == dense.backward_plan.main.source and dense.backward_plan.main_sparse is None
    assert "q_list" in extra.source and "q_list" not in main.source
    assert "warning" not in extra.binary.log and not extra.binary.resources.spills, extra.binary.resources
    declared = contract.params(Kind.BWD_SPARSE, (), tiers.get("wgmma").extra_params(extra.spec))
    assert _signature(extra.source, extra.spec.name) == [(p.ctype, p.name) for p in declared]
    assert not any(p.name.startswith("dq_sem") for p in declared)  # unordered: deterministic calls run BWD
    # the launcher packs it: the static values, the table's strides, and the per-call addresses
    values = backward.backward_pack_values(declared, _arrays(), 2, 33, 17, None)
    values.update(backward.query_tiles_strides(2, 4, 1, 1))
    ArgPack(declared).set(values)  # raises on a missing or unknown argument
    assert bp.main_grads is None and len(re.findall(r"rule::keep\(", extra.source)) >= 1


def test_a_tier_without_one_and_the_cache_key(tmp_path):
    """The mma tier has no block-sparse backward (d192's wgmma forward takes the mma tier's): the plan holds none,
    and a call with a block mask runs the dense kernel, saying why; deterministic calls run it too."""
    mma = fagen.compile(128, mask=doc, arch="sm_90a", tier="mma", block_sparse=True, cache_dir=tmp_path)
    assert builders.sparse_spec(mma.backward_plan.main.spec) is None and mma.backward_plan.main_sparse is None
    assert "has no block-sparse main kernel" in backward.sparse_why_not(mma.backward_plan, False)
    with_one = SimpleNamespace(main_sparse=object(), main=None)
    assert backward.sparse_why_not(with_one, False) is None
    assert "deterministic" in backward.sparse_why_not(with_one, True)


def test_flex_attention_with_grad_runs_the_block_sparse_kernel_and_its_backward(monkeypatch):
    """Inputs that require grad and a BlockMask: the block-sparse request's kernel runs the forward through
    autograd, and its backward gets the block mask (where the transposed table is read)."""
    from fagen import flex, ops

    from .attention_double import DoubleKernel, install, reference_kernel

    made = install(monkeypatch)
    kernels = []

    def fake_compile(request):
        kernel = reference_kernel(
            DoubleKernel(), kind=Kind.FORWARD_SPARSE if request.kind == "block_sparse" else Kind.FORWARD
        )
        made.append((request, kernel))
        kernels.append(kernel)
        return kernel

    monkeypatch.setattr(ops, "_compile", fake_compile)
    monkeypatch.setattr(flex, "_block_sparse", lambda q, k, v, with_grad=False: with_grad)  # as on a GPU
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g, requires_grad=True) for _ in range(3))
    bm = fagen.create_block_mask(lambda b, h, q_, k_: q_ >= k_, None, None, 9, 9, device="cpu")
    fagen.flex_attention(q, k, v, block_mask=bm).sum().backward()
    ((request, kernel),) = made
    assert request.kind == "block_sparse" and kernel.block_sparse
    assert kernel._backward.block_masks == [bm] and q.grad is not None and v.grad is not None


def test_the_compile_cache_keeps_the_block_sparse_backward(tmp_path, monkeypatch):
    """A block-sparse forward's backward is kept in the compile cache with its BWD_SPARSE kernel (under a key of
    its own: the dense forward's backward has none) and read back with it."""
    sparse = fagen.compile(128, mask=doc, arch="sm_90a", tier="wgmma", block_sparse=True, cache_dir=tmp_path)
    built = builders.backward_plan(sparse.program, sparse.spec, sparse.tensor_args, cache_dir=tmp_path)
    monkeypatch.setattr(builders, "build_backward_kernels", lambda *a, **k: pytest.fail("not read from the cache"))
    read = builders.backward_plan(str(sparse.program), sparse.spec, sparse.tensor_args, cache_dir=tmp_path)
    assert read.main_sparse is not None and read.main_sparse.spec == built.main_sparse.spec
    assert read.main_sparse.source == built.main_sparse.source and read.main.spec.kind is Kind.BWD
    monkeypatch.undo()
    dense = fagen.compile(128, mask=doc, arch="sm_90a", tier="wgmma", cache_dir=tmp_path)
    assert (
        builders.backward_plan(str(dense.program), dense.spec, dense.tensor_args, cache_dir=tmp_path).main_sparse
        is None
    )
