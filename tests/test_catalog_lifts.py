"""What the public catalogs (tests/catalogs.py) needed of the tracer, each lifted where it was refused: a captured
0-d tensor (FlexAttention's `scale = torch.ones((), ...)`, `which_bias = torch.tensor(0)`), a list of numbers
indexed by a symbolic index (FlashAttention-4's `offsets = cu_seqlens_k.tolist(); offsets[b]`), and the gradient
through a float remainder (torch.remainder / torch.fmod of the score)."""

import numpy as np
import pytest
import sympy as sp

import fagen
from fagen import pipeline
from fagen.ir import exprs, variants
from fagen.ir.exprs import ExprError
from fagen.math import backward as bw
from fagen.tools import executor

S = exprs.SCORE
q, k, b, h = (exprs.INDICES[n] for n in "qkbh")


def T(name):
    return exprs.tensor(name)


# --- a captured 0-d tensor: a call-time number, read as name[0] ----------------------------------------------------
def test_a_captured_0d_tensor_is_read_as_a_call_time_number():
    """Before: 'tensor scale must be indexed ... (a 0-d tensor is not read)'. Now the element is read, as a number
    (score + scale), as an index (bias[b][h][which, q_idx]), through .item() and through a helper function."""
    torch = pytest.importorskip("torch")
    scale = torch.ones((), dtype=torch.int32)
    which = torch.tensor(0)
    bias = torch.randn(2, 3, 4, 70)
    g = torch.tensor(2.0, requires_grad=True)

    def helper(s):
        return s * g  # a 0-d tensor a helper reads: a torch tensor's own operator

    # named captured_scale: `scale` is a keyword of the kernel's calls (variants.CALL_KEYWORDS)
    assert variants.trace_score(lambda s, b, h, q_idx, kv_idx: s + scale) == S + T("captured_scale")[0]
    got = variants.trace_score(lambda s, b, h, q_idx, kv_idx: s + bias[b][h][which, q_idx])
    assert got == S + T("bias")[b, h, exprs.tensor("which", index=True)[0], q]
    assert variants.trace_score(lambda s, b, h, q_idx, kv_idx: s * g.item()) == S * T("g")[0]
    got = variants.trace_score(lambda s, b, h, q_idx, kv_idx: helper(s) + (g > 1.0))
    assert got == S * T("g")[0] + sp.Piecewise((1, T("g")[0] > 1.0), (0, True))
    with pytest.raises(ExprError, match=r"g\[0\] is a number, not indexed \(a 0-d tensor is read as its element\)"):
        variants.trace_score(lambda s, b, h, q_idx, kv_idx: (lambda: g[0])() + s)


def test_the_kernel_is_passed_a_1_element_view_of_a_0d_tensor(tmp_path):
    """The kernel reads captured_scale[0] of a rank-1 tensor: Captured.value gives a view of the 0-d object (one
    storage, and autograd carries a float one's gradient back through it); raw is the object itself."""
    torch = pytest.importorskip("torch")
    scale = torch.full((), 3, dtype=torch.int32)
    g = torch.tensor(0.5, requires_grad=True)
    fn = lambda s, b, h, q_idx, kv_idx: s * g + scale  # noqa: E731
    caps = {c.name: c for c in variants.captured(fn)}
    assert caps["captured_scale"].raw(fn) is scale
    view = caps["captured_scale"].value(fn)
    assert view.shape == (1,) and view.data_ptr() == scale.data_ptr()
    (view_g := caps["g"].value(fn)).sum().backward()
    assert view_g.shape == (1,) and g.grad == 1.0
    kern = fagen.compile(64, score_mod=fn, arch="sm_90a", cache_dir=tmp_path)
    assert {a.name: (a.dtype, a.rank) for a in kern.tensor_args} == {"g": ("f32", 1), "captured_scale": ("i32", 1)}
    assert kern.with_captured({})["captured_scale"].shape == (1,)


