"""The executor's backward, the CPU oracle of the gradients: against NumPy formulas for plain attention and
against central finite differences of the forward (the unfused program, run by the same executor) for every
shipped variant, custom score functions with learnable per-head tensors, GQA and fully masked rows."""

import numpy as np
import pytest

from fagen.ir import parse_program, variants
from fagen.passes import backward, fuse
from fagen.tools import executor

RNG_SEED = 20261122


def grads(plain, q, k, v, do, tensors=None, block_m=4, block_n=3, scale=None):
    """Forward (fused) then the derived backward, both in the executor: the gradients by name, o and lse."""
    fused = fuse.fuse(plain)
    fwd = executor.run(fused, dict(q=q, k=k, v=v), tensors=tensors, block_m=block_m, block_n=block_n, scale=scale)
    o, lse = fwd.outputs["o"], fwd.lse["o"]
    bwd = backward.derive(fused, plain)
    inputs = dict(q=q, k=k, v=v, o=o, do=do, lse=lse)
    out = executor.run(bwd, inputs, tensors=tensors, block_m=block_m, block_n=block_n, scale=scale).outputs
    return out, o, lse


def loss(plain, q, k, v, do, tensors=None, scale=None):
    """L = Σ dO ∘ O through the unfused program (softmax and matmuls as written)."""
    return float((executor.run(plain, dict(q=q, k=k, v=v), tensors=tensors, scale=scale).outputs["o"] * do).sum())


def check_fd(plain, q, k, v, do, tensors=None, eps=1e-5, rtol=1e-6, **kw):
    """Directional central differences of L along a random direction, for q, k, v and each tensor element."""
    g, _, _ = grads(plain, q, k, v, do, tensors, **kw)
    assert all(np.isfinite(x).all() for x in g.values())
    rng = np.random.default_rng(RNG_SEED + 1)
    args = dict(q=q, k=k, v=v)
    for name in ("q", "k", "v"):
        d = rng.standard_normal(args[name].shape)
        up = loss(plain, **{**args, name: args[name] + eps * d}, do=do, tensors=tensors)
        down = loss(plain, **{**args, name: args[name] - eps * d}, do=do, tensors=tensors)
        fd, exact = (up - down) / (2 * eps), float((g[f"d{name}"] * d).sum())
        assert abs(fd - exact) <= rtol * max(1.0, abs(exact)), (name, fd, exact)
    for tname, values in (tensors or {}).items():
        for i in np.ndindex(np.shape(values)):  # every element of the tensor
            bumped = []
            for sgn in (1, -1):
                x = np.array(values, dtype=float)
                x[i] += sgn * eps
                bumped.append({**tensors, tname: x})
            fd = (loss(plain, q, k, v, do, bumped[0]) - loss(plain, q, k, v, do, bumped[1])) / (2 * eps)
            assert abs(fd - g[f"d{tname}"][i]) <= rtol * max(1.0, abs(fd)), (tname, i, fd, g[f"d{tname}"][i])
    return g


def inputs(B=1, H=2, M=9, N=7, D=4, Hkv=None, seed=RNG_SEED):
    rng = np.random.default_rng(seed)
    Hkv = Hkv or H
    q = rng.standard_normal((B, H, M, D))
    k, v = (rng.standard_normal((B, Hkv, N, D)) for _ in range(2))
    return q, k, v, rng.standard_normal((B, H, M, D))


# --- (a) plain attention against NumPy's formulas ----------------------------------------------------------------
def numpy_backward(q, k, v, do, scale, keep):
    """FlashAttention's backward written out with NumPy (no rule, no tiling): dV = Pᵀ dO, dS = P ∘ (dP − D)."""
    s = np.where(keep, scale * q @ k.swapaxes(-1, -2), -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    o = p @ v
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (do * o).sum(-1, keepdims=True))
    return scale * ds @ k, scale * ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ do


@pytest.mark.parametrize("M, N", [(1, 1), (17, 17), (13, 5), (5, 13)])
@pytest.mark.parametrize("block_m, block_n", [(1, 1), (4, 3), (64, 64)])
@pytest.mark.parametrize("name", ["full", "causal", "causal_br"])
def test_matches_numpy_formulas(name, M, N, block_m, block_n):
    q, k, v, do = inputs(B=2, H=2, M=M, N=N, D=8)
    plain = variants.build(causal={"full": False, "causal": True, "causal_br": "bottom_right"}[name])
    keep = {
        "full": np.ones((M, N), bool),
        "causal": np.arange(N)[None, :] <= np.arange(M)[:, None],
        "causal_br": np.arange(N)[None, :] <= np.arange(M)[:, None] + N - M,
    }[name]
    g, _, _ = grads(plain, q, k, v, do, block_m=block_m, block_n=block_n)
    for got, want in zip((g["dq"], g["dk"], g["dv"]), numpy_backward(q, k, v, do, 1 / np.sqrt(8), keep)):
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


