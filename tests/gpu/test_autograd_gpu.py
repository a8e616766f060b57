"""The GPU tier for the training API: fagen.attention and the FlashAttention drop-ins, forward and backward,
against float64 PyTorch autograd of the naive program with FlashAttention's rule (skipped without a GPU).

Rule, for o and for each of dq, dk, dv (and a learnable tensor's gradient): max |x - x_ref| <= 2 · max
|x_naive - x_ref| + floor, where x_ref is float64 autograd of the formula and x_naive the same formula run in
the input dtype. The gradient tests need Kernel.backward; until it exists they are skipped, saying so.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fagen  # noqa: E402

from ..attention_double import reference  # noqa: E402

pytestmark = pytest.mark.gpu
needs_backward = pytest.mark.skipif(
    not hasattr(fagen.Kernel, "backward"), reason="Kernel.backward has not landed in this tree"
)
FLOOR = {"bf16": 1e-3, "f16": 1e-4, "f32": 1e-5}
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def bound(x, ref, naive, dtype, what):
    """FlashAttention's rule for one tensor: error <= 2 x the naive same-dtype error + floor; finite."""
    assert torch.isfinite(x).all(), f"{what}: non-finite values"
    err = float((x.double() - ref).abs().max())
    err_naive = float((naive.double() - ref).abs().nan_to_num(0.0).max())
    limit = 2 * err_naive + FLOOR[dtype]
    assert err <= limit, f"{what}: max error {err:.3e} > {limit:.3e} (naive {err_naive:.3e})"
    return err, err_naive


