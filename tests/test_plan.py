"""Planning rules: tier choice, tiles that fit, and a swizzle that is bank-conflict free."""

import dataclasses

import pytest

from fagen.backend import plan, tiers, tuned
from fagen.backend.contract import Kind
from fagen.backend.spec import KernelSpec, SpecError
from fagen.backend.tiers import mma

from .lowered import lowered


def _banks(element_offsets):
    """The 4-byte banks a group of 16-byte shared-memory accesses touch (16-bit elements)."""
    out = []
    for off in element_offsets:
        word = off * 2 // 4
        out += [(word + i) % 32 for i in range(4)]
    return out


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 160, 192, 224, 256])
def test_swizzle_is_bank_conflict_free(dim):
    """ldmatrix reads one chunk column of 8 rows (rows aligned to 8); cp.async writes 8 consecutive chunks
    per 128-byte wavefront: each must touch all 32 banks once."""
    chunks = dim // 8
    for r0 in range(0, 128, 8):
        for c in range(chunks):
            assert len(set(_banks(mma.swizzled_offset(r0 + i, c * 8, dim) for i in range(8)))) == 32
    for start in range(0, 128 * chunks, 8):
        offs = [mma.swizzled_offset((start + i) // chunks, (start + i) % chunks * 8, dim) for i in range(8)]
        assert len(set(_banks(offs))) == 32


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 256])
def test_swizzle_is_a_permutation_within_each_row(dim):
    for row in range(16):
        offs = sorted(mma.swizzled_offset(row, c, dim) for c in range(dim))
        assert offs == list(range(row * dim, (row + 1) * dim))


@pytest.mark.parametrize(
    "dim, dtype, tier",
    [
        (64, "bf16", "wgmma"),
        (96, "f16", "wgmma"),
        (128, "bf16", "wgmma"),
        (256, "f16", "wgmma"),
        (160, "bf16", "mma"),
        (40, "bf16", "simt"),
        (72, "f16", "simt"),
        (128, "f32", "simt"),
        (64, "f32", "simt"),
    ],
)
def test_tier_choice(dim, dtype, tier):
    c = plan.choose("full", dim, dtype, "sm_90a")
    assert c.spec.tier == tier
    if tier == "simt":
        assert "does not apply" in c.reason


