"""Split-KV decode on the GPU against a float64 reference (FlashAttention's tolerance rule): cache lengths from
1 to several thousand (shorter than q_len included), q_len 1..16, GQA and MHA, causal and not, one split and
many, outputs and workspace poisoned with NaN."""

import functools

import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu


@functools.cache
def kernel(causal, dim=128, dtype="bf16", alibi=False):
    return fagen.compile(dim, causal=causal, dtype=dtype, decode=True, alibi=alibi)


def _assert_ok(r, what):
    assert r.finite, f"{what}: non-finite output"
    assert r.lse_inf_match, f"{what}: lse -inf/NaN pattern differs from the reference"
    assert r.err <= r.bound, f"{what}: max|O - ref| {r.err:.3e} > bound {r.bound:.3e} (naive {r.err_naive:.3e})"
    assert r.lse_err <= r.lse_bound, f"{what}: max|lse - ref| {r.lse_err:.3e} > {r.lse_bound:.3e}"


LENGTHS = [1, 2, 7, 64, 333, 1000, 4097]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("M", [1, 2, 5, 16])
@pytest.mark.parametrize("H, Hkv", [(32, 8), (4, 4)])
@pytest.mark.parametrize("num_splits", [1, 7, None, "flex"])
def test_decode_matches_reference(causal, M, H, Hkv, num_splits):
    k_ = kernel(causal)
    seqlens = LENGTHS if M * H <= 128 else LENGTHS[:4] + [4097]
    r = testing.check_decode(k_, B=len(seqlens), M=M, H=H, Hkv=Hkv, N=4100, seqlens=seqlens, num_splits=num_splits)
    _assert_ok(r, f"{k_.name} M={M} H={H}/{Hkv} splits={num_splits}")


@pytest.mark.parametrize("dim, dtype", [(64, "f16"), (96, "bf16"), (256, "bf16"), (128, "f32")])
def test_decode_other_dims_and_dtypes(dim, dtype):
    k_ = kernel(True, dim, dtype)
    r = testing.check_decode(k_, B=3, M=3, H=8, Hkv=2, N=2000, seqlens=[2, 500, 2000], num_splits=5)
    _assert_ok(r, k_.name)


def test_decode_with_a_call_time_tensor():
    k_ = kernel(False, alibi=True)
    r = testing.check_decode(k_, B=2, M=2, H=8, Hkv=2, N=900, seqlens=[17, 900], num_splits=4)
    _assert_ok(r, k_.name)


def test_decode_many_splits_and_cuda_graph():
    import torch

    k_ = kernel(True)
    _assert_ok(testing.check_decode(k_, B=2, M=1, H=32, Hkv=8, N=8192, seqlens=[8192, 3], num_splits=128), "128")
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    lens = torch.tensor([1024, 500], dtype=torch.int32, device="cuda")
    want = k_.decode(q, kc, vc, lens)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        k_.decode(q, kc, vc, lens)  # warm up on the capture stream
        with torch.cuda.graph(g, stream=s):
            got = k_.decode(q, kc, vc, lens)
    torch.cuda.current_stream().wait_stream(s)
    got.fill_(float("nan"))
    lens.copy_(torch.tensor([1024, 500], dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