def test_gradients_runs_forward_and_backward():
    q, k, v, do = inputs(M=5, N=6, D=8)
    g = executor.gradients(fuse.fuse(variants.build(causal=True)), dict(q=q, k=k, v=v), do, block_n=4)
    keep = np.arange(6)[None, :] <= np.arange(5)[:, None]
    for got, want in zip((g["dq"], g["dk"], g["dv"]), numpy_backward(q, k, v, do, 1 / np.sqrt(8), keep)):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)
    assert g["o"].shape == q.shape and g["lse"].shape == q.shape[:-1]


def test_scale_override_reaches_the_backward():
    q, k, v, do = inputs(D=8)
    g, _, _ = grads(variants.build(), q, k, v, do, scale=0.3)
    for got, want in zip((g["dq"], g["dk"], g["dv"]), numpy_backward(q, k, v, do, 0.3, True)):
        np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-12)


# --- (b) finite differences, every shipped variant and custom score functions -----------------------------------
SHIPPED_OPTIONS = {
    "full": {},
    "causal": dict(causal=True),
    "causal_br": dict(causal="bottom_right"),
    "window": dict(causal=True, window=3),
    "window_two_sided": dict(window=(2, 1)),
    "softcap": dict(softcap=2.0),
    "prefix": dict(prefix=3),
    "causal_softcap": dict(causal=True, softcap=1.5),
}


@pytest.mark.parametrize("name", sorted(SHIPPED_OPTIONS))
def test_finite_differences(name):
    q, k, v, do = inputs(M=9, N=7)
    check_fd(variants.build(**SHIPPED_OPTIONS[name]), q, k, v, do)


def test_finite_differences_alibi_with_the_slopes_gradient():
    q, k, v, do = inputs(H=3, M=8, N=8)
    slopes = np.array(variants.alibi_slopes(3)) * 4  # large enough to matter at these sizes
    g = check_fd(variants.build(causal=True, alibi=True), q, k, v, do, dict(slopes=slopes))
    assert g["dslopes"].shape == (3,) and np.abs(g["dslopes"]).min() > 1e-3


@pytest.mark.parametrize(
    "score_mod, tensors",
    [
        (lambda s, b, h, q, k, bias: s + bias[h], dict(bias=np.array([0.3, -0.7]))),
        (lambda s, b, h, q, k, temp: s * temp[h], dict(temp=np.array([0.6, 1.7]))),
        (
            lambda s, b, h, q, k, temp, bias: 2 * variants.tanh(s * temp[h] / 2) + bias[h] * (q - k) / 4,
            dict(temp=np.array([1.3, 0.8]), bias=np.array([0.2, 0.5])),
        ),
        (lambda s, b, h, q, k: variants.maximum(s, -0.4) + abs(s) / 3, {}),  # a.e. smooth: steps at ties only
    ],
)
def test_finite_differences_of_custom_score_functions(score_mod, tensors):
    q, k, v, do = inputs(M=7, N=9)
    check_fd(variants.build(score_mod=score_mod, causal=True), q, k, v, do, tensors)


def test_finite_differences_of_a_per_batch_tensor():
    q, k, v, do = inputs(B=2, M=6, N=6)
    plain = variants.build(score_mod=lambda s, b, h, q, k, gain: s * gain[b])
    g = check_fd(plain, q, k, v, do, dict(gain=np.array([0.5, 1.5])))
    assert g["dgain"].shape == (2,)


def test_finite_differences_of_a_per_batch_and_head_tensor():
    q, k, v, do = inputs(B=2, H=3, M=6, N=7)
    prog = variants.build(score_mod=lambda s, b, h, q, k, bias: s - bias[b, h] * abs(q - k), causal=True)
    g = check_fd(prog, q, k, v, do, dict(bias=np.array([[0.5, 1.5, 0.25], [0.75, 0.1, 2.0]])))
    assert g["dbias"].shape == (2, 3) and np.abs(g["dbias"]).min() > 1e-4
    # broadcast along the batch (every batch reads row 0) and longer along the heads (head 3 is never read)
    g = check_fd(prog, q, k, v, do, dict(bias=np.array([[0.5, 1.5, 0.25, 0.6]])))
    assert g["dbias"].shape == (1, 4) and g["dbias"][0, 3] == 0 and np.abs(g["dbias"][0, :3]).min() > 1e-4


