"""Variants: shipped programs, traced Python functions, the executor against naive attention, refusals."""

import inspect
import math

import numpy as np
import pytest
import sympy as sp

import fagen
from fagen import resources
from fagen.backend import plan
from fagen.backend.spec import KernelSpec
from fagen.ir import IRError, exprs, parse_program, variants
from fagen.ir.exprs import ExprError
from fagen.passes import fuse
from fagen.tools import executor

SHIPPED = {
    "sliding_window": dict(causal=True, window=256),
    "alibi": dict(causal=True, alibi=True),
    "softcap": dict(softcap=30),
    "prefix_lm": dict(prefix=128),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_ir_files_are_what_the_options_build(name):
    path = resources.shipped_programs()[name]
    assert parse_program(path.read_text()) == variants.build(**SHIPPED[name])


def naive(q, k, v, scale, keep, score=None):
    """softmax(score(scale · q kᵀ)) v with NumPy; rows with no visible key give 0."""
    s = scale * np.einsum("bhmd,bhnd->bhmn", q, k)
    if score is not None:
        s = score(s)
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    return np.einsum("bhmn,bhnd->bhmd", e / np.where(total > 0, total, 1.0), v)


def _grid(M, N):
    return np.arange(M)[:, None], np.arange(N)[None, :]


CASES = {
    "window": (dict(causal=True, window=5), lambda q, k, M, N: (k <= q) & (q - k <= 5), None),
    "window_two_sided": (dict(window=(3, 2)), lambda q, k, M, N: (q - k <= 3) & (k - q <= 2), None),
    "prefix": (dict(prefix=7), lambda q, k, M, N: (k < 7) | (k <= q), None),
    "softcap": (dict(softcap=2.5), lambda q, k, M, N: np.ones((M, N), bool), lambda s, sl: 2.5 * np.tanh(s / 2.5)),
    "alibi": (
        dict(causal=True, alibi=True),
        lambda q, k, M, N: k <= q,
        lambda s, sl: s + sl[None, :, None, None] * (np.arange(s.shape[-1])[None, :] - np.arange(s.shape[-2])[:, None]),
    ),
    "custom": (
        dict(
            mask=lambda b, h, q, k: (q >= k) & fagen.ne((q - k) % 3, 1),
            score_mod=lambda s, b, h, q, k: s * variants.sigmoid(s) + h * 0.1,
        ),
        lambda q, k, M, N: (q >= k) & ((q - k) % 3 != 1),
        lambda s, sl: s / (1 + np.exp(-s)) + 0.1 * np.arange(s.shape[1])[None, :, None, None],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("M, N", [(23, 23), (19, 31), (31, 12)])
def test_executor_matches_naive(name, M, N):
    options, keep_fn, score_fn = CASES[name]
    program = variants.build(**options)
    rng = np.random.default_rng(1007)
    B, H, D = 2, 3, 8
    q, k, v = (rng.standard_normal((B, H, S, D)) for S in (M, N, N))
    slopes = np.array(variants.alibi_slopes(H))
    qi, ki = _grid(M, N)
    ref = naive(
        q, k, v, 1 / math.sqrt(D), keep_fn(qi, ki, M, N), None if score_fn is None else (lambda s: score_fn(s, slopes))
    )
    tensors = {"slopes": slopes} if options.get("alibi") else {}
    for prog, kw in ((program, {}), (fuse.fuse(program), dict(block_m=5, block_n=4))):
        out = executor.run(prog, dict(q=q, k=k, v=v), tensors=tensors, **kw).outputs["o"]
        np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)


def test_random_affine_masks_through_the_pipeline():
    """Random masks: the fused executor against naive attention, and the derived key ranges proven."""
    from tests.test_bounds import _random_affine_mask

    gen = np.random.default_rng(2007)
    for _ in range(6):
        keep = _random_affine_mask(gen)
        program = variants.program([keep], [], ["random"])
        M, N = (int(x) for x in gen.integers(5, 40, 2))
        q, k, v = (gen.standard_normal((1, 2, S, 8)) for S in (M, N, N))
        values = {
            exprs.INDICES["q"]: np.arange(M)[:, None],
            exprs.INDICES["k"]: np.arange(N)[None, :],
            exprs.DIMS["M"]: M,
            exprs.DIMS["N"]: N,
        }
        mask = np.broadcast_to(executor._evaluate(keep, values), (M, N))
        out = executor.run(fuse.fuse(program), dict(q=q, k=k, v=v), block_m=4, block_n=8).outputs["o"]
        np.testing.assert_allclose(out, naive(q, k, v, 1 / math.sqrt(8), mask), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "options, tier", [(o, t) for o in SHIPPED.values() for t in ("mma", "simt")] + [(CASES["custom"][0], "mma")]
)
def test_variants_compile_without_spills(options, tier, tmp_path):
    kernel = fagen.compile(128, dtype="bf16", arch="sm_90a", tier=tier, cache_dir=tmp_path, **options)
    assert not kernel.resources.spills, str(kernel.resources)
    assert "warning" not in kernel.binary.log


def test_a_spilling_plan_steps_down_to_lighter_tiles(tmp_path):
    spec = KernelSpec("softcap30", 128, "bf16", "sm_90a", "mma", 128, 64, 4, 2)
    lighter = plan.lighter(spec)
    assert (lighter.block_m, lighter.block_n, lighter.num_warps) == (64, 64, 4)
    assert plan.lighter(plan.lighter(lighter)) is None or plan.lighter(lighter).block_n == 32


def test_window_kernel_loops_over_the_window_only():
    src = fagen.compile(128, causal=True, window=256, dtype="bf16", arch="sm_90a").source
    assert "begin = max(begin, q_lo - 256);" in src and "end = min(end, q_hi + 1);" in src
    assert "full_begin_0 = max(full_begin_0, q_hi - 256);" in src


@pytest.mark.parametrize("tier", ["mma", "simt"])
def test_each_term_gets_its_own_range(tier):
    """prefix-LM has two terms: each fully visible range is named for its own term."""
    src = fagen.compile(64, prefix=100, dtype="f16", arch="sm_90a", tier=tier).source
    assert "end = min(end, q_hi + 1);" in src and "end = min(end, 100);" in src
    if tier == "mma":
        assert "full_end_0 = min(full_end_0, q_lo + 1);" in src
        assert "full_end_1 = min(full_end_1, 100);" in src
        assert "full_end_0 = min(full_end_0, 100);" not in src


def test_alibi_kernel_takes_slopes():
    k = fagen.compile(64, causal=True, alibi=True, dtype="f16", arch="sm_90a")
    assert k.tensors == ("slopes",) and "const float* __restrict__ tensor_slopes" in k.source
    assert "fagen_read(tensor_slopes, fagen_at(h, tensor_slopes_size_0, tensor_slopes_stride_0))" in k.source


# traced functions with call-time tensors (extra parameters indexed by h or b): the function, the NumPy score
# given the tensor, and what the tensor is indexed by
TENSOR_CASES = {
    "temperature": (lambda s, b, h, q, k, temp: s * temp[h], lambda s, t: s * t[None, :, None, None], "h"),
    "batch_offset": (lambda s, b, h, q, k, off: s + off[b], lambda s, t: s + t[:, None, None, None], "b"),
    "head_bias": (lambda s, b, h, q, k, bias: s + bias[h], lambda s, t: s + t[None, :, None, None], "h"),
    "mixed": (
        lambda s, b, h, q, k, temp: fagen.where(q >= k, s * temp[h], s - temp[h] * (q - k)),
        lambda s, t: np.where(
            np.arange(s.shape[2])[:, None] >= np.arange(s.shape[3])[None, :],
            s * t[None, :, None, None],
            s - t[None, :, None, None] * (np.arange(s.shape[2])[:, None] - np.arange(s.shape[3])[None, :]),
        ),
        "h",
    ),
}


@pytest.mark.parametrize("name", sorted(TENSOR_CASES))
@pytest.mark.parametrize("M, N", [(23, 23), (19, 31)])
def test_traced_tensors_match_naive(name, M, N):
    fn, score_fn, index = TENSOR_CASES[name]
    program = variants.build(score_mod=fn, causal=name == "batch_offset")
    tensor = list(inspect.signature(fn).parameters)[-1]
    rng = np.random.default_rng()
    B, H, D = 2, 3, 8
    q, k, v = (rng.standard_normal((B, H, S, D)) for S in (M, N, N))
    values = rng.uniform(-1.5, 1.5, B if index == "b" else H)
    qi, ki = _grid(M, N)
    keep = (ki <= qi) if name == "batch_offset" else np.ones((M, N), bool)
    ref = naive(q, k, v, 1 / math.sqrt(D), keep, lambda s: score_fn(s, values))
    for prog, kw in ((program, {}), (fuse.fuse(program), dict(block_m=5, block_n=4))):
        out = executor.run(prog, dict(q=q, k=k, v=v), tensors={tensor: values}, **kw).outputs["o"]
        np.testing.assert_allclose(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", sorted(TENSOR_CASES))
@pytest.mark.parametrize(
    "arch, tier, dtype",
    [("sm_90a", "mma", "bf16"), ("sm_90a", "simt", "f32"), ("sm_80", "mma", "f16"), ("sm_80", "simt", "bf16")],
)
def test_traced_tensors_compile(name, arch, tier, dtype, tmp_path):
    fn, _, index = TENSOR_CASES[name]
    tensor = list(inspect.signature(fn).parameters)[-1]
    kernel = fagen.compile(64, score_mod=fn, dtype=dtype, arch=arch, tier=tier, cache_dir=tmp_path)
    assert kernel.spec.tier == tier and kernel.tensors == (tensor,)
    assert f"const float* __restrict__ tensor_{tensor}" in kernel.source
    assert (
        f"fagen_read(tensor_{tensor}, fagen_at({index}, tensor_{tensor}_size_0, tensor_{tensor}_stride_0))"
        in kernel.source
    )
    assert not kernel.resources.spills, str(kernel.resources)
    assert "warning" not in kernel.binary.log


_closure_tensor = exprs.tensor("elsewhere")


@pytest.mark.parametrize(
    "fn, what, fragment",
    [
        (lambda s, b, h, q, k, bias: s + bias, "score_mod", "tensor bias must be indexed, e.g. bias[h]"),
        (
            lambda s, b, h, q, k, bias: s + bias[h] + _closure_tensor[h],
            "score_mod",
            "tensor elsewhere is not one of the function's parameters (bias)",
        ),
        (lambda s, b, h, q, k, bias: s + bias[h, b] + bias[h], "score_mod", "read with 1 and with 2 indices"),
        (lambda b, h, q, k, lim: q - k <= lim[h + 0.5], "mask", "is not integer arithmetic"),
    ],
)
def test_traced_tensors_are_checked(fn, what, fragment):
    with pytest.raises(ExprError) as e:
        variants.build(**{what: fn})
    assert fragment in str(e.value) and str(e.value).startswith(what)


@pytest.mark.parametrize(
    "fn, what, fragment",
    [
        (lambda b, h, q, k: q >= k and q < 9, "mask", "use & | ~ and fagen.where"),
        (lambda b, h, q, k: q is k, "mask", "'is' compares objects in Python"),
        (lambda b, h, q, k: q in (k, 3), "mask", "'in' compares objects in Python"),
        (lambda b, h, q, k: math.floor(q) > k, "mask", "a numeric function was called on a symbolic value"),
        (lambda b, h, q, k: sp.asin(q) > k, "mask", "asin is not allowed"),
        (lambda b, h, q, k: q**k > 3, "mask", "power"),
        (lambda b, h, q, k: q + k, "mask", "expected a condition"),
        (lambda b, h, q, k: sp.Symbol("evil") > k, "mask", "unknown symbol evil"),
        (lambda s, b, h, q, k: s + sp.oo, "score_mod", "infinities are not allowed"),
        (lambda s, b, h, q, k: q > k, "score_mod", "expected a number"),
        (lambda s, b, h, q, k, table: s + table[s], "score_mod", "an index reads only b, h, q, k, M, N"),
        (lambda s, b, h, q, k, __x: s, "score_mod", "tensor name '__x'"),
        (lambda s, b, h, q, k, int: s, "score_mod", "not a C keyword"),
        (lambda s, b, h, q, k: open("/etc/passwd"), "score_mod", "expected an expression"),
    ],
)
def test_traced_functions_are_checked(fn, what, fragment):
    with pytest.raises(ExprError) as e:
        variants.build(**{what: fn})
    assert fragment in str(e.value) and str(e.value).startswith(what)


@pytest.mark.parametrize(
    "attr, text, fragment",
    [
        ("keep", "__import__('os').system('rm -rf /')", "only plain calls"),
        ("keep", "k <= q; import os", "cannot parse"),
        ("fn", "s.__class__", "construct Attribute is not allowed"),
        ("fn", "s + slopes[s]", "an index reads only b, h, q, k, M, N"),
        ("fn", "s + exec('x')", "function 'exec' is not allowed"),
        ("fn", "s + float[h]", "not a C keyword"),
        ("fn", "s + __t[h]", "tensor name '__t'"),
        ("keep", "k <= q\\n#", "cannot parse"),
    ],
)
def test_ir_file_injection_attempts_are_refused(attr, text, fragment):
    base = resources.shipped_programs()["alibi"].read_text()
    line = (
        f"u: f32[B, H, M, N] = mask(c0, keep={text})"
        if attr == "keep"
        else f"c0: f32[B, H, M, N] = score_mod(t, fn={text})"
    )
    target = [ln for ln in base.splitlines() if ln.startswith("u:" if attr == "keep" else "c0:")][0]
    with pytest.raises((IRError, ExprError)) as e:
        parse_program(base.replace(target, line))
    assert fragment in str(e.value)


def test_alibi_slopes():
    assert variants.alibi_slopes(8) == [2 ** (-i) for i in range(1, 9)]
    s = variants.alibi_slopes(12)
    assert len(s) == 12 and all(0 < x < 1 for x in s)
