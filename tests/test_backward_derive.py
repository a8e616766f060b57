"""The backward pass: before/expected programs, the IR ops it adds, the proofs (g)-(k), and what it refuses."""

import dataclasses

import pytest
import sympy as sp

from fagen import builders, pipeline, resources
from fagen.backend import codegen, contract, tiers
from fagen.ir import IRError, Node, Op, Program, TensorType, exprs, parse_program, variants
from fagen.math import backward as bw
from fagen.math import online_softmax as fwd
from fagen.math.online_softmax import ProofError
from fagen.passes import backward, fuse
from fagen.passes.dtype import bind_dtype

SHIPPED = {name: parse_program(path.read_text()) for name, path in resources.shipped_programs().items()}
D = exprs.DIMS["D"]
s, h, q_, k_ = exprs.SCORE, exprs.INDICES["h"], exprs.INDICES["q"], exprs.INDICES["k"]
PROOFS = [
    "(g) softmax Jacobian",
    "(h) P from lse",
    "(i) chain rule",
    "(l) scale folded into D_i",
    "(k) fully masked row",
]


def expected(score, keep, tensors=(), dtype="T", name="t"):
    """The backward program written out by hand."""
    qt, kt = TensorType(dtype, ("B", "H", "M", "D")), TensorType(dtype, ("B", "H", "N", "D"))
    row = TensorType("f32", ("B", "H", "M"))
    grad_in = ("q", "k", "v", "do", "lse", "delta")
    attrs = (("scale", 1 / sp.sqrt(D)), ("score", score), ("keep", keep))
    nodes = [
        Node("q", Op.INPUT, (), qt),
        Node("k", Op.INPUT, (), kt),
        Node("v", Op.INPUT, (), kt),
        Node("o", Op.INPUT, (), qt),
        Node("do", Op.INPUT, (), qt),
        Node("lse", Op.INPUT, (), row),
        Node("delta", Op.ROW_DOT, ("do", "o"), row),
        Node("dq", Op.ONLINE_SOFTMAX_GRAD, grad_in, qt, (*attrs, ("wrt", "q"))),
        Node("dk", Op.ONLINE_SOFTMAX_GRAD, grad_in, kt, (*attrs, ("wrt", "k"))),
        Node("dv", Op.ONLINE_SOFTMAX_GRAD, grad_in, kt, (*attrs, ("wrt", "v"))),
    ]
    for tname, index in tensors:
        nodes.append(
            Node(
                f"d{tname}",
                Op.ONLINE_SOFTMAX_GRAD,
                grad_in,
                TensorType("f32", (index,)),
                (*attrs, ("wrt", tname)),
            )
        )
    return Program.build(f"{name}_backward", nodes, tuple(n.name for n in nodes[7:]))


def test_derives_plain_attention():
    """Forward o = online_softmax(q, k, v) becomes delta = row_dot(do, o) and one grad node per gradient."""
    fused = fuse.fuse(SHIPPED["full"])
    assert backward.derive(fused) == expected(s, sp.true, name="full")


def test_derives_alibi_with_the_slopes_gradient():
    fused = fuse.fuse(SHIPPED["alibi"])
    score = s + (k_ - q_) * exprs.tensor("slopes")[h]
    assert backward.derive(fused, SHIPPED["alibi"]) == expected(
        score, sp.Le(k_, q_), tensors=[("slopes", "H")], name="causal_alibi"
    )


def test_derive_is_pure_and_keeps_the_bound_dtype():
    plain = bind_dtype(SHIPPED["causal"], "bf16")
    fused = fuse.fuse(plain)
    text = str(fused)
    derived = backward.derive(fused, plain)
    assert str(fused) == text
    assert derived == expected(s, sp.Le(k_, q_), dtype="bf16", name="causal")
    assert backward.derive(fused) == derived  # the fused node's own chain gives the same program


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_every_shipped_backward_prints_and_parses_back(name):
    derived, proven = backward.derive_with_proofs(fuse.fuse(SHIPPED[name]), SHIPPED[name])
    assert parse_program(str(derived)) == derived
    names = [i.name for i in proven.proofs]
    assert names == (PROOFS[:3] + ["(j) tensor gradients"] + PROOFS[3:] if name == "alibi" else PROOFS)


