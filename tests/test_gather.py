"""Call-time tensors read by any integer index expression (doc_id[q], bias[h, q - k + 4096], bias[b, h, q, k]),
captured from a traced function's scope or passed by name, gathered in the kernels: tracing and parsing, the
refusals, the rendered reads, NVRTC compiles of every tier, the float64 executor against naive NumPy, the call-time
checks and SDPA's attn_mask program."""

import numpy as np
import pytest
import sympy as sp

import fagen
from fagen import builders, pipeline
from fagen.backend import codegen, contract
from fagen.ir import exprs, parse_program, variants
from fagen.ir.exprs import ExprError
from fagen.passes import fuse
from fagen.request import for_block_mask
from fagen.tools import executor

from .test_block_mask import brute_force

q, k, b, h = (exprs.INDICES[n] for n in "qkbh")
N_ = exprs.DIMS["N"]


def T(name):
    return exprs.tensor(name)


# --- tracing and parsing ---------------------------------------------------------------------------------------
def test_reads_of_any_integer_index_expression_are_traced():
    cases = {
        lambda b, h, q, k, doc: fagen.eq(doc[q], doc[k]): sp.Eq(T("doc")[q], T("doc")[k]),
        lambda s, b, h, q, k, pos: s + pos[b, q]: exprs.SCORE + T("pos")[b, q],
        lambda s, b, h, q, k, bias: s + bias[h, q - k + 4096]: exprs.SCORE + T("bias")[h, q - k + 4096],
        lambda s, b, h, q, k, bias: s + bias[b, h, q, k]: exprs.SCORE + T("bias")[b, h, q, k],
        lambda s, b, h, q, k, rel: s + rel[(q - k) // 16 + 64]: exprs.SCORE + T("rel")[sp.floor((q - k) / 16) + 64],
    }
    for fn, want in cases.items():
        cond = isinstance(want, sp.logic.boolalg.Boolean) and not isinstance(want, sp.Expr)
        got = variants.trace_mask(fn) if cond else variants.trace_score(fn)
        assert got == want


def test_torch_ops_and_fagen_helpers_give_one_program_and_one_kernel():
    torch = pytest.importorskip("torch")
    doc = torch.zeros(64, dtype=torch.int32)

    def with_torch(b, h, q_idx, kv_idx):
        return torch.logical_and(doc[q_idx] == doc[kv_idx], q_idx >= kv_idx)

    def with_fagen(b, h, q_idx, kv_idx):
        return fagen.eq(doc[q_idx], doc[kv_idx]) & (q_idx >= kv_idx)

    def score_torch(s, b, h, q_idx, kv_idx, bias):
        return torch.where(q_idx >= kv_idx, s + bias[h, q_idx - kv_idx + 64], s)

    def score_fagen(s, b, h, q_idx, kv_idx, bias):
        return fagen.where(q_idx >= kv_idx, s + bias[h, q_idx - kv_idx + 64], s)

    assert variants.trace_mask(with_torch) == variants.trace_mask(with_fagen)
    assert variants.trace_score(score_torch) == variants.trace_score(score_fagen)
    a = fagen.compile(64, mask=with_torch, score_mod=score_torch, tier="simt", arch="sm_80", use_cache=False)
    c = fagen.compile(64, mask=with_fagen, score_mod=score_fagen, tier="simt", arch="sm_80", use_cache=False)
    assert a.name == c.name and a.source == c.source


def test_ir_text_reads_the_same_program():
    text = """program gathered
q: T[B, H, M, D] = input()
k: T[B, H, N, D] = input()
v: T[B, H, N, D] = input()
s: f32[B, H, M, N] = matmul(q, k, transpose_b=True)
t: f32[B, H, M, N] = scale(s, factor=1/sqrt(D))
c: f32[B, H, M, N] = score_mod(t, fn=s + bias[h, q - k + N] + pos[b, q])
u: f32[B, H, M, N] = mask(c, keep=(doc[q] == doc[k]) & keepm[b, h, q, k])
p: f32[B, H, M, N] = softmax(u, axis=N)
o: T[B, H, M, D] = matmul(p, v)
output(o)
"""
    prog = parse_program(text)
    node = prog.node("c")
    assert node.attr("fn") == exprs.SCORE + T("bias")[h, q - k + N_] + T("pos")[b, q]
    keep = prog.node("u").attr("keep")
    assert keep == sp.And(sp.Eq(T("doc")[q], T("doc")[k]), sp.Ne(T("keepm")[b, h, q, k], 0))
    assert parse_program(str(prog)) == prog  # round trip


def test_captured_tensors_are_found_named_and_read_at_each_call():
    torch = pytest.importorskip("torch")
    doc = torch.zeros(10, dtype=torch.int64)

    def make(table):
        return lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx - kv_idx + 9]

    score = make(torch.zeros(2, 19))
    assert variants.captured(score) == (variants.Captured("table", "closure", "table"),)
    assert variants.trace_score(score) == exprs.SCORE + T("table")[h, q - k + 9]

    def mask(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    assert variants.captured(mask) == (variants.Captured("doc", "closure", "doc"),)
    kern = fagen.compile(64, mask=mask, score_mod=score, tier="simt", arch="sm_80", use_cache=False)
    assert kern.tensors == ("doc", "table")
    assert {a.name: a.dtype for a in kern.tensor_args} == {"doc": "i64", "table": "f32"}
    assert "const long long* __restrict__ tensor_doc" in kern.source
    current = kern.with_captured({})
    assert current["doc"] is doc
    globals()["doc_global"] = torch.ones(3)  # a global rebound later is read anew

    def reads_global(s, b, h, q_idx, kv_idx):
        return s + doc_global[q_idx]  # noqa: F821 - set above

    kg = fagen.compile(64, score_mod=reads_global, tier="simt", arch="sm_80", use_cache=False)
    new = torch.full((5,), 2.0)
    globals()["doc_global"] = new
    assert kg.with_captured({})["doc_global"] is new
    # a tensor reached through a helper function is captured too (issue 40), by the path to its variable
    helper = lambda i: doc[i]  # noqa: E731
    through = lambda b, h, q_idx, kv_idx: helper(q_idx) == helper(kv_idx)  # noqa: E731
    assert variants.captured(through) == (variants.Captured("doc", "closure", "doc", (("closure", "helper"),)),)
    assert variants.trace_mask(through) == sp.Eq(T("doc")[q], T("doc")[k])
    with pytest.raises(ExprError, match="neither a parameter of the function nor a variable of its closure"):
        variants.trace_mask(lambda b, h, q_idx, kv_idx: torch.arange(10)[q_idx] == kv_idx)  # made in the function


def test_dtype_is_part_of_the_kernel_values_and_sizes_are_not():
    fn = lambda s, b, h, q, k, bias: s + bias[h, q - k + 64]  # noqa: E731
    f32 = fagen.compile(64, score_mod=fn, tier="simt", arch="sm_80", use_cache=False)
    bf16 = fagen.compile(64, score_mod=fn, tier="simt", arch="sm_80", tensor_dtypes={"bias": "bf16"}, use_cache=False)
    assert f32.name != bf16.name
    assert "const float* __restrict__ tensor_bias" in f32.source
    assert "const fagen_bf16* __restrict__ tensor_bias" in bf16.source
    with pytest.raises(TypeError, match="dtype uint8 is not supported"):
        fagen.compile(64, score_mod=fn, tensor_dtypes={"bias": "uint8"}, tier="simt", arch="sm_80")
    with pytest.raises(ValueError, match="reads no tensor 'other'"):
        fagen.compile(64, score_mod=fn, tensor_dtypes={"other": "i32"}, tier="simt", arch="sm_80")


@pytest.mark.parametrize(
    "fn, fragment",
    [
        (lambda s, b, h, q, k, t: s + t[q / 2], "not integer arithmetic"),
        (lambda s, b, h, q, k, t: s + t[q * 0.5], "not integer arithmetic"),
        (lambda s, b, h, q, k, t, u: s + t[u[q] / 2], "not integer arithmetic"),
        (lambda s, b, h, q, k, t, u: s + t[u[q] * 0.5], "not integer arithmetic"),
        (lambda s, b, h, q, k, t: s + t[s], "which reads s"),
        (lambda s, b, h, q, k, t: s + t[q] + t[q, k], "read with 1 and with 2 indices"),
        (lambda s, b, h, q, k, t: s + t[b, h, q, k, 0], "expected 1 to 4"),
        (lambda s, b, h, q, k, t: s + t[q >= k], "indexed by a condition"),
        (lambda s, b, h, q, k, t: s + t, "must be indexed"),
    ],
)
def test_bad_reads_are_refused_naming_the_tensor(fn, fragment):
    with pytest.raises(ExprError, match=fragment.replace("[", r"\[").replace("1 and with 2", ". and with .")) as e:
        variants.trace_score(fn)
    assert str(e.value).startswith("score_mod") and " t" in str(e.value)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("s + t[q:k]", "a slice is not an index"),
        ("s + t[q * 0.5]", "not integer arithmetic"),
        ("s + t[u[q] / 2]", "not integer arithmetic"),
        ("s + t[u[s]]", "which reads s"),
        ("s + t[s]", "which reads s"),
    ],
)
def test_bad_reads_in_text_are_refused(text, fragment):
    with pytest.raises(ExprError, match=fragment):
        exprs.parse_expr(text, exprs.SCORE_NAMES, what="fn", tensors=True)


