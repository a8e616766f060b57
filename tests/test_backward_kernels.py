"""The backward's kernels on the CPU: the contract of the new kinds against the rendered signatures and the
launcher's packing, render + compile of every shipped variant (and a traced score with a tensor) for every
backward kind, the transposed key ranges (proof, and a brute-force check of their boundary cases), and the CLI."""

import collections
import dataclasses
import re

import numpy as np
import pytest
import sympy as sp

import fagen
from fagen import builders, pipeline
from fagen.backend import build, codegen, contract, plan, tiers
from fagen.backend.contract import Kind
from fagen.backend.spec import SpecError
from fagen.backend.tiers import wgmma
from fagen.ir import exprs
from fagen.math import bounds
from fagen.passes import fuse
from fagen.runtime import backward
from fagen.runtime.arrays import Array
from fagen.runtime.calls import tensor_values
from fagen.runtime.launch import ArgPack

from .lowered import lowered

BACKWARD = contract.BACKWARD_KINDS
VARIANTS = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal_br": dict(causal="bottom_right"),
    "window": dict(causal=True, window=20),
    "window2": dict(window=(5, 3)),
    "alibi": dict(causal=True, alibi=True),
    "softcap": dict(softcap=30.0),
    "prefix": dict(causal=True, prefix=7),
    "bias_h": dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h]),
    "bias_b": dict(score_mod=lambda s, b, h, q, k, bias: s * bias[b]),
    # a tensor under tanh: dL/d(q.k) and the partial read the bias's fixed value too (codegen.fixed_functions)
    "tanh_bias": dict(score_mod=lambda s, b, h, q, k, bias: 20 * fagen.tanh((s + bias[h]) / 20)),
}


def fused(dtype="bf16", **kw):
    return pipeline.lower(pipeline.load_program(**kw), dtype)[-1].program


def _signature(source: str, name: str) -> list[tuple[str, str]]:
    body = source[source.index(f"{name}(\n") + len(name) + 1 :]
    body = body[: body.index(")\n{")]
    return [re.fullmatch(r"\s*(.+?)\s*\b(\w+)\s*", part, re.S).groups() for part in body.split(",")]


def _fake(shape, strides):
    return Array("torch", None, 0, shape, strides, "bf16", "bfloat16", 0)


def _arrays():
    q4, k4, l3 = (
        _fake((2, 4, 33, 64), (8448, 2112, 64, 1)),
        _fake((2, 2, 17, 64), (2176, 1088, 64, 1)),
        _fake((2, 4, 33), (132, 33, 1)),
    )
    rowstat = Array("torch", None, 0, (2, 2, 4, 33), (264, 132, 33, 1), "f32", "float32", 0)
    return dict(q=q4, k=k4, v=k4, o=q4, dout=q4, dq=q4, dk=k4, dv=k4, dq_accum=q4, lse=l3, delta=l3, rowstat=rowstat)


@pytest.mark.parametrize("kind", BACKWARD)
@pytest.mark.parametrize("variant", ["causal", "alibi", "bias_b"])
def test_signature_is_the_contract_and_the_launcher_packs_it(kind, variant):
    program = fused(**VARIANTS[variant])
    low = lowered(program, backward=True)
    tensors = contract.tensor_args(fuse.tensor_reads(program))
    spec = plan.choose(program.name, 64, "bf16", "sm_90a", "simt", causal=True, kind=kind).spec
    src = codegen.render(spec, low)
    declared = contract.params(kind, tensors)
    assert _signature(src, spec.name) == [(p.ctype, p.name) for p in declared]
    values = backward.backward_pack_values(declared, _arrays(), 2, 33, 17, None)
    tensor_static = tensor_values(tensors, {t.name: _fake((4,), (1,)) for t in tensors})
    tensor_static = tensor_static if kind in contract.READS_TENSORS else {}
    values.update(tensor_static)
    ArgPack(declared).set(values)  # raises on a missing or unknown argument
    dynamic = set(backward.BACKWARD_DYNAMIC) | {t.c_name for t in tensors}
    static = {**backward.backward_values(declared, _arrays(), 2, 33, 17, None), **tensor_static}
    assert {p.name for p in declared} == set(static) | (dynamic & {p.name for p in declared})
    assert values.get("dout_stride_m", 64) == 64 and values.get("lse_stride_h", 33) == 33
    with pytest.raises(TypeError, match="missing"):
        ArgPack(declared).set({k: v for k, v in values.items() if k != "seqlen_q"})


def test_kinds_are_appended_and_only_the_main_and_dq_kernels_read_tensors():
    assert [k.name for k in Kind][:3] == ["FORWARD", "DECODE_SPLIT", "BWD_PREPROCESS"]
    assert contract.READS_TENSORS == {
        Kind.FORWARD,
        Kind.DECODE_SPLIT,
        Kind.BWD,
        Kind.BWD_DQ,
        Kind.BLOCK_MASK,  # run-time block sparsity: the mask's tensors, and the block-sparse forward's
        Kind.FORWARD_SPARSE,
        Kind.BWD_SPARSE,  # ... and its backward's
    }
    assert contract.params(Kind.BWD_CONVERT, ("slopes",)) == contract.BWD_CONVERT
    assert [p.name for p in contract.params(Kind.BWD, ("slopes",))[-3:]] == [
        "tensor_slopes",
        "tensor_slopes_stride_0",
        "tensor_slopes_size_0",
    ]
    gathered = contract.TensorArg("bias", "bf16", 2, grad=True)
    assert [p.name for p in contract.params(Kind.BWD, (gathered,))[-6:]] == [
        "tensor_bias",
        "tensor_bias_stride_0",
        "tensor_bias_stride_1",
        "tensor_bias_size_0",
        "tensor_bias_size_1",
        "grad_bias",
    ]
    assert contract.params(Kind.BWD_DQ, (gathered,))[-1].name == "tensor_bias_size_1"  # dQ scatters nothing


