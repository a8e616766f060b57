"""The order the wgmma backward's key tiles start in (wgmma.BWD_ORDER): "heavy_first" (the default) where the proven
query range of a key tile begins at a bound that grows with the tile and ends at the sequence's end (causal, ALiBi
under causal), so the early key tiles, which see the most query tiles, start first, at 128 columns and more; the
natural grid order where every key tile sees as many queries (no mask, softcap, a window), at d64, or under
BWD_ORDER = "natural". The order is in the backward's cache key."""

import pytest

from fagen import builders, pipeline
from fagen.backend import codegen, plan
from fagen.backend.contract import Kind
from fagen.backend.spec import SpecError
from fagen.backend.tiers import wgmma

from .lowered import lowered

VARIANTS = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal_br": dict(causal="bottom_right"),
    "window": dict(causal=True, window=256),
    "softcap": dict(softcap=30.0),
    "alibi": dict(causal=True, alibi=True),
}


# a block per key tile names its unit by its linear index (the order the hardware starts blocks in), then unit_tile
BLOCK_UNIT = "const int u = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);"


@pytest.fixture(autouse=True)
def block_per_tile(monkeypatch):
    """These tests read the kernel of a block per key tile (the keys they compare taken so too), the persistent one
    where `rendered` is asked for it."""
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT", False)


def rendered(variant, dim, order, monkeypatch, det_pairs=0, det_blocks=0, persistent=False):
    """The backward's source under BWD_ORDER = order; det_pairs = det_blocks = 0 leaves deterministic calls in that
    order too, so that the tests of the default mode's order read one line. The kernel of a block per key tile unless
    `persistent` (BWD_PERSISTENT: its blocks take the same order's units from a counter, test_persistent_...)."""
    monkeypatch.setattr(wgmma, "BWD_ORDER", order)
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT", persistent)
    monkeypatch.setattr(wgmma, "BWD_DET_PAIRS", det_pairs)
    monkeypatch.setattr(wgmma, "BWD_DET_BLOCKS", det_blocks)
    opts = VARIANTS[variant]
    program = pipeline.lower(pipeline.load_program(**opts), "bf16")[-1].program
    masked = builders.backward_masked(program)  # (the main kernel's tiles, as build_backward_kernels plans them)
    spec = plan.choose(variant, dim, "bf16", "sm_90a", "wgmma", causal=masked, kind=Kind.BWD).spec
    return codegen.render(spec, lowered(program, backward=True))


@pytest.mark.parametrize(
    "variant, heavy",
    [("full", False), ("softcap", False), ("causal", True), ("causal_br", True), ("window", False), ("alibi", True)],
)
@pytest.mark.parametrize("dim", [64, 96, 128, 256])
def test_masks_that_lengthen_early_key_tiles_start_them_first(variant, heavy, dim, monkeypatch):
    src = rendered(variant, dim, "heavy_first", monkeypatch)
    heavy = heavy and dim > 64  # (d64 measured no gain)
    assert ("if (cu_seqlens_q == nullptr) return heavy_first_tile(g, u, seqlen_q, heads_per_kv);" in src) is heavy
    assert ("const int tile_n = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z;" in src) is not heavy
    assert (BLOCK_UNIT in src) is heavy


@pytest.mark.parametrize("dim", [128, 256])
def test_the_natural_order_keeps_the_grid(dim, monkeypatch):
    src = rendered("causal", dim, "natural", monkeypatch)
    assert "heavy_first_tile" not in src and "const int tile_n = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z;" in src


def test_the_order_is_in_the_cache_key_and_checked(monkeypatch):
    keys = {}
    for order in wgmma.BWD_ORDERS:
        monkeypatch.setattr(wgmma, "BWD_ORDER", order)
        keys[order] = wgmma.Wgmma().backward_key()
    assert keys["natural"] != keys["heavy_first"]
    monkeypatch.setattr(wgmma, "BWD_ORDER", "longest")
    with pytest.raises(SpecError, match="BWD_ORDER"):
        wgmma.backward_order()


