"""Any head dim from 8 to 256, as FlashAttention takes them: a dim the kernels do not take (not a multiple of 8, or
under 32) gets the kernel of the next one, and each op pads q, k, v (o, dO, the caches) with zero columns and
returns the first columns (fagen.runtime.pad). Against float64 with FlashAttention's rule: the kernel's forward
and backward, flash_attn_func with autograd, the varlen form, decode (Kernel.decode and flash_attn_with_kvcache,
appending into the caller's cache), fagen.attention, flex_attention and CuPy arrays."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402
from fagen.tools import testing  # noqa: E402

from .test_autograd_gpu import DTYPES, bound, check_grads, fa_inputs, fa_reference  # noqa: E402
from .test_decode_gpu import _check, _fa_keep, _logical, _paged, _run_decode  # noqa: E402

pytestmark = pytest.mark.gpu

DIMS = [8, 16, 40, 59, 72, 111, 200, 256]


@functools.cache
def kernel(dim, dtype="bf16", causal=True, decode=False):
    return fagen.compile(dim, causal=causal, dtype=dtype, decode=decode)


@pytest.mark.parametrize("dim, dtype", [(d, "bf16") for d in DIMS] + [(16, "f16"), (59, "f16")])
def test_kernel_forward_and_backward(dim, dtype):
    k_ = kernel(dim, dtype)
    assert k_.spec.dim == dim and (k_.spec.input_dim is None) == (dim % 8 == 0 and dim >= 32)
    assert k_.default_scale == pytest.approx(dim**-0.5)
    r = testing.check_kernel(k_, B=2, H=4, Hkv=2, M=300, N=257, layout="bshd", seed=dim)
    testing.assert_ok(r, f"{k_.name} forward")
    g = testing.check_backward(k_, B=2, H=4, Hkv=2, M=300, N=257, seed=dim)
    testing.assert_grads_ok(g, f"{k_.name} backward")


@pytest.mark.parametrize("dim", [16, 59, 111])
def test_kernel_forward_f32(dim):
    k_ = kernel(dim, "f32")
    testing.assert_ok(testing.check_kernel(k_, B=1, H=2, M=200, N=300, seed=dim), f"{k_.name} forward")


@pytest.mark.parametrize("dim", [8, 16, 59, 111, 256])
def test_flash_attn_func_gradients(dim):
    """flash_attn_func on [B, S, H, D] with autograd: o, dq, dk, dv of the inputs' own head dim."""
    q, k, v = fa_inputs(2, 177, 300, 4, 2, dim, "bf16", seed=dim)
    o = fagen.flash_attn_func(q, k, v, causal=True)
    assert o.shape == q.shape and o.stride() == q.stride()
    check_grads(
        lambda q, k, v: fagen.flash_attn_func(q, k, v, causal=True, window_size=(100, -1)),
        lambda q, k, v, dtype: fa_reference(q, k, v, dtype, causal=True, window=(100, -1)),
        (q, k, v),
        "bf16",
        f"flash_attn_func d={dim}",
    )


