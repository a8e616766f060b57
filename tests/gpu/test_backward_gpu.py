"""The backward on the GPU against float64 autograd of the naive program (FlashAttention's rule per gradient:
error <= 2x the naive same-dtype error + a floor): every shipped variant, GQA, varlen, odd sizes, M != N, fully
masked rows (zero gradients, no NaN), learnable bias[h] and ALiBi slope gradients, deterministic mode bit for
bit, f16/bf16/f32."""

import functools

import numpy as np
import pytest

import fagen
from fagen.tools import testing

pytestmark = pytest.mark.gpu

VARIANTS = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal_br": dict(causal="bottom_right"),
    "window": dict(causal=True, window=20),
    "alibi": dict(causal=True, alibi=True),
    "softcap": dict(softcap=30.0),
    "prefix": dict(causal=True, prefix=7),
    # a per-head tensor read as bias[h]: a learned slope (s + bias[h] alone shifts every score of a row alike, so
    # its exact gradient is 0 and a check of it compares rounding noise with rounding noise)
    "bias_h": dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h] * (k - q) * 0.01),
    # per batch and head (FlashAttention's per-batch ALiBi slopes are read so): partials per (batch, head)
    "bias_bh": dict(score_mod=lambda s, b, h, q, k, bias: s + bias[b, h] * (k - q) * 0.01),
    # a per-head tensor under the score function: the score, dL/d(q.k) and the bias's partial all read it (a fixed
    # value, computed once a head), and its gradient is not 0
    "tanh_bias": dict(score_mod=lambda s, b, h, q, k, bias: 4 * fagen.tanh((s + bias[h]) / 4)),
}


@functools.cache
def kernel(variant, dim=64, dtype="bf16", tier="simt"):
    """A forward on `tier`; its backward's main kernel is planned on the same tier family (simt -> simt,
    mma -> mma)."""
    return fagen.compile(dim, dtype=dtype, tier=tier, **VARIANTS[variant])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_every_variant_matches_float64_autograd(variant, dtype):
    k = kernel(variant, 64, dtype)
    r = testing.check_backward(k, B=2, H=2, M=77, N=130)
    testing.assert_grads_ok(r, f"{k.name}: {r}")


@pytest.mark.parametrize("M, N", [(1, 1), (17, 17), (1, 1000), (1000, 17), (200, 1000)])
@pytest.mark.parametrize("variant", ["full", "causal", "causal_br"])
def test_odd_sizes_and_m_not_n(variant, M, N):
    k = kernel(variant, 64, "bf16")
    r = testing.check_backward(k, B=1, H=2, M=M, N=N)
    testing.assert_grads_ok(r, f"{k.name} M={M} N={N}: {r}")


@pytest.mark.parametrize("dim", [32, 96, 128, 256])
def test_head_dims(dim):
    k = kernel("causal", dim, "bf16")
    r = testing.check_backward(k, B=1, H=2, M=100, N=90)
    testing.assert_grads_ok(r, f"{k.name}: {r}")


@pytest.mark.parametrize("variant", ["causal", "alibi", "bias_h", "tanh_bias"])
@pytest.mark.parametrize("H, Hkv", [(8, 2), (4, 1)])
def test_gqa_sums_dk_dv_over_the_group(variant, H, Hkv):
    k = kernel(variant, 64, "bf16")
    r = testing.check_backward(k, B=2, H=H, Hkv=Hkv, M=65, N=90, layout="bshd")
    testing.assert_grads_ok(r, f"{k.name} H={H}/{Hkv}: {r}")


def test_fully_masked_rows_have_zero_gradients():
    """causal bottom-right with M > N: the first M - N query rows see no key."""
    import torch

    k = kernel("causal_br", 64, "f16")
    r = testing.check_backward(k, B=1, H=2, M=50, N=20)
    testing.assert_grads_ok(r, f"{k.name}: {r}")
    q, kk, v = testing.random_qkv(1, 2, 50, 20, 64, "f16")
    o, lse = k(q, kk, v, return_lse=True)
    g = k.backward(q, kk, v, o, lse, torch.randn_like(q))
    assert torch.isfinite(g.dq).all() and torch.isfinite(g.dk).all() and torch.isfinite(g.dv).all()
    assert (g.dq[:, :, :30] == 0).all()


def assert_deterministic(k, B, H, Hkv, M, N, what="deterministic"):
    """Kernel k's deterministic backward on fresh inputs: within FlashAttention's rule of float64 autograd, and dq, dk,
    dv and the call-time tensors' gradients bit for bit equal over three calls on one set of inputs."""
    import torch

    r = testing.check_backward(k, B=B, H=H, Hkv=Hkv, M=M, N=N, deterministic=True)
    testing.assert_grads_ok(r, f"{k.name} {what}: {r}")
    q, kk, v = testing.random_qkv(B, H, M, N, k.spec.dim, k.spec.dtype, Hkv=Hkv)
    tensors = testing.call_tensors(k, B, H)
    o, lse = k(q, kk, v, return_lse=True, **tensors)
    do = torch.randn_like(q)
    runs = [k.backward(q, kk, v, o, lse, do, deterministic=True, **tensors) for _ in range(3)]
    for g in runs[1:]:
        assert g.tensors.keys() == runs[0].tensors.keys()
        for a, b in zip(
            (g.dq, g.dk, g.dv, *g.tensors.values()), (runs[0].dq, runs[0].dk, runs[0].dv, *runs[0].tensors.values())
        ):
            assert torch.equal(a, b)