def fa_inputs(B, M, N, H, Hkv, D, dtype, seed, grad=True):
    """q [B, M, H, D], k, v [B, N, Hkv, D] (FlashAttention's layout), fresh random values."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = DTYPES[dtype]
    make = lambda S, heads: torch.randn(B, S, heads, D, generator=g, device="cuda").to(dt).requires_grad_(grad)  # noqa: E731
    return make(M, H), make(N, Hkv), make(N, Hkv)


def fa_reference(q, k, v, dtype=None, **semantics):
    """The formula on [B, S, H, D] tensors, in float64 (dtype None) or the given dtype; differentiable."""
    dt = dtype or torch.float64
    t = [x.to(dt).transpose(1, 2) for x in (q, k, v)]
    return reference(*t, **semantics)[0].transpose(1, 2)


VARIANTS = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(64, 17)),
    "window_left": dict(causal=True, window=(100, -1)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi=True),
    "alibi_causal_softcap": dict(causal=True, softcap=5.0, alibi=True),
}
SIZES = [(1, 1), (17, 300), (300, 113), (512, 512)]


def call(variant, q, k, v, slopes, **extra):
    opts = dict(VARIANTS[variant])
    alibi = opts.pop("alibi", False)
    window = opts.pop("window", (-1, -1))
    return fagen.flash_attn_func(q, k, v, window_size=window, alibi_slopes=slopes if alibi else None, **opts, **extra)


def semantics_of(variant, slopes):
    opts = dict(VARIANTS[variant])
    alibi = opts.pop("alibi", False)
    return dict(opts, slopes=slopes if alibi else None)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("M, N", SIZES)
@pytest.mark.parametrize("dtype, D", [("bf16", 128), ("f16", 64)])
def test_flash_attn_func_forward(variant, M, N, dtype, D):
    """flash_attn_func's output with FlashAttention's semantics (no grad), GQA 4/2, M != N both ways."""
    q, k, v = fa_inputs(2, M, N, 4, 2, D, dtype, seed=M + N, grad=False)
    slopes = torch.tensor(fagen.alibi_slopes(4), device="cuda")
    o = call(variant, q, k, v, slopes)
    assert o.shape == q.shape and o.stride() == q.stride()
    sem = semantics_of(variant, slopes)
    bound(o, fa_reference(q, k, v, **sem), fa_reference(q, k, v, DTYPES[dtype], **sem), dtype, f"{variant} o")


def test_flash_attn_varlen_forward():
    g = torch.Generator(device="cuda").manual_seed(7)
    lens_q, lens_k = [5, 300, 1], [17, 250, 40]
    q = torch.randn(sum(lens_q), 4, 64, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 64, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    cum = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa: E731
    slopes = torch.tensor(fagen.alibi_slopes(4), device="cuda")
    o = fagen.flash_attn_varlen_func(
        q, k, v, cum(lens_q), cum(lens_k), 300, 250, causal=True, softcap=5.0, alibi_slopes=slopes
    )
    at_q = at_k = 0
    for Lq, Lk in zip(lens_q, lens_k):
        qs, ks, vs = q[None, at_q : at_q + Lq], k[None, at_k : at_k + Lk], v[None, at_k : at_k + Lk]
        sem = dict(causal=True, softcap=5.0, slopes=slopes)
        ref, naive = fa_reference(qs, ks, vs, **sem)[0], fa_reference(qs, ks, vs, torch.bfloat16, **sem)[0]
        bound(o[at_q : at_q + Lq], ref, naive, "bf16", f"varlen sequence of {Lq}x{Lk}")
        at_q, at_k = at_q + Lq, at_k + Lk


def test_attention_with_cupy_arrays_forward():
    cupy = pytest.importorskip("cupy")
    q, k, v = fa_inputs(1, 100, 120, 2, 2, 64, "f16", seed=3, grad=False)
    qb, kb, vb = (cupy.asarray(x.transpose(1, 2)) for x in (q, k, v))
    o = fagen.attention(qb, kb, vb, causal="bottom_right")
    assert isinstance(o, cupy.ndarray)
    ref = fa_reference(q, k, v, causal=True).transpose(1, 2)
    naive = fa_reference(q, k, v, torch.float16, causal=True).transpose(1, 2)
    bound(torch.as_tensor(o, device="cuda"), ref, naive, "f16", "cupy o")


# --- gradients (need Kernel.backward) ---------------------------------------------------------------------
def check_grads(fn_kernel, fn_formula, inputs, dtype, what, extra=()):
    """o and the gradients of inputs + extra (leaf tensors) for a random dO: kernel vs float64 vs naive."""
    o = fn_kernel(*inputs, *extra)
    do = torch.randn_like(o)
    leaves = (*inputs, *extra)
    got = torch.autograd.grad(o, leaves, do)
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    o_ref = fn_formula(*ref_leaves, dtype=None)
    ref = torch.autograd.grad(o_ref, ref_leaves, do.double())
    naive_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    o_naive = fn_formula(*naive_leaves, dtype=DTYPES[dtype])
    naive = torch.autograd.grad(o_naive, naive_leaves, do.to(o_naive.dtype))
    bound(o, o_ref, o_naive, dtype, f"{what} o")
    names = ["dq", "dk", "dv"] + [f"d{i}" for i in range(len(extra))]
    return {n: bound(g, r, nv, dtype, f"{what} {n}") for n, g, r, nv in zip(names, got, ref, naive)}


@needs_backward
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("M, N", [(17, 300), (300, 113), (512, 512)])
@pytest.mark.parametrize("dtype, D", [("bf16", 128), ("f16", 64)])
def test_flash_attn_func_gradients(variant, M, N, dtype, D):
    q, k, v = fa_inputs(2, M, N, 4, 2, D, dtype, seed=M * N)
    slopes = torch.tensor(fagen.alibi_slopes(4), device="cuda")
    sem = semantics_of(variant, slopes)
    check_grads(
        lambda q, k, v: call(variant, q, k, v, slopes),
        lambda q, k, v, dtype: fa_reference(q, k, v, dtype, **sem),
        (q, k, v),
        dtype,
        f"{variant} M={M} N={N}",
    )


@needs_backward
def test_learnable_bias_gradient():
    """A per-head tensor in a traced score function is learned: its gradient is summed over every position. It is a
    slope on the key offset (s + bias[h] alone shifts every score of a row alike: its exact gradient is 0, and a
    check of it compares rounding noise with rounding noise). Bottom-right causal, k - q differs from ALiBi's
    -|q + N - M - k| by N - M per row, which softmax does not see: the reference is ALiBi with slopes bias / 100."""
    q, k, v = (x.transpose(1, 2) for x in fa_inputs(2, 200, 333, 4, 4, 64, "bf16", seed=11))
    bias = torch.randn(4, device="cuda", requires_grad=True)
    fn = lambda s, b, h, q, k, bias: s + bias[h] * (k - q) * 0.01  # noqa: E731

    def formula(q, k, v, bias, dtype):
        dt = dtype or torch.float64
        return reference(q.to(dt), k.to(dt), v.to(dt), causal=True, slopes=bias.to(dt) * 0.01)[0]

    check_grads(
        lambda q, k, v, bias: fagen.attention(q, k, v, causal="bottom_right", score_mod=fn, bias=bias),
        formula,
        (q, k, v),
        "bf16",
        "bias[h]",
        extra=(bias,),
    )


@needs_backward
@pytest.mark.parametrize("deterministic", [False, True])
def test_per_batch_alibi_slopes_and_their_gradient(deterministic):
    """alibi_slopes [B, H] (FlashAttention's per-batch form): batch b's heads take row b; learnable here, its
    gradient is reduced per (batch, head) like a per-head tensor's (no atomics), so deterministic mode takes it."""
    q, k, v = fa_inputs(3, 200, 333, 4, 2, 64, "bf16", seed=21)
    base = torch.tensor(fagen.alibi_slopes(4), device="cuda")
    slopes = torch.stack([base, base * 4, base / 2]).requires_grad_()

    def kernel(q, k, v, slopes):
        return fagen.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, deterministic=deterministic)

    check_grads(
        kernel,
        lambda q, k, v, slopes, dtype: fa_reference(q, k, v, dtype, causal=True, slopes=slopes),
        (q, k, v),
        "bf16",
        "alibi_slopes [B, H]",
        extra=(slopes,),
    )
    if deterministic:
        do = torch.randn(3, 200, 4, 64, device="cuda", dtype=torch.bfloat16)
        runs = [torch.autograd.grad(kernel(q, k, v, slopes), (q, k, v, slopes), do) for _ in range(3)]
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                assert torch.equal(a, b)


