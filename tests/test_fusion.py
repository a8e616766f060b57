"""The fusion pass: before/expected graphs, the proofs, and the rewrites it must refuse."""

import dataclasses

import pytest
import sympy as sp

from fagen import resources
from fagen.ir import Node, Op, Program, TensorType, exprs, parse_program
from fagen.math import online_softmax
from fagen.math.online_softmax import ProofError
from fagen.passes import fuse
from fagen.passes.fuse import FusionError

HEADER = """program t
q: T[B, H, M, D] = input()
k: T[B, H, N, D] = input()
v: T[B, H, N, D] = input()
s: f32[B, H, M, N] = matmul(q, k, transpose_b=True)
"""
q_, k_ = exprs.INDICES["q"], exprs.INDICES["k"]
D = exprs.DIMS["D"]


def program(body: str, out="o") -> Program:
    return parse_program(HEADER + body + f"output({out})\n")


def expected(scale, score, keep) -> Program:
    t = TensorType("T", ("B", "H", "M", "D"))
    inputs = [
        Node("q", Op.INPUT, (), t),
        Node("k", Op.INPUT, (), TensorType("T", ("B", "H", "N", "D"))),
        Node("v", Op.INPUT, (), TensorType("T", ("B", "H", "N", "D"))),
    ]
    fused = Node("o", Op.ONLINE_SOFTMAX, ("q", "k", "v"), t, (("scale", scale), ("score", score), ("keep", keep)))
    return Program.build("t", inputs + [fused], ("o",))


def test_fuses_plain_attention():
    """matmul → scale → softmax → matmul becomes one online_softmax node."""
    before = program(
        "t: f32[B, H, M, N] = scale(s, factor=1/sqrt(D))\n"
        "p: f32[B, H, M, N] = softmax(t, axis=N)\no: T[B, H, M, D] = matmul(p, v)\n"
    )
    assert fuse.fuse(before) == expected(1 / sp.sqrt(D), exprs.SCORE, sp.true)


def test_fuses_causal_attention():
    """The mask becomes the fused node's keep predicate."""
    before = program(
        "t: f32[B, H, M, N] = scale(s, factor=1/sqrt(D))\n"
        "u: f32[B, H, M, N] = mask(t, keep=k <= q)\n"
        "p: f32[B, H, M, N] = softmax(u, axis=N)\no: T[B, H, M, D] = matmul(p, v)\n"
    )
    assert fuse.fuse(before) == expected(1 / sp.sqrt(D), exprs.SCORE, sp.Le(k_, q_))


def test_fuses_score_function_and_mask_order():
    """A score function before the mask, a scale folded after it: all pointwise, all proven."""
    before = program(
        "t: f32[B, H, M, N] = scale(s, factor=1/sqrt(D))\n"
        "c: f32[B, H, M, N] = score_mod(t, fn=30*tanh(s/30))\n"
        "u: f32[B, H, M, N] = mask(c, keep=k <= q)\n"
        "w: f32[B, H, M, N] = scale(u, factor=2)\n"
        "p: f32[B, H, M, N] = softmax(w, axis=N)\no: T[B, H, M, D] = matmul(p, v)\n"
    )
    s = exprs.SCORE
    assert fuse.fuse(before) == expected(1 / sp.sqrt(D), 60 * sp.tanh(s / 30), sp.Le(k_, q_))


def test_fuse_leaves_input_untouched_and_is_idempotent():
    before = program("p: f32[B, H, M, N] = softmax(s, axis=N)\no: T[B, H, M, D] = matmul(p, v)\n")
    text = str(before)
    once = fuse.fuse(before)
    assert str(before) == text
    assert fuse.fuse(once) == once


