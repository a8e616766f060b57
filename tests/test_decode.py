"""Split-KV decode on the CPU: the merge proofs (and a wrong merge they catch), the split-count heuristics,
both kinds rendered and compiled, and a NumPy model of split + merge against plain attention."""

import re

import numpy as np
import pytest
import sympy as sp

from fagen import pipeline
from fagen.backend import build, codegen, contract, plan, splits
from fagen.backend.contract import Kind
from fagen.ir import exprs
from fagen.math import online_softmax as osm
from fagen.tools import decode_ref

from .lowered import lowered


def rule(tau=osm.LAZY_TAU):
    return osm.make_rule(exprs.SCORE, sp.true, tau)


@pytest.mark.parametrize("tau", [0, osm.LAZY_TAU])
def test_the_merge_is_proven(tau):
    names = [i.name for i in osm.prove_merge(rule(tau))]
    assert names == [
        "(f) merge is the state update",
        "(f) merge commutative",
        "(f) merge associative",
        "(f) empty split",
        "(f) all splits empty",
    ]


def test_a_wrong_merge_is_caught():
    good = osm.make_merge(rule().concrete())
    unscaled = osm.MergeRule(good.m, good.m_use, good.w, good.l_sum, osm.w_a * osm.acc_a + osm.acc_b)
    with pytest.raises(osm.ProofError, match="merge is the state update"):
        osm.prove_merge(rule(), unscaled)
    first_max = osm.MergeRule(osm.m_a, good.m_use, good.w, good.l_sum, good.acc)  # right values, not empty-safe
    with pytest.raises(osm.ProofError, match="empty split"):
        osm.prove_merge(rule(), first_max)
    no_m_use = osm.MergeRule(good.m, osm.m_new, good.w, good.l_sum, good.acc)  # -inf - (-inf)
    with pytest.raises(osm.ProofError, match="all splits empty"):
        osm.prove_merge(rule(), no_m_use)