@pytest.mark.parametrize("variant", ["causal", "alibi", "bias_h"])
def test_deterministic_is_bitwise_equal_across_runs_and_correct(variant):
    assert_deterministic(kernel(variant, 64, "bf16"), B=2, H=4, Hkv=2, M=300, N=257)


@pytest.mark.parametrize("variant", ["full", "causal", "alibi"])
def test_varlen_backward_matches_per_sequence_backward(variant):
    """Packed sequences (lengths 1, 17, 100, 33): each sequence's gradients equal the padded call's."""
    import torch

    k = kernel(variant, 64, "f32")
    lens_q, lens_k = [1, 17, 100, 33], [5, 17, 80, 40]
    H, Hkv, D = 4, 2, 64
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), H, D, device="cuda")
    kk = torch.randn(sum(lens_k), Hkv, D, device="cuda")
    v = torch.randn(sum(lens_k), Hkv, D, device="cuda")
    do = torch.randn_like(q)
    tensors = testing.call_tensors(k, 1, H)
    o, lse = k.varlen(q, kk, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True, **tensors)
    g = k.varlen_backward(q, kk, v, o, lse, do, cu_q, cu_k, max(lens_q), max(lens_k), **tensors)
    dtensor = {n: torch.zeros_like(t) for n, t in tensors.items()}
    for i in range(len(lens_q)):
        sq, sk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        qb, kb, vb, dob = (x[s].transpose(0, 1)[None] for x, s in ((q, sq), (kk, sk), (v, sk), (do, sq)))
        ob, lseb = k(qb, kb, vb, return_lse=True, **tensors)
        gb = k.backward(qb, kb, vb, ob, lseb, dob, **tensors)
        for got, want in ((g.dq[sq], gb.dq), (g.dk[sk], gb.dk), (g.dv[sk], gb.dv)):
            torch.testing.assert_close(got, want[0].transpose(0, 1), atol=2e-4, rtol=1e-4)
        for n in dtensor:
            dtensor[n] += gb.tensors[n]
    for n in dtensor:
        torch.testing.assert_close(g.tensors[n], dtensor[n], atol=1e-3, rtol=1e-4)


def test_cupy_arrays_are_taken_and_returned():
    import cupy

    k = kernel("causal", 64, "f16")
    q, kk, v = (cupy.random.standard_normal((1, 2, 40, 64)).astype(cupy.float16) for _ in range(3))
    o, lse = k(q, kk, v, return_lse=True)
    g = k.backward(q, kk, v, o, lse, cupy.ones_like(q))
    assert isinstance(g.dq, cupy.ndarray) and g.dk.shape == kk.shape and bool(cupy.isfinite(g.dv).all())


def _hopper():
    import torch

    return torch.cuda.get_device_capability() == (9, 0)


# --- the tensor-core main kernels (head dims 64 and 128, f16/bf16): mma.sync, and wgmma on Hopper ---------------
TC_TIERS = ["mma", "wgmma"]


def tc_kernel(variant, dim=64, dtype="bf16", tier="mma"):
    """A forward on `tier` whose backward's main kernel runs on that tier too (wgmma: on sm_90a only)."""
    if tier == "wgmma" and not _hopper():
        pytest.skip("the wgmma tier runs on sm_90a (Hopper) only")
    k = kernel(variant, dim, dtype, tier)
    assert k.backward_plan.main.spec.tier == tier, k.backward_plan.main.spec.name
    return k


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dim, dtype", [(64, "bf16"), (64, "f16"), (128, "bf16"), (128, "f16")])
@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_every_variant_matches_float64_autograd(variant, dim, dtype, tier):
    k = tc_kernel(variant, dim, dtype, tier=tier)
    r = testing.check_backward(k, B=2, H=2, M=77, N=130)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name}: {r}")


@pytest.mark.parametrize("M, N", [(1, 1), (17, 17), (1, 1000), (1000, 17), (200, 1000), (300, 257)])
@pytest.mark.parametrize("variant", ["full", "causal", "causal_br", "window"])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_odd_sizes_and_m_not_n(variant, M, N, dim, tier):
    k = tc_kernel(variant, dim, "bf16", tier=tier)
    r = testing.check_backward(k, B=1, H=2, M=M, N=N)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} M={M} N={N}: {r}")


@pytest.mark.parametrize("layout", ["bshd", "strided_d"])
@pytest.mark.parametrize("variant", ["causal", "alibi", "bias_h", "tanh_bias"])
@pytest.mark.parametrize("H, Hkv", [(8, 2), (4, 1)])
@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_gqa_and_layouts(variant, H, Hkv, layout, tier):
    """bshd: 16-byte cp.async rows at other strides; strided_d: element loads (no unit stride along D)."""
    k = tc_kernel(variant, 64, "bf16", tier=tier)
    r = testing.check_backward(k, B=2, H=H, Hkv=Hkv, M=65, N=190, layout=layout)
    testing.assert_grads_ok(r, f"{k.name} H={H}/{Hkv} {layout}: {r}")


