"""Inputs a tier cannot describe go to a tier that takes them, never to an error from the driver: CuPy views with
negative strides (reversed), expand()ed tensors (zero strides), bases 2 elements past a 16-byte boundary; forward
and backward on sm_90a (the wgmma tier's TMA refuses them: the mma or simt tier runs), and decode over caches no
split kernel reads as they are (run on dense copies, the appended rows written back). Against float64 with
FlashAttention's rule."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402
from fagen.tools import testing  # noqa: E402

pytestmark = pytest.mark.gpu


@functools.cache
def kernel(dim=128, causal=True, decode=False, dtype="bf16"):
    return fagen.compile(dim, causal=causal, dtype=dtype, decode=decode)


def _check_forward(k_, q, k, v, o, lse, what):
    """o, lse of the kernel on [B, H, S, D] torch tensors (the inputs' values) against float64."""
    B, H, M, _ = q.shape
    keep = testing.keep_matrix(k_, B, H, M, k.shape[2])
    ref = testing.reference(q, k, v, keep, k_.default_scale)
    naive = testing.reference(q, k, v, keep, k_.default_scale, dtype=q.dtype)
    testing.assert_ok(testing.compare(o, lse, ref, naive, k_.spec.dtype), what)


def _check_grads(k_, q, k, v, do, got: dict, what):
    keep = testing.keep_matrix(k_, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    ref = testing.reference_grads(k_, q, k, v, do, {}, keep, k_.default_scale)
    naive = testing.reference_grads(k_, q, k, v, do, {}, keep, k_.default_scale, dtype=q.dtype)
    for name, g in got.items():
        err = float((g.double() - ref[name]).abs().max())
        limit = 2 * float((naive[name].double() - ref[name]).abs().max()) + testing.FLOOR[k_.spec.dtype] * max(
            1.0, float(ref[name].abs().max())
        )
        assert err <= limit, f"{what} {name}: {err:.3e} > {limit:.3e}"


def _torch_of(x):
    """A CuPy array's values as a torch tensor (a dense copy: torch takes no negative strides)."""
    import cupy

    return torch.as_tensor(cupy.ascontiguousarray(x), device="cuda")


@pytest.mark.parametrize("reverse", ["S", "D", "B"])
def test_cupy_reversed_views_forward_and_backward(reverse):
    cupy = pytest.importorskip("cupy")
    k_ = kernel(dtype="f16")  # CuPy has no bfloat16
    q, k, v = (cupy.asarray(x) for x in testing.random_qkv(2, 4, 300, 333, 128, "f16", Hkv=2))
    index = {"S": (slice(None), slice(None), slice(None, None, -1)), "D": (Ellipsis, slice(None, None, -1))}
    index["B"] = (slice(None, None, -1),)
    q, k, v = (x[index[reverse]] for x in (q, k, v))
    assert any(s < 0 for s in k.strides)
    o, lse = k_(q, k, v, return_lse=True)
    tq, tk, tv = (_torch_of(x) for x in (q, k, v))
    _check_forward(k_, tq, tk, tv, _torch_of(o), _torch_of(lse), f"reversed along {reverse}")
    do = cupy.asarray(torch.randn_like(tq))[index[reverse]]
    g = k_.backward(q, k, v, o, lse, do)
    got = {"dq": _torch_of(g.dq), "dk": _torch_of(g.dk), "dv": _torch_of(g.dv)}
    _check_grads(k_, tq, tk, tv, _torch_of(do), got, f"reversed along {reverse}")


def test_expanded_keys_and_values_forward_and_backward():
    """k, v of one head expand()ed over 4 (stride 0 along H) and over the batch: o and the gradients, which flow
    through expand (summed) by autograd."""
    k_ = kernel()
    q, k1, v1 = testing.random_qkv(2, 4, 300, 333, 128, "bf16", Hkv=1)
    q.requires_grad_()
    k1, v1 = (x[:1].detach().requires_grad_() for x in (k1, v1))  # [1, 1, N, D]
    k, v = (x.expand(2, 4, 333, 128) for x in (k1, v1))
    assert k.stride()[:2] == (0, 0)
    o = fagen.attention(q, k, v, causal=True)
    do = torch.randn_like(o)
    dq, dk1, dv1 = torch.autograd.grad(o, (q, k1, v1), do)
    kd, vd = k.detach().contiguous(), v.detach().contiguous()
    keep = testing.keep_matrix(k_, 2, 4, 300, 333)
    ref_o, _ = testing.reference(q.detach(), kd, vd, keep, k_.default_scale)
    naive_o, _ = testing.reference(q.detach(), kd, vd, keep, k_.default_scale, dtype=q.dtype)
    assert float((o.double() - ref_o).abs().max()) <= 2 * float((naive_o.double() - ref_o).abs().max()) + 1e-3
    ref = testing.reference_grads(k_, q, kd, vd, do, {}, keep, k_.default_scale)
    naive = testing.reference_grads(k_, q, kd, vd, do, {}, keep, k_.default_scale, dtype=q.dtype)
    for name, got, fold in (("dq", dq, False), ("dk", dk1, True), ("dv", dv1, True)):
        r, n = ref[name], naive[name].double()
        if fold:  # the expanded tensor's gradient, summed over what expand broadcast
            r, n = r.sum((0, 1), keepdim=True), n.sum((0, 1), keepdim=True)
        err, limit = (
            float((got.double() - r).abs().max()),
            2 * float((n - r).abs().max()) + 1e-3 * max(1.0, float(r.abs().max())),
        )
        assert err <= limit, f"expand {name}: {err:.3e} > {limit:.3e}"


def test_bases_two_elements_past_a_16_byte_boundary_forward_and_backward():
    k_ = kernel()
    B, H, M, D = 2, 4, 300, 128

    def offset(x):
        buf = torch.empty(x.numel() + 2, dtype=x.dtype, device="cuda")
        y = buf[2:].view(x.shape)
        y.copy_(x)
        return y

    q, k, v = (offset(x) for x in testing.random_qkv(B, H, M, 333, D, "bf16"))
    assert q.data_ptr() % 16 == 4
    o, lse = k_(q, k, v, return_lse=True)
    _check_forward(k_, q, k, v, o, lse, "offset by 2 elements")
    do = offset(torch.randn_like(q))
    g = k_.backward(q, k, v, o, lse, do)
    _check_grads(k_, q, k, v, do, {"dq": g.dq, "dk": g.dk, "dv": g.dv}, "offset by 2 elements")


@pytest.mark.parametrize("new", [0, 3])
def test_decode_over_caches_no_split_kernel_reads(new):
    """Caches 2 elements past a 16-byte boundary: the call runs on dense copies of them and writes the appended
    rows back into the caller's caches."""
    k_ = kernel(decode=True)
    B, M, H, Hkv, D, N = 2, 2, 8, 2, 128, 700
    lens_list = [100, 600]
    g = torch.Generator(device="cuda").manual_seed(new)

    def offset(*shape):
        buf = torch.randn(int(torch.tensor(shape).prod()) + 2, generator=g, device="cuda").to(torch.bfloat16)
        return buf[2:].view(*shape)

    q = torch.randn(B, M, H, D, generator=g, device="cuda").to(torch.bfloat16)
    kc, vc = offset(B, N, Hkv, D), offset(B, N, Hkv, D)
    kn, vn = (offset(B, new, Hkv, D) for _ in range(2)) if new else (None, None)
    before_k, before_v = kc.clone(), vc.clone()
    lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
    o, lse = k_.decode(q, kc, vc, lens, k_new=kn, v_new=vn, return_lse=True)
    torch.cuda.synchronize()
    refs, naives = [], []
    for b, L in enumerate(lens_list):
        kb, vb = before_k[b, :L], before_v[b, :L]
        if new:
            kb, vb = torch.cat([kb, kn[b]]), torch.cat([vb, vn[b]])
        q4, k4, v4 = q[b : b + 1].transpose(1, 2), kb[None].transpose(1, 2), vb[None].transpose(1, 2)
        keep = testing.keep_matrix(k_, 1, H, M, L + new)
        refs.append(testing.reference(q4, k4, v4, keep, k_.default_scale))
        naives.append(testing.reference(q4, k4, v4, keep, k_.default_scale, dtype=q.dtype))
    ref = torch.cat([r[0] for r in refs]).transpose(1, 2), torch.cat([r[1] for r in refs])
    naive = torch.cat([r[0] for r in naives]).transpose(1, 2), torch.cat([r[1] for r in naives])
    testing.assert_ok(testing.compare(o, lse, ref, naive, "bf16"), f"decode on offset caches, {new} new")
    want_k, want_v = before_k.clone(), before_v.clone()
    for b, L in enumerate(lens_list):
        if new:
            want_k[b, L : L + new], want_v[b, L : L + new] = kn[b], vn[b]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
