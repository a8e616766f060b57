"""The persistent wgmma backward (wgmma.BWD_PERSISTENT, set on here: off by default until these have run whole) on
the GPU against float64 autograd (FlashAttention's rule per gradient): its launches capped at a few blocks
(wgmma.BWD_PERSISTENT_BLOCKS), so that each block runs many key tiles in turn, the ring's stages and phases running on
across them, with tiles no query sees (bottom-right causal, M < N) among them; causal, window, softcap and ALiBi (a
call-time tensor's gradient), odd sizes, M != N, GQA, fully masked rows; deterministic and varlen calls (a block per
tile, one-dimensional); and an uncapped launch (a block per SM) over more tiles than SMs."""

import pytest

import fagen
from fagen.backend.tiers import wgmma
from fagen.tools import testing

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


def test_varlen_with_few_blocks(monkeypatch):
    import torch

    monkeypatch.setattr(wgmma, "BWD_PERSISTENT_BLOCKS", 2)
    k = kernel("causal")
    lens = [300, 1, 700, 129]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, H, D = sum(lens), 2, 128
    q, kk, v = (torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    o, lse = k.varlen(q, kk, v, cu, cu, max(lens), max(lens), return_lse=True)
    g = k.varlen_backward(q, kk, v, o, lse, do, cu, cu, max(lens), max(lens))
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = [x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, kk, v, do)]
        o1, lse1 = k(*one[:3], return_lse=True)
        g1 = k.backward(*one[:3], o1, lse1, one[3])
        for name, got, want in (("dq", g.dq, g1.dq), ("dk", g.dk, g1.dk), ("dv", g.dv, g1.dv)):
            got, want = got[a:b].transpose(0, 1).unsqueeze(0).float(), want.float()  # (dQ's additions in any order)
            err, scale = (got - want).abs().max().item(), want.abs().max().item()
            assert err <= 1e-2 * scale + 1e-3, (name, s, err, scale)