def test_gqa_sums_dk_dv_over_the_group():
    """4 query heads on 2 key/value heads: the gradients of k and v are the sums over each group, and equal
    finite differences through a forward that repeats k and v explicitly."""
    q, k, v, do = inputs(H=4, Hkv=2, M=8, N=6)
    plain = variants.build(causal=True, softcap=3.0)
    g, _, _ = grads(plain, q, k, v, do)
    assert g["dk"].shape == k.shape and g["dv"].shape == v.shape
    full, _, _ = grads(plain, q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), do)
    np.testing.assert_allclose(g["dq"], full["dq"], rtol=1e-12, atol=1e-13)
    for n in ("dk", "dv"):
        np.testing.assert_allclose(g[n], full[n].reshape(1, 2, 2, 6, 4).sum(2), rtol=1e-12, atol=1e-13)
    eps, rng = 1e-5, np.random.default_rng(7)
    for name, x in (("k", k), ("v", v)):
        d = rng.standard_normal(x.shape)

        def at(y, name=name):
            kv = {"k": k, "v": v, name: y}
            return loss(plain, q, np.repeat(kv["k"], 2, axis=1), np.repeat(kv["v"], 2, axis=1), do)

        fd = (at(x + eps * d) - at(x - eps * d)) / (2 * eps)
        assert abs(fd - (g[f"d{name}"] * d).sum()) <= 1e-6 * max(1.0, abs(fd))


def test_gqa_heads_must_divide():
    q, k, v, do = inputs(H=3, Hkv=2)
    with pytest.raises(ValueError, match="2 heads do not divide the 3 heads"):
        grads(variants.build(), q, k, v, do)


def test_fully_masked_rows_have_zero_gradients_and_no_nan():
    """Bottom-right causal with M > N: the first M - N queries see no key (lse = -inf)."""
    M, N = 12, 5
    q, k, v, do = inputs(M=M, N=N)
    plain = variants.build(causal="bottom_right", softcap=2.0)
    g, o, lse = grads(plain, q, k, v, do)
    assert np.isneginf(lse[:, :, : M - N]).all() and np.isfinite(lse[:, :, M - N :]).all()
    assert all(np.isfinite(x).all() for x in g.values())
    assert (g["dq"][:, :, : M - N] == 0).all()
    # row M - N sees one key (P = 1 whatever its score: dQ = 0 too); the rows after it see several
    assert np.abs(g["dq"][:, :, M - N]).max() < 1e-15 and np.abs(g["dq"][:, :, M - N + 1 :]).min() > 0
    check_fd(plain, q, k, v, do)
    # the masked rows' dO does not reach dK or dV
    do2 = do.copy()
    do2[:, :, : M - N] = 1e3
    g2, _, _ = grads(plain, q, k, v, do2)
    for n in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(g2[n], g[n])


def test_the_backward_of_a_user_program():
    """A program from text, with its own names: the backward names its inputs and gradients after them."""
    text = (
        "program mine\nquery: T[B, H, M, D] = input()\nkey: T[B, H, N, D] = input()\nvalue: T[B, H, N, D] = input()\n"
        "s: f32[B, H, M, N] = matmul(query, key, transpose_b=True)\nt: f32[B, H, M, N] = scale(s, factor=1/sqrt(D))\n"
        "c: f32[B, H, M, N] = score_mod(t, fn=s + bias[h])\nu: f32[B, H, M, N] = mask(c, keep=k <= q + 1)\n"
        "p: f32[B, H, M, N] = softmax(u, axis=N)\nout: T[B, H, M, D] = matmul(p, value)\noutput(out)\n"
    )
    plain = parse_program(text)
    fused = fuse.fuse(plain)
    derived = backward.derive(fused, plain)
    assert derived.outputs == ("dquery", "dkey", "dvalue", "dbias")
    q, k, v, do = inputs(M=6, N=6)
    bias = dict(bias=np.array([0.1, -0.4]))
    ev = executor.run(fused, dict(query=q, key=k, value=v), tensors=bias)
    g = executor.run(
        derived, dict(query=q, key=k, value=v, out=ev.outputs["out"], dout=do, lse=ev.lse["out"]), tensors=bias
    ).outputs
    eps = 1e-5
    f = [
        (
            executor.run(plain, dict(query=q, key=k, value=v), tensors=dict(bias=bias["bias"] + d)).outputs["out"] * do
        ).sum()
        for d in (np.array([eps, 0]), np.array([-eps, 0]))
    ]
    assert abs((f[0] - f[1]) / (2 * eps) - g["dbias"][0]) < 1e-7