@pytest.mark.parametrize("wave", [0, 256])
@pytest.mark.parametrize("variant, dim", [("causal", 128), ("alibi", 96), ("causal", 256)])
def test_a_heavy_first_chunk_takes_at_least_wave_blocks(variant, dim, wave, monkeypatch):
    """wgmma.BWD_WAVE_BLOCKS: a heavy-first chunk is L2's budget of pairs or BWD_WAVE_BLOCKS // key tiles pairs,
    whichever is more (a GQA pair's query heads shrink L2's); 0 leaves L2's budget alone. In the backward's key."""
    monkeypatch.setattr(wgmma, "BWD_WAVE_BLOCKS", wave)
    src = rendered(variant, dim, "heavy_first", monkeypatch)
    assert "WAVE_BLOCKS" not in rendered("full", dim, "heavy_first", monkeypatch)  # (no heavy-first order)
    key = wgmma.Wgmma().backward_key()
    assert "if (cu_seqlens_q == nullptr) return heavy_first_tile(g, u, seqlen_q, heads_per_kv);" in src
    assert (f"constexpr int WAVE_BLOCKS = {wave};" in src) is bool(wave)
    assert ("const long long wave_pairs = WAVE_BLOCKS / g.tiles();" in src) is bool(wave)
    wave_chunk = "max(max(1ll, wave_pairs), L2_BYTES / pair_bytes)"
    assert (wave_chunk in src) is bool(wave) and ("max(1ll, L2_BYTES / pair_bytes)" in src) is not bool(wave)
    monkeypatch.setattr(wgmma, "BWD_WAVE_BLOCKS", 0)
    assert key == ({**wgmma.Wgmma().backward_key(), "wave_blocks": wave} if wave else wgmma.Wgmma().backward_key())


@pytest.mark.parametrize("variant, v4", [("causal", True), ("alibi", True), ("full", False), ("softcap", False)])
def test_lse_and_d_are_read_as_row_pairs_unless_the_derivative_reads_the_score(variant, v4, monkeypatch):
    """(Not the order, the same rendering:) at d128 a thread's two rows of lse_i and D_i are one 16-byte load, except
    where f'(t) reads the score (softcap), whose live values made those loads spill, and at 80 rows a step (no mask:
    full), where they spilled too."""
    src = rendered(variant, 128, "heavy_first", monkeypatch)
    assert ("constexpr bool ROWS_V4 = true;" in src) is v4


@pytest.mark.parametrize("variant, dim", [("causal", 128), ("full", 128), ("causal", 64)])
def test_deterministic_calls_may_take_key_tiles_first_over_chunks_of_pairs(variant, dim, monkeypatch):
    """wgmma.BWD_DET_PAIRS: a deterministic call (dq_semaphore set) takes the key tiles first-first over chunks of that
    many pairs (det_tile); 0 keeps the default mode's order, and the setting is part of the backward's key."""
    plain = rendered(variant, dim, "heavy_first", monkeypatch, det_pairs=0)
    key = wgmma.Wgmma().backward_key()
    src = rendered(variant, dim, "heavy_first", monkeypatch, det_pairs=32)
    assert "det_tile" not in plain and "constexpr int DET_PAIRS = 32;" in src
    assert "if (dq_semaphore != nullptr) return det_tile(g, u);" in src and BLOCK_UNIT in src
    assert wgmma.Wgmma().backward_key() == {**key, "det_pairs": 32}


@pytest.mark.parametrize(
    "variant, dim, by_blocks",
    [
        ("full", 64, True),
        ("full", 128, True),
        ("softcap", 128, True),
        ("causal", 128, True),
        ("window", 128, True),
        ("causal", 64, False),
        ("window", 64, False),
        ("alibi", 96, True),
        ("full", 256, False),
    ],
)
def test_deterministic_calls_without_a_mask_take_chunks_of_blocks(variant, dim, by_blocks, monkeypatch):
    """wgmma.BWD_DET_BLOCKS: without a mask (every key tile takes every query tile), and under one at d96 and d128
    (BWD_DET_BLOCKS_MASKED), a deterministic call's chunk is about that many blocks (det_tile: DET_BLOCKS / the key
    tiles, at least one pair); under a mask at other head dims, and in the wide backward (d256), BWD_DET_PAIRS pairs.
    Both in the backward's key."""
    key = wgmma.Wgmma().backward_key()
    src = rendered(variant, dim, "heavy_first", monkeypatch, det_pairs=32, det_blocks=256)
    assert ("constexpr int DET_BLOCKS = 256;" in src) is by_blocks
    assert ("constexpr int DET_PAIRS = 32;" in src) is not by_blocks
    assert "if (dq_semaphore != nullptr) return det_tile(g, u);" in src and BLOCK_UNIT in src
    if by_blocks:
        assert "return g.first_first(u, max(1, min(DET_BLOCKS / g.tiles(), g.pairs())));" in src
    assert wgmma.Wgmma().backward_key() == {**key, "det_pairs": 32, "det_blocks": 256}