# --- rendering and compiling -------------------------------------------------------------------------------------
def _doc_mask(b, h, q, k, doc):
    return fagen.eq(doc[q], doc[k]) & (q >= k)


PROGRAMS = {
    "document": (dict(mask=_doc_mask), {"doc": "i32"}),
    "relative": (dict(score_mod=lambda s, b, h, q, k, rel: s + rel[(q - k) // 16 + 64]), {"rel": "bf16"}),
    "bias_table": (dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h, q - k + 4096]), {}),
    "full_bias": (dict(score_mod=lambda s, b, h, q, k, bias: s + bias[b, h, q, k]), {"bias": "f16"}),
    "bool_mask": (dict(mask=lambda b, h, q, k, m: m[b, h, q, k]), {"m": "bool"}),
    "positions": (dict(mask=lambda b, h, q, k, pos: pos[b, q] >= pos[b, k]), {"pos": "i64"}),
    "neighbourhood": (
        dict(mask=lambda b, h, q, k: (abs(q // 37 - k // 37) <= 3) & (abs(q % 37 - k % 37) <= 3)),
        {},
    ),
}


def test_a_read_clamps_every_index_and_keeps_index_math_integer():
    kern = fagen.compile(
        64, score_mod=lambda s, b, h, q, k, rel: s + rel[h, (q - k) // 16 + 64], tier="simt", arch="sm_80"
    )
    rule = fuse.rule_of(fuse.fused_node(kern.program))
    (score,) = [f for f in codegen.rule_functions(rule, _simt(), kern.tensor_args) if f.name == "score"]
    assert "fagen_at(h, tensor_rel_size_0, tensor_rel_stride_0)" in score.body
    assert "fagen_at(floor_div(-k_idx + q_idx, 16) + 64, tensor_rel_size_1, tensor_rel_stride_1)" in score.body
    assert "long long tensor_rel_size_1" in score.params
    assert "return i < 0 ? 0 : (i >= size ? size - 1 : i);" in kern.source
    # a product that can pass 2^31 is computed in 64 bits
    big = fagen.compile(64, score_mod=lambda s, b, h, q, k, t: s + t[q * 65536 + k], tier="simt", arch="sm_80")
    assert "(long long)q_idx" in big.source


def _simt():
    from fagen.backend import tiers

    return tiers.get("simt")


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("tier, arch", [("simt", "sm_80"), ("mma", "sm_80"), ("mma", "sm_90a"), ("wgmma", "sm_90a")])
def test_every_tier_compiles_the_gathers_without_spills(name, tier, arch):
    opts, dtypes = PROGRAMS[name]
    kern = fagen.compile(128, dtype="bf16", tier=tier, arch=arch, tensor_dtypes=dtypes or None, use_cache=False, **opts)
    assert kern.resources.spills == 0, f"{kern.name}: {kern.resources}"
    for arg in kern.tensor_args:
        assert arg.dtype == dtypes.get(arg.name, "f32")
        assert f"{contract.TENSOR_DTYPES[arg.dtype]}* __restrict__ tensor_{arg.name}" in kern.source


@pytest.mark.parametrize("name", ["document", "bias_table", "relative"])
def test_backward_and_decode_kinds_compile_the_gathers(name):
    """Every backward kind compiles; on the simt tier with no spill. (The mma backward's main kernel, at 255
    registers already, may spill a few bytes for the atomics of a gathered gradient: not asserted here.)"""
    opts, dtypes = PROGRAMS[name]
    kern = fagen.compile(128, dtype="bf16", tier="mma", arch="sm_80", tensor_dtypes=dtypes or None, **opts)
    bp = kern.backward_plan
    for launch in (bp.preprocess, bp.convert, bp.dq):
        assert launch.binary.resources.spills == 0, f"{launch.spec.name}: {launch.binary.resources}"
    simt = fagen.compile(64, dtype="f32", tier="simt", arch="sm_80", tensor_dtypes=dtypes or None, **opts)
    assert simt.backward_plan.main.binary.resources.spills == 0, simt.backward_plan.main.binary.resources
    want = {"document": (), "bias_table": ("bias",), "relative": ("rel",)}[name]
    assert bp.scatters == want
    for t in want:
        assert f"atomicAdd(&grad_{t}[rule::at_{t}_g0(" in bp.main.source
        assert any(p.name == f"grad_{t}" for p in bp.main.params)
    dec = fagen.compile(128, dtype="bf16", arch="sm_80", decode=True, tensor_dtypes=dtypes or None, **opts)
    for launch in dec.plan.launches:
        assert launch.binary.resources.spills == 0


def test_int_tensors_get_no_gradient_and_float_per_head_ones_keep_their_slots():
    kern = fagen.compile(
        64,
        score_mod=lambda s, b, h, q, k, pos, w: s + w[h] * pos[b, q],
        tensor_dtypes={"pos": "i32"},
        tier="simt",
        arch="sm_80",
    )
    bp = kern.backward_plan
    assert bp.gradients == (("w", "h"),) and bp.scatters == ()
    assert "d_pos" not in bp.main.source


# --- the executor against naive NumPy ------------------------------------------------------------------------
def _naive(q, k, v, keep, bias=0.0):
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1]) + bias
    s = np.where(keep, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    return np.where(den > 0, (p / np.where(den > 0, den, 1.0)) @ v, 0.0)


def _run(opts, tensors, M, N, B=2, H=3, D=8, seed=0):
    rng = np.random.default_rng(seed)
    prog = variants.build(**opts)
    fused = pipeline.lower(prog, "f32")[-1].program
    q, k, v = rng.standard_normal((B, H, M, D)), rng.standard_normal((B, H, N, D)), rng.standard_normal((B, H, N, D))
    o = executor.run(fused, dict(q=q, k=k, v=v), tensors=tensors, block_m=8, block_n=16).outputs["o"]
    return (q, k, v), o, fused


@pytest.mark.parametrize("seed", range(4))
def test_executor_document_masks_with_random_lengths(seed):
    rng = np.random.default_rng(100 + seed)
    lens = list(rng.integers(1, 12, size=8)) + [1, 1]
    rng.shuffle(lens)
    doc = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
    M = len(doc)
    (q, k, v), o, _ = _run(dict(mask=_doc_mask), {"doc": doc}, M, M, seed=seed)
    i, j = np.arange(M)[:, None], np.arange(M)[None, :]
    np.testing.assert_allclose(o, _naive(q, k, v, (doc[i] == doc[j]) & (i >= j)), atol=1e-12)


def test_executor_relative_position_tables_and_full_bias():
    rng = np.random.default_rng(7)
    M, N, B, H = 29, 41, 2, 3
    table = rng.standard_normal((H, 2 * 64 + 1))
    (q, k, v), o, _ = _run(
        dict(score_mod=lambda s, b, h, q, k, rel: s + rel[h, (q - k) // 4 + 64]), {"rel": table}, M, N
    )
    i, j = np.arange(M)[:, None], np.arange(N)[None, :]
    want = _naive(q, k, v, True, table[np.arange(H)[:, None, None], ((i - j) // 4 + 64)[None]][None])
    np.testing.assert_allclose(o, want, atol=1e-12)
    full = rng.standard_normal((B, H, M, N))
    (q, k, v), o, _ = _run(dict(score_mod=lambda s, b, h, q, k, bias: s + bias[b, h, q, k]), {"bias": full}, M, N)
    np.testing.assert_allclose(o, _naive(q, k, v, True, full), atol=1e-12)
    # a broadcast table (size 1 along b) and an index past the table's end, clamped as the kernels clamp
    short = rng.standard_normal((1, H, M, 7))
    (q, k, v), o, _ = _run(dict(score_mod=lambda s, b, h, q, k, bias: s + bias[b, h, q, k]), {"bias": short}, M, N)
    np.testing.assert_allclose(o, _naive(q, k, v, True, short[:, :, :, np.minimum(np.arange(N), 6)]), atol=1e-12)


def test_executor_two_dimensional_neighbourhood():
    W, R = 9, 2  # an image of rows of W pixels; q and k read as (row, col)
    M = N = 5 * W
    opts = dict(mask=lambda b, h, q, k: (abs(q // W - k // W) <= R) & (abs(q % W - k % W) <= R))
    (q, k, v), o, _ = _run(opts, {}, M, N)
    i, j = np.arange(M)[:, None], np.arange(N)[None, :]
    keep = (np.abs(i // W - j // W) <= R) & (np.abs(i % W - j % W) <= R)
    np.testing.assert_allclose(o, _naive(q, k, v, keep), atol=1e-12)


def test_executor_bool_mask_and_fully_masked_rows():
    rng = np.random.default_rng(3)
    M, N = 13, 17
    m = rng.random((2, 1, M, N)) < 0.3
    m[:, :, 4] = False  # a row that sees nothing gives 0
    (q, k, v), o, _ = _run(dict(mask=lambda b, h, q, k, m: m[b, h, q, k]), {"m": m}, M, N)
    np.testing.assert_allclose(o, _naive(q, k, v, np.broadcast_to(m, (2, 3, M, N))), atol=1e-12)
    assert np.all(o[:, :, 4] == 0)


def test_executor_gradient_of_a_gathered_bias_table_matches_finite_differences():
    rng = np.random.default_rng(11)
    M, N, B, H, D = 7, 9, 1, 2, 4
    table = rng.standard_normal((H, M + N))
    opts = dict(score_mod=lambda s, b, h, q, k, bias: s + bias[h, q - k + N])
    prog = variants.build(**opts)
    fused = pipeline.lower(prog, "f32")[-1].program
    q, k, v = (rng.standard_normal((B, H, n, D)) for n in (M, N, N))
    do = rng.standard_normal((B, H, M, D))
    g = executor.gradients(fused, dict(q=q, k=k, v=v), do, tensors={"bias": table}, block_m=4, block_n=4)

    def loss(t):
        o = executor.run(fused, dict(q=q, k=k, v=v), tensors={"bias": t}).outputs["o"]
        return float((o * do).sum())

    fd = np.zeros_like(table)
    for idx in np.ndindex(*table.shape):
        up, down = table.copy(), table.copy()
        up[idx] += 1e-6
        down[idx] -= 1e-6
        fd[idx] = (loss(up) - loss(down)) / 2e-6
    assert g["dbias"].shape == table.shape
    np.testing.assert_allclose(g["dbias"], fd, atol=1e-6)
    assert np.any(fd != 0)


# --- call-time checks ----------------------------------------------------------------------------------------
def _fake_describe(monkeypatch):
    """checks.check_tensors on CPU: describe() builds an Array from a NumPy array as if it were a CUDA tensor."""
    from fagen.runtime import checks
    from fagen.runtime.arrays import Array

    def describe(name, x):
        x = np.asarray(x)
        strides = tuple(s // x.dtype.itemsize for s in x.strides)
        return Array("torch", x, 0, tuple(x.shape), strides, None, x.dtype.name, 0)

    monkeypatch.setattr(checks, "describe", describe)
    return describe


def check_tensors(kern, given, tq):
    """The forward's check of a call's tensors (fagen.runtime.checks), for B, H, M, N = 2, 3, 10, 12."""
    from fagen.runtime import checks

    return checks.check_tensors(kern.tensor_args, kern.tensor_index, given, tq, 2, 3, 10, 12)


def test_call_time_checks_name_the_tensor(monkeypatch):
    describe = _fake_describe(monkeypatch)
    kern = fagen.compile(
        64,
        mask=_doc_mask,
        score_mod=lambda s, b, h, q, k, bias: s + bias[b, h, q, k],
        tensor_dtypes={"doc": "int32"},
        tier="simt",
        arch="sm_80",
    )
    tq = describe("q", np.zeros((2, 3, 10, 64), np.float32))
    good = dict(doc=np.zeros(10, np.int32), bias=np.zeros((1, 3, 10, 12), np.float32))
    assert set(check_tensors(kern, good, tq)) == {"doc", "bias"}
    bad = [
        (dict(good, doc=np.zeros(10, np.int64)), TypeError, "doc: dtype int64 differs from the compiled i32"),
        (dict(good, doc=np.zeros((10, 1), np.int32)), ValueError, "doc: the program reads it with 1 indices"),
        (dict(good, bias=np.zeros((2, 3, 9, 12), np.float32)), ValueError, "bias: dimension 2 is indexed by q"),
        (dict(good, bias=np.zeros((2, 3, 10, 0), np.float32)), ValueError, "bias: empty tensor"),
        (dict(good, bias=np.zeros((2, 3, 10, 12), np.uint8)), TypeError, "bias: dtype uint8 is not supported"),
        ({"doc": good["doc"]}, TypeError, "bias: this kernel's program reads bias"),
        (dict(good, other=good["doc"]), TypeError, "other: this kernel takes no tensor of that name"),
    ]
    for given, err, fragment in bad:
        with pytest.raises(err, match=fragment):
            check_tensors(kern, given, tq)


def test_sdpa_attn_mask_programs():
    from fagen import flex

    assert variants.trace_mask(flex._sdpa_bool_mask) == sp.Ne(T("attn_mask")[b, h, q, k], 0)
    assert variants.trace_score(flex._sdpa_additive_mask) == exprs.SCORE + T("attn_mask")[b, h, q, k]
    torch = pytest.importorskip("torch")
    view = flex._broadcast_mask(torch.zeros(5, 7, dtype=torch.bool), 2, 3, 5, 7)
    assert view.shape == (2, 3, 5, 7) and view.stride() == (0, 0, 7, 1)
    with pytest.raises(ValueError, match="does not broadcast"):
        flex._broadcast_mask(torch.zeros(4, 7), 2, 3, 5, 7)


def test_sdpa_bool_mask_as_a_captured_mask_mod():
    """A bool attn_mask's block-sparse path: the mask as FlexAttention's mask_mod capturing it, indexed by b and h
    only where it varies along them (one block table for a mask broadcast over the batch or the heads)."""
    torch = pytest.importorskip("torch")
    from fagen import flex

    view = flex._broadcast_mask(torch.zeros(5, 7, dtype=torch.bool), 2, 3, 5, 7)
    want = {
        (True, True): T("attn_mask")[b, h, q, k],
        (True, False): T("attn_mask")[b, 0, q, k],
        (False, True): T("attn_mask")[0, h, q, k],
        (False, False): T("attn_mask")[0, 0, q, k],
    }
    for (per_b, per_h), read in want.items():
        fn = flex._sdpa_mask_mod(view, per_b, per_h)
        assert [c.name for c in variants.captured(fn)] == ["attn_mask"]
        assert variants.trace_mask(fn) == sp.Ne(read, 0), (per_b, per_h)


def test_cli_compiles_an_ir_program_with_tensor_dtypes(tmp_path, capsys):
    from fagen.tools import cli

    text = """program docmask
q: T[B, H, M, D] = input()
k: T[B, H, N, D] = input()
v: T[B, H, N, D] = input()
s: f32[B, H, M, N] = matmul(q, k, transpose_b=True)
t: f32[B, H, M, N] = scale(s, factor=1/sqrt(D))
c: f32[B, H, M, N] = score_mod(t, fn=s + rel[h, q - k + 4096])
u: f32[B, H, M, N] = mask(c, keep=(doc[q] == doc[k]) & (k <= q))
p: f32[B, H, M, N] = softmax(u, axis=N)
o: T[B, H, M, D] = matmul(p, v)
output(o)
"""
    path = tmp_path / "docmask.ir"
    path.write_text(text)
    args = ["compile", "--dim", "64", "--ir", str(path), "--arch", "sm_80", "--tier", "simt", "-o", str(tmp_path)]
    assert cli.main(args + ["--tensor-dtype", "doc=int32", "--tensor-dtype", "rel=bf16"]) == 0
    (cu,) = tmp_path.glob("*.cu")
    source = cu.read_text()
    assert "const int* __restrict__ tensor_doc" in source and "const fagen_bf16* __restrict__ tensor_rel" in source
    assert cli.main(args + ["--tensor-dtype", "doc"]) == 1
    assert "--tensor-dtype: expected NAME=DTYPE" in capsys.readouterr().err


# --- gathers of gathers: a read inside another read's index ----------------------------------------------------
def Int(name):
    """The tensor `name` as read inside another read's index (an integer)."""
    return exprs.tensor(name, index=True)


def _offsets_mask(b, h, q, k, offsets, doc):
    """The usual document mask from offsets: a query sees the keys of its document up to itself."""
    return (k >= offsets[doc[q]]) & (k <= q)


def _table_score(s, b, h, q, k, table, dist):
    return s + table[h, dist[q, k]]


def test_reads_inside_an_index_are_traced_parsed_and_printed_back_as_integers():
    cases = {
        _offsets_mask: sp.And(k >= T("offsets")[Int("doc")[q]], k <= q),
        _table_score: exprs.SCORE + T("table")[h, Int("dist")[q, k]],
        lambda b, h, q, k, ancestors, p: ancestors[q, k - p[q]] != 0: sp.Ne(T("ancestors")[q, k - Int("p")[q]], 0),
        lambda b, h, q, k, intervals, image_id: (q >= intervals[image_id[k], 0]) & (q < intervals[image_id[k], 1]): (
            sp.And(q >= T("intervals")[Int("image_id")[k], 0], q < T("intervals")[Int("image_id")[k], 1])
        ),
        # any depth, and integer arithmetic on the inner reads: (a + 1) // 2, max, %
        lambda s, b, h, q, k, t, u, w: s + t[(u[w[q] + 1] + 1) // 2, fagen.maximum(w[k], 3) % 5]: exprs.SCORE
        + T("t")[sp.floor((Int("u")[Int("w")[q] + 1] + 1) / 2), sp.Mod(sp.Max(Int("w")[k], 3), 5)],
    }
    for fn, want in cases.items():
        cond = isinstance(want, sp.logic.boolalg.Boolean) and not isinstance(want, sp.Expr)
        got = variants.trace_mask(fn) if cond else variants.trace_score(fn)
        assert got == want
        names = exprs.MASK_NAMES if cond else exprs.SCORE_NAMES
        assert exprs.parse_expr(exprs.to_text(got), names, tensors=True) == want  # text round trip
    text = """program nested
q: T[B, H, M, D] = input()
k: T[B, H, N, D] = input()
v: T[B, H, N, D] = input()
s: f32[B, H, M, N] = matmul(q, k, transpose_b=True)
t: f32[B, H, M, N] = scale(s, factor=1/sqrt(D))
c: f32[B, H, M, N] = score_mod(t, fn=s + table[h, dist[q, k]])
u: f32[B, H, M, N] = mask(c, keep=(k >= offsets[doc[q]]) & (k <= q))
p: f32[B, H, M, N] = softmax(u, axis=N)
o: T[B, H, M, D] = matmul(p, v)
output(o)
"""
    prog = parse_program(text)
    assert prog.node("u").attr("keep") == cases[_offsets_mask] and prog.node("c").attr("fn") == cases[_table_score]
    assert parse_program(str(prog)) == prog
    inner = {r for r in cases[_offsets_mask].atoms(sp.Indexed) if exprs.is_index_read(r)}
    assert inner == {Int("doc")[q]} and exprs.index_tensors(cases[_offsets_mask]) == ("doc",)
    assert exprs.is_int_valued(Int("doc")[q] + 1) and not exprs.is_int_valued(T("doc")[q] + 1)


def test_captured_tensors_read_inside_an_index_are_found():
    torch = pytest.importorskip("torch")
    doc = torch.zeros(100, dtype=torch.int32)
    offsets = torch.zeros(9, dtype=torch.int64)

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx >= offsets[doc[q_idx]]) & (kv_idx < offsets[doc[q_idx] + 1])

    assert [c.name for c in variants.captured(mask)] == ["doc", "offsets"]
    kern = fagen.compile(64, mask=mask, tier="simt", arch="sm_80", use_cache=False)
    assert {a.name: (a.dtype, a.dims) for a in kern.tensor_args} == {"doc": ("i32", "q"), "offsets": ("i64", ".")}
    # an index built by hand with a value read in it, and a tensor read inside an index but neither a parameter nor
    # captured: refused, naming them
    with pytest.raises(ExprError, match=r"whose read v\[q\] is not an integer read"):
        exprs.check_tensor_read(T("t")[T("v")[q]])
    with pytest.raises(ExprError, match="tensor v is not one of the function's parameters"):
        exprs.check_expr(
            T("t")[Int("v")[q]] + exprs.SCORE, exprs.SCORE_NAMES, what="score_mod", condition=False, tensors=["t"]
        )


def test_a_float_tensor_used_as_an_index_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"tensor dist indexes another tensor \(dist\[q, k\] inside an index\).*f32"):
        fagen.compile(64, score_mod=_table_score, tier="simt", arch="sm_80", use_cache=False)
    with pytest.raises(TypeError, match="tensor doc indexes another tensor.*bf16"):
        fagen.compile(64, mask=_offsets_mask, tensor_dtypes={"doc": "bf16"}, tier="simt", arch="sm_80")
    with pytest.raises(TypeError, match="tensor doc indexes another tensor.*bool"):
        fagen.compile(64, mask=_offsets_mask, tensor_dtypes={"doc": "bool"}, tier="simt", arch="sm_80")
    torch = pytest.importorskip("torch")
    ids = torch.zeros(10)  # captured float32

    def mask(b, h, q_idx, kv_idx, offsets):
        return kv_idx >= offsets[ids[q_idx]]

    with pytest.raises(TypeError, match="tensor ids indexes another tensor"):
        fagen.compile(64, mask=mask, tensor_dtypes={"offsets": "i32"}, tier="simt", arch="sm_80", use_cache=False)


NESTED = {"offsets": "i32", "doc": "i32", "dist": "i32", "table": "f32"}


def _rule_body(kern, name):
    rule = fuse.rule_of(fuse.fused_node(kern.program))
    (f,) = [f for f in codegen.rule_functions(rule, _simt(), kern.tensor_args) if f.name == name]
    return f.body


def test_the_inner_element_is_read_clamped_then_the_outer_one():
    kern = fagen.compile(64, mask=_offsets_mask, tensor_dtypes={"doc": "i32"}, tier="simt", arch="sm_80")
    inner = "fagen_index(fagen_read(tensor_doc, fagen_at(q_idx, tensor_doc_size_0, tensor_doc_stride_0)))"
    outer = f"fagen_read(tensor_offsets, fagen_at({inner}, tensor_offsets_size_0, tensor_offsets_stride_0))"
    assert _rule_body(kern, "keep") == f"k_idx >= {outer} && k_idx <= q_idx"
    assert "__device__ __forceinline__ int fagen_index(long long v)" in kern.source
    plain = fagen.compile(64, mask=_doc_mask, tensor_dtypes={"doc": "i32"}, tier="simt", arch="sm_80")
    assert "fagen_index" not in plain.source  # the helper only where a read sits inside an index
    # an index that can pass 2^31 is computed in 64 bits, the inner read cast
    wide = fagen.compile(
        64,
        score_mod=lambda s, b, h, q, k, t, u: s + t[u[q] * 65536 + k],
        tensor_dtypes={"u": "i64"},
        tier="simt",
        arch="sm_80",
    )
    assert "(long long)fagen_index(fagen_read(tensor_u, fagen_at(q_idx" in _rule_body(wide, "score")


@pytest.mark.parametrize("tier, arch", [("simt", "sm_80"), ("mma", "sm_80"), ("wgmma", "sm_90a")])
def test_nested_reads_compile_forward_backward_and_block_mask(tier, arch, tmp_path):
    opts = dict(mask=_offsets_mask, score_mod=_table_score, tensor_dtypes=NESTED)
    kern = fagen.compile(128, dtype="bf16", tier=tier, arch=arch, cache_dir=tmp_path, **opts)
    assert "warning" not in kern.binary.log and kern.resources.spills == 0, kern.resources
    assert kern.tensors == ("dist", "doc", "offsets", "table")
    bp = kern.backward_plan
    assert bp.scatters == ("table",)  # the float table gets its gradient; the integer ones none
    body = [ln for ln in bp.main.source.splitlines() if "long long at_table_g0(" in ln]
    assert body, "the gathered gradient's offset function"
    at = bp.main.source.split("long long at_table_g0(", 1)[1].split("}", 1)[0]
    assert "fagen_clamp(fagen_index(fagen_read(tensor_dist, fagen_at(q_idx" in at
    assert "d_dist" not in bp.main.source and "d_doc" not in bp.main.source
    sparse = fagen.compile(128, dtype="bf16", tier=tier, arch=arch, block_sparse=True, cache_dir=tmp_path, **opts)
    assert "warning" not in sparse.binary.log and not sparse.resources.spills


def test_block_mask_kernel_of_a_nested_read_compiles(tmp_path):
    torch = pytest.importorskip("torch")
    mask = _captured_offsets_mask()
    doc, offsets = torch.as_tensor(mask.doc), torch.as_tensor(mask.offsets)

    def captured(b, h, q_idx, kv_idx):
        return (kv_idx >= offsets[doc[q_idx]]) & (kv_idx <= q_idx)

    fused, variant, rng, dtypes = pipeline.block_mask_program(
        for_block_mask(mask=captured, device=("torch", "cpu", None), tiles=(128, 128))
    )
    assert dtypes == {"doc": "i32", "offsets": "i32"}
    launch = builders.build_block_mask_launch(
        fused, variant, "sm_90a", 128, 128, key_range=rng, tensor_dtypes=dtypes, cache_dir=tmp_path
    )
    assert "warning" not in launch.binary.log and not launch.binary.resources.spills
    assert "fagen_index(fagen_read(tensor_doc" in launch.source


def _captured_offsets_mask(lengths=(5, 1, 17, 2, 40), n=None):
    """A document mask from offsets over captured NumPy tensors: documents of `lengths` tokens (padded to `n` with
    the last document)."""
    lengths = list(lengths)
    doc = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    if n is not None:
        doc = np.concatenate([doc, np.full(max(0, n - len(doc)), len(lengths) - 1, np.int32)])[:n]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

    def mask(b, h, q_idx, kv_idx):
        return (kv_idx >= offsets[doc[q_idx]]) & (kv_idx <= q_idx)

    mask.doc, mask.offsets = doc, offsets
    return mask


def test_executor_offsets_document_mask_and_nested_table_score():
    """The float64 executor evaluates reads inside indices (inner first, each index clamped): against NumPy's own
    fancy indexing, odd lengths, M != N."""
    rng = np.random.default_rng(5)
    lengths = [int(x) for x in rng.integers(1, 9, 6)] + [1, 13]
    doc = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    M = len(doc)
    N = M + 5  # keys past the last document: never seen (k <= q)
    tensors = {"offsets": offsets, "doc": doc}
    (q, k, v), o, _ = _run(dict(mask=_offsets_mask), tensors, M, N)
    i, j = np.arange(M)[:, None], np.arange(N)[None, :]
    np.testing.assert_allclose(o, _naive(q, k, v, (j >= offsets[doc[i]]) & (j <= i)), atol=1e-12)
    H = 3
    dist = rng.integers(-3, 12, (M, N)).astype(np.int32)  # out of the table's range on both sides: clamped
    table = rng.standard_normal((H, 9))
    (q, k, v), o, _ = _run(dict(score_mod=_table_score), {"table": table, "dist": dist}, M, N, H=H)
    want = _naive(q, k, v, True, table[np.arange(H)[:, None, None], np.clip(dist, 0, 8)[None]][None])
    np.testing.assert_allclose(o, want, atol=1e-12)


def test_executor_gradient_of_a_table_read_through_an_index_matches_finite_differences():
    """dtable accumulates at the gathered (clamped) element: score + table[h, bucket[q - k + N]]."""
    rng = np.random.default_rng(13)
    M, N, B, H, D = 6, 9, 1, 2, 4
    bucket = rng.integers(-1, 7, M + N).astype(np.int64)  # many positions share a bucket; -1 clamps to 0
    table = rng.standard_normal((H, 6))
    opts = dict(score_mod=lambda s, b, h, q, k, table, bucket: s + table[h, bucket[q - k + N]])
    fused = pipeline.lower(variants.build(**opts), "f32")[-1].program
    q, k, v = (rng.standard_normal((B, H, n, D)) for n in (M, N, N))
    do = rng.standard_normal((B, H, M, D))
    tensors = {"table": table, "bucket": bucket}
    g = executor.gradients(fused, dict(q=q, k=k, v=v), do, tensors=tensors, block_m=4, block_n=4)
    assert "dbucket" not in g  # an integer read inside an index has no gradient

    def loss(t):
        o = executor.run(fused, dict(q=q, k=k, v=v), tensors={**tensors, "table": t}).outputs["o"]
        return float((o * do).sum())

    fd = np.zeros_like(table)
    for idx in np.ndindex(*table.shape):
        up, down = table.copy(), table.copy()
        up[idx] += 1e-6
        down[idx] -= 1e-6
        fd[idx] = (loss(up) - loss(down)) / 2e-6
    np.testing.assert_allclose(g["dtable"], fd, atol=1e-6)
    assert np.all(fd[:, 0] != 0)  # bucket -1 and 0: clamped to the first entry


# --- soundness: a mask that reads data gets no static range from that part ---------------------------------------
def test_key_ranges_take_no_bound_from_a_nested_read():
    from fagen.math import bounds

    keep = variants.trace_mask(_offsets_mask)
    rng = bounds.key_range(keep)
    (term,) = rng.terms
    assert not term.exact and term.begins == () and term.full_begins == ()  # k >= offsets[doc[q]]: nothing static
    assert [b.conjunct for b in term.bounds] == [k <= q]  # the affine part keeps its (safe) bound
    assert all(not e.has(sp.Indexed) for b in term.bounds for e in (b.visible, b.full))
    bounds.prove(keep, rng)


REACH = {  # masks whose key ranges would drop kept keys if the reads were taken for constants (0, or >= 0)
    "reach": lambda b, h, q, k, far, doc: (k <= q + far[doc[q]]) & (k >= q - far[doc[k]]),
    "below": lambda b, h, q, k, far, doc: k >= q - far[doc[q] + 1] * 3,
    "offsets": _offsets_mask,
}


@pytest.mark.parametrize("name", sorted(REACH))
@pytest.mark.parametrize("seed", range(3))
def test_block_masks_of_nested_reads_keep_every_kept_key(name, seed):
    """The proven ranges with data a wrong range would cut: reads that reach far past the diagonal on either side,
    negative values, indices past the tables (clamped): the executor's block mask (the kernel's classification, in
    NumPy, inside the proven key range) against brute force on the Python function itself."""
    rng = np.random.default_rng(seed)
    M, N = (int(x) for x in rng.integers(30, 300, 2))
    doc = np.sort(rng.integers(0, 7, max(M, N))).astype(np.int32)
    tensors = {
        "doc": doc,
        "far": rng.integers(-40, 400, 6).astype(np.int32),  # 6 entries for 7 ids: the last clamps
        "offsets": np.sort(rng.integers(-20, max(M, N), 8)).astype(np.int32),
    }
    mask = REACH[name]
    fused = pipeline.lower(variants.build(mask=mask), "f32")[-1].program
    used = {n: tensors[n] for n in fuse.tensors_of(fused)}
    got = executor.block_mask(fused, 1, 1, M, N, 32, 16, tensors=used)

    def clamped(n):  # the Python function on NumPy, reading as the kernels read (each index clamped)
        t = used[n]
        return lambda i: t[np.clip(i, 0, len(t) - 1)]

    class Reader:
        def __init__(self, n):
            self.read = clamped(n)

        def __getitem__(self, i):
            return self.read(i)

    readers = [Reader(n) for n in _params(mask)]
    want = brute_force(lambda bb, hh, qq, kk: mask(bb, hh, qq, kk, *readers), 1, 1, M, N, 32, 16)
    assert want[0].sum() > 0
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _params(fn):
    import inspect

    return list(inspect.signature(fn).parameters)[4:]
