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
    torch = pytest.importorskip("torch")
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


def _states(count, listed):
    """The tiles' states (0 empty, 1 partial, 2 full) of a block mask's lists, in NumPy."""
    B, H, tm, tn = listed.shape
    state = np.zeros((B, H, tm, tn), np.int32)
    for b, h, i in np.ndindex(B, H, tm):
        for e in listed[b, h, i, : count[b, h, i]]:
            state[b, h, i, e // 2] = 1 + e % 2
    return state


# (the forward's tiles, the backward's): refined rows, equal, coarsened, both ways at once, odd sizes
_NESTED = [((128, 128), (64, 128)), ((128, 128), (128, 128)), ((64, 64), (128, 128)), ((128, 32), (64, 128))]
_NESTED += [((16, 176), (64, 88)), ((17, 33), (34, 11))]


@pytest.mark.parametrize("seed", range(3))
def test_derived_tables_match_the_block_mask_kernels(seed):
    """Tables derived from another tile size (block_mask.derive, no mask evaluated) against the block-mask
    kernel's at the new tiles (brute force, which its CPU and GPU tests match): equal where every dimension keeps
    or coarsens its tiles; where one refines, a tile differs only by being partial where the kernel's is empty
    or full (never empty where some pair is kept, never full where one is not). Their lists and transposed
    table are those of their states."""
    torch = pytest.importorskip("torch")
    from fagen.runtime.block_mask import BlockTiles, derive

    gen = np.random.default_rng(100 + seed)
    for t, mask in enumerate(_templates(gen)):
        (fm, fn), (bm, bn) = _NESTED[(t + seed) % len(_NESTED)]
        B, H = 2, 3
        M, N = (int(x) for x in gen.integers(1, 900, 2))
        count, listed = brute_force(mask, B, H, M, N, fm, fn)
        source = BlockTiles(fm, fn, torch.as_tensor(count), torch.as_tensor(np.maximum(listed, 0)))
        got = derive(source, bm, bn, M, N)
        want_count, want_list = brute_force(mask, B, H, M, N, bm, bn)
        want = _states(want_count, want_list)
        what = f"mask {t}: {fm}x{fn} -> {bm}x{bn}, M={M} N={N}"
        assert (got.block_m, got.block_n) == (bm, bn)
        count_d, list_d = got.kv_count.numpy(), got.kv_list.numpy()
        state = _states(count_d, list_d)
        assert np.array_equal(got.state().numpy(), state), what
        if fm <= bm and fn <= bn:
            assert np.array_equal(count_d, want_count) and np.array_equal(state, want), what
        else:
            assert np.all((state == want) | (state == 1)), what
        assert count_d.dtype == list_d.dtype == np.int32 and got.kv_list.is_contiguous()
        assert not np.any(list_d[np.arange(list_d.shape[-1]) >= count_d[..., None]]), what  # zeros past the count
        q_count, q_list = _transposed(count_d, list_d)
        assert np.array_equal(got.transposed().q_count.numpy(), q_count), what
        assert np.array_equal(got.transposed().q_list.numpy(), q_list), what


def test_derived_tables_of_cupy_arrays(monkeypatch):
    """The CuPy branch of derive, on NumPy arrays standing in for CuPy's: refined rows, coarsened keys."""
    import sys

    from fagen.runtime import arrays
    from fagen.runtime.block_mask import BlockTiles, derive

    monkeypatch.setitem(sys.modules, "cupy", np)
    monkeypatch.setattr(arrays, "library", lambda x: "cupy")
    count, listed = brute_force(window, 1, 2, 1500, 1300, 128, 64)
    got = derive(BlockTiles(128, 64, count, np.maximum(listed, 0).astype(np.int32)), 64, 128, 1500, 1300)
    want = _states(*brute_force(window, 1, 2, 1500, 1300, 64, 128))
    state = _states(got.kv_count, got.kv_list)
    assert np.all((state == want) | (state == 1)) and np.array_equal(got.state(), state)
    q_count, q_list = _transposed(got.kv_count, got.kv_list)
    assert np.array_equal(got.transposed().q_count, q_count) and np.array_equal(got.transposed().q_list, q_list)


def test_a_block_mask_derives_the_backwards_tables_from_the_forwards(monkeypatch):
    """BlockMask.tiles at tiles that nest with ones the stream holds derives them (the block-mask kernel not run
    again), the finest first; at tiles that do not nest, or on another stream, the kernel builds them."""
    torch = pytest.importorskip("torch")
    from fagen import flex
    from fagen.runtime import block_mask

    M = N = 700
    bm = fagen.create_block_mask(doc, None, None, M, N, device="cpu")
    now = {"stream": 1}
    built = []

    def build(mask, block_m, block_n, kind, device):
        built.append((block_m, block_n, now["stream"]))
        count, listed = brute_force(doc, 1, 1, M, N, block_m, block_n)
        return block_mask.BlockTiles(block_m, block_n, torch.as_tensor(count), torch.as_tensor(np.maximum(listed, 0)))

    monkeypatch.setattr(block_mask, "current_stream", lambda where: (now["stream"], False))
    monkeypatch.setattr(flex, "_build", build)
    monkeypatch.setattr(flex, "_current_device", lambda: 0)
    derived = []
    real = block_mask.derive
    monkeypatch.setattr(block_mask, "derive", lambda s, *a: derived.append((s.block_m, s.block_n)) or real(s, *a))
    forward = bm.tiles(128, 128)
    backward = bm.tiles(64, 128)
    assert built == [(128, 128, 1)] and derived == [(128, 128)] and bm.tiles(64, 128) is backward
    want = _states(*brute_force(doc, 1, 1, M, N, 64, 128))
    state = backward.state().numpy()
    assert np.all((state == want) | (state == 1))
    assert forward.transposed() is not backward.transposed()
    bm.tiles(32, 64)  # finer than both: derived from the finer of them
    assert derived[-1] == (64, 128)
    bm.tiles(128, 96)  # 96 and 128 do not nest: the kernel
    assert built[-1] == (128, 96, 1)
    bm.tiles(128, 192)  # nests with 64 (192 = 3 x 64) through the 32x64 table: derived, exact
    assert derived[-1] == (32, 64) and len(built) == 2
    now["stream"] = 2
    bm.tiles(64, 128)  # another stream: its own, from the kernel
    assert built[-1] == (64, 128, 2)


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
    # partial tiles evaluate the mask: the document mask's rule::keep, the window's exact terms as columns of a key
    masked = "key_q_begin[r]" in extra.source if mask is window else len(re.findall(r"rule::keep\(", extra.source)) >= 1
    assert bp.main_grads is None and masked


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
    torch = pytest.importorskip("torch")
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