@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_fully_masked_rows_have_zero_gradients(tier):
    import torch

    k = tc_kernel("causal_br", 128, "f16", tier=tier)
    r = testing.check_backward(k, B=1, H=2, M=150, N=20)
    testing.assert_grads_ok(r, f"{k.name}: {r}")
    q, kk, v = testing.random_qkv(1, 2, 150, 20, 128, "f16")
    o, lse = k(q, kk, v, return_lse=True)
    g = k.backward(q, kk, v, o, lse, torch.randn_like(q))
    assert torch.isfinite(g.dq).all() and torch.isfinite(g.dk).all() and torch.isfinite(g.dv).all()
    assert (g.dq[:, :, :130] == 0).all()


@pytest.mark.parametrize("variant", ["causal", "bias_h", "bias_bh"])
@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_deterministic_is_bitwise_equal_across_runs_and_correct(variant, tier):
    assert_deterministic(tc_kernel(variant, 64, "bf16", tier=tier), B=2, H=4, Hkv=2, M=300, N=257)


@pytest.mark.parametrize(
    "variant, dim", [("causal", 128), ("causal", 64), ("bias_h", 64), ("full", 128), ("full", 64), ("causal", 96)]
)
def test_wgmma_deterministic_over_more_pairs_than_a_chunk(variant, dim):
    """Deterministic calls on the wgmma tier take the key tiles first-first over chunks of (batch, KV head) pairs:
    wgmma.BWD_DET_PAIRS under a mask at d64, wgmma.BWD_DET_BLOCKS // key tiles without one and under one at d96 and
    d128 (full, bias_h, causal d96 and d128: 2000 keys, 16 key tiles, 16 pairs). 3 x 7 = 21 pairs leave a partial
    last chunk (16 + 5), the key and query tiles partial; the gradients pass the float64 rule and are bit for bit equal
    across runs. (bias_h's gradient sends a deterministic call to the dQ kernel, counters off: its DET_BLOCKS is only
    rendered.)"""
    from fagen.backend.tiers import wgmma

    k = tc_kernel(variant, dim, "bf16", tier="wgmma")
    src, name = k.backward_plan.main.source, k.backward_plan.main.spec.name
    if variant == "causal" and dim not in wgmma.BWD_DET_BLOCKS_MASKED:
        N, chunk = 390, wgmma.BWD_DET_PAIRS
        assert f"DET_PAIRS = {chunk};" in src, name
    else:
        N = 2000
        chunk = wgmma.BWD_DET_BLOCKS // -(-N // k.backward_plan.main.spec.block_n)
        assert f"DET_BLOCKS = {wgmma.BWD_DET_BLOCKS};" in src, name
    assert 0 < chunk < 21, name
    M = N if variant == "causal" else 300  # (causal: every key tile sees queries, and waits on those before it)
    assert_deterministic(k, B=3, H=14, Hkv=7, M=M, N=N, what="deterministic, 21 pairs")


