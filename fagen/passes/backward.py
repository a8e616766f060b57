"""The backward pass: a fused forward program becomes the program of its gradients (a pure function IR → IR),
after the identities of fagen.math.backward are proven for its rule (a backward that cannot be derived or
proven is refused, naming the score function and why).

For a fused node o = online_softmax(q, k, v, scale=..., score=..., keep=...) the backward program is

    q, k, v, o, do: the forward's inputs, its output and the gradient of the loss by it (inputs)
    lse:            the forward's row log-sum-exp [.., M] (an input: the forward saved it)
    delta = row_dot(do, o)                                    D_i = rowsum(dO_i ∘ O_i)
    dq = online_softmax_grad(q, k, v, do, lse, delta, wrt=q, scale=..., score=..., keep=...)
    dk = online_softmax_grad(..., wrt=k, ...)
    dv = online_softmax_grad(..., wrt=v, ...)
    d<tensor> = online_softmax_grad(..., wrt=<tensor>, ...)    per call-time tensor the score reads
    output(dq, dk, dv, d<tensor>...)

Multiple outputs: the IR's nodes have one value each, so the fused backward is one online_softmax_grad node
per gradient, all with the same inputs and the same scale/score/keep (the forward node's), told apart by
`wrt` (q, k, v, or a tensor's name). Together they stand for one computation, as the forward's node does for
its O and lse: the executor evaluates the group once, and the backward kernels compute every gradient of the
group in one pass. The nodes carry the forward's attributes rather than the rule, as the forward's node does:
the rule is `math.backward.make_backward_rule(score, keep)`, a function of them (`rule_of`).

Gradients of the tensors a mask reads are not taken (a mask is piecewise constant: no gradient flows).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..ir import IRError, Node, Op, Program, TensorType, exprs, verify
from ..math import bounds
from ..math.backward import BackwardError, BackwardRule, make_backward_rule, prove_backward
from ..math.bounds import KeyRange
from ..math.online_softmax import Identity, ProofError
from . import fuse


@dataclass(frozen=True)
class ProvenRule:
    """What the backward kernels print, proven by this pass: the rule ((g)-(k), `proofs`) and the transposed key
    ranges, the query tiles that see a key tile (`range_proofs`)."""

    rule: BackwardRule
    query_range: KeyRange
    proofs: tuple[Identity, ...]
    range_proofs: tuple[str, ...]

    def statements(self) -> tuple[str, ...]:
        """Every statement proven, as the kernels' proofs list them."""
        return tuple(f"{i.name}: {i.statement}" for i in self.proofs) + self.range_proofs


def rule_of(node: Node) -> BackwardRule:
    """The backward rule of an online_softmax or online_softmax_grad node (a function of its score and keep)."""
    if node.op not in (Op.ONLINE_SOFTMAX, Op.ONLINE_SOFTMAX_GRAD):
        raise BackwardError(f"node {node.name!r} is {node.op.value}, not online_softmax(_grad)")
    return make_backward_rule(node.attr("score"), node.attr("keep"))


def derive(fused: Program, source: Program | None = None) -> Program:
    """The backward program of a fused forward program (see the module docstring)."""
    return derive_with_proofs(fused, source)[0]


def prove_rule(fused: Program, source: Program | None = None) -> ProvenRule:
    """The backward rule of a fused program's attention node and its transposed key ranges, each proven (a score
    function that cannot be differentiated, or a failed proof, is refused with a BackwardError). `source`: the
    program before fusion, whose pointwise chain (scale, score_mod, mask nodes) (i) and (j) differentiate; without
    it, the fused node's own scale and score (which fusion's (c) proved equal to the original graph's)."""
    node = fuse.fused_node(fused)
    score, keep, scale = node.attr("score"), node.attr("keep"), node.attr("scale")
    brule = make_backward_rule(score, keep)  # refuses a score function it cannot differentiate
    chain, chain_scale = _source_chain(source, scale)
    try:
        proven = prove_backward(brule, chain, chain_scale)
    except ProofError as e:
        raise BackwardError(f"cannot derive the backward of {node.name!r} ({exprs.to_text(score)}): {e}") from None
    qrng = bounds.query_range(keep)
    return ProvenRule(brule, qrng, proven, tuple(bounds.prove_query_range(keep, qrng)))


def derive_with_proofs(fused: Program, source: Program | None = None) -> tuple[Program, ProvenRule]:
    """`derive`, and the rule and ranges it proved before deriving (prove_rule)."""
    node = fuse.fused_node(fused)
    if fused.outputs != (node.name,):
        raise BackwardError(
            f"program {fused.name!r}: the backward is derived for a program whose one output is the attention "
            f"{node.name!r}; it outputs {', '.join(fused.outputs)}"
        )
    proven = prove_rule(fused, source)
    brule = proven.rule
    scale, score, keep = (node.attr(a) for a in ("scale", "score", "keep"))
    names = {}
    for g in brule.tensors:
        names[g.name] = "" if g.gathered else g.index  # a gathered tensor's gradient has its own shape: f32[]
    q, k, v = (fused.node(i) for i in node.inputs)
    out = node
    row = TensorType("f32", q.type.shape[:-1])
    inputs = [
        Node(q.name, Op.INPUT, (), q.type),
        Node(k.name, Op.INPUT, (), k.type),
        Node(v.name, Op.INPUT, (), v.type),
        Node(out.name, Op.INPUT, (), out.type),
        Node(f"d{out.name}", Op.INPUT, (), out.type),
        Node("lse", Op.INPUT, (), row),
        Node("delta", Op.ROW_DOT, (f"d{out.name}", out.name), row),
    ]
    grad_inputs = (q.name, k.name, v.name, f"d{out.name}", "lse", "delta")
    attrs = (("scale", scale), ("score", score), ("keep", keep))
    grads = [
        Node(f"d{x.name}", Op.ONLINE_SOFTMAX_GRAD, grad_inputs, x.type, (*attrs, ("wrt", role)))
        for role, x in zip("qkv", (q, k, v))
    ]
    grads += [
        Node(
            f"d{name}",
            Op.ONLINE_SOFTMAX_GRAD,
            grad_inputs,
            TensorType("f32", tuple(index.upper())),
            (*attrs, ("wrt", name)),
        )
        for name, index in sorted(names.items())
    ]
    nodes = inputs + grads
    seen = set()
    for n in nodes:
        if n.name in seen:
            raise BackwardError(
                f"program {fused.name!r}: the backward's node {n.name!r} would be defined twice; rename the "
                "forward's inputs or output (the backward names them d<name>, and adds lse and delta)"
            )
        seen.add(n.name)
    try:
        program = verify(Program.build(f"{fused.name}_backward", nodes, tuple(g.name for g in grads)))
    except IRError as e:  # pragma: no cover - the nodes above are built to verify
        raise BackwardError(f"program {fused.name!r}: the derived backward does not verify: {e}") from None
    return program, proven


def _source_chain(source: Program | None, scale: sp.Expr):
    """The original graph's pointwise chain and scale (fusion's match), or None for the fused node's own."""
    if source is None or not source.find(Op.SOFTMAX):
        return None, scale
    (softmax,) = source.find(Op.SOFTMAX)[-1:]
    m = fuse.match(source, softmax)
    return m.chain, fuse.compose(m.chain)[0]


def grad_group(program: Program, node: Node) -> list[Node]:
    """The online_softmax_grad nodes computed together with `node`: same inputs and same scale/score/keep."""
    key = (node.inputs, node.attrs[:-1])
    return [n for n in program.find(Op.ONLINE_SOFTMAX_GRAD) if (n.inputs, n.attrs[:-1]) == key]
