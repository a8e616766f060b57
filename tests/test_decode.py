"""Split-KV decode on the CPU: the merge proofs (and a wrong merge they catch), the split-count heuristics,
both kinds rendered and compiled, and a NumPy model of split + merge against plain attention."""

import math
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
        (dict(rotary_cos=1, rotary_sin=1), ValueError, "rotary_cos: rotary embeddings rotate the new keys"),
        (dict(cache_leftpad=1), TypeError, "cache_leftpad"),
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


# --- flash_attn_with_kvcache's arguments on the CPU, the kernel behind it the float64 double (attention_double) ---


@pytest.fixture
def double(monkeypatch):
    """fagen's memo compiles doubles (tests/attention_double.py): the (request, kernel) pairs made."""
    pytest.importorskip("torch")
    from .attention_double import install

    return install(monkeypatch)


def _fa_rotary(x, cos, sin, offsets, interleaved):
    """FlashAttention's apply_rotary_emb as its tests write it in PyTorch: x [B, S, H, D] at positions
    offsets[b] + s, x·cos + rotate_half(x)·sin over the first rotary_dim dims, cos repeated to that width."""
    import torch

    rd = 2 * cos.shape[1]
    pos = offsets.long()[:, None] + torch.arange(x.shape[1])[None]
    c, s = cos[pos].double(), sin[pos].double()
    widen = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (lambda t: torch.cat([t, t], -1))
    c, s = widen(c)[:, :, None], widen(s)[:, :, None]
    xr = x[..., :rd].double()
    if interleaved:
        half = torch.stack((-xr[..., 1::2], xr[..., ::2]), -1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, -1)
        half = torch.cat((-x2, x1), -1)
    return torch.cat([(xr * c + half * s).to(x.dtype), x[..., rd:]], -1)