@pytest.mark.parametrize("dim", [128, 256])
def test_wgmma_heavy_first_chunks_of_wave_blocks(dim, monkeypatch):
    """The default mode's heavy-first order takes chunks of at least wgmma.BWD_WAVE_BLOCKS // key tiles pairs
    (GQA's L2 budget gives fewer). With L2's budget cut to one pair, that rule alone sets the chunk: 2000 keys, 16 key
    tiles at d128 (16 pairs a chunk), 32 at d256 (8); 3 x 7 = 21 pairs leave a partial last chunk, two query heads a
    KV head; the gradients pass the float64 rule."""
    from fagen.backend.tiers import wgmma

    if not _hopper():
        pytest.skip("the wgmma tier runs on sm_90a (Hopper) only")
    monkeypatch.setattr(wgmma, "L2_KV_BYTES", 1)
    k = fagen.compile(dim, causal=True, dtype="bf16", tier="wgmma", use_cache=False)
    main = k.backward_plan.main
    tiles = -(-2000 // main.spec.block_n)
    assert "L2_BYTES = 1;" in main.source and f"WAVE_BLOCKS = {wgmma.BWD_WAVE_BLOCKS};" in main.source, main.spec.name
    chunk = wgmma.BWD_WAVE_BLOCKS // tiles
    assert 0 < chunk < 21 and 21 % chunk, (main.spec.name, chunk)
    r = testing.check_backward(k, B=3, H=14, Hkv=7, M=2000, N=2000)
    testing.assert_grads_ok(r, f"{k.name} heavy-first, wave chunks: {r}")


@pytest.mark.parametrize("dim, dtype", [(64, "bf16"), (128, "f16")])
@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_without_tensor_gradients_runs_the_plain_main_kernel(dim, dtype, tier):
    """tensor_grads=False (autograd's choice where no call-time tensor requires grad): the main kernel without the
    slopes' sums runs; dq, dk, dv still pass the float64 rule, and no slopes gradient comes back."""
    import torch

    k = tc_kernel("alibi", dim, dtype, tier=tier)
    bp = k.backward_plan
    assert bp.main_grads is not None and bp.main_grads.spec.tensor_grads and not bp.main.spec.tensor_grads
    r = testing.check_backward(k, B=2, H=4, Hkv=2, M=300, N=257, tensor_grads=False)
    testing.assert_grads_ok(r, f"{k.name} tensor_grads=False: {r}")
    q, kk, v = testing.random_qkv(1, 4, 130, 200, dim, dtype, Hkv=2)
    tensors = testing.call_tensors(k, 1, 4)
    o, lse = k(q, kk, v, return_lse=True, **tensors)
    g = k.backward(q, kk, v, o, lse, torch.randn_like(q), tensor_grads=False, **tensors)
    assert g.tensors == {} and torch.isfinite(g.dq).all()


@pytest.mark.parametrize("variant", ["full", "causal"])
@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_varlen_backward_matches_per_sequence_backward(variant, tier):
    """Packed sequences (bf16, deterministic dQ): each sequence's gradients match the padded call's."""
    import torch

    k = tc_kernel(variant, 128, "bf16", tier=tier)
    lens_q, lens_k = [1, 17, 200, 33], [5, 17, 180, 140]
    H, Hkv, D = 4, 2, 128
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), H, D, device="cuda").bfloat16()
    kk = torch.randn(sum(lens_k), Hkv, D, device="cuda").bfloat16()
    v = torch.randn(sum(lens_k), Hkv, D, device="cuda").bfloat16()
    do = torch.randn_like(q)
    o, lse = k.varlen(q, kk, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True)
    g = k.varlen_backward(q, kk, v, o, lse, do, cu_q, cu_k, max(lens_q), max(lens_k), deterministic=True)
    for i in range(len(lens_q)):
        sq, sk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        qb, kb, vb, dob = (x[s].transpose(0, 1)[None] for x, s in ((q, sq), (kk, sk), (v, sk), (do, sq)))
        ob, lseb = k(qb, kb, vb, return_lse=True)
        gb = k.backward(qb, kb, vb, ob, lseb, dob, deterministic=True)
        for got, want in ((g.dq[sq], gb.dq), (g.dk[sk], gb.dk), (g.dv[sk], gb.dv)):
            torch.testing.assert_close(got, want[0].transpose(0, 1), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_varlen_calls_of_one_shape_with_other_documents(tier):
    """One call shape (400 packed rows), other documents each call: the kept prepared calls (forward and backward)
    take each call's offsets and maxima; o, dq, dk, dv of every document equal that document's own call."""
    import torch

    k = tc_kernel("causal", 64, "bf16", tier=tier)
    H, Hkv, D = 4, 2, 64
    for lens in ([400], [100, 300], [399, 1], [50] * 8, [300, 100]):
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
        q, do = (torch.randn(400, H, D, device="cuda").bfloat16() for _ in range(2))
        kk, v = (torch.randn(400, Hkv, D, device="cuda").bfloat16() for _ in range(2))
        o, lse = k.varlen(q, kk, v, cu, cu, max(lens), max(lens), return_lse=True)
        g = k.varlen_backward(q, kk, v, o, lse, do, cu, cu, max(lens), max(lens))
        for i in range(len(lens)):
            s = slice(int(cu[i]), int(cu[i + 1]))
            qb, kb, vb, dob = (x[s].transpose(0, 1)[None] for x in (q, kk, v, do))
            ob, lseb = k(qb, kb, vb, return_lse=True)
            gb = k.backward(qb, kb, vb, ob, lseb, dob)
            for got, want in ((o[s], ob), (g.dq[s], gb.dq), (g.dk[s], gb.dk), (g.dv[s], gb.dv)):
                torch.testing.assert_close(
                    got, want[0].transpose(0, 1), atol=2e-2, rtol=1e-2, msg=lambda m: f"{lens}: {m}"
                )


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("tier", TC_TIERS + ["simt"])
def test_varlen_backward_rows_outside_every_sequence_are_zero(tier, deterministic):
    """Packed arrays with rows before the first sequence and after the last: dq, dk, dv are exactly 0 there (dQ by
    the convert, which runs over every packed row; dK, dV by the preprocess, over more key rows than query rows),
    on memory the allocator hands back dirty (NaN), and the rows inside equal those of the same call on the
    sequences' rows alone. Every tier's main kernel (simt's too) runs after the same preprocess."""
    import torch

    k = kernel("causal", 128, "bf16", "simt") if tier == "simt" else tc_kernel("causal", 128, "bf16", tier=tier)
    lens_q, lens_k = [130, 1, 257], [140, 9, 257]
    (head_q, tail_q), (head_k, tail_k) = (3, 70), (5, 129)
    H, Hkv, D = 4, 2, 128
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    total_q, total_k = head_q + sum(lens_q) + tail_q, head_k + sum(lens_k) + tail_k
    q, do = (torch.randn(total_q, H, D, device="cuda").bfloat16() for _ in range(2))
    kk, v = (torch.randn(total_k, Hkv, D, device="cuda").bfloat16() for _ in range(2))
    inner_q, inner_k = slice(head_q, total_q - tail_q), slice(head_k, total_k - tail_k)
    args = (cu_q + head_q, cu_k + head_k, max(lens_q), max(lens_k))
    o, lse = k.varlen(q, kk, v, *args, return_lse=True)
    for _ in range(2):  # freed NaN blocks of the outputs' sizes: the call's outputs likely reuse them
        dirty = [torch.full_like(x, float("nan")) for x in (q, kk, v, q, kk, v)]
        del dirty
        g = k.varlen_backward(q, kk, v, o, lse, do, *args, deterministic=deterministic)
        for name, outside in (
            ("dq", (slice(0, head_q), slice(total_q - tail_q, None))),
            ("dk", (slice(0, head_k), slice(total_k - tail_k, None))),
            ("dv", (slice(0, head_k), slice(total_k - tail_k, None))),
        ):
            for rows in outside:
                assert bool((getattr(g, name)[rows] == 0).all()), (name, rows)
    o_in, lse_in = k.varlen(q[inner_q], kk[inner_k], v[inner_k], cu_q, cu_k, *args[2:], return_lse=True)
    want = k.varlen_backward(
        q[inner_q],
        kk[inner_k],
        v[inner_k],
        o_in,
        lse_in,
        do[inner_q],
        cu_q,
        cu_k,
        *args[2:],
        deterministic=deterministic,
    )
    for got, ref in ((g.dq[inner_q], want.dq), (g.dk[inner_k], want.dk), (g.dv[inner_k], want.dv)):
        torch.testing.assert_close(got, ref, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("variant", ["full", "causal", "window"])
@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_repeated_calls_of_one_shape_leave_the_workspace_clean(variant, tier):
    """A call shape's workspaces (D, the float32 dQ accumulator) are reused call after call: three calls of one
    shape on fresh inputs, each against float64, and a deterministic call between them (no accumulator). A row of
    the accumulator not cleared before a call would add the last call's dQ into this one's."""
    k = tc_kernel(variant, 64, "bf16", tier=tier)
    for i in range(3):
        r = testing.check_backward(k, B=2, H=4, Hkv=2, M=333, N=300, seed=100 + i)
        testing.assert_grads_ok(r, f"{k.name} call {i}: {r}")
        if i == 1:
            r = testing.check_backward(k, B=2, H=4, Hkv=2, M=333, N=300, deterministic=True)
            testing.assert_grads_ok(r, f"{k.name} deterministic: {r}")


@pytest.mark.parametrize("tier", TC_TIERS)
def test_tc_varlen_repeated_calls_with_short_sequences(tier):
    """Varlen with sequences shorter than the longest (blocks past a sequence's keys have no work) and sequences
    with no rows or no keys, call after call on one workspace: dQ, dK, dV against the deterministic mode's."""
    import torch

    k = tc_kernel("causal", 64, "bf16", tier=tier)
    lens_q, lens_k = [130, 0, 1, 257, 64], [300, 5, 0, 257, 1]
    H, Hkv, D = 4, 2, 64
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    for call in range(3):
        q = torch.randn(sum(lens_q), H, D, device="cuda").bfloat16()
        kk = torch.randn(sum(lens_k), Hkv, D, device="cuda").bfloat16()
        v = torch.randn(sum(lens_k), Hkv, D, device="cuda").bfloat16()
        do = torch.randn_like(q)
        args = (cu_q, cu_k, max(lens_q), max(lens_k))
        o, lse = k.varlen(q, kk, v, *args, return_lse=True)
        g = k.varlen_backward(q, kk, v, o, lse, do, *args)
        want = k.varlen_backward(q, kk, v, o, lse, do, *args, deterministic=True)
        for name in ("dq", "dk", "dv"):
            got, ref = getattr(g, name), getattr(want, name)
            assert bool(torch.isfinite(got).all()), (call, name)
            torch.testing.assert_close(got, ref, atol=2e-2, rtol=1e-2, msg=lambda m: f"call {call} {name}: {m}")


@pytest.mark.parametrize(
    "variant, dim, H, Hkv, M", [("causal", 128, 9, 9, 2000), ("alibi", 128, 18, 9, 2000), ("causal", 256, 6, 6, 1500)]
)
def test_wgmma_key_tiles_start_heavy_first_over_chunks_of_heads(variant, dim, H, Hkv, M):
    """The causal backward's blocks start their key tiles heavy-first over chunks of (batch, KV head) pairs
    (flash_bwd_wgmma's heavy_first_tile, 32 MiB of Q, dO and dq_accum a chunk): here 2 x Hkv pairs make chunks of 16
    (d128), 8 (d128 with two query heads a KV head) or 10 (d256) and a partial last one, so every gradient depends on
    the chunk arithmetic naming each (key tile, pair) once."""
    from fagen.backend.tiers import wgmma

    k = wide_kernel(variant, dim) if dim > 128 else tc_kernel(variant, dim, "bf16", tier="wgmma")
    assert wgmma.backward_order() == "heavy_first" and "heavy_first_tile(" in k.backward_plan.main.source
    r = testing.check_backward(k, B=2, H=H, Hkv=Hkv, M=M, N=M)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} H={H}/{Hkv} M={M}: {r}")


def test_the_default_forward_on_this_gpu_takes_its_tiers_backward():
    """The planner's default forward (wgmma on sm_90a, mma on sm_80) plans its backward's main kernel on its own
    tier."""
    k = fagen.compile(128, dtype="bf16", causal=True)
    want = "wgmma" if _hopper() else "mma"
    assert k.backward_plan.main.spec.tier == want, (k.spec.tier, k.backward_plan.main.spec.name)
    r = testing.check_backward(k, B=2, H=4, Hkv=2, M=257, N=300)
    testing.assert_grads_ok(r, f"{k.name}: {r}")


# d96 runs the wgmma backward on d128's tiles: TMA zero-fills columns 96-127, the products over the head dim stop at
# 96, and no column past 96 is written (dK, dV) or added into dq_accum.
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_wgmma_d96_every_variant_matches_float64_autograd(variant):
    k = tc_kernel(variant, 96, "bf16", tier="wgmma")
    r = testing.check_backward(k, B=2, H=2, M=77, N=130)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name}: {r}")


