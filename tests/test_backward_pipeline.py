"""The wgmma backward's step orders (wgmma.BWD_PIPELINE): "serial", "overlap_dq" (the default: dQ's part written out
while dK's wgmma runs) and "overlap" (that, and P formed from S while dP's wgmma runs, FlashAttention-3's order).
Each renders and compiles for sm_90a within the tier's spill budget; the serial source holds neither reordering."""

import pytest

from fagen import builders, pipeline
from fagen.backend import codegen, plan, tiers
from fagen.backend.contract import Kind
from fagen.backend.spec import SpecError
from fagen.backend.tiers import wgmma

from .lowered import lowered

VARIANTS = {
    "full": dict(),
    "causal": dict(causal=True),
    "softcap": dict(softcap=30.0),
    "alibi": dict(causal=True, alibi=True),
    "alibi_full": dict(alibi=True),
}


def fused(**kw):
    return pipeline.lower(pipeline.load_program(**kw), "bf16")[-1].program


def rendered(variant, dim, pipeline_name, monkeypatch):
    monkeypatch.setattr(wgmma, "BWD_PIPELINE", pipeline_name)
    program = fused(**VARIANTS[variant])
    masked = builders.backward_masked(program)  # (the main kernel's tiles, as build_backward_kernels plans them)
    spec = plan.choose(variant, dim, "bf16", "sm_90a", "wgmma", causal=masked, kind=Kind.BWD).spec
    return codegen.render(spec, lowered(program, backward=True))


@pytest.mark.parametrize("dim", [64, 128])
def test_the_orders_render_their_waits(dim, monkeypatch):
    serial, odq, ovl = (rendered("causal", dim, p, monkeypatch) for p in wgmma.BWD_PIPELINES)
    assert "wgmma_wait<1>" not in serial and "gemm_s_then_dp" not in serial and "float pt[" not in serial
    assert odq.count("wgmma_wait<1>();") == 1 and "gemm_s_then_dp" not in odq  # dV and dQ done, dK running
    assert "gemm_s_then_dp(qk, dp, c, desc_add(c.Q_k, st)" in ovl and "to_fragments(pt, p_frag);" in ovl
    assert ovl.index("gemm_dq(dq,") < ovl.index("gemm_acc(dK, ds_frag,") < ovl.index("write_dq(dq, smem, c);")


@pytest.mark.parametrize("dim, first", [(64, True), (128, False)])
def test_dqk_is_stored_before_dv_at_128_rows(dim, first, monkeypatch):
    """At d64 (128 query rows a step) dqk^T goes to shared memory before dV's wgmma is issued (DS_FIRST_ROWS); at d128
    after it; with no rows set, after it at both, and the backward's key holds the setting."""
    src = rendered("causal", dim, "overlap_dq", monkeypatch)
    assert (src.index("store_ds(ds_frag, dS_i, c);") < src.index("gemm_acc(dV, p_frag,")) == first
    on = tiers.get("wgmma").backward_key()
    monkeypatch.setattr(wgmma, "DS_FIRST_ROWS", ())
    assert tiers.get("wgmma").backward_key() == {**on, "ds_first_rows": ()}
    src = rendered("causal", dim, "overlap_dq", monkeypatch)
    assert src.index("store_ds(ds_frag, dS_i, c);") > src.index("gemm_acc(dV, p_frag,")
    assert src.count("store_ds(ds_frag, dS_i, c);") == 1


def test_an_unknown_order_is_refused(monkeypatch):
    monkeypatch.setattr(wgmma, "BWD_PIPELINE", "fast")
    with pytest.raises(SpecError, match="BWD_PIPELINE"):
        wgmma.backward_pipeline()