def _fa_kvcache_reference(q, cache_k, cache_v, k, v, lens, *, rotary, leftpad, causal, window, scale):
    """FlashAttention's test of flash_attn_with_kvcache, written out: q and k rotated (q row by row with causal or
    a window, else all at cache_seqlens), k, v written at cache_seqlens[b], keys j < cache_seqlens[b] + seqlen_new
    and j >= leftpad[b] kept, the window bottom-right; softmax in float64. cache_k, cache_v: each batch's own
    logical cache [B, N, Hkv, D] (its rows through cache_batch_idx or the page table). Returns the output and
    the caches as the call must leave them."""
    import torch

    B, M, H, D = q.shape
    new = 0 if k is None else k.shape[1]
    if rotary is not None:
        cos, sin, interleaved = rotary
        if causal or window != (-1, -1):
            q = _fa_rotary(q, cos, sin, lens, interleaved)
        else:
            q = _fa_rotary(q.reshape(B, 1, M * H, D), cos, sin, lens, interleaved).reshape(B, M, H, D)
        k = _fa_rotary(k, cos, sin, lens, interleaved)
    cache_k, cache_v = cache_k.clone(), cache_v.clone()
    outs = []
    for b in range(B):
        L = int(lens[b])
        if new:
            cache_k[b, L : L + new], cache_v[b, L : L + new] = k[b], v[b]
        total = L + new
        i = torch.arange(M)[:, None] + total - M
        j = torch.arange(cache_k.shape[1])[None]
        keep = ((j < total) & (j >= (int(leftpad[b]) if leftpad is not None else 0))).expand(M, -1).clone()
        left, right = window[0], 0 if causal else window[1]
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        kb = cache_k[b].double().repeat_interleave(H // cache_k.shape[2], 1)
        vb = cache_v[b].double().repeat_interleave(H // cache_k.shape[2], 1)
        s = torch.einsum("mhd,nhd->hmn", q[b].double(), kb) * scale
        s = s.masked_fill(~keep, -math.inf)
        p = torch.softmax(s, -1).nan_to_num(0.0)
        outs.append(torch.einsum("hmn,nhd->mhd", p, vb))
    return torch.stack(outs), cache_k, cache_v


def _logical_rows(cache, table):
    """[B, max_pages * page_size, Hkv, D]: each batch's keys through its row of the page table."""
    return cache[table.long()].flatten(1, 2)


ROTARY = [None, (True, 8), (False, 8), (False, 16)]  # (interleaved, rotary_dim); D = 16
MASKS = [dict(causal=True), dict(causal=False, window_size=(3, 1)), dict(causal=False)]
LAYOUTS = ["contiguous", "batch_idx", "batch_idx_leftpad", "paged_leftpad", "leftpad"]


@pytest.mark.parametrize("rotary", ROTARY, ids=str)
@pytest.mark.parametrize("mask", MASKS, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_kvcache_rotary_batch_idx_and_leftpad_as_flashattention(double, rotary, mask, layout):
    """flash_attn_with_kvcache against FlashAttention's own reference (its test, written out): rotary interleaved
    and not, rotary_dim < D; cache_batch_idx permuted (reads and appends go to the named rows, the others stay);
    cache_leftpad; paged caches; seqlen_new < seqlen_q. The output, and the caches left as FlashAttention leaves
    them (the rotated keys appended)."""
    import torch

    g = torch.Generator().manual_seed(len(layout) * 7 + (rotary[1] if rotary else 0) + len(mask))
    B, M, H, Hkv, D, N, new = 3, 4, 4, 2, 16, 24, 2
    q = torch.randn(B, M, H, D, generator=g)
    k, v = torch.randn(B, new, Hkv, D, generator=g), torch.randn(B, new, Hkv, D, generator=g)
    lens = torch.tensor([0, 7, 22], dtype=torch.int32)  # 22 + 2 new: the cache's last row
    rows = B + 2 if "batch_idx" in layout else B
    cache_k, cache_v = torch.randn(rows, N, Hkv, D, generator=g), torch.randn(rows, N, Hkv, D, generator=g)
    args = dict(cache_seqlens=lens, softmax_scale=0.3, **mask)
    idx = table = None
    if "batch_idx" in layout:
        idx = args["cache_batch_idx"] = torch.tensor([3, 0, 4], dtype=torch.int32)
    leftpad = torch.tensor([0, 3, 9], dtype=torch.int32) if "leftpad" in layout else None
    args["cache_leftpad"] = leftpad
    if rotary is not None:
        cos, sin = (torch.randn(N + 3, rotary[1] // 2, generator=g) for _ in range(2))
        args.update(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=rotary[0])
    page = 5
    if layout.startswith("paged"):  # 5 pages of 5 keys a batch, shuffled in a pool, the unused entries poisoned
        pool_k, pool_v = torch.randn(17, page, Hkv, D, generator=g), torch.randn(17, page, Hkv, D, generator=g)
        table = torch.randperm(17, generator=g)[:15].reshape(B, 5).int()
        table[0, 1:] = -7  # batch 0 uses one page (two new keys)
        logical = table.clamp(0)
        cache_k, cache_v = _logical_rows(pool_k, logical)[:, :N], _logical_rows(pool_v, logical)[:, :N]
        cache_args = (pool_k, pool_v)
        args["block_table"] = table
    else:
        cache_args = (cache_k, cache_v)
        if idx is not None:
            cache_k, cache_v = cache_k[idx.long()], cache_v[idx.long()]
    rot = None if rotary is None else (args["rotary_cos"], args["rotary_sin"], rotary[0])
    window = mask.get("window_size", (-1, -1))
    scale, causal = 0.3, mask["causal"]
    want, want_k, want_v = _fa_kvcache_reference(
        q, cache_k, cache_v, k, v, lens, rotary=rot, leftpad=leftpad, causal=causal, window=window, scale=scale
    )
    before = [c.clone() for c in cache_args]
    o = fagen_kvcache()(q, *cache_args, k, v, **args)
    torch.testing.assert_close(o.double(), want, atol=1e-5, rtol=0)
    if layout.startswith("paged"):
        got_k, got_v = (_logical_rows(c, table.clamp(0))[:, :N] for c in cache_args)
        torch.testing.assert_close(got_k[0, :2], want_k[0, :2], atol=1e-6, rtol=0)
        torch.testing.assert_close(got_k[1:], want_k[1:], atol=1e-6, rtol=0)
        torch.testing.assert_close(got_v[1:], want_v[1:], atol=0, rtol=0)
    elif idx is not None:
        torch.testing.assert_close(cache_args[0][idx.long()], want_k, atol=1e-6, rtol=0)
        assert torch.equal(cache_args[1][idx.long()], want_v)
        for r in (1, 2):  # the rows no batch names are untouched
            assert torch.equal(cache_args[0][r], before[0][r]) and torch.equal(cache_args[1][r], before[1][r])
    else:
        torch.testing.assert_close(cache_args[0], want_k, atol=1e-6, rtol=0)
        assert torch.equal(cache_args[1], want_v)
    request, kernel = double[0]
    assert request.source.leftpad == (leftpad is not None)
    assert request.tensor_dtypes == ((("leftpad", "i32"),) if leftpad is not None else ())
    table_seen = kernel.calls[0][3]
    if idx is not None:
        assert table_seen == [[3], [0], [4]], "cache_batch_idx runs as a table of one page a batch"


def fagen_kvcache():
    import fagen

    return fagen.flash_attn_with_kvcache


def test_kvcache_rotary_rotates_q_at_one_position_without_causal_or_window(double):
    """Without causal or a window, every query row is rotated at cache_seqlens[b] (FlashAttention's rule); a window
    as wide as the cache counts as none; with causal, row i at cache_seqlens[b] + i. (The outputs differ.)"""
    import torch

    g = torch.Generator().manual_seed(3)
    q, kc = torch.randn(2, 3, 2, 16, generator=g), torch.randn(2, 10, 2, 16, generator=g)
    k = torch.randn(2, 1, 2, 16, generator=g)
    cos, sin = torch.randn(10, 8, generator=g), torch.randn(10, 8, generator=g)
    lens = torch.tensor([2, 6], dtype=torch.int32)
    run = fagen_kvcache()

    def call(**kw):
        return run(q, kc.clone(), kc.clone(), k, k, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, **kw)

    assert torch.equal(call(window_size=(10, 10)), call())
    assert not torch.allclose(call(window_size=(9, 10)), call(), atol=1e-3)
    assert not torch.allclose(call(causal=True), call(), atol=1e-3)


def test_block_table_entries_and_lengths_are_checked(double):
    """An entry in use outside [0, num_pages) and a sequence past its row's capacity raise an error naming
    block_table (a RuntimeError, as FlashAttention raises, and a ValueError); poisoned entries past the pages in
    use, and a cache exactly at capacity, do not (FlashAttention's test_flash_attn_kvcache_paged_block_table_bounds,
    whose error we match)."""
    import torch

    from fagen.kvcache import BlockTableError

    run = fagen_kvcache()
    q = torch.randn(2, 1, 2, 16)
    pool = torch.randn(6, 4, 2, 16)
    table = torch.tensor([[5, 0, 2**30], [1, -1, -1]], dtype=torch.int32)  # batch 0: 2 pages, batch 1: 1
    lens = torch.tensor([8, 3], dtype=torch.int32)
    run(q, pool, pool.clone(), cache_seqlens=lens, block_table=table)  # the poisoned entries are not in use
    one = torch.randn(2, 1, 2, 16)
    run(q, pool, pool.clone(), k=one, v=one, cache_seqlens=lens - 1, block_table=table)  # to exactly 8 and 3 keys
    for bad in ([[6, 0, 0], [1, 0, 0]], [[5, 0, 0], [-1, 0, 0]], [[5, 2**30, 0], [1, 0, 0]]):
        with pytest.raises(RuntimeError, match=r"block_table: 1 of the entries in use name pages outside \[0, 6\)"):
            run(q, pool, pool.clone(), cache_seqlens=lens, block_table=torch.tensor(bad, dtype=torch.int32))
    with pytest.raises(BlockTableError, match=r"block_table: a sequence of 13 keys passes the 12 keys"):
        run(
            q,
            pool,
            pool.clone(),
            k=one,
            v=one,
            cache_seqlens=torch.tensor([12, 3], dtype=torch.int32),
            block_table=table,
        )
    with pytest.raises(ValueError, match="block_table: a sequence of 13 keys"):
        run(q, pool, pool.clone(), cache_seqlens=torch.tensor([13, 3], dtype=torch.int32), block_table=table)
    cache = torch.randn(3, 8, 2, 16)
    with pytest.raises(
        RuntimeError, match=r"cache_batch_idx: 1 of the entries in use name cache rows outside \[0, 3\)"
    ):
        run(q, cache, cache, cache_seqlens=4, cache_batch_idx=torch.tensor([2, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="cache_batch_idx: a sequence of 9 keys passes the 8 keys"):
        run(q, cache, cache, cache_seqlens=9, cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32))
    assert len(double[0][1].calls) == 2, "no refused call reached the kernel"


class ones:
    """A PyTorch tensor of ones of `shape` and `dtype`, made in the test (collecting needs no PyTorch)."""

    def __init__(self, shape, dtype="float32"):
        self.shape, self.dtype = shape, dtype

    def __call__(self):
        import torch

        return torch.ones(self.shape, dtype=getattr(torch, self.dtype))

    def __repr__(self):
        return f"ones{self.shape}{self.dtype}"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rotary_cos=ones((10, 4))), ValueError, "rotary_cos, rotary_sin: pass both"),
        (dict(rotary_cos=ones((10, 4)), rotary_sin=ones((10, 4))), ValueError, "rotary_cos: .*pass k, v"),
        (dict(new=True, rotary_cos=ones((10, 9)), rotary_sin=ones((10, 9))), ValueError, "rotary_dim <= 16"),
        (dict(new=True, rotary_cos=ones((9, 4)), rotary_sin=ones((9, 4))), ValueError, "fewer than the cache"),
        (dict(new=True, rotary_cos=ones((10, 4)), rotary_sin=ones((10, 2))), ValueError, "shapes"),
        (dict(new=True, rotary_cos=ones((10, 4), "int64"), rotary_sin=ones((10, 4))), TypeError, "floating"),
        (dict(rotary_interleaved=1), TypeError, "rotary_interleaved"),
        (dict(cache_leftpad=ones((2,), "int64")), ValueError, r"cache_leftpad: expected a \[B=2\] int32"),
        (dict(cache_leftpad=[0, 1]), TypeError, "cache_leftpad"),
        (dict(cache_batch_idx=ones((3,), "int32")), ValueError, "cache_batch_idx: expected a \\[B=2\\]"),
        (dict(cache_batch_idx=ones((2,), "int32"), block_table=ones((2, 1), "int32")), ValueError, "paged"),
        (dict(block_table=ones((2, 1), "int64")), ValueError, "block_table: expected an int32"),
        (dict(cache_seqlens=ones((2,), "int64")), ValueError, "cache_seqlens: expected a contiguous int32"),
        (dict(cache_seqlens=1.5), TypeError, "cache_seqlens"),
        (dict(cache_seqlens=ones((), "float32")), TypeError, "cache_seqlens"),
        (dict(num_splits=np.ones(2, int)), ValueError, "num_splits"),
        (dict(window_size=(np.ones(2, int), 0)), ValueError, r"window_size \(left\)"),
        (dict(window_size=ones((3,), "int64")), ValueError, r"window_size: expected a pair.*shape \[3\]"),
        (dict(window_size=(1.0, 0)), ValueError, r"window_size \(left\)"),
        (dict(softmax_scale="x"), TypeError, "softmax_scale"),
    ],
)
def test_kvcache_argument_errors_name_the_argument(double, kwargs, error, match):
    import torch

    q = torch.zeros(2, 1, 4, 16)
    kc = torch.zeros(2, 10, 2, 16)
    kwargs = {n: x() if isinstance(x, ones) else x for n, x in kwargs.items()}
    if kwargs.pop("new", False):
        kwargs.update(k=torch.zeros(2, 1, 2, 16), v=torch.zeros(2, 1, 2, 16))
    with pytest.raises(error, match=match):
        fagen_kvcache()(q, kc, kc, **kwargs)
    assert not double, "nothing compiled for a refused call"


def test_kvcache_takes_any_integer_type(double):
    """Window sides, num_splits and cache_seqlens as NumPy integers and 0-d tensors (as FlashAttention's tests pass
    them), a window as a 2-element tensor: the same request and the same numbers as Python ints."""
    import torch

    g = torch.Generator().manual_seed(9)
    q, kc = torch.randn(2, 2, 4, 16, generator=g), torch.randn(2, 12, 2, 16, generator=g)
    run = fagen_kvcache()
    want = run(q, kc, kc, cache_seqlens=9, window_size=(3, 1), num_splits=2, softcap=5.0)
    for window, seqlens, count, cap in (
        ((np.int64(3), np.int32(1)), np.int16(9), np.uint8(2), np.float32(5.0)),
        ((torch.tensor(3), torch.tensor(1, dtype=torch.int32)), torch.tensor(9), torch.tensor(2), torch.tensor(5.0)),
        (torch.tensor([3, 1]), np.array(9), np.array(2), np.array(5)),
        (np.array([3, 1]), torch.tensor(9, dtype=torch.int32), 2, 5),
    ):
        got = run(q, kc, kc, cache_seqlens=seqlens, window_size=window, num_splits=count, softcap=cap)
        assert torch.equal(got, want)
    assert len(double) == 1, "one request: the integer types make no new kernel"
    assert double[0][0].source.window == (3, 1) and type(double[0][0].source.window[0]) is int