@pytest.mark.parametrize("M, N", [(1, 1), (17, 17), (1000, 17), (300, 257)])
@pytest.mark.parametrize("variant", ["full", "causal_br", "window"])
def test_wgmma_d96_odd_sizes_gqa_and_f16(variant, M, N):
    k = tc_kernel(variant, 96, "f16", tier="wgmma")
    r = testing.check_backward(k, B=1, H=4, Hkv=2, M=M, N=N)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} M={M} N={N}: {r}")


# Deterministic on the wgmma tier: the main kernel's additions into dq_accum in key-tile order (a counter per query
# tile), no dQ kernel. Many key tiles a query tile (N = 2000: 16) so an unordered sum would differ between runs; GQA,
# masks whose query ranges differ per key tile, d64 (dQ split by rows), d96 and d128 (by columns), varlen.
@pytest.mark.parametrize(
    "variant, dim", [("full", 64), ("causal", 128), ("window", 96), ("prefix", 64), ("causal_br", 128)]
)
def test_wgmma_deterministic_orders_the_main_kernels_dq_additions(variant, dim):
    import torch

    k = tc_kernel(variant, dim, "bf16", tier="wgmma")
    assert any(p.name == "dq_semaphore" for p in k.backward_plan.main.params)
    r = testing.check_backward(k, B=2, H=4, Hkv=2, M=1500, N=2000, deterministic=True)
    testing.assert_grads_ok(r, f"{k.name} deterministic: {r}")
    q, kk, v = testing.random_qkv(2, 4, 1500, 2000, dim, "bf16", Hkv=2)
    o, lse = k(q, kk, v, return_lse=True)
    do = torch.randn_like(q)
    runs = [k.backward(q, kk, v, o, lse, do, deterministic=True) for _ in range(4)]
    for g in runs[1:]:
        for a, b in zip((g.dq, g.dk, g.dv), (runs[0].dq, runs[0].dk, runs[0].dv)):
            assert torch.equal(a, b)
    default = k.backward(q, kk, v, o, lse, do)
    torch.testing.assert_close(runs[0].dq, default.dq, atol=2e-2, rtol=1e-2)