@pytest.mark.parametrize("variant, heavy", [("causal", True), ("alibi", True), ("window", False), ("softcap", False)])
def test_persistent_blocks_draw_their_units_in_the_same_order(variant, heavy, monkeypatch):
    """A persistent kernel (d128, 64 rows a step) names unit u's key tile by the very order functions over its work
    grid (grid_n, grid_h, grid_b): det_tile for a deterministic call, heavy_first_tile where the mask lengthens early
    key tiles and the call is not varlen, else the grid's order."""
    src = rendered(variant, 128, "heavy_first", monkeypatch, det_pairs=32, det_blocks=256, persistent=True)
    assert "const WorkGrid grid{grid_n, grid_h, grid_b};" in src and BLOCK_UNIT not in src
    assert "if (dq_semaphore != nullptr) return det_tile(g, u);" in src
    assert "return g.first_first(u, max(1, min(DET_BLOCKS / g.tiles(), g.pairs())));" in src
    assert ("if (cu_seqlens_q == nullptr) return heavy_first_tile(g, u, seqlen_q, heads_per_kv);" in src) is heavy
    call = "unit_tile(grid, u, grid.in_order(u), seqlen_q_arg, heads_per_kv, cu_seqlens_q, dq_semaphore)"
    assert src.count(call) == 3  # (the producer's loop and the consumers', and its check of a drawn varlen unit)


@pytest.mark.parametrize("masked", [(), (128,), (64, 96)])
def test_the_head_dims_whose_masked_programs_take_chunks_of_blocks_are_a_setting_in_the_key(masked, monkeypatch):
    """wgmma.BWD_DET_BLOCKS_MASKED names the head dims (d96, d128) whose masked programs' deterministic calls take
    DET_BLOCKS; () leaves them BWD_DET_PAIRS. Off its default, it is in the backward's key."""
    key = wgmma.Wgmma().backward_key()
    monkeypatch.setattr(wgmma, "BWD_DET_BLOCKS_MASKED", masked)
    for dim in (64, 96, 128, 256):
        src = rendered("causal", dim, "heavy_first", monkeypatch, det_pairs=16, det_blocks=256)
        assert ("constexpr int DET_BLOCKS = 256;" in src) is (dim in masked and dim != 256), dim  # (d256: the wide one)
        assert ("constexpr int DET_PAIRS = 16;" in src) is (dim not in masked or dim == 256), dim
    monkeypatch.setattr(wgmma, "BWD_DET_PAIRS", key.get("det_pairs", 0))
    monkeypatch.setattr(wgmma, "BWD_DET_BLOCKS", key.get("det_blocks", 0))
    assert wgmma.Wgmma().backward_key() == {**key, "det_blocks_masked": masked}


INNER = "if (++h == (kt.h_kv + 1) * heads_per_kv) {   // heads inner"  # next_step's advance
OUTER = "if (++t == kt.tiles) {                       // heads outer"


def assert_heads(src: str, inner: bool) -> None:
    """One order, next_step's, for every loop over a key tile's steps: the loads, dQ's additions, the consumers."""
    assert (INNER in src) is inner and (OUTER in src) is not inner
    assert src.count("next_step(kt, heads_per_kv, h, t);") == 3


@pytest.mark.parametrize(
    "variant, inner",
    [("causal", True), ("causal_br", True), ("alibi", True), ("window", False), ("full", False), ("softcap", False)],
)
@pytest.mark.parametrize("dim", [64, 96, 128, 192, 256])
def test_gqa_steps_take_the_heads_inner_where_early_key_tiles_see_more_queries(variant, inner, dim, monkeypatch):
    """wgmma.BWD_HEADS_INNER: where early key tiles see more query tiles (causal; not a window, whose key tiles see
    about as many), a GQA group's query heads are inner, so that a deterministic call's key tiles reach each head's
    query tile at about the same step; elsewhere, and in the wide backward (d192, d256), heads outer."""
    assert_heads(rendered(variant, dim, "heavy_first", monkeypatch), inner and dim <= 128)


def test_a_fixed_value_is_read_again_at_every_step_when_heads_are_inner(monkeypatch):
    """ALiBi's slope is read once a head: with heads inner, each step where a group has several heads."""
    src = rendered("alibi", 128, "heavy_first", monkeypatch)
    assert "if (heads_per_kv > 1 || t == 0) " in src


def test_the_kernel_that_sums_a_tensors_gradient_keeps_heads_outer():
    """ALiBi's slopes' gradient is summed over a head's tiles (at its last): that kernel keeps each head's tiles
    together."""
    import dataclasses

    program = pipeline.lower(pipeline.load_program(**VARIANTS["alibi"]), "bf16")[-1].program
    spec = plan.choose("alibi", 128, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec
    low = lowered(program, backward=True)
    plain, grads = codegen.render(spec, low), codegen.render(dataclasses.replace(spec, tensor_grads=True), low)
    assert_heads(plain, True)
    assert_heads(grads, False)
    assert "const bool last_tile" in grads and "const bool last_tile" not in plain  # (where a head's sums end)


def test_the_setting_is_in_the_cache_key_and_off_keeps_heads_outer(monkeypatch):
    key = wgmma.Wgmma().backward_key()
    monkeypatch.setattr(wgmma, "BWD_HEADS_INNER", False)
    assert wgmma.Wgmma().backward_key() == {**key, "heads_inner": False}
    assert_heads(rendered("causal", 128, "heavy_first", monkeypatch), False)