@pytest.mark.parametrize(
    "pipeline_name, variant, dim",
    [
        ("overlap", "full", 128),
        ("overlap", "causal", 128),
        ("overlap", "softcap", 128),
        ("overlap", "alibi", 128),
        ("overlap", "causal", 64),
        ("overlap_dq", "causal", 128),
        ("overlap_dq", "causal", 64),
    ],
)
def test_the_overlapped_orders_compile_within_the_budget(variant, dim, pipeline_name, monkeypatch, tmp_path):
    """NVRTC builds each order on the wgmma tier with no warning: plain and causal d128 with no spill (causal under
    "overlap", not the default order, within the budget: 8 bytes since the 16-byte dK/dV epilogue); a score
    function's (softcap's dL/d(q.k) keeps the raw q.k beside P under "overlap") and d64's 128 rows a step within the
    budget (d64 causal under "overlap" spills a few words), where 128 rows may step down to 64."""
    monkeypatch.setattr(wgmma, "BWD_PIPELINE", pipeline_name)
    program = fused(**VARIANTS[variant])
    main = builders.build_backward_kernels(program, program.name, dim, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    spec, resources = main.main.spec, main.main.binary.resources
    assert spec.tier == "wgmma" and "warning" not in main.main.binary.log, spec.name
    budget = tiers.get("wgmma").backward_stack_budget
    # (causal d128 under "overlap" keeps a word on the stack since dK, dV leave through shared memory)
    # (the persistent kernel, overlap_dq's at 64 rows, keeps a few words of its work tile: BWD_PERSISTENT)
    persistent = wgmma.backward_persistent(spec.kind, spec.head_dim, spec.block_m)
    exact = dim == 128 and variant in ("full", "causal") and (pipeline_name, variant) != ("overlap", "causal")
    exact = exact and not persistent
    assert resources.stack_frame == 0 if exact else resources.stack_frame <= budget, (spec.name, resources)
    assert ("gemm_s_then_dp" in main.main.source) == (pipeline_name == "overlap")


@pytest.mark.parametrize("variant", ["causal", "softcap", "alibi"])
def test_the_scale_is_folded_into_d_i_where_no_tensor_needs_ds(variant, monkeypatch):
    """wgmma.BWD_FOLD_SCALE: dL/d(q.k) from P, dP and D_i times the scale (math.backward's (l)), D_i scaled once a row
    by the producer; the _grads variant, whose tensor gradients sum dS itself, keeps dS and dL/d(q.k) from it."""
    import dataclasses

    folded = rendered(variant, 128, wgmma.BWD_PIPELINE, monkeypatch)
    assert "rule::dqk_p(p, dp[4 * i + e], d_r, scale, x, scale_log2, " in folded
    assert "= rule::d_scaled(d, scale);" in folded and "rule::ds(" not in folded and "rule::dqk(" not in folded
    monkeypatch.setattr(wgmma, "BWD_FOLD_SCALE", False)
    plain = rendered(variant, 128, wgmma.BWD_PIPELINE, monkeypatch)
    assert "dqk_p" not in plain and "d_scaled" not in plain and "rule::ds(p, dp[4 * i + e], d_r)" in plain
    if variant == "alibi":  # the slopes' gradient: the _grads variant sums dS
        monkeypatch.setattr(wgmma, "BWD_FOLD_SCALE", True)
        spec = plan.choose(variant, 128, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec
        grads = codegen.render(
            dataclasses.replace(spec, tensor_grads=True), lowered(fused(**VARIANTS[variant]), backward=True)
        )
        assert "dqk_p" not in grads and "rule::ds(p, dp[4 * i + e], d_r)" in grads and "rule::d_slopes_h(ds," in grads


def test_the_fold_is_part_of_the_backward_key(monkeypatch):
    on = tiers.get("wgmma").backward_key()
    monkeypatch.setattr(wgmma, "BWD_FOLD_SCALE", False)
    assert tiers.get("wgmma").backward_key() == {**on, "fold_scale": False}


def test_d96_computes_dk_and_dv_over_96_columns_not_the_tile(monkeypatch, tmp_path):
    """wgmma.BWD_NARROW_KV: at d96 (on d128's tiles) dV += P^T dO and dK += dqk^T Q are one N = 96 wgmma a k-step (48
    accumulators a thread each, where the tile's 128 columns took 64); d64 and d128 keep their tile's width. Off, the
    setting is part of the backward's key and d96 takes the tile's width again."""
    narrow = rendered("causal", 96, wgmma.BWD_PIPELINE, monkeypatch)
    assert "constexpr int KV_COLS = 96;" in narrow and "Wgmma<KV_COLS>::rs(acc, A[kk]" in narrow
    assert "template <> struct Wgmma<96>" in narrow
    for dim in (64, 128):
        assert f"constexpr int KV_COLS = {dim};" in rendered("causal", dim, wgmma.BWD_PIPELINE, monkeypatch)
    program = fused(causal=True)
    main = builders.build_backward_kernels(program, program.name, 96, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    assert main.main.binary.resources.stack_frame == 0, main.main.binary.resources
    on = tiers.get("wgmma").backward_key()
    monkeypatch.setattr(wgmma, "BWD_NARROW_KV", False)
    assert tiers.get("wgmma").backward_key() == {**on, "narrow_kv": False}
    wide = rendered("causal", 96, wgmma.BWD_PIPELINE, monkeypatch)
    assert "constexpr int KV_COLS = 128;" in wide and "Wgmma<KV_COLS>::rs(acc, A[kk]" in wide
    assert "constexpr int DQ_COLS = 96;" in wide  # (the one N = 96 wgmma left: dQ's, DQ_SINGLE_HEAD_DIMS)


@pytest.mark.parametrize("pipeline_name", ["overlap_dq", "serial"])
def test_at_d96_warpgroup_0_alone_computes_dq(pipeline_name, monkeypatch, tmp_path):
    """wgmma.DQ_SINGLE_HEAD_DIMS: at d96 with 64 rows a step, warpgroup 0 computes dQ_i over all 96 columns and 128
    keys (one float32 part of 96 columns, three of dq_accum's 32-column boxes); both warpgroups still store their keys
    of dqk^T and meet at BAR_DS, and warpgroup 1 goes on to dK's wgmma. d128 and d96 at 80 rows keep two parts. Set
    otherwise, the head dims are part of the backward's key and d96 splits dQ by 64-column blocks again."""
    src = rendered("causal", 96, pipeline_name, monkeypatch)
    for line in ("constexpr int DQ_COLS = 96;", "constexpr int DQ_KEYS = 128;", "constexpr int DQ_REGS = 48;"):
        assert line in src, line
    assert "constexpr int DQ_PARTS = 1;" in src and "template <> struct Wgmma<96>" in src
    assert "dq_k = opaque(make_desc(smem.K, N_BLK_BYTES, 1024));" in src
    single = src.index("if (dq_accum != nullptr && c.wg == 0) {")
    assert src.index("named_bar_sync(BAR_DS, CONSUMER_THREADS);") < single < src.index("gemm_dq(dq,")
    assert "for (int w = 0; w < DQ_PARTS; ++w)" in src and "if (ordered && w == DQ_PARTS - 1)" in src
    for variant, dim in (("causal", 128), ("full", 96)):
        other = rendered(variant, dim, pipeline_name, monkeypatch)
        assert "constexpr int DQ_PARTS = 2;" in other and "c.wg == 0) {" not in other
    program = fused(causal=True)
    main = builders.build_backward_kernels(program, program.name, 96, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    assert main.main.binary.resources.stack_frame == 0 and "warning" not in main.main.binary.log
    key = tiers.get("wgmma").backward_key()
    assert "dq_single" not in key
    monkeypatch.setattr(wgmma, "DQ_SINGLE_HEAD_DIMS", ())
    assert tiers.get("wgmma").backward_key() == {**key, "dq_single": ()}
    split = rendered("causal", 96, pipeline_name, monkeypatch)
    assert "constexpr int DQ_COLS = 64;" in split and "constexpr int DQ_PARTS = 2;" in split


@pytest.mark.parametrize(
    "variant, dim, rows",
    [
        ("full", 128, 80),
        ("causal", 128, 64),
        ("softcap", 128, 64),
        ("alibi_full", 128, 64),
        ("full", 96, 80),
        ("causal", 96, 64),
        ("full", 64, 128),
    ],
)
def test_d96_and_d128_without_a_mask_take_80_rows_a_step(variant, dim, rows, monkeypatch):
    """wgmma.ROWS80_HEAD_DIMS: d96 and d128 without a mask or score function (builders.backward_masked) take 80
    query rows a step (FlashAttention-3's and -4's non-causal d128 tile), dQ_i computed transposed (dQ^T = K^T dqk^T:
    wgmma m64 over the head dim, n80 over the rows) from dqk stored [queries][keys] by a transposing stmatrix, and
    written to the float32 parts [80][32] a value at a time; under a mask, and at other head dims, the tiles are as
    before. Set otherwise, the head dims are part of the backward's key."""
    src = rendered(variant, dim, wgmma.BWD_PIPELINE, monkeypatch)
    assert f"constexpr int BLOCK_M = {rows};" in src
    swap = rows == 80
    assert ("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in src) == swap
    assert ("Wgmma<BLOCK_M>::ss_mnk(dq, desc_add(db, kk * 2048)" in src) == swap
    assert ("p, 1, 1, 1, 0; }" in src) == swap  # ss_mnk: A transposed (MN-major), B not
    assert ("Wgmma<DQ_COLS>::ss_mn(dq," in src) == (not swap)
    assert ("st_shared_f32(at + i * 1024, dq[4 * i + e]);" in src) == swap  # dQ^T written a value at a time
    assert f"constexpr int DQ_ROWS = {64 if rows == 128 else rows};" in src
    on = tiers.get("wgmma").backward_key()
    monkeypatch.setattr(wgmma, "ROWS80_HEAD_DIMS", ())
    assert tiers.get("wgmma").backward_key() == {**on, "rows80": ()}
    off = rendered(variant, dim, wgmma.BWD_PIPELINE, monkeypatch)
    assert f"constexpr int BLOCK_M = {64 if rows == 80 else rows};" in off


def test_80_rows_step_down_where_a_step_holds_more():
    """The tensor gradients' row sums and the block mask's step table do not fit shared memory beside 80 rows' tiles:
    those main kernels (main_variant) take 64 rows, as does a kernel that spills at 80 (lighter); the tier plans 80
    for the dense kernel alone. The shared memory at 80 rows is FlashAttention-3's: 2 stages of Q_i and dO_i, two dqk
    buffers and two float32 dQ parts of 80 rows."""
    import dataclasses

    tier, limit = tiers.get("wgmma"), tiers.SMEM_LIMIT["sm_90a"]
    spec = plan.choose("full", 128, "bf16", "sm_90a", "wgmma", causal=False, kind=Kind.BWD).spec
    assert spec.block_m == 80 and tier.tight(spec)
    assert plan.choose("full", 128, "bf16", "sm_90a", "wgmma", causal=False, kind=Kind.BWD_SPARSE).spec.block_m == 64
    assert tier.main_variant(spec, tensor_grads=True).block_m == 64
    assert tier.main_variant(spec, kind=Kind.BWD_SPARSE).block_m == 64
    assert builders.sparse_spec(spec).block_m == 64
    assert tier.lighter(spec).block_m == 64
    assert tier.smem_bytes(spec) == wgmma.backward_smem_bytes(128, 80, 2, tensor_grads=False) <= limit
    assert wgmma.backward_smem_bytes(128, 80, 2, tensor_grads=True) > limit
    with pytest.raises(SpecError, match="block_m=80"):
        tiers.check(dataclasses.replace(spec, head_dim=64, input_dim=None))
    with pytest.raises(SpecError, match="block_m=80"):
        tiers.check(dataclasses.replace(spec, kind=Kind.BWD_SPARSE))
    with pytest.raises(SpecError, match="row sums"):
        tier.replace(spec, tensor_grads=True)
    assert (wgmma.dq_rows(80), wgmma.dq_rows(64), wgmma.dq_rows(128)) == (80, 64, 64)
    assert wgmma.dq_swap(80) and not wgmma.dq_swap(64) and not wgmma.dq_swap(128)


def test_the_80_row_kernel_compiles_without_spilling_and_score_functions_keep_64(tmp_path):
    """d96 and d128 without a mask at 80 rows: no spill (lse_i and D_i as two 8-byte loads a row pair: the 16-byte
    ones spilled 16 bytes). A score function's backward takes a masked program's 64 rows (softcap spilled at 80 and ran
    slower)."""
    for dim, opts, rows in (
        (128, dict(), 80),
        (96, dict(), 80),
        (128, dict(softcap=30.0), 64),
        (128, dict(alibi=True), 64),
    ):
        program = fused(**opts)
        planned = plan.choose(
            "x", dim, "bf16", "sm_90a", "wgmma", causal=builders.backward_masked(program), kind=Kind.BWD
        )
        assert planned.spec.block_m == rows  # planned so, not stepped down
        main = builders.build_backward_kernels(
            program, program.name, dim, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path
        )
        spec, resources = main.main.spec, main.main.binary.resources
        assert spec.block_m == rows and "warning" not in main.main.binary.log, spec.name
        # (a persistent kernel at 64 rows keeps a few words of its work tile on the stack, within the budget: its
        # roles name their tile after setmaxnreg, wgmma.BWD_PERSISTENT)
        persistent = wgmma.backward_persistent(spec.kind, spec.head_dim, spec.block_m)
        budget = tiers.get("wgmma").backward_stack_budget if persistent else 0
        assert resources.stack_frame <= budget, (spec.name, resources)


@pytest.mark.parametrize("pipeline_name", ["overlap_dq", "serial"])
def test_the_dq_part_changes_hands_at_named_barriers_at_d64(pipeline_name, monkeypatch):
    """wgmma.DQ_BARRIER_HEAD_DIMS: at d64 a consumer warpgroup and the producer's warp 1 hand a dQ part over at named
    barriers (the warpgroup arrives at 8 + w once written and waits at 10 + w before writing; warp 1 the reverse; each
    warpgroup's warp 0 arrives once for step 0); d128 takes the dq_full / dq_empty mbarriers. Set otherwise, the head
    dims are part of the backward's key."""
    d128 = rendered("causal", 128, pipeline_name, monkeypatch)
    assert "named_bar_arrive" not in d128 and "mbar_wait(smem.dq_full + 8 * w, step & 1);" in d128
    assert "mbar_arrive(smem.dq_empty + 8 * w);" in d128 and "mbar_arrive(smem.dq_full + 8 * c.wg);" in d128
    key = tiers.get("wgmma").backward_key()
    assert "dq_bars" not in key
    for src in (rendered("causal", 64, pipeline_name, monkeypatch), rendered("full", 64, pipeline_name, monkeypatch)):
        assert "mbar_wait(smem.dq_full" not in src and "mbar_wait(smem.dq_empty" not in src
        assert "mbar_arrive(smem.dq_full" not in src and "mbar_arrive(smem.dq_empty" not in src
        for call in (
            "named_bar_sync(BAR_DQ_FULL + w, DQ_BAR_THREADS);",
            "named_bar_arrive(BAR_DQ_EMPTY + w, DQ_BAR_THREADS);",
            "named_bar_sync(BAR_DQ_EMPTY + c.wg, DQ_BAR_THREADS);",
            "named_bar_arrive(BAR_DQ_FULL + c.wg, DQ_BAR_THREADS);",
            "c.warp_in_wg == 0) named_bar_arrive(BAR_DQ_EMPTY + c.wg, DQ_BAR_THREADS);",
        ):
            assert src.count(call) == 1, call
        assert src.index("named_bar_sync(BAR_DQ_EMPTY + c.wg") < src.index("write_dq(dq, smem, c);")
        assert src.index("write_dq(dq, smem, c);") < src.index("named_bar_arrive(BAR_DQ_FULL + c.wg")
    monkeypatch.setattr(wgmma, "DQ_BARRIER_HEAD_DIMS", (64, 128))
    assert tiers.get("wgmma").backward_key() == {**key, "dq_bars": (64, 128)}
    assert "named_bar_sync(BAR_DQ_FULL + w, DQ_BAR_THREADS);" in rendered("causal", 128, pipeline_name, monkeypatch)


def test_d256_stages_dq_in_the_ring_and_takes_two_stages(monkeypatch):
    """At d256 the wide backward stages dQ_i's float32 parts in the step's own dO_i and Q_i (DQ_RING_HEAD_DIMS): no
    buffer of its own, so the ring is 2 deep and still fits, tensor gradients' row sums included; warp 1 frees a
    stage. d192 keeps its buffer; `DQ_RING_HEAD_DIMS=()` gives d256 its one stage and buffer back, and the cache key
    says so."""
    tier, limit = tiers.get("wgmma"), tiers.SMEM_LIMIT["sm_90a"]
    spec = plan.choose("causal", 256, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec
    assert (spec.block_m, spec.block_n, spec.stages) == (64, 64, 2)
    assert tier.smem_bytes(spec) == wgmma.backward_smem_bytes(256, 64, 2, tensor_grads=False) == 215152
    assert wgmma.backward_smem_bytes(256, 64, 2, tensor_grads=True) <= limit
    src = rendered("causal", 256, wgmma.BWD_PIPELINE, monkeypatch)
    assert "constexpr int OFF_LSE = OFF_DQ;" in src and "smem.init_barriers(dq_accum != nullptr);" in src
    assert "mbar_init(empty + 8 * s, CONSUMER_THREADS + reduced);" in src
    first = src.index("write_dq(dq, c, dO_i, Q_i, 0, 2);")  # dO_i's half while dK's wgmma runs, Q_i's after
    assert first < src.index("wgmma_wait<0>();", first) < src.index("write_dq(dq, c, dO_i, Q_i, 2, 4);")
    assert "if (w == DQ_PARTS - 1) mbar_arrive(smem.empty + 8 * (step % STAGES));" in src
    d192 = rendered("causal", 192, wgmma.BWD_PIPELINE, monkeypatch)
    assert "constexpr int OFF_LSE = OFF_DQ + 64 * TILE_DIM * 4;" in d192 and "OFF_LSE = OFF_DQ;" not in d192
    on = tier.backward_key()
    monkeypatch.setattr(wgmma, "DQ_RING_HEAD_DIMS", ())
    assert tier.backward_key() == {**on, "dq_ring": ()}
    off = plan.choose("causal", 256, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec
    assert off.stages == 1 and tier.smem_bytes(off) == wgmma.backward_smem_bytes(256, 64, 1, tensor_grads=False)
    assert "OFF_LSE = OFF_DQ;" not in rendered("causal", 256, wgmma.BWD_PIPELINE, monkeypatch)


def test_the_wide_backward_writes_dk_dv_in_16_byte_chunks_through_the_stage_the_last_step_left(monkeypatch):
    """With a ring 2 deep (d192, d256), each warpgroup of the wide backward puts its columns of dK_j, dV_j into the
    stage the last step did not use (stmatrix), meets its own 128 threads, and writes 16-byte chunks of rows (the
    keys inside seqlen_k, not the columns past HEAD_DIM); at one stage (d256 without dq_ring) no stage is free, and
    every value is stored alone as before."""
    for dim, second in ((192, "KV_COL1 = 128, KV_N1 = 64;"), (256, "KV_COL1 = 128, KV_N1 = 128;")):
        src = rendered("causal", dim, wgmma.BWD_PIPELINE, monkeypatch)
        assert "KV_COL0 = 0, KV_N0 = 128;" in src and second in src
        assert "constexpr int col = WG == 0 ? KV_COL0 : KV_COL1, cols = WG == 0 ? KV_N0 : KV_N1;" in src
        staged = src.index("const unsigned free_stage = unsigned(kt.steps) % STAGES * TILE_M_BYTES;")
        stm = src.index("stage_dk_dv<cols>(dK, dV, tile_k, tile_v, col, c);", staged)
        bar = src.index("named_bar_sync(BAR_EPILOGUE + WG, 128);", stm)
        copy = src.index("copy_dk_dv<ROW_CHUNKS>(tile_k, tile_v, col / 8, kt.k_lo, kt.seqlen_k,", bar)
        assert copy < src.index("store_grad(", bar)  # the one-stage path after
        # the helpers the narrower kernels share: stmatrix from column col, then chunks of the rows below seqlen_k
        assert "stmatrix_x4(chunk_address<64>(tile_k, st_row, col / 8 + i + lane / 16), rk);" in src[:staged]
        assert "if (k_idx < seqlen_k) {" in src[:staged]
        assert "store_dk_dv<WG>(dK, dV, kt, c, smem," in src
    monkeypatch.setattr(wgmma, "DQ_RING_HEAD_DIMS", ())
    one = rendered("causal", 256, wgmma.BWD_PIPELINE, monkeypatch)
    assert "constexpr int STAGES = 1;" in one and "free_stage" not in one and "BAR_EPILOGUE + WG" not in one