def test_wgmma_deterministic_varlen_is_bitwise_equal_across_runs():
    import torch

    k = tc_kernel("causal", 128, "bf16", tier="wgmma")
    lens = [1, 700, 1300, 33, 2000]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    q, kk, v = (torch.randn(sum(lens), 4, 128, device="cuda").bfloat16() for _ in range(3))
    do = torch.randn_like(q)
    o, lse = k.varlen(q, kk, v, cu, cu, max(lens), max(lens), return_lse=True)
    runs = [k.varlen_backward(q, kk, v, o, lse, do, cu, cu, max(lens), max(lens), deterministic=True) for _ in range(4)]
    for g in runs[1:]:
        for a, b in zip((g.dq, g.dk, g.dv), (runs[0].dq, runs[0].dk, runs[0].dv)):
            assert torch.equal(a, b)
    default = k.varlen_backward(q, kk, v, o, lse, do, cu, cu, max(lens), max(lens))
    torch.testing.assert_close(runs[0].dq, default.dq, atol=2e-2, rtol=1e-2)


# d192 and d256: the wgmma backward's two consumer warpgroups share a 64-key tile and split dK, dV and dQ by head-dim
# columns (d256: 128 each; d192: dK, dV 128 and 64, dQ 64 and 128), P^T and dS^T through shared memory; its ring is 2
# deep, and at d256 dQ's float32 parts are staged in the step's own dO_i and Q_i (wgmma.DQ_RING_HEAD_DIMS). Every
# variant, odd sizes, M != N, GQA, fully masked rows, varlen, deterministic mode, and outputs on memory filled with NaN
# first (an element the kernels leave unwritten shows).
WIDE = [192, 256]