def test_varlen_values_zero_the_batch_strides_but_rowstats():
    values = backward.backward_values(contract.BWD, _arrays(), 2, 33, 17, (_fake((3,), (1,)), _fake((3,), (1,))))
    assert all(v == 0 for n, v in values.items() if n.endswith("_stride_b") and n != "rowstat_stride_b")
    # rowstat is indexed by a sequence's own rows [1 + T, B, H, max_q]: its batch stride stays
    assert values["rowstat_stride_b"] == 132 and values["rowstat_stride_s"] == 264


def test_a_varlen_call_s_row_passes_take_every_packed_row_as_one_sequence():
    """The preprocess and the convert of packed documents (7 of them, the longest 3902 of 16384 rows): one sequence
    of every row, no offsets; the main kernels keep the documents. Before: (7, 3902, 3902, offsets) for every role,
    the row passes a grid of 7 x 3902 rows for 16384 (blocks past a document's end leave at once), the rows outside
    every document left unconverted, so dQ was zero-filled per call."""
    sizes, totals, offsets = (7, 16, 16, 3902, 3902), (16384, 16384), (_fake((8,), (1,)), _fake((8,), (1,)))
    for role in backward.ROW_PASSES:
        assert backward.row_pass(role, sizes, totals, offsets) == (1, 16384, 16384, None)
        assert backward.row_pass(role, (8, 16, 16, 2048, 2048), totals, None) == (8, 2048, 2048, None)  # dense
    for role in ("main", "main_grads", "main_sparse", "dq"):
        assert backward.row_pass(role, sizes, totals, offsets) == (7, 3902, 3902, offsets)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_renders_and_compiles_without_spills(variant, tmp_path):
    program = fused(**VARIANTS[variant])
    low = lowered(program, backward=True)
    for kind in BACKWARD:
        spec = plan.choose(program.name, 64, "bf16", "sm_90a", "simt", causal=True, kind=kind).spec
        src = codegen.render(spec, low)
        assert not re.search(r"^\s*#include", src, re.M)
        binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
        assert "warning" not in binary.log and not binary.resources.spills, (spec.name, binary.log)
        if kind in (Kind.BWD, Kind.BWD_DQ):
            assert "rule::p_from_lse(" in src and "rule::ds(" in src and "rule::dqk(" in src
    if "bias" in variant or variant == "alibi":  # the main kernel's _grads variant sums the tensor's gradient
        spec = plan.choose(program.name, 64, "bf16", "sm_90a", "simt", kind=Kind.BWD).spec
        grads = dataclasses.replace(spec, tensor_grads=True)
        assert grads.name == spec.name.replace(program.name, program.name + "_grads")
        main, main_grads = codegen.render(spec, low), codegen.render(grads, low)
        assert not re.search(r"rule::d_(bias|slopes)_[hb]\(", main) and "rowstat" not in main.split(")\n{")[1]
        assert re.search(r"rule::d_(bias|slopes)_[hb]\(", main_grads) and "atomicAdd(rowstat_h" in main_grads
        binary = build.compile_cubin(main_grads, grads, cache_dir=tmp_path)
        assert "warning" not in binary.log and not binary.resources.spills, (grads.name, binary.log)


@pytest.mark.parametrize("tier", ["wgmma", "mma", "simt"])
def test_a_tensor_under_the_score_function_is_read_once_a_head(tier, tmp_path):
    """20 tanh((s + bias[h]) / 20): the score, dL/d(q.k) and the bias's partial read bias[h] / 20 as one fixed value,
    which the main kernel computes once a head (where its step loop reaches the head's first tile), not an element."""
    program = fused(**VARIANTS["tanh_bias"])
    low = lowered(program, backward=True)
    main = plan.choose(program.name, 64, "bf16", "sm_90a", tier, causal=True, kind=Kind.BWD).spec
    for spec in (main, dataclasses.replace(main, tensor_grads=True)):
        src = codegen.render(spec, low)
        names = ("score", "dqk", "d_bias_h") if spec.tensor_grads else ("score", "dqk")
        for name in names:
            body = re.search(rf"float {name}\([^)]*\) \{{\n    return ([^;]*);", src).group(1)
            assert "fixed_0" in body and "fagen_read" not in body, (name, body)
        assert "return (1.0f/20.0f)*fagen_read(tensor_bias, fagen_at(h, " in src  # fixed_0: bias[h] / 20
        decl = r"\bfixed_0 = rule::fixed_0\(scale_log2, b, h, seqlen_q, seqlen_k, tensor_bias"
        assert len(re.findall(decl, src)) == 1
        binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
        assert "warning" not in binary.log, (spec.name, binary.log)


@pytest.mark.parametrize("dim", [32, 64, 96, 128, 160, 256])
@pytest.mark.parametrize("dtype, arch", [("f32", "sm_80"), ("f16", "sm_90a"), ("bf16", "sm_86")])
def test_every_head_dim_and_dtype_fits_and_does_not_spill(dim, dtype, arch, tmp_path):
    program = fused(dtype, causal=True, alibi=True)
    low = lowered(program, backward=True)
    for kind in (Kind.BWD, Kind.BWD_DQ):
        spec = plan.choose(program.name, dim, dtype, arch, "simt", causal=True, kind=kind).spec
        assert tiers.get("simt").smem_bytes(spec) <= tiers.SMEM_LIMIT[arch]
        binary = build.compile_cubin(codegen.render(spec, low), spec, cache_dir=tmp_path)
        assert "warning" not in binary.log and not binary.resources.spills, (spec.name, binary.resources)