def test_custom_score_functions_get_their_tensor_gradients():
    prog = variants.build(score_mod=lambda s, b, h, q, k, bias, temp: s * temp[h] + bias[h], causal=True)
    derived, proven = backward.derive_with_proofs(fuse.fuse(prog), prog)
    assert derived.outputs == ("dq", "dk", "dv", "dbias", "dtemp")
    assert [derived.node(n).type.shape for n in ("dbias", "dtemp")] == [("H",), ("H",)]
    assert "(j) tensor gradients" in [i.name for i in proven.proofs]
    brule = backward.rule_of(fuse.fused_node(fuse.fuse(prog)))
    partials = {g.name: g.partial for g in brule.tensors}
    assert partials["bias"] == 1
    assert sp.simplify(partials["temp"] - fwd.qk * fwd.scale_log2 / fwd.kLog2e) == 0


def test_a_mask_tensor_gets_no_gradient():
    prog = variants.build(mask=lambda b, h, q, k, lens: k < lens[b])
    assert backward.derive(fuse.fuse(prog)).outputs == ("dq", "dk", "dv")


# --- the IR ops ----------------------------------------------------------------------------------------------
GRAD_HEADER = """program g
q: T[B, H, M, D] = input()
k: T[B, H, N, D] = input()
v: T[B, H, N, D] = input()
o: T[B, H, M, D] = input()
do: T[B, H, M, D] = input()
lse: f32[B, H, M] = input()
"""


@pytest.mark.parametrize(
    "body, fragment",
    [
        (
            "delta: f32[B, H, M] = row_dot(do, q)\nx: T[B, H, M, D] = online_softmax_grad(q, k, v, do, lse, delta, "
            "scale=1, score=s, keep=True, wrt=x)\n",
            "wrt='x' is neither q, k, v nor a tensor the score reads",
        ),
        ("delta: f32[B, H, M] = row_dot(do, k)\n", "row_dot): operands"),
        (
            "delta: f32[B, H, M] = row_dot(do, o)\nx: T[B, H, M, D] = online_softmax_grad(q, k, v, do, lse, delta, "
            "scale=1, score=s, keep=True, wrt=k)\n",
            "declared shape [B, H, M, D], expected [B, H, N, D]",
        ),
        (
            "delta: f32[B, H, M] = row_dot(do, o)\nx: T[B, H, M, D] = online_softmax_grad(q, k, v, do, delta, lse, "
            "scale=1, score=s, keep=True, wrt=1)\n",
            "expected a name",
        ),
        (
            "delta: f32[B, H, M] = row_dot(do, o)\nx: T[B, H, M, D] = online_softmax_grad(q, k, v, o, do, delta, "
            "scale=1, score=s, keep=True, wrt=q)\n",
            "lse and delta must be one value per query row",
        ),
        (
            "delta: f32[B, H, M] = row_dot(do, o)\nx: T[B, H, M, D] = online_softmax_grad(q, k, v, do, lse, delta, "
            "scale=1, score=s, keep=True)\n",
            "needs the attribute 'wrt'",
        ),
    ],
)
def test_grad_ops_are_verified(body, fragment):
    with pytest.raises(IRError) as e:
        parse_program(GRAD_HEADER + body + "output(" + body.split(":")[0] + ")\n")
    assert fragment in str(e.value)


def test_a_tensor_gradient_has_the_tensor_shape():
    text = (
        GRAD_HEADER + "delta: f32[B, H, M] = row_dot(do, o)\n"
        "db: f32[B] = online_softmax_grad(q, k, v, do, lse, delta, scale=1, score=s + bias[b], keep=True, wrt=bias)\n"
        "output(db)\n"
    )
    assert parse_program(text).node("db").type.shape == ("B",)
    with pytest.raises(IRError, match=r"declared shape \[H\], expected \[B\]"):
        parse_program(text.replace("db: f32[B]", "db: f32[H]"))


# --- the proofs ---------------------------------------------------------------------------------------------------
def _rule(score=s, keep=sp.true):
    return bw.make_backward_rule(score, keep)


@pytest.mark.parametrize(
    "score",
    [
        s,
        30 * sp.tanh(s / 30),
        variants.alibi_score(),
        s * exprs.tensor("temp")[h] + exprs.tensor("bias")[h],
        sp.Max(s, -5),  # a.e. smooth: a Heaviside step
        sp.Abs(s),  # a.e. smooth: sign
        sp.Piecewise((s, s > 0), (s / 2, True)),
        sp.log(1 + sp.exp(s)),
    ],
)
def test_the_proofs_hold(score):
    names = [i.name for i in bw.prove_backward(_rule(score))]
    assert names[:3] == PROOFS[:3] and names[-2:] == PROOFS[3:]
    assert ("(j) tensor gradients" in names) == bool(score.atoms(sp.Indexed))