def _poison_allocator():
    """Fill a large block of the caching allocator with NaN and free it: the next outputs are carved from it."""
    import torch

    x = torch.full((64 << 20,), float("nan"), device="cuda")
    del x


def wide_kernel(variant, dim, dtype="bf16"):
    k = tc_kernel(variant, dim, dtype, tier="wgmma")
    spec = k.backward_plan.main.spec
    assert (spec.block_m, spec.block_n) == (64, 64), spec.name  # the wide kernel, not a step-down
    return k


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("dim", WIDE)
def test_wgmma_wide_every_variant_matches_float64_autograd(variant, dim):
    k = wide_kernel(variant, dim)
    _poison_allocator()
    r = testing.check_backward(k, B=2, H=2, M=77, N=130)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name}: {r}")


@pytest.mark.parametrize("M, N", [(1, 1), (17, 17), (1, 1000), (1000, 17), (200, 1000), (300, 257)])
@pytest.mark.parametrize("variant", ["full", "causal", "causal_br", "window"])
@pytest.mark.parametrize("dim, dtype", [(192, "bf16"), (256, "bf16"), (192, "f16")])
def test_wgmma_wide_odd_sizes_gqa_and_m_not_n(variant, M, N, dim, dtype):
    k = wide_kernel(variant, dim, dtype)
    _poison_allocator()
    r = testing.check_backward(k, B=1, H=4, Hkv=2, M=M, N=N)
    testing.assert_grads_ok(r, f"{k.backward_plan.main.spec.name} M={M} N={N}: {r}")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("variant", ["causal", "alibi", "bias_h", "tanh_bias"])
@pytest.mark.parametrize("H, Hkv", [(8, 2), (4, 1)])
@pytest.mark.parametrize("dim", WIDE)
def test_wgmma_wide_gqa(variant, H, Hkv, layout, dim):
    k = wide_kernel(variant, dim)
    r = testing.check_backward(k, B=2, H=H, Hkv=Hkv, M=65, N=190, layout=layout)
    testing.assert_grads_ok(r, f"{k.name} H={H}/{Hkv} {layout}: {r}")


@pytest.mark.parametrize("dim", WIDE)
def test_wgmma_wide_fully_masked_rows_have_zero_gradients(dim):
    import torch

    k = wide_kernel("causal_br", dim, "f16")
    r = testing.check_backward(k, B=1, H=2, M=150, N=20)
    testing.assert_grads_ok(r, f"{k.name}: {r}")
    q, kk, v = testing.random_qkv(1, 2, 150, 20, dim, "f16")
    o, lse = k(q, kk, v, return_lse=True)
    _poison_allocator()
    g = k.backward(q, kk, v, o, lse, torch.randn_like(q))
    assert torch.isfinite(g.dq).all() and torch.isfinite(g.dk).all() and torch.isfinite(g.dv).all()
    assert (g.dq[:, :, :130] == 0).all()


# deterministic: "causal" orders the main kernel's dQ additions (a counter per query tile); "bias_h" asks for a tensor
# gradient, so its dQ comes from the dQ kernel and the main kernel runs with dq_accum null
@pytest.mark.parametrize("variant", ["causal", "window", "bias_h"])
@pytest.mark.parametrize("dim", WIDE)
def test_wgmma_wide_deterministic_is_bitwise_equal_across_runs_and_correct(variant, dim):
    assert_deterministic(wide_kernel(variant, dim), B=2, H=4, Hkv=2, M=700, N=900)