def test_the_backward_plan_is_built_lazily_and_names_its_gradients(tmp_path):
    k = pipeline.compile(64, causal=True, alibi=True, dtype="f16", arch="sm_90a", cache_dir=tmp_path)
    assert k.has_backward and k._backward_plan is None  # nothing built for a forward-only user
    bp = k.backward_plan
    assert bp.gradients == (("slopes", "h"),)
    assert [launch.spec.kind for launch in (bp.preprocess, bp.main, bp.convert, bp.dq)] == list(BACKWARD)
    assert any("(transposed)" in p for p in bp.proofs)
    assert bp.main.grid(2, 8, 2, 100, 70) == (-(-70 // bp.main.spec.block_n), 2, 2)
    assert bp.dq.grid(2, 8, 2, 100, 70) == (-(-100 // bp.dq.spec.block_m), 8, 2)
    decode = pipeline.compile(64, causal=True, dtype="f16", arch="sm_90a", decode=True, cache_dir=tmp_path)
    assert not decode.has_backward


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_mma_main_kernel_renders_and_compiles_within_its_spill_budget(variant, tmp_path):
    program = fused(**VARIANTS[variant])
    low = lowered(program, backward=True)
    for dim in (64, 128):
        spec = plan.choose(program.name, dim, "bf16", "sm_90a", "mma", causal=True, kind=Kind.BWD).spec
        src = codegen.render(spec, low)
        assert "mma.sync.aligned.m16n8k16" in src and "rule::dqk(" in src and "ldmatrix" in src
        _assert_main_kernel_fits(program, dim, "bf16", "sm_90a", tmp_path)


def _assert_main_kernel_fits(program, dim, dtype, arch, cache_dir):
    """The main kernel the pipeline builds spills at most the tier's budget (the rule's large tiles step down past
    it), and the lightest tiles, 32 query rows a step, do not spill at all."""
    mma = tiers.get("mma")
    main = builders.build_backward_kernels(program, program.name, dim, dtype, arch, "mma", cache_dir=cache_dir).main
    assert main.spec.tier == "mma" and mma.validate(main.spec) is None
    assert main.binary.resources.stack_frame <= mma.backward_stack_budget, (main.spec.name, main.binary.resources)
    assert "warning" not in main.binary.log
    lightest = mma.replace(main.spec, block_m=32)
    binary = build.compile_cubin(
        codegen.render(lightest, lowered(program, backward=True)), lightest, cache_dir=cache_dir
    )
    assert "warning" not in binary.log and not binary.resources.spills, (lightest.name, binary.resources)


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype, arch", [("f16", "sm_80"), ("bf16", "sm_86"), ("f16", "sm_90a")])
def test_the_mma_main_kernel_fits_every_arch_within_its_spill_budget(dim, dtype, arch, tmp_path):
    program = fused(dtype, causal=True, alibi=True, softcap=30.0)
    low = lowered(program, backward=True)
    spec = plan.choose(program.name, dim, dtype, arch, "mma", causal=True, kind=Kind.BWD).spec
    mma = tiers.get("mma")
    assert mma.validate(spec) is None and mma.smem_bytes(spec) <= tiers.SMEM_LIMIT[arch]
    assert _signature(codegen.render(spec, low), spec.name) == _signature(
        codegen.render(
            plan.choose(program.name, dim, dtype, arch, "simt", causal=True, kind=Kind.BWD).spec,
            low,
        ),
        plan.choose(program.name, dim, dtype, arch, "simt", causal=True, kind=Kind.BWD).spec.name,
    )  # the contract's BWD parameters: the runtime packs both the same way
    _assert_main_kernel_fits(program, dim, dtype, arch, tmp_path)


def test_the_backward_main_kernel_follows_the_forward_tier_family(monkeypatch):
    K = Kind
    assert builders.backward_tier(K.BWD, 64, "bf16", "sm_90a", "wgmma") == "wgmma"
    assert builders.backward_tier(K.BWD, 128, "f16", "sm_90a", "wgmma") == "wgmma"
    assert builders.backward_tier(K.BWD, 128, "f16", "sm_80", "mma") == "mma"
    assert builders.backward_tier(K.BWD, 64, "bf16", "sm_90a", "simt") == "simt"
    assert builders.backward_tier(K.BWD, 96, "bf16", "sm_90a", "wgmma") == "wgmma"  # on d128's tiles
    assert builders.backward_tier(K.BWD, 192, "bf16", "sm_90a", "wgmma") == "wgmma"  # dK, dV split by columns
    assert builders.backward_tier(K.BWD, 256, "bf16", "sm_90a", "wgmma") == "wgmma"
    monkeypatch.setattr(wgmma, "BWD_WIDE", False)  # the A/B switch: d192, d256 take the fallback family's (simt)
    assert builders.backward_tier(K.BWD, 192, "bf16", "sm_90a", "wgmma") == "simt"
    assert builders.backward_tier(K.BWD, 128, "bf16", "sm_90a", "wgmma") == "wgmma"
    assert tiers.get("wgmma").backward_key()["wide"] is False  # (the backward's cache key holds it)
    monkeypatch.undo()
    assert "wide" not in tiers.get("wgmma").backward_key()
    assert builders.backward_tier(K.BWD, 96, "bf16", "sm_90a", "mma") == "simt"  # mma: 64, 128 only
    assert builders.backward_tier(K.BWD, 64, "f32", "sm_80", "simt") == "simt"
    for kind in (K.BWD_PREPROCESS, K.BWD_CONVERT, K.BWD_DQ):
        assert builders.backward_tier(kind, 64, "bf16", "sm_90a", "wgmma") == "simt"
    assert "head dims" in tiers.get("mma").supports(K.BWD, 96, "bf16", "sm_90a")
    assert "16-bit" in tiers.get("mma").supports(K.BWD, 64, "f32", "sm_90a")


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("variant", ["full", "causal", "causal_br", "window", "softcap", "prefix"])
def test_the_wgmma_main_kernel_compiles_without_spilling_past_its_budget(variant, dim, tmp_path):
    """sm_90a: the plain variants' main kernel stays on wgmma (a producer and two consumer warpgroups of 64 keys),
    with no spill at d128 and within the tier's budget at d64."""
    program = fused("bf16", **VARIANTS[variant])
    low = lowered(program, backward=True)
    main = builders.build_backward_kernels(program, program.name, dim, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    spec = main.main.spec
    assert spec.tier == "wgmma" and (spec.block_n, spec.num_warps) == (128, 12), spec.name
    # d128 without a score function: no spill; else (d64 at 128 rows a step, softcap's derivative beside the step
    # order's overlapped dQ) a few words at most, within the tier's budget
    stack = main.main.binary.resources.stack_frame
    # (and the persistent kernel, at 64 rows, a few words of its work tile: wgmma.BWD_PERSISTENT)
    persistent = wgmma.backward_persistent(spec.kind, spec.head_dim, spec.block_m)
    plain = dim == 128 and variant != "softcap" and not persistent
    assert stack == 0 if plain else stack <= tiers.get("wgmma").backward_stack_budget, (spec.name, stack)
    assert "warning" not in main.main.binary.log and "powf(" not in main.main.source  # softcap: 1 - t*t
    assert main.preprocess.spec.tier == main.convert.spec.tier == "simt"
    # d64 takes 128 query rows a step, and 64 only where those spill; d128 takes 80 without a mask or score, else 64
    if dim == 128:
        assert spec.block_m == (80 if variant == "full" else 64), spec.name
    elif spec.block_m != 128:  # d64 stepped down: 128 rows spill
        wide = tiers.get("wgmma").replace(spec, block_m=128)
        assert build.compile_cubin(codegen.render(wide, low), wide, cache_dir=tmp_path).resources.stack_frame > 0


@pytest.mark.parametrize(
    "dim, dtype, rows, vector",
    [
        (64, "bf16", 32, True),
        (128, "f16", 16, True),
        (256, "bf16", 8, True),
        (64, "f32", 16, True),
        (96, "bf16", 16, True),  # 12 chunks on 16 lanes
        (96, "f32", 8, True),  # 24 chunks on 32 lanes
        (40, "f32", 16, True),  # 10 chunks on 16 lanes
        (256, "f32", 8, False),  # 64 chunks: more than a warp, a row a warp
    ],
)
def test_preprocess_and_convert_read_rows_in_16_byte_chunks(dim, dtype, rows, vector, tmp_path):
    """The memory-bound preprocess and convert: a 16-byte chunk a thread, a row's chunks on the power of two of
    lanes at or above them (up to 32: a row's lanes sum in one warp), a row a warp otherwise; the chunk path checks
    unit strides and 16-byte alignment at run time and falls back to the row a warp. Both compile with no spill."""
    low = lowered(fused(dtype, causal=True), backward=True)
    for kind in (Kind.BWD_PREPROCESS, Kind.BWD_CONVERT):
        spec = plan.choose("causal", dim, dtype, "sm_90a", "simt", causal=True, kind=kind).spec
        assert (spec.block_m, spec.num_warps) == (rows, 8), spec.name
        src = codegen.render(spec, low)
        assert f"constexpr bool VECTOR = {'true' if vector else 'false'};" in src
        assert "aligned16(" in src and "for (int r = warp; r < BLOCK_M; r += NUM_WARPS)" in src
        resources = build.compile_cubin(src, spec, cache_dir=tmp_path).resources
        assert not resources.spills and resources.stack_frame == 0, (spec.name, resources)


def test_a_wgmma_main_kernel_that_spills_goes_to_the_mma_tier(tmp_path, monkeypatch):
    """The wgmma backward has one configuration: past its spill budget the pipeline builds the mma tier's."""
    wg = tiers.get("wgmma")
    monkeypatch.setattr(type(wg), "backward_stack_budget", -1)  # every kernel is "over budget"
    program = fused("bf16", causal=True)
    main = builders.build_backward_kernels(program, program.name, 128, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    assert main.main.spec.tier == "mma", main.main.spec.name
    lighter = plan.lighter(plan.choose("causal", 128, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec)
    assert lighter.tier == "mma" and tiers.get("mma").validate(lighter) is None


def test_the_wgmma_main_kernel_configurations():
    wg = tiers.get("wgmma")
    spec = plan.choose("full", 128, "bf16", "sm_90a", "wgmma", kind=Kind.BWD).spec
    assert wg.validate(spec) is None and wg.smem_bytes(spec) <= tiers.SMEM_LIMIT["sm_90a"]
    with pytest.raises(SpecError, match="two consumer warpgroups"):
        wg.replace(spec, block_m=32)
    with pytest.raises(SpecError, match="stages"):
        wg.replace(spec, stages=1)
    with pytest.raises(SpecError, match="head dim 64 only"):  # 128 rows at d128: no registers for it
        wg.replace(spec, block_m=128)
    assert wg.lighter(wg.replace(spec, head_dim=64, block_m=128)).block_m == 64  # d64: 128 rows, then 64
    assert wg.supports(Kind.BWD, 96, "bf16", "sm_90a") is None  # on d128's tiles
    assert "head dims" in wg.supports(Kind.BWD, 160, "bf16", "sm_90a")
    assert "sm_90a" in wg.supports(Kind.BWD, 64, "bf16", "sm_80")
    # Q_i, dO_i, K_j and V_j by TMA, dQ added into dq_accum by TMA: their tensor maps by value; inputs TMA cannot
    # describe go to the mma tier's backward
    # and deterministic mode's counters, one per query tile, that order the additions into dq_accum
    assert [p.name for p in wg.extra_params(spec)] == [
        *("q_map", "k_map", "v_map", "dout_map", "dq_accum_map", "dq_semaphore", "dq_sem_tiles")
    ]


@pytest.mark.parametrize("dim", [192, 256])
@pytest.mark.parametrize("variant", ["full", "causal", "window2", "softcap", "alibi", "bias_h"])
def test_the_wide_wgmma_main_kernel_splits_dk_dv_by_columns(variant, dim, tmp_path):
    """d192 and d256: both consumer warpgroups take one 64-key tile; S^T, dP^T are m64n32 (half the step's 64 queries
    each), dV, dK wgmma from shared memory (A K-major P^T, dS^T; B MN-major dO_i, Q_i) and dQ (both MN-major) over
    each warpgroup's columns (d256: 128 and 128; d192: dK, dV 128 and 64, dQ 64 and 128). The ring is 2 deep at both
    (d256: dQ_i's float32 parts staged in the step's dO_i and Q_i, DQ_RING_HEAD_DIMS). The kernel and its _grads
    variant compile with no spill, no serialized wgmma (ptxas C7519) and fit shared memory."""
    program = fused("bf16", **VARIANTS[variant])
    low = lowered(program, backward=True)
    wg = tiers.get("wgmma")
    main = builders.build_backward_kernels(program, program.name, dim, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    spec = main.main.spec
    assert spec.tier == "wgmma" and (spec.block_m, spec.block_n, spec.num_warps) == (64, 64, 12), spec.name
    assert spec.stages == 2 and wg.smem_bytes(spec) <= tiers.SMEM_LIMIT["sm_90a"]
    for kernel in (main.main, main.main_grads):
        if kernel is None:
            continue
        resources = kernel.binary.resources
        assert not resources.spills and resources.stack_frame == 0, (kernel.spec.name, resources)
        # the launch's dynamic shared memory and the kernel's static (the _grads variant's row sums) fit together
        assert wg.smem_bytes(kernel.spec) + resources.static_smem <= 227 * 1024, (kernel.spec.name, resources)
        assert "C7519" not in kernel.binary.log and "warning" not in kernel.binary.log, kernel.binary.log
    ptx = build.compile_ptx(codegen.render(spec, low), spec)
    pattern = r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+, p, 1, 1, "
    shapes = re.findall(pattern + r"(\d), (\d);", ptx)  # (N, A transposed, B transposed)
    kinds = collections.Counter(shapes)
    # S^T and dP^T: HEAD_DIM / 16 k-steps each, in each warpgroup's copy of the step loop
    assert kinds[("32", "0", "0")] == 2 * 2 * dim // 16, kinds
    kv, dq = ({"128": 4 * 2, "64": 4 * 2}, {"128": 4, "64": 4}) if dim == 192 else ({"128": 4 * 2 * 2}, {"128": 4 * 2})
    assert {n: c for (n, a, b), c in kinds.items() if (a, b) == ("0", "1")} == kv, kinds  # dV, dK: 4 k-steps each
    assert {n: c for (n, a, b), c in kinds.items() if (a, b) == ("1", "1")} == dq, kinds  # dQ
    assert "stmatrix" in ptx and "wgmma.wait_group.sync.aligned 1;" in ptx
    # Each consumer warpgroup runs its own copy of the step loop: the two meet on an mbarrier, as a named barrier there
    # would be reached at two different instructions (synccheck: "Divergent thread(s) in block"). The bar.sync left
    # are the block's, before the roles split, and one in each warpgroup's epilogue: its own barrier (1 + WG) of its
    # 128 threads, between writing its columns of dK_j, dV_j into the stage the last step did not use and reading
    # them back as 16-byte chunks of rows.
    block_barriers = r"\bbar(?:rier)?(?:\.cta)?\.(?:sync|arrive|red)\b[^;]*;"
    for kernel in (main.main, main.main_grads):
        if kernel is not None:
            text = ptx if kernel is main.main else build.compile_ptx(kernel.source, kernel.spec)
            found = re.findall(block_barriers, text)
            assert found[0] == "bar.sync \t0;" and len(found) == 3, (kernel.spec.name, found)
            assert all(re.fullmatch(r"bar\.sync %r\d+, %r\d+;", b) for b in found[1:]), (kernel.spec.name, found)
            assert "named_bar_sync(BAR_EPILOGUE + WG, 128);" in kernel.source
            assert "unsigned(kt.steps) % STAGES * TILE_M_BYTES" in kernel.source


def test_a_wide_wgmma_main_kernel_that_spills_goes_to_the_simt_tier(tmp_path, monkeypatch):
    """d192 and d256 have one wgmma configuration: past the spill budget the main kernel steps down to the first tier
    of the fallback family that takes the head dim (the mma tier's backward takes 64 and 128 only: simt)."""
    monkeypatch.setattr(type(tiers.get("wgmma")), "backward_stack_budget", -1)  # every kernel is "over budget"
    program = fused("bf16", causal=True)
    main = builders.build_backward_kernels(program, program.name, 192, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    assert main.main.spec.tier == "simt", main.main.spec.name
    spec = plan.choose("causal", 256, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec
    assert plan.lighter(spec).tier == "simt" and tiers.get("simt").validate(plan.lighter(spec)) is None


def test_the_wgmma_backward_takes_what_tma_can_describe():
    """The wgmma main kernel reads q, k, v and dO by TMA: a dO (or q, k, v) without unit stride along D or with
    strides that are not 16-byte multiples is refused, and Kernel.backward then takes the fallback tier's."""
    from fagen.runtime.arrays import Array

    def array(strides=(2 * 5 * 64, 5 * 64, 64, 1), ptr=256):
        return Array("torch", None, ptr, (2, 2, 5, 64), strides, "bf16", "bfloat16", 0)

    wg = tiers.get("wgmma")
    good = dict(q=array(), k=array(), v=array(), dout=array())
    assert wg.backward_fits(good) is None
    assert "dout" in wg.backward_fits({**good, "dout": array(strides=(2 * 5 * 128, 5 * 128, 128, 2))})
    assert "dout" in wg.backward_fits({**good, "dout": array(ptr=258)})
    assert "q" in wg.backward_fits({**good, "q": array(strides=(2 * 5 * 63, 5 * 63, 63, 1))})
    assert tiers.get("mma").backward_fits({**good, "dout": array(ptr=258)}) is None  # element loads where needed


def test_the_mma_main_kernel_refuses_tiles_it_cannot_split():
    mma = tiers.get("mma")
    good = plan.choose("full", 64, "bf16", "sm_90a", "mma", kind=Kind.BWD).spec
    assert mma.validate(good) is None and good.block_n == 16 * good.num_warps
    with pytest.raises(SpecError, match="16 keys per warp"):
        mma.replace(good, block_n=64)
    with pytest.raises(SpecError, match="row tiles"):
        mma.replace(good, block_m=16)
    assert mma.candidates(Kind.BWD, 64, "bf16", "sm_90a") == []


# --- the transposed key ranges -------------------------------------------------------------------------------
def _eval(e, env):
    return int(e.xreplace(env)) if isinstance(e, sp.Basic) else int(e)


def _query_range_numbers(rng, k_lo, k_hi, M, N):
    """Evaluate the transposed range as the template does: the hull of the terms' [begin, end) in [0, M], and the
    fully visible ranges of the exact terms."""
    env = {bounds.k_lo: k_lo, bounds.k_hi: k_hi, exprs.DIMS["M"]: M, exprs.DIMS["N"]: N}
    if not rng.terms:
        return 0, M, [(0, M)]
    hull, full = [M, 0], []
    for t in rng.terms:
        begin = max([0] + [_eval(e, env) for e in t.begins])
        end = min([M] + [_eval(e, env) for e in t.ends])
        if begin < end:
            hull = [min(hull[0], begin), max(hull[1], end)]
        if t.exact:
            full.append(
                (max([0] + [_eval(e, env) for e in t.full_begins]), min([M] + [_eval(e, env) for e in t.full_ends]))
            )
    return max(hull[0], 0), max(hull[1], 0), full


@pytest.mark.parametrize("variant", ["causal", "causal_br", "window", "window2", "prefix", "full"])
@pytest.mark.parametrize("M, N", [(1, 1), (17, 5), (5, 17), (40, 40)])
def test_transposed_ranges_hold_every_visible_query_and_only_fully_visible_ones(variant, M, N):
    """Brute force over every key tile: each (q, k) the mask keeps lies in [q_begin, q_end), and a query inside a
    fully visible range sees every key of the tile (no mask evaluated there)."""
    keep = fuse.fused_node(fused(**VARIANTS[variant])).attr("keep")
    rng = bounds.query_range(keep)
    assert bounds.prove_query_range(keep, rng) is not None
    qq, kk = np.meshgrid(np.arange(M), np.arange(N), indexing="ij")
    env = {exprs.INDICES["q"]: qq, exprs.INDICES["k"]: kk, exprs.DIMS["M"]: M, exprs.DIMS["N"]: N}
    from fagen.tools import executor

    mask = np.broadcast_to(np.asarray(executor._evaluate(keep, env), dtype=bool), (M, N))
    for tile in (1, 3, 4, 16):
        for k_lo in range(0, N, tile):
            k_hi = min(k_lo + tile, N) - 1
            begin, end, full = _query_range_numbers(rng, k_lo, k_hi, M, N)
            seen = np.nonzero(mask[:, k_lo : k_hi + 1].any(axis=1))[0]
            assert all(begin <= s < end for s in seen), (variant, k_lo, k_hi, begin, end, seen)
            for fb, fe in full:
                for s in range(max(fb, 0), min(fe, M)):
                    assert mask[s, k_lo : k_hi + 1].all(), (variant, k_lo, k_hi, s, fb, fe)


@pytest.mark.parametrize("variant", ["causal", "causal_br", "window", "window2"])
@pytest.mark.parametrize("M, N", [(1, 1), (17, 5), (5, 17), (40, 40)])
def test_an_exact_terms_range_at_one_key_is_exactly_the_queries_that_see_it(variant, M, N):
    """bounds.one_key, brute force: at every key k, the union of the terms' [max(0, begins), min(M, ends)) is the set
    of queries the mask keeps (every term of these masks is exact; a prefix's k < P bounds no query: not exact)."""
    keep = fuse.fused_node(fused(**VARIANTS[variant])).attr("keep")
    rng = bounds.query_range(keep)
    proven = bounds.prove_query_range(keep, rng)
    assert sum("(transposed, one key)" in p for p in proven) == len(rng.terms)
    assert all(t.exact for t in rng.terms)
    prefix = bounds.query_range(fuse.fused_node(fused(**VARIANTS["prefix"])).attr("keep"))
    assert not all(t.exact for t in prefix.terms)
    qq, kk = np.meshgrid(np.arange(M), np.arange(N), indexing="ij")
    env = {exprs.INDICES["q"]: qq, exprs.INDICES["k"]: kk, exprs.DIMS["M"]: M, exprs.DIMS["N"]: N}
    from fagen.tools import executor

    mask = np.broadcast_to(np.asarray(executor._evaluate(keep, env), dtype=bool), (M, N))
    for key in range(N):
        seen = np.zeros(M, dtype=bool)
        one = {exprs.INDICES["k"]: key, exprs.DIMS["M"]: M, exprs.DIMS["N"]: N}
        for begins, ends in map(bounds.one_key, rng.terms):
            begin = max([0] + [_eval(e, one) for e in begins])
            end = min([M] + [_eval(e, one) for e in ends])
            seen[max(begin, 0) : max(end, 0)] = True
        assert (seen == mask[:, key]).all(), (variant, key, np.nonzero(seen), np.nonzero(mask[:, key]))


def test_a_bound_wider_than_its_one_key_range_is_refused():
    """A lower bound whose full range starts one query later than its visible one holds over tiles (check_bound) but
    is not the mask at one key: prove_query_range refuses it."""
    keep = fuse.fused_node(fused(causal=True)).attr("keep")
    (term,) = bounds.query_range(keep).terms
    (b,) = term.bounds
    wide = bounds.KeyRange(
        (bounds.Term((bounds.Bound(b.kind, b.conjunct, b.visible, b.full + 1),), True, term.conjuncts),)
    )
    with pytest.raises(bounds.BoundsError, match="bounds exactly the"):
        bounds.prove_query_range(keep, wide)


@pytest.mark.parametrize(
    "variant, columns",
    [
        (dict(causal=True), True),
        (dict(causal=True, window=20), True),
        (dict(window=(5, 3)), True),
        (dict(causal=True, prefix=7), False),  # k < 7 bounds no query: a term not exact
        (dict(causal=True, alibi=True), False),  # an added term: not mask_first
        (dict(causal=True, softcap=30.0), False),  # a score function: not mask_first
    ],
)
def test_the_wgmma_masked_step_tests_the_terms_columns_only_with_mask_first(variant, columns):
    """Where every term is exact and the masked step selects once (mask_first: no score function, no added term), an
    entry's visibility is its column against the terms' ranges at its key, not rule::keep; elsewhere the mask."""
    program = fused(**variant)
    low = lowered(program, backward=True)
    spec = plan.choose(program.name, 64, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec
    body = codegen.render(spec, low).split(")\n{", 1)[1]
    assert ("key_q_begin[r]" in body and "col_begin[e >> 1][0] <= 8 * i + (e & 1)" in body) == columns
    assert ("rule::keep(" in body) == (not columns)


@pytest.mark.parametrize(
    "variant, first_pass", [(dict(), True), (dict(causal=True), False), (dict(window=(5, 3)), False)]
)
def test_without_a_mask_the_wgmma_boundary_step_scores_first(variant, first_pass):
    """Without a mask (only rows or keys past the sequences' ends are hidden) a boundary step puts -inf into the score
    in a pass of its own, which the element pass reads; under a mask the select goes into the score's FFMA. (The FFMA's
    select in the kernel without a mask made its interior steps slower: d128 at 80 rows a step, H200, 1.2x.)"""
    program = fused(**variant)
    low = lowered(program, backward=True)
    spec = plan.choose(program.name, 128, "bf16", "sm_90a", "wgmma", causal=bool(variant), kind=Kind.BWD).spec
    assert spec.block_m == (80 if first_pass else 64)
    body = codegen.render(spec, low).split(")\n{", 1)[1]
    assert ("qk[4 * i + e] = visible ? rule::score(qk[4 * i + e], scale_log2" in body) == first_pass
    assert ("const float s = x;" in body) == first_pass
    assert ("rule::score(visible ? x : -FAGEN_INFINITY" in body) == (not first_pass)


def test_the_transposed_causal_range_is_the_expected_one():
    keep = fuse.fused_node(fused(causal=True)).attr("keep")
    (term,) = bounds.query_range(keep).terms
    assert term.begins == (bounds.k_lo,) and term.full_begins == (bounds.k_hi,) and not term.ends


def test_a_wrong_transposed_bound_is_refused():
    keep = fuse.fused_node(fused(causal=True)).attr("keep")
    (term,) = bounds.query_range(keep).terms
    (b,) = term.bounds
    wrong = bounds.KeyRange(
        (bounds.Term((bounds.Bound(b.kind, b.conjunct, b.visible + 1, b.full),), True, term.conjuncts),)
    )
    with pytest.raises(bounds.BoundsError):
        bounds.prove_query_range(keep, wrong)


def test_cli_compile_backward_writes_the_backward_kernels(tmp_path, monkeypatch):
    from fagen.tools import cli

    monkeypatch.setenv("FAGEN_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "gen"
    assert cli.main(["compile", "--dim", "64", "--causal", "--arch", "sm_90a", "--backward", "-o", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    for kind in BACKWARD:
        assert any(n.startswith(kind.value + "_causal_") for n in names), (kind, names)
    main = next(p for p in out.iterdir() if p.name.startswith("flash_bwd_causal_"))
    assert "--backward" in main.read_text().splitlines()[1]


def test_lighter_main_kernel_keeps_the_tensor_dtypes(monkeypatch, tmp_path):
    """The main kernel re-rendered at lighter tiles (its stack frame over budget) reads a call-time tensor at the
    dtype the program was compiled for, as the first render does: a bf16 table is not read as float32."""
    program = fused(score_mod=lambda s, b, h, q, k, rel: s + rel[h, q - k + 64])
    mma = tiers.get("mma")
    heavy = builders.build_backward_kernels(
        program, program.name, 64, "bf16", "sm_90a", "mma", tensor_dtypes={"rel": "bf16"}, cache_dir=tmp_path
    ).main
    monkeypatch.setattr(mma, "backward_stack_budget", -1)  # every stack frame over budget: step down to 32 rows
    main = builders.build_backward_kernels(
        program, program.name, 64, "bf16", "sm_90a", "mma", tensor_dtypes={"rel": "bf16"}, cache_dir=tmp_path
    ).main
    assert main.spec.block_m == 32 < heavy.spec.block_m
    for kernel in (heavy, main):
        assert "const fagen_bf16* __restrict__ tensor_rel" in kernel.source
        assert "const float* __restrict__ tensor_rel" not in kernel.source


def test_a_small_power_of_an_int_tensor_read_is_taken_in_float(tmp_path):
    """(pos[b, q] - pos[b, k])**2 of an int32 tensor prints as fagen_pow2(...), which takes a float: the difference
    converts before the product, which in int would overflow past 46340. Forward and backward compile cleanly."""
    program = fused(score_mod=lambda s, b, h, q, k, pos: s - 0.001 * (pos[b, q] - pos[b, k]) ** 2)
    plan_ = builders.build_backward_kernels(
        program, program.name, 64, "bf16", "sm_90a", "wgmma", tensor_dtypes={"pos": "i32"}, cache_dir=tmp_path
    )
    source = plan_.main.source
    assert "const int* __restrict__ tensor_pos" in source and "fagen_pow2(" in source and "powf(" not in source
    assert "float fagen_pow2(float x)" in source
    assert "warning" not in plan_.main.binary.log


def test_every_step_down_of_the_grads_main_kernel_stays_the_grads_variant():
    """The _grads main kernel's step-downs (wgmma's 128 rows, 64 rows, then the mma tier's tiles) keep
    tensor_grads: the runtime runs it where a tensor's gradient is asked for, and a kernel without the sums would
    leave dtensor unwritten."""
    spec = plan.choose("alibi", 64, "bf16", "sm_90a", "wgmma", causal=True, kind=Kind.BWD).spec
    spec = dataclasses.replace(spec, tensor_grads=True)
    tiers_seen = []
    while spec is not None:
        assert spec.tensor_grads and "_grads_" in spec.name, spec
        tiers_seen.append(spec.tier)
        spec = plan.lighter(spec)
    assert tiers_seen[0] == "wgmma" and "mma" in tiers_seen


def test_a_d64_scored_wgmma_main_kernel_compiles_its_step_down_at_once(monkeypatch, tmp_path):
    """At d64 the wgmma backward takes 128 query rows a step, where a score function may spill (the tier marks it
    tight): its 64-row step-down compiles in the same NVRTC round as the four kernels, and is the one kept where
    the 128-row kernel spills past the tier's budget (softcapped ALiBi under a 300-key window spills 16 B under
    NVRTC 13.0, within the 64 B budget; the budget is lowered here to see the step-down taken. Softcapped ALiBi
    alone has had no stack since the masked steps evaluate the mask beside its selects, nor has ALiBi alone, whose
    score reads k - q from the kernel's float copy). The plain
    causal kernel keeps 128 rows and compiles no spare. The _grads variant (ALiBi's slopes) compiles beside it
    with its own spare, in the same round."""
    import threading

    seen, stack = [], {}
    real = build.compile_cubin

    def recorded(source, spec, **kw):
        main = spec.kind is Kind.BWD and not spec.tensor_grads
        seen.append(
            (
                spec.kind if not spec.tensor_grads else "grads",
                spec.block_m,
                threading.current_thread().name.startswith("fagen-nvrtc"),
            )
        )
        binary = real(source, spec, **kw)
        if main:
            stack[spec.block_m] = binary.resources.stack_frame
        return binary

    monkeypatch.setattr(build, "compile_cubin", recorded)
    program = fused("bf16", causal=True, alibi=True, softcap=20.0, window=(300, 0))
    main = builders.build_backward_kernels(program, program.name, 64, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    assert sorted(m for kind, m, _ in seen if kind is Kind.BWD) == [64, 128] and all(t for *_, t in seen)
    assert sorted(m for kind, m, _ in seen if kind == "grads") == [64, 128]
    assert main.main_grads.spec.tensor_grads and main.main_grads.spec.tier == "wgmma"
    assert main.main.spec.tier == "wgmma" and stack[128] > 0 and stack[64] == 0, stack
    assert main.main.spec.block_m == (128 if stack[128] <= tiers.get("wgmma").LARGE_STEP_STACK_BUDGET else 64)
    wgmma, budget = type(tiers.get("wgmma")), tiers.get("wgmma").backward_stack_budget
    monkeypatch.setattr(wgmma, "backward_stack_budget", stack[128] - 1)
    seen.clear()
    again = tmp_path / "again"  # compiled again, not read from the cache
    main = builders.build_backward_kernels(program, program.name, 64, "bf16", "sm_90a", "wgmma", cache_dir=again)
    assert (main.main.spec.tier, main.main.spec.block_m) == ("wgmma", 64) and not main.main.binary.resources.spills
    assert sorted(m for kind, m, _ in seen if kind is Kind.BWD) == [64, 128] and all(t for *_, t in seen)
    monkeypatch.setattr(wgmma, "backward_stack_budget", budget)
    assert len(seen) == 7  # the four kinds, the _grads variant and the two spares, one round
    seen.clear()
    program = fused("bf16", causal=True)
    plain = builders.build_backward_kernels(program, program.name, 64, "bf16", "sm_90a", "wgmma", cache_dir=tmp_path)
    assert plain.main.spec.block_m == 128 and [m for kind, m, _ in seen if kind is Kind.BWD] == [128]


def test_inputs_a_tensor_map_cannot_describe_go_to_a_tier_that_takes_them():
    """Negative strides (a reversed view) and zero strides (expand()) along a dim of more than one entry are refused
    by the wgmma tier, forward and backward, before any tensor map is encoded; the mma tier reads them (its loads
    take any 16-byte multiple, of either sign), the simt tier any strides. Along a dim of one entry the stride is
    never used: the tensor map gets a dense one there (map_strides), so such views stay on the wgmma tier."""
    from fagen.backend.tiers.wgmma import map_strides
    from fagen.runtime.arrays import Array

    def array(shape=(2, 2, 5, 64), strides=(2 * 5 * 64, 5 * 64, 64, 1), ptr=256):
        return Array("cupy", None, ptr, shape, strides, "bf16", "bfloat16", 0)

    wg, mma = tiers.get("wgmma"), tiers.get("mma")
    good = dict(q=array(), k=array(), v=array(), o=array())
    reversed_s = array(strides=(2 * 5 * 64, 5 * 64, -64, 1), ptr=256 + 4 * 64 * 2)
    expanded_h = array(strides=(5 * 64, 0, 64, 1))
    for bad in (reversed_s, expanded_h):
        assert "k has a stride of" in wg.fits({**good, "k": bad})
        assert "dout has a stride of" in wg.backward_fits({**good, "dout": bad})
        assert mma.fits({**good, "k": bad}) is None
    assert "not a positive multiple of 16 bytes" in wg.fits({**good, "q": array(strides=(2 * 5 * 68, 5 * 68, 68, 1))})
    one_head = array(shape=(2, 1, 5, 64), strides=(5 * 64, -7, 64, 1))  # H = 1: its stride is never used
    assert wg.fits({**good, "q": one_head}) is None
    assert map_strides(one_head.shape, one_head.strides, 2) == (128, 5 * 64 * 2, 5 * 64 * 2)
    assert map_strides((1, 4, 5, 64), (0, 5 * 64, 64, 1), 2) == (128, 5 * 64 * 2, 4 * 5 * 64 * 2)
    assert map_strides((2, 2, 5, 64), (2 * 5 * 64, 5 * 64, 64, 1), 2) == (128, 5 * 64 * 2, 2 * 5 * 64 * 2)
