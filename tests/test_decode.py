"""Split-KV decode on the CPU: the merge proofs (and a wrong merge they catch), the split-count heuristics,
both kinds rendered and compiled, and a NumPy model of split + merge against plain attention."""

import numpy as np
import pytest
import sympy as sp

from fagen import pipeline
from fagen.backend import build, codegen, contract, plan, splits
from fagen.backend.contract import Kind
from fagen.ir import exprs
from fagen.math import online_softmax as osm
from fagen.tools import decode_ref


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


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("dim", [64, 96, 128, 256])
def test_both_kinds_render_and_compile(dtype, dim, tmp_path):
    program = pipeline.lower(pipeline.load_program(causal="bottom_right"), dtype)[-1].program
    for kind in (Kind.DECODE_SPLIT, Kind.DECODE_COMBINE):
        spec = plan.choose(program.name, dim, dtype, "sm_90a", causal=True, kind=kind).spec
        assert spec.tier == "simt" and spec.name.startswith(kind.value)
        src = codegen.render(spec, program)
        assert "rule::merge_w(" in src and "rule::merge_acc(" in src and "namespace rule {" in src
        assert "--decode" in src.splitlines()[1]
        binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
        assert "warning" not in binary.log and not binary.resources.spills, (spec.name, binary.log)
    assert contract.params(Kind.DECODE_COMBINE, ("slopes",)) == contract.BASE[Kind.DECODE_COMBINE]


def test_decode_compile_is_a_plan_of_split_and_combine(tmp_path):
    k = pipeline.compile(128, causal=True, decode=True, arch="sm_90a", cache_dir=tmp_path)
    assert [launch.spec.kind for launch in k.plan.launches] == [Kind.DECODE_SPLIT, Kind.DECODE_COMBINE]
    assert k.plan.decode and k.plan.workspaces == ("ws_acc", "ws_ml")
    assert k.spec.variant == "causal_br"  # decode's causal is bottom-right
    assert any(p.startswith("(f) merge is the state update") for p in k.proofs)
    with pytest.raises(TypeError, match="decode=True"):
        k(None, None, None)
    with pytest.raises(TypeError, match="decode=True"):
        k.varlen(None, None, None, None, None, 1, 1)
    with pytest.raises(ValueError, match="bottom-right"):
        pipeline.compile(128, causal="top_left", decode=True, arch="sm_90a", cache_dir=tmp_path)


def test_cli_compile_decode_writes_both_kernels(tmp_path):
    from fagen.tools import cli

    assert cli.main(["compile", "--dim", "64", "--causal", "--decode", "--arch", "sm_90a", "-o", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n.split("_causal_br_")[0] for n in names] == ["flash_decode_combine", "flash_decode_split"]
    assert "rule::merge_acc(" in (tmp_path / names[1]).read_text()
