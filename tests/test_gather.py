"""Call-time tensors read by any integer index expression (doc_id[q], bias[h, q - k + 4096], bias[b, h, q, k]),
captured from a traced function's scope or passed by name, gathered in the kernels: tracing and parsing, the
refusals, the rendered reads, NVRTC compiles of every tier, the float64 executor against naive NumPy, the call-time
checks and SDPA's attn_mask program."""

import numpy as np
import pytest
import sympy as sp

import fagen
from fagen import pipeline
from fagen.backend import codegen, contract
from fagen.ir import exprs, parse_program, variants
from fagen.ir.exprs import ExprError
from fagen.passes import fuse
from fagen.tools import executor

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
        (lambda s, b, h, q, k, t: s + t[t[q]], "indexed by another tensor's value"),
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
        ("s + t[t[q]]", "another tensor's value"),
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