@pytest.mark.parametrize(
    "field, wrong, fragment",
    [
        # dS with the wrong sign of D: not the softmax Jacobian
        ("ds", bw.p * (bw.dp + bw.d_row), "(g) softmax Jacobian"),
        # dS without P
        ("ds", bw.dp - bw.d_row, "(g) softmax Jacobian"),
        # P from lse in base e on base-2 scores
        ("p", sp.exp(fwd.s - bw.lse_log2), "(g) softmax Jacobian"),
        # lse_log2 that forgets the base change
        ("lse_log2", sp.Piecewise((sp.oo, sp.Eq(bw.lse, -sp.oo)), (bw.lse, True)), "(g) softmax Jacobian"),
        # no guard for the fully masked row: 2^(s + inf) = inf, not 0
        ("lse_log2", bw.lse * fwd.kLog2e, "(k) fully masked row"),
        # the chain without the scale
        ("dqk", bw.ds, "(i) chain rule"),
        # the folded form without the scale on D_i
        ("d_scaled_of", bw.d_row, "(l) scale folded into D_i"),
        # the folded form with dS's sign of D_i wrong
        ("dqk_p", bw.p * (bw.dp * bw.scale + bw.d_scaled), "(l) scale folded into D_i"),
    ],
)
def test_a_wrong_rule_is_caught_by_the_proof(field, wrong, fragment):
    bad = dataclasses.replace(_rule(), **{field: wrong})
    with pytest.raises(ProofError) as e:
        bw.prove_backward(bad)
    assert fragment in str(e.value)


def test_a_wrong_chain_or_tensor_gradient_is_caught():
    softcap = _rule(30 * sp.tanh(s / 30))
    bad = dataclasses.replace(softcap, dqk=_rule().dqk)  # the identity's chain for softcap: f' missing
    with pytest.raises(ProofError, match=r"\(i\) chain rule"):
        bw.prove_backward(bad)
    alibi = _rule(variants.alibi_score())
    g = alibi.tensors[0]
    bad = dataclasses.replace(alibi, tensors=(bw.TensorGradient(g.name, g.index, k_ + q_),))
    with pytest.raises(ProofError, match=r"\(j\) tensor gradients"):
        bw.prove_backward(bad)
    with pytest.raises(ProofError, match=r"\(j\) tensor gradients"):
        bw.prove_backward(dataclasses.replace(alibi, tensors=()))  # a tensor the score reads, with no gradient


def test_the_chain_is_the_original_graphs():
    """(i) differentiates the graph's own ops: a rule whose score differs from the graph's is refused."""
    plain = SHIPPED["softcap"]
    m = fuse.match(plain, plain.find(Op.SOFTMAX)[0])
    scale = fuse.compose(m.chain)[0]
    assert bw.prove_backward(_rule(fuse.compose(m.chain)[1]), m.chain, scale)
    with pytest.raises(ProofError, match=r"\(i\) chain rule"):
        bw.prove_backward(_rule(20 * sp.tanh(s / 20)), m.chain, scale)


def test_derive_refuses_when_a_proof_fails(monkeypatch):
    bad = dataclasses.replace(_rule(), ds=bw.dp - bw.d_row)
    monkeypatch.setattr(backward, "make_backward_rule", lambda score, keep: bad)
    with pytest.raises(bw.BackwardError, match=r"cannot derive the backward of 'o' \(s\): proof failed: \(g\)"):
        backward.derive(fuse.fuse(SHIPPED["full"]))


def test_an_unproven_backward_is_refused_before_anything_is_printed(monkeypatch):
    """The backend prints only what the backward pass proved: a rule that fails (g) is refused by the pass, before
    a backward kernel is rendered."""
    bad = dataclasses.replace(_rule(), ds=bw.dp - bw.d_row)
    monkeypatch.setattr(backward, "make_backward_rule", lambda score, keep: bad)
    monkeypatch.setattr(codegen, "render", lambda *a, **kw: pytest.fail("rendered an unproven backward"))
    with pytest.raises(bw.BackwardError, match=r"\(g\) softmax Jacobian"):
        builders.build_backward_kernels(fuse.fuse(SHIPPED["full"]), "full", 64, "bf16", "sm_90a")
    monkeypatch.undo()
    names = [f.name for f in codegen.backward_rule_functions(_rule(sp.Max(s, -5)), tiers.get("simt"), ())]
    assert names == ["score", "lse_log2", "p_from_lse", "ds", "dqk"]


