"""The wgmma backward's step orders (wgmma.BWD_PIPELINE) on the GPU against float64 autograd (FlashAttention's rule
per gradient): every order, head dims 64, 96 and 128, plain, causal, window, softcap and ALiBi, odd sizes, GQA, and
deterministic mode. Each kernel is built afresh (use_cache=False: the compile cache's key does not hold the order)."""

import pytest

import fagen
from fagen.backend.tiers import wgmma
from fagen.tools import testing

pytestmark = pytest.mark.gpu

VARIANTS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(causal=True, window=20),
    "softcap": dict(softcap=30.0),
    "alibi": dict(causal=True, alibi=True),
}


def kernel(variant, dim, pipeline_name, monkeypatch, dtype="bf16"):
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma tier runs on sm_90a (Hopper) only")
    monkeypatch.setattr(wgmma, "BWD_PIPELINE", pipeline_name)
    k = fagen.compile(dim, dtype=dtype, tier="wgmma", use_cache=False, **VARIANTS[variant])
    main = k.backward_plan.main
    assert main.spec.tier == "wgmma", main.spec.name
    assert ("gemm_s_then_dp" in main.source) == (pipeline_name == "overlap"), main.spec.name
    return k


@pytest.mark.parametrize("pipeline_name", wgmma.BWD_PIPELINES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dim, dtype", [(64, "bf16"), (96, "bf16"), (128, "bf16"), (128, "f16")])
def test_every_order_matches_float64_autograd(pipeline_name, variant, dim, dtype, monkeypatch):
    k = kernel(variant, dim, pipeline_name, monkeypatch, dtype)
    r = testing.check_backward(k, B=2, H=2, M=300, N=270)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} {pipeline_name}: {r}")


@pytest.mark.parametrize("pipeline_name", ["overlap_dq", "overlap"])
@pytest.mark.parametrize("M, N", [(1, 1), (17, 17), (1000, 17), (200, 1000)])
@pytest.mark.parametrize("dim", [64, 128])
def test_odd_sizes_gqa_and_deterministic(pipeline_name, M, N, dim, monkeypatch):
    k = kernel("causal", dim, pipeline_name, monkeypatch)
    r = testing.check_backward(k, B=2, H=4, Hkv=2, M=M, N=N, layout="bshd")
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} {pipeline_name} M={M} N={N}: {r}")
    r = testing.check_backward(k, B=1, H=2, M=M, N=N, deterministic=True)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} {pipeline_name} deterministic M={M} N={N}: {r}")