def test_executor_gradient_of_a_0d_float_tensor_matches_finite_differences():
    """dg of score · g + g²: every score adds into the one element."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    M, N, B, H, D = 5, 7, 1, 2, 4
    g = torch.tensor(0.7)
    fused = pipeline.lower(variants.build(score_mod=lambda s, b, h, q, k: s * g + g * g), "f32")[-1].program
    qkv = {n: rng.standard_normal((B, H, m, D)) for n, m in (("q", M), ("k", N), ("v", N))}
    do = rng.standard_normal((B, H, M, D))
    grads = executor.gradients(fused, qkv, do, tensors={"g": np.array([0.7])}, block_m=4, block_n=4)

    def loss(x):
        return float((executor.run(fused, qkv, tensors={"g": np.array([x])}).outputs["o"] * do).sum())

    fd = (loss(0.7 + 1e-6) - loss(0.7 - 1e-6)) / 2e-6
    assert grads["dg"].shape == (1,)
    np.testing.assert_allclose(grads["dg"][0], fd, atol=1e-6)
    assert fd != 0


# --- a list of numbers indexed by a symbolic index: a constant table of the kernel --------------------------------
def test_a_list_of_numbers_indexed_by_an_index_is_a_constant_table():
    """Before: 'a symbolic value was used as a Python integer (a list or tuple indexed by it, ...)'. Now a list (or
    tuple) of numbers from the closure or module is the kernel's constant: its entry at the index, clamped to the list
    as tensor reads are."""
    torch = pytest.importorskip("torch")
    offsets = torch.tensor([0, 256, 512, 768, 1024]).tolist()  # FlashAttention-4's debug_global_idx_factory

    def mod(score, b, h, q_idx, kv_idx):
        global_kv = offsets[b] + kv_idx
        return score + global_kv.float() * 0.001

    got = variants.trace_score(mod)
    table = got.coeff(sp.Float(0.001)) - k
    assert [table.subs(b, i) for i in range(7)] == [0, 256, 512, 768, 1024, 1024, 1024]
    lengths = (3, 7)
    mask = variants.trace_mask(lambda b, h, q, k: (k < lengths[h]) & (q >= lengths[0]))
    assert mask == sp.And(q >= 3, k < sp.Piecewise((3, h <= 0), (7, True)))
    assert lengths[0] == 3 and len(lengths) == 2  # the caller's tuple is untouched
    kern = fagen.compile(64, score_mod=mod, arch="sm_90a", use_cache=False)
    assert kern.tensors == ()


def test_a_table_too_long_or_indexed_by_a_float_or_made_in_the_function_is_refused():
    big = list(range(100))
    halves = [0.5, 1.5]
    with pytest.raises(ExprError, match=r"the list big \(100 numbers\) is indexed by a symbolic value; at most 64"):
        variants.trace_mask(lambda b, h, q, k: k < big[h])
    with pytest.raises(ExprError, match=r"the list halves is indexed by .*, which is not an integer"):
        variants.trace_score(lambda s, b, h, q, k: s + halves[s])
    with pytest.raises(ExprError, match="a list made inside the function indexed by it"):
        variants.trace_mask(lambda b, h, q, k: k < [1, 2][h])


def test_a_closure_list_is_keyed_by_its_values():
    from fagen.request import function_key

    def make(values):
        return lambda b, h, q, k: k < values[h]

    assert function_key(make([1, 2])) == function_key(make([1, 2])) != function_key(make([1, 3]))


# --- the gradient through a float remainder -------------------------------------------------------------------------
def test_a_remainder_of_the_score_differentiates_as_its_dividend():
    """Before: '% (3) is piecewise constant in the score'. torch's rule: d remainder(x, c) / dx = 1 (almost
    everywhere), fmod the same; a remainder by a divisor that depends on the score is still refused."""
    assert bw.make_backward_rule(sp.Mod(S, 3), sp.true).score_derivative == 1
    assert bw.make_backward_rule(exprs.fmod(2 * S, 3) ** 2, sp.true).score_derivative == 4 * exprs.fmod(2 * S, 3)
    assert bw.make_backward_rule(sp.Mod(sp.Mod(S, 3) * S, 2), sp.true).score_derivative == S + sp.Mod(S, 3)
    with pytest.raises(bw.BackwardError, match=r"the divisor of \(3\) % \(s\) depends on the score"):
        bw.make_backward_rule(sp.Mod(3, S), sp.true)


@pytest.mark.parametrize("op", ["remainder", "fmod"])
def test_executor_gradient_through_a_remainder_matches_finite_differences(op):
    torch = pytest.importorskip("torch")
    score = {
        "remainder": lambda s, b, h, q, k: torch.remainder(s, 0.7),
        "fmod": lambda s, b, h, q, k: torch.fmod(s * 2, 0.9) + s,
    }[op]
    rng = np.random.default_rng(0)
    M, N, B, H, D = 7, 9, 1, 2, 4
    fused = pipeline.lower(variants.build(score_mod=score), "f32")[-1].program
    q_, k_, v_ = (rng.standard_normal((B, H, n, D)) for n in (M, N, N))
    do = rng.standard_normal((B, H, M, D))
    g = executor.gradients(fused, dict(q=q_, k=k_, v=v_), do, block_m=4, block_n=4)

    def loss(x):
        return float((executor.run(fused, dict(q=x, k=k_, v=v_)).outputs["o"] * do).sum())

    fd = np.zeros_like(q_)
    for idx in np.ndindex(*q_.shape):
        up, down = q_.copy(), q_.copy()
        up[idx] += 1e-7
        down[idx] -= 1e-7
        fd[idx] = (loss(up) - loss(down)) / 2e-7
    np.testing.assert_allclose(g["dq"], fd, atol=1e-6)


def test_the_backward_of_a_remainder_score_compiles(tmp_path):
    """The backward's main kernel of score + remainder(s, 3) + fmod(s, 2) prints as CUDA that NVRTC compiles."""
    torch = pytest.importorskip("torch")
    from fagen.backend import build, codegen, plan
    from fagen.backend.contract import Kind
    from fagen.pipeline import load_program, lower

    from .lowered import lowered

    score = lambda s, b, h, q, k: s + torch.remainder(s, 3.0) + torch.fmod(s, 2.0)  # noqa: E731
    program = lower(load_program(score_mod=score), "bf16")[-1].program
    spec = plan.choose(program.name, 64, "bf16", "sm_90a", "simt", causal=False, kind=Kind.BWD).spec
    src = codegen.render(spec, lowered(program, backward=True))
    binary = build.compile_cubin(src, spec, cache_dir=tmp_path)
    assert "warning" not in binary.log, binary.log
    assert "fmodf(" in src