@pytest.mark.parametrize("dim", [8, 59, 111])
def test_flash_attn_varlen_func_forward_and_gradients(dim):
    g = torch.Generator(device="cuda").manual_seed(dim)
    lens_q, lens_k = [5, 300, 1], [17, 250, 40]
    mk = lambda n, h: torch.randn(n, h, dim, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(sum(lens_q), 4), mk(sum(lens_k), 2), mk(sum(lens_k), 2)
    cum = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa: E731
    o = fagen.flash_attn_varlen_func(q, k, v, cum(lens_q), cum(lens_k), 300, 250, causal=True)
    assert o.shape == q.shape
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
    at_q = at_k = 0
    for Lq, Lk in zip(lens_q, lens_k):
        sl_q, sl_k = slice(at_q, at_q + Lq), slice(at_k, at_k + Lk)
        parts = [x.detach()[None, s] for x, s in ((q, sl_q), (k, sl_k), (v, sl_k))]
        ref_in = [x.double().requires_grad_() for x in parts]
        naive_in = [x.clone().requires_grad_() for x in parts]
        o_ref, o_naive = fa_reference(*ref_in, causal=True), fa_reference(*naive_in, torch.bfloat16, causal=True)
        bound(o[sl_q], o_ref[0], o_naive[0], "bf16", f"d={dim} varlen o {Lq}x{Lk}")
        d_out = do[None, sl_q]
        ref = torch.autograd.grad(o_ref, ref_in, d_out.double())
        naive = torch.autograd.grad(o_naive, naive_in, d_out)
        for name, got, r, nv in zip(("dq", "dk", "dv"), (dq[sl_q], dk[sl_k], dv[sl_k]), ref, naive):
            bound(got, r[0], nv[0], "bf16", f"d={dim} varlen {name} {Lq}x{Lk}")
        at_q, at_k = at_q + Lq, at_k + Lk


@pytest.mark.parametrize("dim, dtype", [(d, "bf16") for d in DIMS] + [(16, "f32"), (111, "f32")])
def test_kernel_decode(dim, dtype):
    k_ = kernel(dim, dtype, decode=True)
    r = testing.check_decode(k_, B=3, M=2, H=8, Hkv=2, N=1000, seqlens=[1, 300, 1000], num_splits=4)
    testing.assert_ok(r, k_.name)


@pytest.mark.parametrize("dim", [8, 59, 111])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_appends_into_the_callers_cache(dim, paged):
    """The kernel appends into padded copies of the caches; their first columns are written back: attention sees
    the new keys, and the caller's cache holds them afterwards with nothing else changed."""
    k_ = kernel(dim, decode=True)
    seqlens, page, new, H, Hkv, M = [0, 15, 300], 16, 3, 8, 2, 3
    q, kc, vc, lens, table, kn, vn = _paged(len(seqlens), M, H, Hkv, dim, "bf16", seqlens, page, new=new, paged=paged)
    k_before, v_before = kc.clone(), vc.clone()
    logical = _logical(kc, vc, table, kn, vn, seqlens, page)
    o, lse, tensors = _run_decode(k_, q, kc, vc, lens, table, kn, vn)
    assert o.shape == q.shape
    r = _check(
        o,
        lse,
        q,
        logical,
        lambda N: testing.keep_matrix(k_, 1, H, M, N, tensors),
        k_.default_scale,
        lambda N: testing.score_function(k_, 1, H, M, N, tensors),
        "bf16",
    )
    testing.assert_ok(r, f"{k_.name} append paged={paged}")
    want_k, want_v = k_before.clone(), v_before.clone()
    host_table = table.tolist() if paged else None
    for b, L in enumerate(seqlens):
        for j in range(new):
            n = L + j
            idx = (host_table[b][n // page], n % page) if paged else (b, n)
            want_k[idx], want_v[idx] = kn[b, j], vn[b, j]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v), "the appended cache differs"


@pytest.mark.parametrize("dim", [16, 59])
def test_flash_attn_with_kvcache(dim):
    seqlens, page, H, Hkv, M = [1, 200, 777], 16, 8, 2, 3
    q, kc, vc, lens, table, kn, vn = _paged(len(seqlens), M, H, Hkv, dim, "f16", seqlens, page, new=2, seed=dim)
    logical = _logical(kc, vc, table, kn, vn, seqlens, page)
    o, lse = fagen.flash_attn_with_kvcache(
        q, kc, vc, k=kn, v=vn, cache_seqlens=lens, block_table=table, causal=True, return_softmax_lse=True
    )
    torch.cuda.synchronize()
    assert o.shape == q.shape
    r = _check(o, lse, q, logical, lambda N: _fa_keep(M, N, True, (-1, -1)), dim**-0.5, lambda N: None, "f16")
    testing.assert_ok(r, f"flash_attn_with_kvcache d={dim}")


@pytest.mark.parametrize("dim", [8, 59, 111])
def test_attention_and_flex_attention_gradients(dim):
    q, k, v = (x.transpose(1, 2) for x in fa_inputs(2, 200, 333, 4, 4, dim, "bf16", seed=dim))
    check_grads(
        lambda q, k, v: fagen.attention(q, k, v, causal="bottom_right", softcap=20.0),
        lambda q, k, v, dtype: fa_reference(
            *(x.transpose(1, 2) for x in (q, k, v)), dtype, causal=True, softcap=20.0
        ).transpose(1, 2),
        (q, k, v),
        "bf16",
        f"fagen.attention d={dim}",
    )
    check_grads(
        lambda q, k, v: fagen.flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: 20.0 * torch.tanh(s / 20.0)),
        lambda q, k, v, dtype: fa_reference(*(x.transpose(1, 2) for x in (q, k, v)), dtype, softcap=20.0).transpose(
            1, 2
        ),
        (q, k, v),
        "bf16",
        f"flex_attention d={dim}",
    )


def test_cupy_arrays_of_a_padded_head_dim():
    cupy = pytest.importorskip("cupy")
    q, k, v = fa_inputs(1, 100, 120, 2, 2, 59, "f16", seed=3, grad=False)
    qb, kb, vb = (cupy.asarray(x.transpose(1, 2)) for x in (q, k, v))
    o = fagen.attention(qb, kb, vb, causal="bottom_right")
    assert isinstance(o, cupy.ndarray) and o.shape == qb.shape
    ref = fa_reference(q, k, v, causal=True).transpose(1, 2)
    naive = fa_reference(q, k, v, DTYPES["f16"], causal=True).transpose(1, 2)
    bound(torch.as_tensor(o, device="cuda"), ref, naive, "f16", "cupy o d=59")