# --- refusals --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "score, fragment",
    [
        (sp.floor(s), "floor(s) is piecewise constant in the score"),
        (s + sp.floor(2 * s), "floor(2*s) is piecewise constant in the score"),
        (sp.Mod(3, s), "the divisor of (3) % (s) depends on the score"),
        (s + sp.floor(exprs.tensor("bias")[h]), "piecewise constant in tensor bias[h]"),
        (sp.Function("g")(s), "has no closed form"),
    ],
)
def test_refuses_what_it_cannot_differentiate(score, fragment):
    with pytest.raises(bw.BackwardError) as e:
        bw.make_backward_rule(score, sp.true)
    assert str(e.value).startswith(f"score function {exprs.to_text(score)}: ")
    assert fragment in str(e.value)


def test_the_backend_refuses_a_derivative_it_cannot_print():
    """The pass derives what SymPy can; a derivative the C printer has no function for is refused where the kernels
    print it, naming the score function and the derivative."""
    score = sp.LambertW(s)
    brule = bw.make_backward_rule(score, sp.true)
    with pytest.raises(bw.BackwardError) as e:
        codegen.backward_rule_functions(brule, tiers.get("simt"), ())
    assert str(e.value).startswith(f"score function {exprs.to_text(score)}: ")
    assert "its derivative by the score, " in str(e.value)


def test_refuses_a_floor_of_the_score_from_a_program_and_accepts_one_of_indices():
    prog = variants.build(score_mod=lambda s, b, h, q, k: s + s // 2)
    with pytest.raises(bw.BackwardError, match="piecewise constant in the score"):
        backward.derive(fuse.fuse(prog), prog)
    prog = variants.build(score_mod=lambda s, b, h, q, k: s - (k // 4))  # floor of indices only: fine
    assert backward.derive(fuse.fuse(prog), prog).outputs == ("dq", "dk", "dv")


def test_a_tensor_read_at_two_indices_is_gathered_with_one_gradient():
    prog = variants.build(score_mod=lambda s, b, h, q, k, bias: s + bias[h] + 2 * bias[b])
    derived = backward.derive(fuse.fuse(prog))
    (dbias,) = [n for n in derived.nodes() if n.name == "dbias"]
    assert dbias.type.shape == ()  # the tensor's own shape, known at call time
    rule = backward.rule_of(fuse.fused_node(fuse.fuse(prog)))
    assert sorted((str(g.read), g.index, g.partial) for g in rule.tensors) == [
        ("bias[b]", "g0", 2),
        ("bias[h]", "g1", 1),
    ]


def test_a_tensor_read_once_as_b_h_gets_a_slot_gradient():
    """name[b, h] (per-batch ALiBi slopes) is reduced per block, batch and head like name[h]: no atomics."""
    prog = variants.build(score_mod=lambda s, b, h, q, k, slopes: s + slopes[b, h] * (k - q))
    rule = backward.rule_of(fuse.fused_node(fuse.fuse(prog)))
    assert [(str(g.read), g.index, g.gathered) for g in rule.tensors] == [("slopes[b, h]", "bh", False)]
    assert fuse.tensor_index(fuse.fuse(prog), "slopes") == "bh"
    (arg,) = contract.tensor_args(fuse.tensor_reads(fuse.fuse(prog)))
    assert (arg.rank, arg.grad, arg.dims) == (2, False, "bh")
    swapped = variants.build(score_mod=lambda s, b, h, q, k, slopes: s + slopes[h, b] * (k - q))
    assert [g.index for g in backward.rule_of(fuse.fused_node(fuse.fuse(swapped))).tensors] == ["g0"]


def test_refuses_names_that_would_clash():
    text = str(SHIPPED["full"]).replace("q: T", "delta: T").replace("matmul(q, k", "matmul(delta, k")
    with pytest.raises(bw.BackwardError, match="node 'delta' would be defined twice"):
        backward.derive(fuse.fuse(parse_program(text)))


# --- the pipeline -----------------------------------------------------------------------------------------------
def test_lower_with_backward_adds_the_proven_step():
    steps = pipeline.lower(SHIPPED["alibi"], "f16", backward=True)
    last = steps[-1]
    assert last.name.startswith("backward:")
    assert last.program.outputs == ("dq", "dk", "dv", "dslopes")
    assert [p.split(":")[0] for p in last.proofs] == PROOFS[:3] + ["(j) tensor gradients", *PROOFS[3:]]
    assert last.facts["forward"] == steps[-2].program
    assert last.facts["rule"] == backward.rule_of(fuse.fused_node(steps[-2].program))
    assert [st.name for st in pipeline.lower(SHIPPED["alibi"], "f16")] == [st.name for st in steps[:-1]]