@pytest.mark.parametrize(
    "body, out, fragment",
    [
        # a non-pointwise op between the matmuls
        (
            "a: f32[B, H, M, N] = softmax(s, axis=N)\np: f32[B, H, M, N] = softmax(a, axis=N)\n"
            "o: T[B, H, M, D] = matmul(p, v)\n",
            "o",
            "softmax 'a' sits between the matmuls and is not pointwise",
        ),
        # P is also an output: the fused kernel never forms it
        (
            "p: f32[B, H, M, N] = softmax(s, axis=N)\no: T[B, H, M, D] = matmul(p, v)\n",
            "o, p",
            "it is an output of the program",
        ),
        # the scores are needed elsewhere
        (
            "t: f32[B, H, M, N] = scale(s, factor=2)\np: f32[B, H, M, N] = softmax(t, axis=N)\n"
            "o: T[B, H, M, D] = matmul(p, v)\n",
            "o, t",
            "scale 't' between the matmuls is also used elsewhere",
        ),
        # tanh after the mask would un-mask keys: tanh(-inf) = -1
        (
            "u: f32[B, H, M, N] = mask(s, keep=k <= q)\nc: f32[B, H, M, N] = score_mod(u, fn=tanh(s))\n"
            "p: f32[B, H, M, N] = softmax(c, axis=N)\no: T[B, H, M, D] = matmul(p, v)\n",
            "o",
            "score_mod 'c' after a mask does not keep masked scores at -inf",
        ),
        # a negative scale after a mask turns -inf into +inf
        (
            "u: f32[B, H, M, N] = mask(s, keep=k <= q)\nc: f32[B, H, M, N] = score_mod(u, fn=2*s)\n"
            "w: f32[B, H, M, N] = scale(c, factor=-1)\n"
            "p: f32[B, H, M, N] = softmax(w, axis=N)\no: T[B, H, M, D] = matmul(p, v)\n",
            "o",
            "after a mask must have a positive factor",
        ),
        # the runtime scale is positive
        (
            "w: f32[B, H, M, N] = scale(s, factor=-1)\n"
            "p: f32[B, H, M, N] = softmax(w, axis=N)\no: T[B, H, M, D] = matmul(p, v)\n",
            "o",
            "must have a positive factor (the kernels take the scale as a positive argument)",
        ),
    ],
)
def test_refuses_and_names_the_op(body, out, fragment):
    with pytest.raises(FusionError) as e:
        fuse.fuse(program(body, out))
    assert fragment in str(e.value)


def _plain_rule():
    return online_softmax.make_rule(exprs.SCORE, sp.true)


def test_the_proofs_hold_for_the_rule():
    names = [i.name for i in online_softmax.prove(_plain_rule(), (), sp.Integer(1))]
    assert names == [
        "(a) row sum",
        "(a) output",
        "(b) commutative",
        "(b) associative",
        "(d) fully masked row",
        "(e) max of raw scores",
        "(c) output",
        "(c) log-sum-exp",
        "(c) scores",
    ]
    exact = online_softmax.make_rule(exprs.SCORE, sp.true, tau=0)
    assert [i.name for i in online_softmax.prove_algebra(exact)][0] == "(a) running max"


def test_raw_max_for_scores_affine_in_qk_with_a_positive_constant_slope():
    s, q, k, h = exprs.SCORE, exprs.INDICES["q"], exprs.INDICES["k"], exprs.INDICES["h"]
    qk, scale_log2, kLog2e = online_softmax.qk, online_softmax.scale_log2, online_softmax.kLog2e
    plain = online_softmax.make_rule(s, sp.true)
    assert plain.raw_max == online_softmax.m_raw * scale_log2 and plain.raw == qk
    assert online_softmax.make_rule(2 * s, sp.true).raw == qk
    assert online_softmax.make_rule(30 * sp.tanh(s / 30), sp.true).raw_max is None
    assert online_softmax.make_rule(-s, sp.true).raw_max is None  # a negative slope: the max is not scaled so
    assert online_softmax.make_rule(s * k, sp.true).raw_max is None  # a slope that changes from key to key
    # a bias (ALiBi's, per key): S = scale_log2 (qk + r), the block max over qk + r
    alibi = online_softmax.make_rule(s + exprs.tensor("slopes")[h] * (k - q), sp.true)
    assert alibi.raw_max == online_softmax.m_raw * scale_log2
    assert sp.expand(alibi.raw - qk - kLog2e * exprs.tensor("slopes")[h] * (k - q) / scale_log2) == 0
    assert online_softmax._raw_max_holds(alibi.concrete())


def test_a_raw_value_that_does_not_match_the_score_is_caught():
    h, q, k = exprs.INDICES["h"], exprs.INDICES["q"], exprs.INDICES["k"]
    alibi = online_softmax.make_rule(exprs.SCORE + exprs.tensor("slopes")[h] * (k - q), sp.true)
    for wrong in (online_softmax.qk, online_softmax.qk + 2 * (alibi.raw - online_softmax.qk)):
        with pytest.raises(ProofError, match=r"\(e\) max of raw scores"):
            online_softmax.prove(dataclasses.replace(alibi, raw=wrong), (), sp.Integer(1))