# --- an index comparison through abs of a fraction of the indices ----------------------------------------------------
def test_abs_of_a_fraction_of_the_indices_compares_exactly_in_integers(tmp_path):
    """Before: 'comparison abs(k/64 - q/64) <= 3 of indices is not integer arithmetic'. FlexAttention's natten_2d
    (idx / W true division, then |q_x - kv_x| <= window): the denominators come out of the abs, so the kernel
    compares |k - q| <= 192 in integers; on a grid it keeps what torch's float32 computation keeps."""
    torch = pytest.importorskip("torch")
    W, WINDOW = 64, 3

    def natten_mask(score, b, h, q, kv):
        q_x, q_y = q / W, q % W
        kv_x, kv_y = kv / W, kv % W
        near = ((q_x - kv_x).abs() <= WINDOW) | ((q_y - kv_y).abs() <= WINDOW)
        return torch.where(near, score, float("-inf"))

    _, keep = variants.trace_score_and_mask(natten_mask)
    assert exprs.exact_index_form(sp.Abs(k / 64 - q / 64) <= 3) == (sp.Abs(k - q), "<=", 192)
    kern = fagen.compile(64, score_mod=natten_mask, arch="sm_90a", cache_dir=tmp_path)
    assert "abs(k_idx - q_idx) <= 192" in kern.source
    qi, ki = torch.arange(700)[:, None], torch.arange(700)[None, :]
    want = torch.isfinite(natten_mask(torch.zeros(()), 0, 0, qi, ki))
    exact = sp.lambdify((q, k), exprs.exact_relations(keep), "numpy")
    assert np.array_equal(np.broadcast_to(exact(qi.numpy(), ki.numpy()), want.shape), want.numpy())


# --- a captured tensor's sizes ---------------------------------------------------------------------------------------
def test_a_captured_tensors_sizes_are_constants_and_key_the_function():
    """Before: 'Tensor.shape of the tensor doc_ids: ... its sizes and values are not part of the kernel'.
    FlexAttention's doc_mask_clamped_repro clamps with doc_ids.shape[0] - 1: the sizes the object has now are the
    kernel's constants, and a function that reads sizes is keyed by them (a new size traces anew); a parameter's sizes
    are unknown."""
    torch = pytest.importorskip("torch")
    from fagen.request import function_key

    doc_ids = torch.arange(300) // 100

    def doc_mask_mod(b, h, q_idx, kv_idx):
        last = doc_ids.shape[0] - 1
        return doc_ids[q_idx.clamp(0, last)] == doc_ids[kv_idx.clamp(0, len(doc_ids) - doc_ids.dim())]

    ids = exprs.tensor("doc_ids")
    assert variants.trace_mask(doc_mask_mod) == sp.Eq(ids[sp.Min(q, 299)], ids[sp.Min(k, 299)])
    before = function_key(doc_mask_mod)
    doc_ids = torch.arange(400) // 100  # noqa: F841 - read by doc_mask_mod
    assert variants.trace_mask(doc_mask_mod) == sp.Eq(ids[sp.Min(q, 399)], ids[sp.Min(k, 399)])
    assert function_key(doc_mask_mod) != before
    bias = torch.zeros(4, 8)
    assert variants.trace_score(lambda s, b, h, q, k: s + bias[b][bias[b].size(0) - 1 - h]) == S + T("bias")[b, 7 - h]
    with pytest.raises(ExprError, match=r"Tensor.shape of the tensor t, a parameter: its sizes are not part"):
        variants.trace_score(lambda s, b, h, q, k, t: s + t[t.shape[0] - 1])