def test_return_attn_probs_gives_the_log_sum_exp():
    """return_attn_probs=True: (out, softmax_lse, None); lse against float64 logsumexp of the scores (natural log),
    -inf where a row sees no key (M > N, bottom-right causal); the varlen form's lse is [H, total_q]."""
    q, k, v = fa_inputs(2, 300, 100, 4, 2, 64, "bf16", seed=23, grad=False)
    slopes = torch.tensor(fagen.alibi_slopes(4), device="cuda")
    o, lse, probs = fagen.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, return_attn_probs=True)
    assert probs is None and lse.shape == (2, 4, 300) and lse.dtype == torch.float32
    t = [x.double().transpose(1, 2) for x in (q, k, v)]
    ref_o, ref_lse = reference(*t, causal=True, slopes=slopes.double())
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen) and not seen[:, :, :200].any()
    assert float((lse[seen].double() - ref_lse[seen]).abs().max()) < 1e-3
    assert torch.equal(o, fagen.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes))
    cu = torch.tensor([0, 300, 600], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 100, 200], dtype=torch.int32, device="cuda")
    packed = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    ov, lse_v, probs = fagen.flash_attn_varlen_func(
        *packed, cu, cu_k, 300, 100, causal=True, alibi_slopes=slopes, return_attn_probs=True
    )
    assert probs is None and lse_v.shape == (4, 600)
    assert torch.equal(torch.isfinite(lse_v), torch.cat([seen[0], seen[1]], 1))
    finite = torch.cat([seen[0], seen[1]], 1)
    want = torch.cat([ref_lse[0], ref_lse[1]], 1)
    assert float((lse_v[finite].double() - want[finite]).abs().max()) < 1e-3


@needs_backward
def test_qkvpacked_gradients():
    """flash_attn_qkvpacked_func on qkv [B, S, 3, H, D]: the parts are strided views (TMA takes them on Hopper);
    o and the packed gradient against float64."""
    g = torch.Generator(device="cuda").manual_seed(31)
    qkv = torch.randn(2, 333, 3, 4, 128, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()

    def formula(qkv, dtype):
        return fa_reference(*(qkv[:, :, i] for i in range(3)), dtype, causal=True, window=(100, -1))

    check_grads(
        lambda qkv: fagen.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(100, -1)),
        lambda qkv, dtype: formula(qkv, dtype),
        (qkv,),
        "bf16",
        "qkvpacked",
    )


@needs_backward
def test_fully_masked_rows_give_zero_gradients():
    """M > N, bottom-right causal: the first M - N queries see no key; their dq is 0, nothing is NaN."""
    q, k, v = fa_inputs(1, 300, 100, 2, 2, 64, "bf16", seed=5)
    o = fagen.flash_attn_func(q, k, v, causal=True)
    o.float().square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert q.grad[:, :200].abs().max() == 0 and o[:, :200].abs().max() == 0