@pytest.mark.parametrize(
    "field, wrong, fragment",
    [
        # the classic bug: rescale by exp(m_new - m_old) instead of exp(m_old - m_new)
        ("alpha", 2 ** (online_softmax.m_use - online_softmax.m_i), "(a) row sum"),
        # forgetting to rescale the accumulator
        ("acc_new", online_softmax.acc + online_softmax.pv, "(a) output"),
        # exp instead of exp2 on base-2 scores
        ("p", sp.exp(online_softmax.s - online_softmax.m_use), "(a) row sum"),
        # a natural-log lse that forgets the base change
        (
            "lse",
            sp.Piecewise(
                (-sp.oo, sp.Eq(online_softmax.l_i, 0)), (online_softmax.m_i + sp.log(online_softmax.l_i), True)
            ),
            "(c) log-sum-exp",
        ),
        # no guard: a fully masked row forms -inf - (-inf) = NaN
        ("m_use", online_softmax.m_new, "(d) fully masked row"),
        # dividing without the l = 0 guard
        ("inv_l", 1 / online_softmax.l_i, "(d) fully masked row"),
        # a raw-max shortcut that does not match the score
        ("raw_max", 2 * online_softmax.m_raw * online_softmax.scale_log2, "(e) max of raw scores"),
    ],
)
def test_a_wrong_rule_is_caught_by_the_proof(field, wrong, fragment):
    bad = dataclasses.replace(_plain_rule(), **{field: wrong})
    with pytest.raises(ProofError) as e:
        online_softmax.prove(bad, (), sp.Integer(1))
    assert fragment in str(e.value)


def test_a_wrong_score_is_caught_against_the_graph():
    """The rule's score must reproduce the graph's scale: (c) compares with the original ops."""
    p = parse_program(resources.shipped_programs()["full"].read_text())
    m = fuse.match(p, p.find(Op.SOFTMAX)[0])
    bad = dataclasses.replace(
        _plain_rule(), score=online_softmax.qk * online_softmax.scale_log2 * 2, raw_max=None, p_from_qk=None
    )
    with pytest.raises(ProofError, match=r"\(c\) scores"):
        online_softmax.prove(bad, m.chain, 1 / sp.sqrt(D))


def test_fuse_refuses_when_the_proof_fails(monkeypatch):
    bad_rule = dataclasses.replace(_plain_rule(), alpha=2 ** (online_softmax.m_use - online_softmax.m_i))
    monkeypatch.setattr(fuse, "make_rule", lambda fn, keep: bad_rule)
    p = parse_program(resources.shipped_programs()["full"].read_text())
    with pytest.raises(FusionError, match="cannot fuse softmax 'p': proof failed"):
        fuse.fuse(p)


def test_fuse_deferred_rewrites_now_and_proves_when_asked(monkeypatch):
    """The pipeline renders and compiles the rewrite while it proves: the rewrite comes first, and its proof is a
    function whose failure raises the refusal fuse() raises."""
    p = parse_program(resources.shipped_programs()["full"].read_text())
    fused, prove = fuse.fuse_deferred(p)
    assert fused == fuse.fuse(p) and [i.name for i in prove()] == [i.name for i in fuse.fuse_with_proofs(p)[1]]
    bad_rule = dataclasses.replace(_plain_rule(), alpha=2 ** (online_softmax.m_use - online_softmax.m_i))
    monkeypatch.setattr(fuse, "make_rule", lambda fn, keep: bad_rule)
    fused, prove = fuse.fuse_deferred(p)
    assert fused.find(Op.ONLINE_SOFTMAX)
    with pytest.raises(FusionError, match="cannot fuse softmax 'p': proof failed"):
        prove()


def test_a_failed_proof_stops_the_compile_after_nvrtc_and_keeps_nothing(monkeypatch, tmp_path):
    """compile proves while NVRTC runs; a proof that fails raises its refusal, returns no kernel and stores no
    compile-cache entry (a later compile proves again)."""
    from fagen import cache, pipeline
    from fagen.request import for_compile

    bad_rule = dataclasses.replace(_plain_rule(), alpha=2 ** (online_softmax.m_use - online_softmax.m_i))
    monkeypatch.setattr(fuse, "make_rule", lambda fn, keep: bad_rule)
    with pytest.raises(FusionError, match="proof failed"):
        pipeline.compile(64, arch="sm_90a", cache_dir=tmp_path)
    assert cache.load(for_compile(64, arch="sm_90a").cache_key(), tmp_path) is None
    assert not (tmp_path / "proofs").exists() or not list((tmp_path / "proofs").iterdir())
