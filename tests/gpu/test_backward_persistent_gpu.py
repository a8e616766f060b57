"""The persistent wgmma backward (wgmma.BWD_PERSISTENT, on by default, set on here whatever the default) on
the GPU against float64 autograd (FlashAttention's rule per gradient): its launches capped at a few blocks
(wgmma.BWD_PERSISTENT_BLOCKS), so that each block runs many key tiles in turn, the ring's stages and phases running on
across them, with tiles no query sees (bottom-right causal, M < N) among them; causal, window, softcap and ALiBi (a
call-time tensor's gradient), odd sizes, M != N, GQA, fully masked rows; deterministic calls (every unit drawn in
order, the ordered dQ additions waiting across blocks) and varlen ones; and an uncapped launch (a block per SM) over
more tiles than SMs."""

import pytest

import fagen
from fagen.backend.tiers import wgmma
from fagen.tools import testing

from .test_backward_gpu import assert_deterministic

pytestmark = pytest.mark.gpu

VARIANTS = {
    "causal": dict(causal=True),
    "bottom_right": dict(causal="bottom_right"),
    "window": dict(causal=True, window=100),
    "softcap": dict(softcap=30.0),
    "alibi": dict(causal=True, alibi=True),
}


@pytest.fixture(autouse=True)
def persistent(monkeypatch):
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT", True)


def kernel(variant, dim=128, dtype="bf16"):
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma tier runs on sm_90a (Hopper) only")
    k = fagen.compile(dim, dtype=dtype, tier="wgmma", **VARIANTS[variant])
    main = k.backward_plan.main
    assert main.spec.tier == "wgmma" and any(p.name == "tile_counter" for p in main.params), main.spec.name
    return k


@pytest.mark.parametrize("blocks", [1, 3, 7])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("M, N", [(300, 270), (1000, 130), (130, 1000)])
def test_few_blocks_many_tiles(variant, M, N, blocks, monkeypatch):
    k = kernel(variant)
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT_BLOCKS", blocks)
    r = testing.check_backward(k, B=2, H=4, Hkv=2, M=M, N=N)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} blocks={blocks} M={M} N={N}: {r}")


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_more_tiles_than_sms(dtype):
    k = kernel("causal", dtype=dtype)
    r = testing.check_backward(k, B=2, H=16, M=2048, N=2048)  # 16 key tiles x 32 heads: 512 tiles on 132 SMs
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} 2k: {r}")


def test_deterministic_and_tensor_gradients_with_few_blocks(monkeypatch):
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT_BLOCKS", 2)
    k = kernel("alibi")
    r = testing.check_backward(k, B=2, H=4, Hkv=2, M=333, N=400, deterministic=True)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} deterministic: {r}")
    r = testing.check_backward(k, B=1, H=2, M=500, N=500, tensor_grads=False)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} without tensor gradients: {r}")


@pytest.mark.parametrize("blocks", [0, 3])
@pytest.mark.parametrize("variant", ["causal", "bottom_right", "window"])
def test_deterministic_orders_dq_over_heads_and_batch(variant, blocks, monkeypatch):
    """A deterministic call with no tensor gradient (the main kernel orders its dQ additions by a counter per query
    tile of each (batch, head), laid out by the work grid's KV heads, not the one-dimensional launch's; its blocks draw
    every unit in order, so that a key tile's wait is on units that running blocks hold): within the rule, and bit for
    bit equal over three calls, with more key tiles than SMs, and over 3 blocks."""
    monkeypatch.setattr(wgmma, "BWD_PERSISTENT_BLOCKS", blocks)
    assert_deterministic(kernel(variant), B=3, H=6, Hkv=3, M=1000, N=1100, what=f"persistent, {blocks or 'an SM each'}")


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_with_few_blocks(deterministic, monkeypatch):
    import torch

    monkeypatch.setattr(wgmma, "BWD_PERSISTENT_BLOCKS", 2)
    k = kernel("causal")
    lens = [300, 1, 700, 129]
    H = 4  # (two KV heads: a deterministic call's counters are laid out by the batch and heads)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, D = sum(lens), 128
    q = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16)
    kk, v = (torch.randn(total, H // 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    o, lse = k.varlen(q, kk, v, cu, cu, max(lens), max(lens), return_lse=True)
    g = k.varlen_backward(q, kk, v, o, lse, do, cu, cu, max(lens), max(lens), deterministic=deterministic)
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = [x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, kk, v, do)]
        o1, lse1 = k(*one[:3], return_lse=True)
        g1 = k.backward(*one[:3], o1, lse1, one[3])
        for name, got, want in (("dq", g.dq, g1.dq), ("dk", g.dk, g1.dk), ("dv", g.dv, g1.dv)):
            got, want = got[a:b].transpose(0, 1).unsqueeze(0).float(), want.float()  # (dQ's additions in any order)
            err, scale = (got - want).abs().max().item(), want.abs().max().item()
            assert err <= 1e-2 * scale + 1e-3, (name, s, err, scale)