@pytest.mark.parametrize("variant", ["full", "causal"])
@pytest.mark.parametrize("dim", WIDE)
def test_wgmma_wide_varlen_matches_per_sequence_backward(variant, dim):
    """Packed sequences, some shorter than a tile, some with no keys: each sequence's gradients match its own call's."""
    import torch

    k = wide_kernel(variant, dim)
    lens_q, lens_k = [1, 17, 200, 33, 130], [5, 17, 180, 140, 1]
    H, Hkv = 4, 2
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), H, dim, device="cuda").bfloat16()
    kk = torch.randn(sum(lens_k), Hkv, dim, device="cuda").bfloat16()
    v = torch.randn(sum(lens_k), Hkv, dim, device="cuda").bfloat16()
    do = torch.randn_like(q)
    o, lse = k.varlen(q, kk, v, cu_q, cu_k, max(lens_q), max(lens_k), return_lse=True)
    g = k.varlen_backward(q, kk, v, o, lse, do, cu_q, cu_k, max(lens_q), max(lens_k))
    for i in range(len(lens_q)):
        sq, sk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        qb, kb, vb, dob = (x[s].transpose(0, 1)[None] for x, s in ((q, sq), (kk, sk), (v, sk), (do, sq)))
        ob, lseb = k(qb, kb, vb, return_lse=True)
        gb = k.backward(qb, kb, vb, ob, lseb, dob, deterministic=True)
        for got, want in ((g.dq[sq], gb.dq), (g.dk[sk], gb.dk), (g.dv[sk], gb.dv)):
            torch.testing.assert_close(got, want[0].transpose(0, 1), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dim", WIDE)
def test_wgmma_wide_and_the_simt_backward_on_the_same_inputs(dim, monkeypatch):
    """wgmma.BWD_WIDE = False (the A/B switch) plans the fallback family's backward (simt), as before the wide kernel;
    on the same seeded inputs both pass the float64 rule."""
    from fagen.backend.tiers import wgmma

    k = wide_kernel("causal", dim)
    monkeypatch.setattr(wgmma, "BWD_WIDE", False)
    old = fagen.compile(dim, dtype="bf16", tier="wgmma", causal=True, use_cache=False)
    assert old.backward_plan.main.spec.tier == "simt", old.backward_plan.main.spec.name
    for kernel in (k, old):
        r = testing.check_backward(kernel, B=2, H=4, Hkv=2, M=333, N=517, seed=7)
        testing.assert_grads_ok(r, f"{kernel.backward_plan.main.spec.name}: {r}")


@pytest.mark.parametrize("tier", TC_TIERS)
def test_tensor_gradient_over_split_keys_is_corrected_once(tier):
    """Kernel.backward_rows on two halves of the keys, each with the whole rows' o and lse (as fagen.ring's pieces):
    the tensor's uncorrected sums and the row sums E_i, R_i added over the calls and corrected once
    (backward.corrected) give the one call's gradient of a per-head tensor, which backward_rows corrected alone
    gives too."""
    import torch

    from fagen.runtime.backward import corrected

    k = tc_kernel("tanh_bias", 128, "bf16", tier=tier)
    q, kk, v = testing.random_qkv(2, 4, 256, 512, 128, "bf16", Hkv=2, seed=5)
    tensors = testing.call_tensors(k, 2, 4, seed=5)
    o, lse = k(q, kk, v, return_lse=True, **tensors)
    do = torch.randn_like(q)
    whole = k.backward(q, kk, v, o, lse, do, **tensors).tensors["bias"]
    tol = dict(rtol=1e-3, atol=1e-3 * float(whole.abs().max()))
    g, rows = k.backward_rows(q, kk, v, o, lse, do, **tensors)
    torch.testing.assert_close(corrected(g.tensors, *rows)["bias"], whole, **tol)
    halves = [
        k.backward_rows(q, kk[:, :, s], v[:, :, s], o, lse, do, **tensors) for s in (slice(0, 256), slice(256, 512))
    ]
    raw = {"bias": halves[0][0].tensors["bias"] + halves[1][0].tensors["bias"]}
    (_, a), (_, b) = halves
    split = corrected(raw, a.e + b.e, {key: a.r[key] + b.r[key] for key in a.r}, a.shapes)["bias"]
    torch.testing.assert_close(split, whole, **tol)


# float32 dK, dV (Kernel.backward(float32_dkv=True): fagen.ring's partials, summed over calls and rounded once)
@pytest.mark.parametrize(
    "tier, dim, dtype",
    [
        ("simt", 64, "bf16"),
        ("simt", 64, "f32"),
        ("mma", 64, "bf16"),
        ("mma", 128, "f16"),
        ("wgmma", 64, "bf16"),
        ("wgmma", 96, "bf16"),
        ("wgmma", 128, "bf16"),
        ("wgmma", 128, "f16"),
        ("wgmma", 256, "bf16"),
    ],
)
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_float32_dkv_are_the_kernels_sums_before_rounding(tier, dim, dtype, layout, deterministic):
    """dk, dv in float32 (dense, k's and v's shapes) that round to the bits of the default call's, on every tier, GQA,
    odd sizes and a transposed layout; dq the same (bit for bit where deterministic). Where the storage is 16 bits,
    the float32 values carry bits that bf16/f16 do not."""
    import torch

    k_ = tc_kernel("causal", dim, dtype, tier=tier) if tier != "simt" else kernel("causal", dim, dtype, tier)
    q, kk, v = testing.random_qkv(2, 4, 150, 333, dim, dtype, Hkv=2, layout=layout)
    o, lse = k_(q, kk, v, return_lse=True)
    do = torch.randn_like(q)
    _poison_allocator()
    base = k_.backward(q, kk, v, o, lse, do, deterministic=deterministic)
    _poison_allocator()
    wide = k_.backward(q, kk, v, o, lse, do, deterministic=deterministic, float32_dkv=True)
    for name, got, want, x in (("dk", wide.dk, base.dk, kk), ("dv", wide.dv, base.dv, v)):
        assert got.dtype == torch.float32 and got.shape == x.shape and got.is_contiguous(), (name, got.dtype)
        assert torch.equal(got.to(x.dtype), want), f"{name}: float32 values do not round to the default call's"
        if dtype != "f32":
            assert (got != got.to(x.dtype).float()).any(), f"{name}: no bit past {dtype}'s"
    if deterministic:
        assert torch.equal(wide.dq, base.dq)
    else:
        torch.testing.assert_close(wide.dq, base.dq, atol=2e-2, rtol=1e-2)