def test_tier_requests():
    assert plan.choose("full", 128, "bf16", "sm_90a", "simt").spec.tier == "simt"
    with pytest.raises(SpecError, match="mma cannot compile this kernel: f32"):
        plan.choose("full", 128, "f32", "sm_90a", "mma")
    with pytest.raises(SpecError, match="not a multiple of 32"):
        plan.choose("full", 72, "bf16", "sm_90a", "mma")


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90a"])
@pytest.mark.parametrize("dim", [32, 64, 96, 128, 160, 192, 224, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_mma_tiles_fit_shared_memory(arch, dim, causal):
    spec = plan.choose("full", dim, "bf16", arch, "mma", causal=causal).spec
    assert spec.tier == "mma"
    assert plan.smem_bytes(spec) <= tiers.SMEM_LIMIT[arch]
    assert spec.block_m % (16 * spec.num_warps) == 0


def test_tuned_entries_are_valid_specs():
    for key, cfg in tuned.tuned_table().items():
        tier, arch, dtype, d, _ = tuned.parse_key(key)
        spec = tiers.check(KernelSpec("full", d, dtype, arch, tier, **cfg))
        assert tiers.get(tier).validate(spec) is None, key
        assert plan.smem_bytes(spec) <= tiers.SMEM_LIMIT[arch]


@pytest.mark.parametrize("key", sorted(tuned.tuned_table()))
def test_tuned_configurations_compile_without_spills(key, tmp_path):
    """Every shipped tuned configuration, with the plain program its key names."""
    from fagen.backend import build, codegen

    tier, arch, dtype, d, masked = tuned.parse_key(key)
    low = lowered(dict(causal=masked), dtype)
    program = low.program
    spec = plan.choose(program.name, d, dtype, arch, tier, causal=masked).spec
    assert "tuning table" in plan.choose(program.name, d, dtype, arch, tier, causal=masked).reason
    binary = build.compile_cubin(codegen.render(spec, low), spec, cache_dir=tmp_path)
    assert not binary.resources.spills, (spec.name, str(binary.resources))
    if tier == "wgmma":  # the block holds 65536 registers (384 x 168 or 512 x 128), which setmaxnreg's budget assumes
        assert binary.resources.registers == 65536 // (32 * spec.num_warps) // 8 * 8, (spec.name, str(binary.resources))


@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_wgmma_is_the_default_on_sm90a_and_fits(dim, causal):
    spec = plan.choose("full", dim, "bf16", "sm_90a", causal=causal).spec
    # d64 takes three consumer warpgroups (192 rows; the tuning table's H100 winner), the others two
    assert spec.tier == "wgmma" and (spec.block_m, spec.num_warps) == ((192, 16) if dim == 64 else (128, 12))
    assert plan.smem_bytes(spec) <= tiers.SMEM_LIMIT["sm_90a"]
    assert plan.choose("full", dim, "bf16", "sm_90").spec.tier == "mma"  # wgmma needs the sm_90a target


def test_wgmma_three_consumer_warpgroups_only_where_160_registers_hold_the_tile():
    """192 query rows leave a consumer thread 160 registers: d64 with up to 128 keys, d96 with up to 96 (O over its
    96 columns), d128 with up to 80."""
    wg = tiers.get("wgmma")

    def spec(d, bm, bn, warps=None):
        return tiers.check(
            KernelSpec(
                "full", d, "bf16", "sm_90a", "wgmma", block_m=bm, block_n=bn, num_warps=warps or bm // 16 + 4, stages=2
            )
        )

    assert spec(64, 192, 128).block_m == 192 and spec(128, 192, 80).block_m == 192 and spec(96, 192, 96).block_m == 192
    for d, bm, bn, warps, why in [
        (64, 192, 144, None, "160 registers"),
        (96, 192, 112, None, "160 registers"),
        (128, 192, 96, None, "160 registers"),
        (256, 192, 64, None, "160 registers"),
        (64, 192, 128, 12, "num_warps"),
        (64, 256, 64, None, "block_m must be"),
    ]:
        with pytest.raises(SpecError, match=why):
            spec(d, bm, bn, warps)
    wide = {
        (c["block_m"], c["block_n"]) for c in wg.candidates(Kind.FORWARD, 64, "bf16", "sm_90a") if c["block_m"] == 192
    }
    assert wide and max(n for _, n in wide) == 128
    assert not [c for c in wg.candidates(Kind.FORWARD, 256, "bf16", "sm_90a") if c["block_m"] == 192]
    step = wg.lighter(spec(64, 192, 128))  # a spill narrows the key tiles to 96, then leaves two consumer warpgroups
    assert (step.block_m, step.block_n) == (192, 96)
    step = wg.lighter(step)
    assert (step.block_m, step.num_warps, step.block_n) == (128, 12, 96)


def test_a_score_function_that_spills_at_192_rows_takes_narrower_key_tiles(tmp_path, monkeypatch):
    """softcap's tanh with ALiBi's bias needs more than 160 registers a thread at d64's 192 x 128 tiles (16 bytes of
    spill under NVRTC 13.0 and 13.5; softcap alone spilled there under earlier builds, no longer under 13.5.37): the
    kernel is built at 192 x 96 instead, and says so. Both were compiled at once (NVRTC's threads), as the tier marks
    192 rows as tight for a score function; a plain kernel there compiles once."""
    import threading

    from fagen import pipeline
    from fagen.backend import build

    seen = []
    real = build.compile_cubin

    def recorded(source, spec, **kw):
        seen.append(((spec.block_m, spec.block_n), threading.current_thread().name.startswith("fagen-nvrtc")))
        return real(source, spec, **kw)

    monkeypatch.setattr(build, "compile_cubin", recorded)
    kernel = pipeline.compile(64, softcap=30.0, alibi=True, arch="sm_90a", cache_dir=tmp_path)
    assert (kernel.spec.tier, kernel.spec.block_m, kernel.spec.block_n) == ("wgmma", 192, 96), kernel.name
    assert not kernel.resources.spills and "m192n128w16s2p spilled" in kernel.tier_reason  # persistent: no mask
    assert sorted(seen) == [((192, 96), True), ((192, 128), True)]
    seen.clear()
    plain = pipeline.compile(64, arch="sm_90a", cache_dir=tmp_path)
    assert (plain.spec.block_m, plain.spec.block_n) == (192, 128) and seen == [((192, 128), True)]


def test_a_warpgroup_skips_key_tiles_its_rows_cannot_see_only_where_it_can_happen(tmp_path):
    """Where the block's rows past the first warpgroup's span a whole key tile (d64's 192 x 128, d256's 128 x 64), a
    warpgroup skips the leading key tiles outside its own rows' proven range (a causal diagonal); elsewhere (d128's
    128 x 128) the kernel is rendered as before, with no skipping code."""
    from fagen.backend import codegen

    low = lowered(dict(causal=True), "bf16")
    program = low.program
    for dim, skips in ((64, True), (256, True), (128, False)):
        spec = plan.choose(program.name, dim, "bf16", "sm_90a", "wgmma", causal=True).spec
        assert tiers.get("wgmma").context(spec)["warpgroup_skips"] == skips, spec.name
        assert ("leading key tiles" in codegen.render(spec, low)) == skips, spec.name
    full_low = lowered(dict(), "bf16")  # no mask: nothing to skip
    full = full_low.program
    spec = plan.choose(full.name, 64, "bf16", "sm_90a", "wgmma").spec
    assert "leading key tiles" not in codegen.render(spec, full_low)


def test_persistent_blocks_draw_work_tiles_the_longest_first_where_a_mask_shortens_early_ones():
    """A persistent forward's producer draws each later work tile from the counter and names it to the consumers;
    the last block out sets the counter back to zero. Where the mask's key range grows with the query tile
    (causal, prefix-LM), the order is the longest query tiles first, heads fastest inside chunks of heads whose K
    and V fit the L2 budget; without a mask, query tiles fastest (a head's K, V stay in L2)."""
    from fagen.backend import codegen

    for causal, longest_first in ((True, True), (False, False)):
        low = lowered(dict(causal=causal), "bf16")
        program = low.program
        spec = plan.choose(program.name, 128, "bf16", "sm_90a", "wgmma", causal=causal).spec
        assert spec.persistent, spec.name
        src = codegen.render(spec, low)
        assert "next = gridDim.x + atomicAdd(tile_counter, 1);" in src
        assert "atomicExch(tile_counter, 0);" in src and "int* tile_counter)" in src
        assert ("tile_m = grid_m - 1 - r / width;" in src) == longest_first, spec.name
        assert ("tile_m = unit % grid_m;" in src) != longest_first, spec.name
        assert ("L2_KV_BYTES = 33554432;" in src) == ("heads_per_kv));" in src) == longest_first, spec.name


@pytest.mark.parametrize("dim", [64, 128, 256])
def test_a_varlen_tile_writes_o_from_its_shared_memory_tile_in_16_byte_chunks(dim):
    """The wgmma forward puts a tile's O into shared memory (O's own tile where persistent, else the warpgroup's rows
    of Q_i) whatever the call; a dense tile stores it by TMA, a varlen one (the map cannot stop at its sequence's
    end) by 16-byte chunks of the rows inside its sequence, once its warpgroup has met; a tile that saw no key writes
    its zeros from registers."""
    from fagen.backend import codegen

    low = lowered(dict(causal=True), "bf16")
    spec = plan.choose(low.program.name, dim, "bf16", "sm_90a", "wgmma", causal=True).spec
    src = codegen.render(spec, low)
    assert "const bool staged = w.n_tiles > 0, store_tma = staged && !varlen;" in src
    assert ("smem.O + wg * 64 * 128" in src) == spec.persistent and ("c.q_tile;" in src) != spec.persistent
    copy = src.index("if (staged && !store_tma) {")
    met = src.index("named_bar_sync(BAR_OUT_BASE + wg, 128);", copy)
    assert met < src.index("if (q_idx < w.seqlen_q)", copy)
    assert src.index("*reinterpret_cast<uint4*>(o_wg + q_idx * o_stride_m + 8 * chunk)", copy) < src.index(
        "if (store_tma) {", copy
    )


def test_the_persistent_forward_names_only_tiles_inside_their_varlen_sequence():
    """A varlen batch's grid counts the longest sequence's query tiles in every sequence. The persistent forward's
    producer draws again past a tile that lies beyond its own sequence's end (each draw issued before the check),
    so the consumers are named real work tiles only; a dense call takes its first draw."""
    from fagen.backend import codegen

    low = lowered(dict(causal=True), "bf16")
    spec = plan.choose(low.program.name, 128, "bf16", "sm_90a", "wgmma", causal=True).spec
    assert spec.persistent
    src = codegen.render(spec, low)
    assert "TileScheduler scheduler(grid_m, grid_h, grid_b, seqlen_k, heads_per_kv, cu_seqlens_q, total_q);" in src
    loop = src.index("for (int unit = next; unit < units; unit = next) {")
    draw = src.index("next = gridDim.x + atomicAdd(tile_counter, 1);", loop)
    dense = src.index("if (cu_seqlens_q == nullptr) break;", draw)
    inside = src.index("if (tile_m * BLOCK_M < varlen_length(cu_seqlens_q, b, total_q, q0)) break;", dense)
    again = src.index("tile_m = -1;", inside)
    assert loop < draw < dense < inside < again < src.index("st_shared_u32(smem.unit_words, tile_m);", again)


def test_a_program_without_a_mask_gets_a_persistent_kernel_where_o_has_room(monkeypatch):
    """Every work tile costs the same without a mask, so the wgmma forward is persistent there, where O's own
    shared-memory tile fits beside the ring (d64-d128); under a mask too (blocks draw work tiles from a counter,
    the longest first), at two consumer warpgroups (d96, d128) and at three (d64's 192 rows); block sparsity, d256
    or another tier: a block per work tile. The launch is a block per SM (at most), told the work tiles' grid and
    given the counter its blocks draw from (the runtime's, per call shape and stream)."""
    from fagen.backend.tiers import wgmma

    def spec(dim, causal=False, kind=Kind.FORWARD):
        return plan.choose("causal" if causal else "full", dim, "bf16", "sm_90a", causal=causal, kind=kind).spec

    assert spec(64).persistent and spec(128).persistent and spec(128).name.endswith("s2p")
    assert spec(128, True).persistent and spec(96, True).persistent and spec(128, True).block_m == 128
    assert spec(64, True).persistent and spec(64, True).block_m == 192 and not spec(256).persistent
    assert not spec(64, kind=Kind.FORWARD_SPARSE).persistent
    assert not plan.choose("full", 128, "bf16", "sm_80").spec.persistent
    for s in (spec(64), spec(128)):
        assert plan.smem_bytes(s) <= tiers.SMEM_LIMIT["sm_90a"]
        o_tile = 2 * wgmma.tile_dim(s.head_dim) * s.block_m  # 16-bit, the rows of Q_i
        assert plan.smem_bytes(s) == plan.smem_bytes(dataclasses.replace(s, persistent=False)) + o_tile
    with pytest.raises(SpecError, match="no persistent"):
        tiers.check(dataclasses.replace(plan.choose("full", 128, "bf16", "sm_80").spec, persistent=True))
    monkeypatch.setattr(wgmma, "sm_count", lambda device: 132)
    t = tiers.get("wgmma")
    assert t.launch_grid(spec(128), (16, 16, 8), 0) == ((132, 1, 1), dict(grid_m=16, grid_h=16, grid_b=8))
    assert t.launch_grid(spec(128), (3, 2, 1), 0) == ((6, 1, 1), dict(grid_m=3, grid_h=2, grid_b=1))
    assert t.launch_grid(spec(128), (0, 2, 1), 0)[0] == (1, 1, 1)  # no work tile: one block, which does nothing
    assert t.launch_grid(spec(64, True), (11, 32, 8), 0) == ((132, 1, 1), dict(grid_m=11, grid_h=32, grid_b=8))
    assert t.launch_grid(spec(256, True), (16, 16, 8), 0) == ((16, 16, 8), {})
    assert [p.name for p in t.extra_params(spec(128))][-4:] == ["grid_m", "grid_h", "grid_b", "tile_counter"]
    assert "grid_m" not in [p.name for p in t.extra_params(spec(256, True))]
    assert "tile_counter" not in [p.name for p in t.extra_params(spec(256, True))]


@pytest.mark.parametrize("dim", [64, 96, 128, 256])
def test_given_tiles_are_persistent_as_the_tiers_own_would_be(dim):
    """Tiles given to plan.choose (`fagen tune`'s candidates, a user's config) run persistent exactly where the
    tier would make those tiles persistent (where O's own tile fits, with a mask or not), not as the tiles they
    replace."""
    from fagen.backend.tiers import wgmma

    wg = tiers.get("wgmma")
    seen = set()
    for tiles in wg.candidates(Kind.FORWARD, dim, "bf16", "sm_90a"):
        assert "persistent" not in tiles
        for masked in (False, True):
            spec = plan.choose("full", dim, "bf16", "sm_90a", "wgmma", causal=masked, config=tiles).spec
            fits = (
                wgmma.smem_bytes(dim, tiles["block_n"], tiles["stages"], tiles["block_m"], True)
                <= tiers.SMEM_LIMIT["sm_90a"]
            )
            assert spec.persistent == fits, (tiles, masked)
            seen.add(spec.persistent)
    assert seen == {64: {True}, 96: {False, True}, 128: {False, True}, 256: {False}}[dim]  # every d64 candidate fits
    given = dict(block_m=128, block_n=128, num_warps=12, stages=2, persistent=False)  # an explicit choice stands
    assert not plan.choose("full", 128, "bf16", "sm_90a", "wgmma", config=given).spec.persistent
