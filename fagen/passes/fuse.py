"""The fusion pass: matmul → pointwise* → softmax → matmul becomes one online_softmax node, after the
identities of fagen.math.online_softmax are proven for it (a rewrite that cannot be proven is refused,
naming the op). Also the queries later stages ask of a fused program.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sympy as sp

from ..ir import POINTWISE, IRError, Node, Op, Program, exprs, verify
from ..math.online_softmax import Identity, OnlineSoftmaxRule, ProofError, make_rule, prove


class FusionError(IRError):
    """The pass cannot fuse (or cannot prove the fusion); names the op that blocks it."""


@dataclass(frozen=True)
class Match:
    qk: Node  # matmul(q, k, transpose_b=True)
    chain: tuple[Node, ...]  # pointwise ops between the matmuls, in order
    softmax: Node
    pv: Node  # matmul(p, v)


def match(program: Program, softmax: Node) -> Match:
    """Find matmul → pointwise* → softmax → matmul around `softmax`, or refuse naming the op."""
    where = f"cannot fuse softmax {softmax.name!r}"
    users = program.consumers(softmax.name)
    if softmax.name in program.outputs:
        raise FusionError(f"{where}: it is an output of the program; the fused kernel never forms P")
    if (
        len(users) != 1
        or users[0].op is not Op.MATMUL
        or users[0].inputs[0] != softmax.name
        or users[0].attr("transpose_b")
    ):
        names = ", ".join(f"{u.name!r} ({u.op.value})" for u in users) or "nothing"
        raise FusionError(f"{where}: its result must feed exactly one matmul(p, v); it feeds {names}")
    pv_node = users[0]
    chain = []
    cur = program.node(softmax.inputs[0])
    while cur.op in POINTWISE:
        if len(program.consumers(cur.name)) != 1 or cur.name in program.outputs:
            raise FusionError(f"{where}: {cur.op.value} {cur.name!r} between the matmuls is also used elsewhere")
        chain.append(cur)
        cur = program.node(cur.inputs[0])
    if cur.op is not Op.MATMUL or not cur.attr("transpose_b"):
        raise FusionError(
            f"{where}: {cur.op.value} {cur.name!r} sits between the matmuls and is not pointwise "
            "(expected matmul(q, k, transpose_b=True) → scale/score_mod/mask → softmax)"
        )
    if len(program.consumers(cur.name)) != 1 or cur.name in program.outputs:
        raise FusionError(f"{where}: matmul {cur.name!r} (Q Kᵀ) is also used elsewhere")
    if softmax.attr("axis") != program.node(cur.inputs[1]).type.shape[-2]:
        raise FusionError(f"{where}: softmax over {softmax.attr('axis')!r} is not over the keys")
    if program.node(cur.inputs[1]).type.shape[-2] != program.node(pv_node.inputs[1]).type.shape[-2]:
        raise FusionError(f"{where}: matmul {pv_node.name!r} does not contract over the keys")
    return Match(cur, tuple(reversed(chain)), softmax, pv_node)


def compose(chain: tuple[Node, ...]) -> tuple[sp.Expr, sp.Expr, sp.Basic]:
    """(scale, score_fn(s), keep) for a pointwise chain; refuses chains the rewrite cannot express.

    Scale ops before any score function form the (runtime-overridable) scale; later ones fold into the
    score function. Masking excludes a key from the softmax, so every op after a mask must keep -inf at
    -inf (a positive scale does; tanh does not: tanh(-inf) = -1 would un-mask the key).
    """
    scale, fn, keep, masked = sp.Integer(1), exprs.SCORE, sp.true, False
    for node in chain:
        if node.op is Op.SCALE:
            factor = node.attr("factor")
            if fn == exprs.SCORE and factor.is_positive is not True:
                raise FusionError(
                    f"cannot fuse: scale {node.name!r} must have a positive factor (the kernels take "
                    f"the scale as a positive argument), got {exprs.to_text(factor)}"
                )
            if masked and not factor.is_positive:
                raise FusionError(f"cannot fuse: scale {node.name!r} after a mask must have a positive factor")
            if fn == exprs.SCORE:
                scale = scale * factor
            else:
                fn = factor * fn
        elif node.op is Op.SCORE_MOD:
            f = node.attr("fn")
            if (
                masked
                and sp.limit(
                    f.xreplace({exprs.SCORE: -sp.Symbol("y", positive=True)}), sp.Symbol("y", positive=True), sp.oo
                )
                != -sp.oo
            ):
                raise FusionError(
                    f"cannot fuse: score_mod {node.name!r} after a mask does not keep masked "
                    "scores at -inf; put the mask after it"
                )
            fn = f.xreplace({exprs.SCORE: fn})
        elif node.op is Op.MASK:
            keep, masked = sp.And(keep, node.attr("keep")), True
    return scale, fn, keep


def fuse(program: Program) -> Program:
    """Rewrite every matmul → pointwise → softmax → matmul into one proven online_softmax node."""
    return fuse_with_proofs(program)[0]


def fuse_with_proofs(program: Program) -> tuple[Program, tuple[Identity, ...]]:
    """`fuse`, and the identities it proved for the rewrite (the pipeline keeps them with its step)."""
    fused, prove_rewrite = fuse_deferred(program)
    return fused, prove_rewrite()


def fuse_deferred(program: Program) -> tuple[Program, Callable[[], tuple[Identity, ...]]]:
    """The rewrite, and its proof as a function still to call: it returns the identities the rewrite relies on,
    or raises FusionError at the first that fails. `fuse_with_proofs` calls it at once; the pipeline calls it
    while NVRTC compiles the kernel printed from the rewrite, and uses neither the program nor the kernel
    until it has returned."""
    softmaxes = program.find(Op.SOFTMAX)
    if not softmaxes:
        return program, lambda: ()
    nodes = {n.name: n for n in program.nodes()}
    obligations = []
    for sm in reversed(softmaxes):  # the last softmax first: one inside another's chain is then refused by name
        m = match(program, sm)
        scale, fn, keep = compose(m.chain)
        obligations.append((sm.name, make_rule(fn, keep), m.chain, scale))
        for dead in (m.qk, *m.chain, m.softmax):
            del nodes[dead.name]
        q, k = m.qk.inputs
        v = m.pv.inputs[1]
        nodes[m.pv.name] = Node(
            m.pv.name, Op.ONLINE_SOFTMAX, (q, k, v), m.pv.type, (("scale", scale), ("score", fn), ("keep", keep))
        )
    order = [n.name for n in program.nodes() if n.name in nodes]
    fused = verify(Program.build(program.name, [nodes[n] for n in order], program.outputs))

    def prove_rewrite() -> tuple[Identity, ...]:
        proven: list[Identity] = []
        for name, rule, chain, scale in obligations:
            try:
                proven += prove(rule, chain, scale)
            except ProofError as e:
                raise FusionError(f"cannot fuse softmax {name!r}: {e}") from None
        return tuple(proven)

    return fused, prove_rewrite


def rule_of(node: Node) -> OnlineSoftmaxRule:
    """The proven rule of a fused node (fuse() proved it before it created the node)."""
    if node.op is not Op.ONLINE_SOFTMAX:
        raise FusionError(f"node {node.name!r} is {node.op.value}, not online_softmax")
    return make_rule(node.attr("score"), node.attr("keep"))


def fused_node(program: Program) -> Node:
    found = program.find(Op.ONLINE_SOFTMAX)
    if len(found) != 1:
        raise FusionError(
            f"program {program.name!r}: expected exactly one fused attention, found {len(found)}"
            + (" (is there a softmax followed by a matmul?)" if not found else "")
        )
    return found[0]


# --- Queries on a fused program ---------------------------------------------------------------------------
def tensors_of(program: Program) -> tuple[str, ...]:
    """The call-time tensors of a fused program (kernel parameters, in this order)."""
    node = fused_node(program)
    return tuple(sorted(set(exprs.tensors_in(node.attr("score"))) | set(exprs.tensors_in(node.attr("keep")))))


@dataclass(frozen=True)
class TensorRead:
    """How a fused program reads one call-time tensor (the backend makes its kernel parameters from this:
    contract.tensor_args)."""

    name: str
    rank: int
    gathered: bool  # the score reads it other than as the one read name[h] / name[b] / name[b, h]: its gradient,
    # where it has one, is scatter-added
    dims: str  # per dimension, the bare index every read puts there (b, h, q or k), else '.'
    index: str = ""  # a read of it inside another read's index, in text (offsets[doc[q]]: 'doc[q]'), else '': its
    # dtype must be an integer one


def tensor_reads(program: Program) -> tuple[TensorRead, ...]:
    """The call-time tensors of a fused program, in tensors_of's order, as it reads them."""
    node = fused_node(program)
    score, keep = node.attr("score"), node.attr("keep")
    ranks = exprs.tensor_ranks(score, keep)
    out = []
    for name in tensors_of(program):
        reads = [r for r in score.atoms(sp.Indexed) if str(r.base.label) == name]
        every = [r for e in (score, keep) for r in e.atoms(sp.Indexed) if str(r.base.label) == name]
        dims = "".join(
            str(col[0]) if len(set(col)) == 1 and col[0] in exprs.INDICES.values() else "."
            for col in zip(*(r.indices for r in every))
        )
        inner = sorted(str(r) for r in every if exprs.is_index_read(r))
        gathered = bool(reads) and exprs.slot_index(reads) is None
        out.append(TensorRead(name, ranks[name], gathered, dims, inner[0] if inner else ""))
    return tuple(out)


def tensor_index(program: Program, name: str) -> str:
    """What a call-time tensor is read as, in text: 'h', 'b' or 'bh' for a per-head / per-batch / per-(batch, head)
    tensor read once as name[h], name[b] or name[b, h] (exprs.slot_index), else its reads ('doc_id[q], doc_id[k]'),
    for messages."""
    node = fused_node(program)
    reads = sorted(
        {
            str(i)
            for e in (node.attr("score"), node.attr("keep"))
            for i in e.atoms(sp.Indexed)
            if str(i.base.label) == name
        }
    )
    if not reads:
        raise KeyError(f"program {program.name!r} reads no tensor {name!r}")
    if reads in ([f"{name}[h]"], [f"{name}[b]"], [f"{name}[b, h]"]):
        return reads[0][len(name) + 1 : -1].replace(", ", "")
    return ", ".join(reads)


def is_masked(program: Program) -> bool:
    return fused_node(program).attr("keep") != sp.true


def is_scored(program: Program) -> bool:
    """Whether the fused attention applies a score function to the scaled q·k (softcap, ALiBi, a score_mod)."""
    return fused_node(program).attr("score") != exprs.SCORE