# --- what stays refused says what it is -------------------------------------------------------------------------------
def test_an_autograd_function_is_refused_naming_it():
    """Before: 'tracing the function raised RuntimeError: mark_non_differentiable only accepts variable arguments'
    (FlexAttention's test_autograd_function_in_score_mod). Now the message names the construct."""
    torch = pytest.importorskip("torch")

    class ApplyMask(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(a, mask):
            return torch.where(mask, a, -float("inf"))

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.mark_non_differentiable(inputs[1])

        @staticmethod
        def backward(ctx, i):
            return i, None

    with pytest.raises(ExprError, match=r"^score_mod: a torch.autograd.Function is not traced \(fagen derives"):
        variants.trace_score(lambda score, b, h, q, kv: ApplyMask.apply(score, q <= kv))


# --- a captured tensor's row, reduced --------------------------------------------------------------------------------
def _euclidean(means, length_scales):
    import torch

    def euclidean_dist_pos_embed(score, b, h, q_idx, k_idx):  # FlexAttention's test_reduction_unrolled
        q_pos = means[q_idx]
        k_pos = means[k_idx]
        dist = (q_pos - k_pos).pow(2).sum(-1).sqrt()
        scale = length_scales[h]
        inv_dist = torch.exp(-dist / scale)
        return inv_dist * score

    return euclidean_dist_pos_embed


def test_a_row_of_a_captured_tensor_computes_element_by_element_and_reduces():
    """Before: 'tensor means is read with 1 of its 2 indices'. means[q_idx] of a [S, 3] means is a row of 3
    elements: arithmetic, torch functions and methods apply to each, and sum/mean/prod/amax/amin/norm over its
    dimension give a number; a row used as a number, reduced over another dimension, or longer than 16, is refused."""
    torch = pytest.importorskip("torch")
    means, scales = torch.randn(64, 3), torch.ones(8)
    m = T("means")
    dist = sp.sqrt(sum((m[q, j] - m[k, j]) ** 2 for j in range(3)))
    assert variants.trace_score(_euclidean(means, scales)) == S * sp.exp(-dist / T("length_scales")[h])
    got = variants.trace_score(lambda s, b, h, q, k: s + torch.abs(means[q] - 1).amax(-1) + means[k].mean(dim=-1))
    assert got == S + sp.Max(*(sp.Abs(m[q, j] - 1) for j in range(3))) + sum(m[k, j] for j in range(3)) / 3
    assert variants.trace_score(lambda s, b, h, q, k: s * means[q][2]) == S * m[q, 2]
    wide = torch.randn(64, 17)
    for fn, message in [
        (lambda s, b, h, q, k: s + means[q], "a row of 3 elements of the tensor means is used as one number"),
        (lambda s, b, h, q, k: s + means[q].sum(0, keepdim=True), "reduce over its one dimension"),
        (lambda s, b, h, q, k: s + means[q].cumsum(0)[0], "Tensor.cumsum of a row of the tensor means"),
        (lambda s, b, h, q, k: s + wide[q].sum(), "a row of 17 elements of the tensor wide is computed on; at most 16"),
    ]:
        with pytest.raises(ExprError, match=message):
            variants.trace_score(fn)


def test_executor_of_a_reduced_row_matches_torch_and_its_key_has_the_sizes(tmp_path):
    """The float64 executor of the Euclidean-distance score against torch computing the function on index grids; the
    kernel compiles; a function that reduces is keyed by its captured tensors' sizes (the row's length is a
    constant)."""
    torch = pytest.importorskip("torch")
    from fagen.request import function_key
    from fagen.tools import testing

    rng = np.random.default_rng(3)
    B, H, M, N, D = 1, 2, 6, 9, 4
    means, scales = torch.tensor(rng.standard_normal((N, 3))), torch.tensor(rng.uniform(0.5, 2, H))
    fn = _euclidean(means, scales)
    fused = pipeline.lower(variants.build(score_mod=fn), "f32")[-1].program
    qkv = {n: rng.standard_normal((B, H, m, D)) for n, m in (("q", M), ("k", N), ("v", N))}
    tensors = {"means": means.numpy(), "length_scales": scales.numpy()}
    got = executor.run(fused, qkv, tensors=tensors).outputs["o"]
    b_, h_, qi, ki = testing.index_grids(B, H, M, N, "cpu")
    keep = np.ones((B, H, M, N), dtype=bool)
    want, _ = testing.reference(
        *(torch.tensor(qkv[n]) for n in "qkv"), keep, 1 / np.sqrt(D), score=lambda s: fn(s, b_, h_, qi, ki)
    )
    np.testing.assert_allclose(got, want.numpy(), atol=1e-12)
    kern = fagen.compile(64, score_mod=_euclidean(means.float(), scales.float()), arch="sm_90a", cache_dir=tmp_path)
    assert kern.tensors == ("length_scales", "means")
    assert function_key(fn) != function_key(_euclidean(torch.randn(N, 4), scales))