@needs_backward
def test_deterministic_backward_is_bitwise_reproducible():
    q, k, v = fa_inputs(2, 700, 700, 8, 2, 128, "bf16", seed=9)
    do = torch.randn(2, 700, 8, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(3):
        o = fagen.flash_attn_func(q, k, v, causal=True, deterministic=True)
        runs.append(torch.autograd.grad(o, (q, k, v), do))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


@needs_backward
def test_varlen_gradients():
    g = torch.Generator(device="cuda").manual_seed(13)
    lens_q, lens_k = [5, 300, 1], [17, 250, 40]
    q = torch.randn(sum(lens_q), 4, 64, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    k, v = (
        torch.randn(sum(lens_k), 2, 64, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
        for _ in range(2)
    )
    cum = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa: E731

    def formula(q, k, v, dtype):
        outs, at_q, at_k = [], 0, 0
        for Lq, Lk in zip(lens_q, lens_k):
            outs.append(
                fa_reference(
                    q[None, at_q : at_q + Lq], k[None, at_k : at_k + Lk], v[None, at_k : at_k + Lk], dtype, causal=True
                )[0]
            )
            at_q, at_k = at_q + Lq, at_k + Lk
        return torch.cat(outs)

    check_grads(
        lambda q, k, v: fagen.flash_attn_varlen_func(q, k, v, cum(lens_q), cum(lens_k), 300, 250, causal=True),
        formula,
        (q, k, v),
        "bf16",
        "varlen",
    )


@needs_backward
def test_torch_compile_fullgraph_forward_and_backward():
    """torch.compile(fullgraph=True) of a step using fagen.attention: no graph break, eager's gradients."""
    torch._dynamo.reset()
    q, k, v = (x.transpose(1, 2) for x in fa_inputs(2, 256, 256, 4, 2, 64, "bf16", seed=21))
    bias = torch.randn(4, device="cuda", requires_grad=True)
    fn = lambda s, b, h, q, k, bias: 20 * fagen.tanh((s + bias[h]) / 20)  # noqa: E731

    def step(q, k, v, bias):
        return fagen.attention(q, k, v, causal=True, score_mod=fn, bias=bias).float().square().mean()

    eager = torch.autograd.grad(step(q, k, v, bias), (q, k, v, bias))
    traced = torch.autograd.grad(torch.compile(step, fullgraph=True)(q, k, v, bias), (q, k, v, bias))
    for a, b in zip(traced, eager):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def paged_pool(lens_k, page_size, Hkv, D, dtype, seed):
    """A shuffled pool of pages [num_pages, page_size, Hkv, D] holding sequences of lens_k keys (table entries past
    a sequence's pages poisoned with out-of-range ids), its block_table, and `rows(pages, b)`: sequence b's keys
    read through the table (differentiable)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // page_size) for n in lens_k]
    num_pages = sum(need) + 5
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.full((len(lens_k), max(need) + 2), 2**30, dtype=torch.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(order[at : at + n], dtype=torch.int32)
        at += n
    make = lambda: torch.randn(num_pages, page_size, Hkv, D, generator=g, device="cuda").to(DTYPES[dtype])  # noqa: E731
    host = table.tolist()

    def rows(pages, b):
        index = torch.tensor([host[b][j // page_size] for j in range(lens_k[b])], device="cuda")
        return pages[index, torch.arange(lens_k[b], device="cuda") % page_size]

    return make().requires_grad_(), make().requires_grad_(), table.cuda(), rows


@needs_backward
@pytest.mark.parametrize("page_size", [16, 256])
def test_varlen_block_table_forward_and_gradients(page_size):
    """flash_attn_varlen_func with paged k, v (block_table): odd lengths, shuffled pages; o, dq and the pages'
    gradients (through the gather) against float64 autograd of the formula on each sequence's keys."""
    lens_q, lens_k = [5, 300, 1], [17, 251, 41]
    k_pages, v_pages, table, rows = paged_pool(lens_k, page_size, 2, 64, "bf16", seed=page_size)
    g = torch.Generator(device="cuda").manual_seed(17)
    q = torch.randn(sum(lens_q), 4, 64, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
    cum = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")  # noqa: E731

    def formula(q, k_pages, v_pages, dtype):
        outs, at_q = [], 0
        for b, Lq in enumerate(lens_q):
            kb, vb = rows(k_pages, b)[None], rows(v_pages, b)[None]
            outs.append(fa_reference(q[None, at_q : at_q + Lq], kb, vb, dtype, causal=True)[0])
            at_q += Lq
        return torch.cat(outs)

    def kernel(q, k_pages, v_pages):
        return fagen.flash_attn_varlen_func(
            q, k_pages, v_pages, cum(lens_q), cum(lens_k), 300, 251, causal=True, block_table=table
        )

    check_grads(kernel, formula, (q, k_pages, v_pages), "bf16", f"varlen paged {page_size}")