def test_split_heuristics():
    # FlashAttention's: B x Hkv = 64 tiles on 132 SMs -> the first count within 0.85 of the best efficiency
    assert splits.flash_heuristic(64, 132, 128) == 2
    assert splits.flash_heuristic(64, 132 * 4, 256) == 7
    assert splits.flash_heuristic(200, 132, 1000) == 1  # the tiles fill the GPU already
    assert splits.flash_heuristic(1, 132, 3) == 3  # at most the key blocks
    assert splits.flex_heuristic(64, 132, 1000) == 4
    assert splits.flex_heuristic(1, 132, 1000) == 128
    assert splits.choose("flash", 64, 132, 4, 8192, 32) == 7
    with pytest.raises(ValueError, match="num_splits"):
        splits.choose("nope", 1, 1, 1, 1, 1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("M, H, Hkv, S", [(1, 8, 2, 1), (1, 8, 2, 5), (3, 4, 4, 3), (5, 6, 2, 64)])
def test_split_and_merge_match_attention(causal, M, H, Hkv, S):
    rng = np.random.default_rng(0)
    B, N, D = 3, 40, 16
    q = rng.standard_normal((B, M, H, D))
    k, v = rng.standard_normal((2, B, N, Hkv, D))
    seqlens = np.array([1, 2, 40])[:B]  # shorter than q_len x splits: empty splits and, causal, empty rows
    o_ref, lse_ref = decode_ref.attention(q, k, v, seqlens, causal=causal, scale=0.25)
    o, lse = decode_ref.split_merge(q, k, v, seqlens, S, causal=causal, scale=0.25, rule=rule())
    assert np.isfinite(o).all() and not np.isnan(lse).any()
    np.testing.assert_allclose(o, o_ref, atol=1e-12)
    assert (np.isneginf(lse) == np.isneginf(lse_ref)).all()
    fin = np.isfinite(lse_ref)
    np.testing.assert_allclose(lse[fin], lse_ref[fin], atol=1e-12)
    if causal and M > 1:
        assert np.isneginf(lse_ref).any()  # a sequence shorter than q_len leaves rows with no key


@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("tier", ["mma", "simt"])
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("dim", [64, 96, 128, 256])
def test_the_split_kernel_renders_and_compiles(dtype, dim, tier, arch, tmp_path):
    if tier == "mma" and dtype == "f32":
        pytest.skip("the mma tier takes f16/bf16 (f32 decodes on simt: test_decode_tiers)")
    low = lowered(dict(causal="bottom_right"), dtype, decode=True)
    program = low.program
    spec = plan.choose(program.name, dim, dtype, arch, tier, causal=True, kind=Kind.DECODE_SPLIT).spec
    assert spec.tier == tier and spec.name.startswith(Kind.DECODE_SPLIT.value)
    src = codegen.render(spec, low)
    assert "rule::merge_w(" in src and "rule::merge_acc(" in src and "namespace rule {" in src
    assert "--decode" in src.splitlines()[1]
    # the merge of the splits: counted in split_count, by the last block of a row tile, into o and lse
    assert "atomicAdd(count, 1) == num_splits - 1" in src and "o_row[d * o_stride_d]" in src
    binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert "warning" not in binary.log and not binary.resources.spills, (spec.name, binary.log)
    names = [p.name for p in contract.params(Kind.DECODE_SPLIT, ())]
    assert {"split_count", "o", "lse", "o_stride_d", "lse_stride_m"} <= set(names)


@pytest.mark.parametrize("tier", ["mma", "simt"])
def test_a_rows_fixed_values_are_computed_once_before_the_key_loop(tier, tmp_path):
    """ALiBi's factor (kLog2e/scale_log2)*slopes[h] is a fixed value of the row's own head (a tile holds rows of
    several heads): each row computes it once, beside its token and head, and the key loop reads it from there."""
    low = lowered(dict(causal="bottom_right", alibi=True), "bf16", decode=True)
    program = low.program
    spec = plan.choose(program.name, 128, "bf16", "sm_90a", tier, causal=True, kind=Kind.DECODE_SPLIT).spec
    src = codegen.render(spec, low)
    loop = src.index("for (int j = 0; j < num_tiles; ++j)" if tier == "mma" else "for (int n0 = split_begin")
    calls = [m.start() for m in re.finditer(r"rule::fixed_0\(", src)]
    assert len(calls) == 1 and calls[0] < loop  # once a row, before the key loop
    idx = "[t][i / 2]" if tier == "mma" else "[r]"
    assert f"const float fixed_0 = fixed_0_r{idx};" in src[loop:]
    binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert not binary.resources.spills, (spec.name, binary.log)


def test_decode_tiers(tmp_path):
    """mma's split kernel is the default for f16/bf16 at head dims that are multiples of 32 (a wgmma request
    reaches it down the fallback chain); f32 and other head dims decode on simt."""
    from fagen.backend import tiers
    from fagen.backend.tiers import mma

    def tier(dim, dtype, requested=None):
        k = pipeline.compile(
            dim, causal=True, decode=True, dtype=dtype, arch="sm_90a", tier=requested, cache_dir=tmp_path
        )
        assert [launch.spec.tier for launch in k.plan.launches] == [k.spec.tier]  # one launch: the split kernel
        return k.spec.tier

    assert tier(128, "bf16") == tier(64, "f16") == tier(128, "bf16", "wgmma") == tier(96, "bf16", "mma") == "mma"
    assert tier(128, "f32") == tier(72, "bf16") == tier(72, "bf16", "wgmma") == tier(128, "bf16", "simt") == "simt"
    # the default tiles: a 16-row tile, 8 warps of 16 keys, 3 stages; one block an SM at d128 on sm_90a
    spec = plan.choose("causal_br", 128, "bf16", "sm_90a", causal=True, kind=Kind.DECODE_SPLIT).spec
    assert (spec.block_m, spec.block_n, spec.num_warps, spec.stages) == (16, 128, 8, 3)
    t = tiers.get("mma")
    assert t.smem_bytes(spec) == 16 * 128 * 2 + 2 * 3 * 128 * 128 * 2 and mma.decode_min_blocks(spec) == 1
    small = plan.choose("causal_br", 64, "bf16", "sm_90a", causal=True, kind=Kind.DECODE_SPLIT).spec
    assert mma.decode_min_blocks(small) == 2  # 98 KiB at d64: two blocks an SM
    # where 3 stages do not fit: 2 stages (d128 on sm_80), then fewer warps (d256 on sm_90a: 4 warps, 3 stages)
    a100 = plan.choose("causal_br", 128, "bf16", "sm_80", causal=True, kind=Kind.DECODE_SPLIT).spec
    d256 = plan.choose("causal_br", 256, "bf16", "sm_90a", causal=True, kind=Kind.DECODE_SPLIT).spec
    assert (a100.num_warps, a100.stages, d256.num_warps, d256.block_n, d256.stages) == (8, 2, 4, 64, 3)
    for arch in ("sm_80", "sm_86", "sm_90a"):  # every dim's tiles fit the arch's shared memory
        for dim in (32, 64, 96, 128, 160, 192, 224, 256):
            spec = plan.choose("causal_br", dim, "bf16", arch, "mma", causal=True, kind=Kind.DECODE_SPLIT).spec
            assert t.smem_bytes(spec) <= tiers.SMEM_LIMIT[arch], (arch, dim)
    with pytest.raises(ValueError, match="block_m=24 must be a multiple of 16"):
        plan.choose("causal_br", 128, "bf16", "sm_90a", "mma", kind=Kind.DECODE_SPLIT, config=dict(block_m=24))
    with pytest.raises(ValueError, match="16 keys per warp"):
        plan.choose("causal_br", 128, "bf16", "sm_90a", "mma", kind=Kind.DECODE_SPLIT, config=dict(block_n=48))
    lighter = t.lighter(
        plan.choose("causal_br", 128, "bf16", "sm_90a", "mma", kind=Kind.DECODE_SPLIT, config=dict(block_m=32)).spec
    )
    assert lighter.block_m == 16 and t.lighter(lighter) is None


def test_decode_compile_is_a_plan_of_one_split_kernel(tmp_path):
    k = pipeline.compile(128, causal=True, decode=True, arch="sm_90a", cache_dir=tmp_path)
    assert [launch.spec.kind for launch in k.plan.launches] == [Kind.DECODE_SPLIT]
    assert k.plan.decode and k.plan.workspaces == ("ws_acc", "ws_ml", "split_count")
    assert k.spec.variant == "causal_br"  # decode's causal is bottom-right
    assert any(p.startswith("(f) merge is the state update") for p in k.proofs)
    with pytest.raises(TypeError, match="decode=True"):
        k(None, None, None)
    with pytest.raises(TypeError, match="decode=True"):
        k.varlen(None, None, None, None, None, 1, 1)
    with pytest.raises(ValueError, match="bottom-right"):
        pipeline.compile(128, causal="top_left", decode=True, arch="sm_90a", cache_dir=tmp_path)


def test_cli_compile_decode_writes_the_split_kernel(tmp_path):
    from fagen.tools import cli

    assert cli.main(["compile", "--dim", "64", "--causal", "--decode", "--arch", "sm_90a", "-o", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n.split("_causal_br_")[0] for n in names] == ["flash_decode_split"]
    assert "rule::merge_acc(" in (tmp_path / names[0]).read_text()


# --- paged caches, appended keys, flash_attn_with_kvcache (argument checks and compiles; the GPU tier runs them)


def _array(shape, dtype="bf16", name="bfloat16", strides=None, kind="torch", ptr=0):
    from fagen.runtime.arrays import Array

    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.insert(0, step)
            step *= n
    return Array(kind, None, ptr, tuple(shape), tuple(strides), dtype, name, 0)


def test_split_signature_declares_the_paged_and_append_parameters():
    names = [p.name for p in contract.BASE[Kind.DECODE_SPLIT]]
    for name in ("block_table", "block_table_stride_b", "page_size", "max_pages", "num_pages", "seqlen_new"):
        assert name in names
    for name in ("k_new", "v_new", "k_append", "v_append"):
        assert name in names
    types = {p.name: p.ctype for p in contract.BASE[Kind.DECODE_SPLIT]}
    assert types["block_table"] == "const int* __restrict__" and types["k_append"] == "storage_t*"
    assert types["k"].startswith("const")  # the reads stay read-only; the appends go through k_append
    low = lowered(dict(causal="bottom_right"), "bf16", decode=True)
    program = low.program
    spec = plan.choose(program.name, 128, "bf16", "sm_90a", causal=True, kind=Kind.DECODE_SPLIT).spec
    src = codegen.render(spec, low)
    assert "block_table[" not in src or "pages[" in src
    assert "const int* __restrict__ block_table" in src and "storage_t* k_append" in src


def test_decode_values_for_paged_and_append():
    from fagen.runtime import decode

    B, M, H, Hkv, D = 3, 2, 8, 2, 64
    a = dict(
        q=_array((B, M, H, D)),
        k_cache=_array((50, 16, Hkv, D)),
        v_cache=_array((50, 16, Hkv, D)),
        block_table=_array((B, 7), "i32", "int32"),
        k_new=_array((B, 4, Hkv, D)),
        v_new=_array((B, 4, Hkv, D)),
    )
    v = decode.decode_values(a, H // Hkv, Hkv, M, num_splits=3, ws_rows=8, max_seqlen_k=7 * 16)
    assert (v["page_size"], v["max_pages"], v["num_pages"], v["block_table_stride_b"]) == (16, 7, 50, 7)
    assert (v["k_stride_b"], v["k_stride_n"]) == (16 * Hkv * D, Hkv * D)  # "b" is the page stride
    assert (v["seqlen_new"], v["k_new_stride_n"], v["max_seqlen_k"]) == (4, Hkv * D, 112)
    contiguous = dict(q=a["q"], k_cache=_array((B, 100, Hkv, D)), v_cache=_array((B, 100, Hkv, D)))
    v = decode.decode_values(contiguous, 4, Hkv, M, num_splits=3, ws_rows=8, max_seqlen_k=100)
    assert v["page_size"] == v["max_pages"] == v["seqlen_new"] == v["block_table_stride_b"] == 0


def test_paged_and_append_arguments_are_checked():
    from fagen.runtime import decode

    spec = plan.choose("causal_br", 64, "bf16", "sm_90a", causal=True, kind=Kind.DECODE_SPLIT).spec
    q, pages = _array((3, 1, 8, 64)), _array((20, 16, 2, 64))
    decode.check_decode(spec, q, pages, pages, _array((3, 5), "i32", "int32"))  # fine: batch from the table
    with pytest.raises(ValueError, match="block_table: expected an int32 array"):
        decode.check_decode(spec, q, pages, pages, _array((2, 5), "i32", "int32"))
    with pytest.raises(ValueError, match="block_table: expected an int32"):
        decode.check_decode(spec, q, pages, pages, _array((3, 5), None, "int64"))
    with pytest.raises(ValueError, match="unit stride"):
        decode.check_decode(spec, q, pages, pages, _array((3, 5), "i32", "int32", strides=(1, 3)))
    with pytest.raises(ValueError, match="below 2"):
        decode.check_decode(spec, q, pages, pages, _array((3, 2**28), "i32", "int32"))
    with pytest.raises(ValueError, match="batch sizes differ"):  # contiguous: the cache's batch is q's
        decode.check_decode(spec, q, pages, pages, None)

    tk = _array((3, 100, 2, 64))

    def check_new(k_new, v_new, capacity=100):
        orig = decode.describe
        decode.describe = lambda name, x: x
        try:
            return decode.check_new(q, tk, k_new, v_new, capacity)
        finally:
            decode.describe = orig

    assert check_new(None, None) == (None, None)
    new = _array((3, 4, 2, 64))
    assert check_new(new, new) == (new, new)
    with pytest.raises(ValueError, match="pass both"):
        check_new(new, None)
    with pytest.raises(ValueError, match="k_new: expected shape"):
        check_new(_array((3, 4, 1, 64)), new)
    with pytest.raises(TypeError, match="dtype"):
        check_new(_array((3, 4, 2, 64), "f16", "float16"), new)
    with pytest.raises(ValueError, match="do not fit"):
        check_new(new, new, capacity=3)


def test_the_tier_checks_new_keys_alignment():
    from fagen.backend import tiers

    cache = _array((3, 100, 2, 64), ptr=256)
    odd = _array((3, 4, 2, 64), strides=(4 * 2 * 64, 2 * 64, 64, 2), ptr=256)
    for name in ("simt", "mma"):
        t = tiers.get(name)
        assert t.fits(dict(k_cache=cache, v_cache=cache)) is None
        assert "k_new" in t.fits(dict(k_cache=cache, v_cache=cache, k_new=odd, v_new=cache))
        assert "k_cache" in t.fits(dict(k_cache=_array((3, 100, 2, 64), ptr=258), v_cache=cache))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rotary_cos=1), NotImplementedError, "rotary_cos"),
        (dict(cache_leftpad=1), NotImplementedError, "cache_leftpad"),
        (dict(k=1), ValueError, "pass both"),
        (dict(window_size=(3,)), ValueError, "pair"),
        (dict(window_size=(-5, 0)), ValueError, "window_size \\(left\\)"),
        (dict(window_size=(0, 2**31)), ValueError, "window_size \\(right\\)"),
        (dict(softcap=-1.0), ValueError, "softcap"),
        (dict(softcap=float("nan")), ValueError, "softcap"),
        (dict(num_splits=1.5), ValueError, "num_splits"),
        (dict(causal="bottom_right"), TypeError, "causal"),
        (dict(cache_seqlens=-1), ValueError, "cache_seqlens"),
    ],
)
def test_flash_attn_with_kvcache_refuses_what_it_cannot_honour(kwargs, error, match):
    torch = pytest.importorskip("torch")
    import fagen

    q = torch.zeros(2, 1, 8, 64, dtype=torch.float16)
    kc = torch.zeros(2, 10, 2, 64, dtype=torch.float16)
    with pytest.raises(error, match=match):
        fagen.flash_attn_with_kvcache(q, kc, kc, **kwargs)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(8,\) or \(2, 8\)"):
        fagen.flash_attn_with_kvcache(q, kc, kc, alibi_slopes=torch.zeros(3, 8))


