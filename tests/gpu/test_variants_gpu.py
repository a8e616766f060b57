"""The GPU tier for variants, GQA and variable-length batches (skipped, with the reason, without a GPU)."""

import functools

import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu

VARIANTS = {
    "window": dict(causal=True, window=256),
    "window_two_sided": dict(window=(100, 37)),
    "alibi": dict(causal=True, alibi=True),
    "alibi_full": dict(alibi=True),
    "softcap": dict(softcap=30),
    "softcap_causal": dict(causal=True, softcap=20),
    "prefix": dict(prefix=100),
    "custom": dict(
        mask=lambda b, h, q, k: (q >= k) & fagen.ne((q - k) % 5, 3),
        score_mod=lambda s, b, h, q, k: s - 0.05 * h * fagen.minimum(q - k, 8),
    ),
}


@functools.cache
def kernel(name, dim, dtype, tier):
    return fagen.compile(dim, dtype=dtype, tier=tier, **VARIANTS[name])


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize(
    "tier, dtype, dim", [("mma", "bf16", 128), ("mma", "f16", 64), ("simt", "f32", 64), ("simt", "bf16", 96)]
)
@pytest.mark.parametrize("M, N", [(1, 1), (17, 700), (1000, 1000), (700, 333)])
def test_variant_matches_reference(name, tier, dtype, dim, M, N):
    k = kernel(name, dim, dtype, tier)
    testing.assert_ok(testing.check_kernel(k, B=2, H=3, M=M, N=N), f"{k.name} M={M} N={N}")


@pytest.mark.parametrize("name", ["window", "alibi", "softcap", "prefix"])
def test_variant_with_gqa(name):
    k = kernel(name, 128, "bf16", "mma")
    testing.assert_ok(testing.check_kernel(k, B=1, H=8, Hkv=2, M=600, N=600), f"{k.name} gqa")


def test_missing_or_wrong_tensors_are_refused():
    import torch

    k = kernel("alibi", 128, "bf16", "mma")
    q, kk, v = testing.random_qkv(1, 4, 8, 8, 128, "bf16")
    with pytest.raises(TypeError, match="slopes: this kernel's program reads slopes"):
        k(q, kk, v)
    with pytest.raises(ValueError, match=r"slopes: expected a vector of at least 4 entries \(heads\)"):
        k(q, kk, v, slopes=torch.ones(3, device="cuda"))
    with pytest.raises(TypeError, match="bias: this kernel takes no tensor of that name"):
        k(q, kk, v, slopes=torch.ones(4, device="cuda"), bias=torch.ones(4, device="cuda"))


@pytest.mark.parametrize(
    "options",
    [dict(causal=True), dict(causal="bottom_right"), dict(causal=True, window=64), dict()],
    ids=["causal", "causal_br", "window", "full"],
)
@pytest.mark.parametrize("tier", ["wgmma", "mma", "simt"])
@pytest.mark.parametrize("D", [64, 128])
def test_varlen(options, tier, D):
    """Packed sequences of different lengths against the reference run on each sequence alone (on the wgmma tier,
    d128 under a mask is the persistent kernel whose blocks draw work tiles from a counter)."""
    import numpy as np
    import torch

    if tier == "wgmma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the wgmma tier runs on sm_90a (Hopper) only")
    k_ = fagen.compile(D, dtype="f16", tier=tier, **options)
    lens_q, lens_k = [1, 37, 300, 129], [1, 37, 250, 400]
    H, Hkv = 4, 2
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, H, D, device="cuda").half()
    kk = torch.randn(tk, Hkv, D, device="cuda").half()
    v = torch.randn(tk, Hkv, D, device="cuda").half()
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    o, lse = k_.varlen(q, kk, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True)
    torch.cuda.synchronize()
    assert o.shape == (tq, H, D) and lse.shape == (H, tq)
    for i in range(len(lens_q)):
        qs = q[cu_q[i] : cu_q[i + 1]].permute(1, 0, 2)[None]
        ks = kk[cu_k[i] : cu_k[i + 1]].permute(1, 0, 2)[None]
        vs = v[cu_k[i] : cu_k[i + 1]].permute(1, 0, 2)[None]
        keep = testing.keep_matrix(k_, 1, H, lens_q[i], lens_k[i])
        ref, lse_ref = testing.reference(qs, ks, vs, keep, k_.default_scale)
        naive, _ = testing.reference(qs, ks, vs, keep, k_.default_scale, dtype=torch.float16)
        got = o[cu_q[i] : cu_q[i + 1]].permute(1, 0, 2)[None]
        err = float((got.double() - ref).abs().max())
        bound = 2 * float((naive.double() - ref).abs().nan_to_num(0).max()) + testing.FLOOR["f16"]
        assert err <= bound, f"sequence {i}: {err:.3e} > {bound:.3e}"
        got_lse = lse[:, cu_q[i] : cu_q[i + 1]][None]
        assert torch.equal(torch.isneginf(got_lse), torch.isneginf(lse_ref))
    assert k_._fallback is None, "the compiled tier ran the batch itself"


def test_varlen_bad_offsets_are_refused():
    import torch

    k_ = fagen.compile(64, dtype="f16", causal=True)
    q = torch.randn(10, 2, 64, device="cuda").half()
    with pytest.raises(ValueError, match="cu_seqlens_q: expected a contiguous int32 vector"):
        k_.varlen(q, q, q, torch.tensor([0, 10], device="cuda"), torch.tensor([0, 10], device="cuda"), 10, 10)
    with pytest.raises(ValueError, match="q: expected 3 dimensions"):
        k_.varlen(q[None], q, q, None, None, 10, 10)


def test_window_skips_tiles():
    """A 256-key window does a small part of full causal attention's work (timing is the benchmark's job;
    here: the loop bounds the kernel emits)."""
    src = kernel("window", 128, "bf16", "mma").source
    assert "begin = max(begin, q_lo - 256);" in src


# traced functions whose extra parameters are call-time tensors (indexed per head or per batch);
# check_kernel passes random values for them and evaluates the program's score with the same values
TRACED_TENSORS = {
    "temperature": dict(score_mod=lambda s, b, h, q, k, temp: s * temp[h]),
    "batch_offset": dict(causal=True, score_mod=lambda s, b, h, q, k, off: s + off[b]),
    "head_bias": dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h]),
}


@pytest.mark.parametrize("name", sorted(TRACED_TENSORS))
@pytest.mark.parametrize("tier, dtype, dim", [("mma", "bf16", 128), ("mma", "f16", 64), ("simt", "f32", 64)])
@pytest.mark.parametrize("M, N", [(17, 700), (1000, 1000)])
def test_traced_tensors_match_reference(name, tier, dtype, dim, M, N):
    k = fagen.compile(dim, dtype=dtype, tier=tier, **TRACED_TENSORS[name])
    assert len(k.tensors) == 1
    testing.assert_ok(testing.check_kernel(k, B=3, H=4, M=M, N=N), f"{name} {k.name} M={M} N={N}")