def test_flash_attn_with_kvcache_has_flashattentions_signature():
    import inspect

    from fagen import kvcache

    params = list(inspect.signature(kvcache.flash_attn_with_kvcache).parameters)
    assert params == [
        "q",
        "k_cache",
        "v_cache",
        "k",
        "v",
        "rotary_cos",
        "rotary_sin",
        "cache_seqlens",
        "cache_batch_idx",
        "cache_leftpad",
        "block_table",
        "softmax_scale",
        "causal",
        "window_size",
        "softcap",
        "rotary_interleaved",
        "alibi_slopes",
        "num_splits",
        "return_softmax_lse",
    ]


@pytest.mark.parametrize(
    "options",
    [
        (True, -1, -1, 0.0, None),
        (False, 50, 20, 0.0, None),
        (True, 64, -1, 0.0, "h"),
        (False, -1, 0, 5.0, "h"),
        (True, -1, -1, 0.0, "bh"),
    ],
)
def test_flash_attn_with_kvcache_programs_compile(options, tmp_path):
    from fagen.request import Flash

    causal, left, right, softcap, alibi = options
    program = Flash(causal, (left, right), softcap, alibi).build()  # FlashAttention's semantics, as flash_attn_func's
    text = str(program)
    assert ("k <= -M + N + q" in text or "M - N + k - q <= 0" in text) == (causal or right == 0)  # bottom-right
    assert ("abs(M - N + k - q)*slopes[h]" in text) == (alibi == "h")  # FlashAttention's symmetric ALiBi
    assert ("abs(M - N + k - q)*slopes[b, h]" in text) == (alibi == "bh")  # alibi_slopes [B, H]
    if softcap and alibi:  # softcap first, then ALiBi (FlashAttention's order)
        assert text.index("tanh") < text.index("abs(")
    k = pipeline.compile(64, ir=program, dtype="f16", arch="sm_90a", decode=True, cache_dir=tmp_path)
    assert [launch.spec.kind for launch in k.plan.launches] == [Kind.DECODE_SPLIT]
    assert k.tensors == (("slopes",) if alibi else ())
    assert "pages[" in k.source and "k_append" in k.source


def test_flash_attn_with_kvcache_is_exported_lazily():
    import subprocess
    import sys

    code = "import sys, fagen; f = fagen.flash_attn_with_kvcache; print(f.__module__, 'sympy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["fagen.kvcache", "False"]
