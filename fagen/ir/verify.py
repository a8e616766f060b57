"""The verifier: structure and types of a program, checked after every pass."""

from __future__ import annotations

import sympy as sp

from . import exprs
from .core import DTYPES, POINTWISE, SCHEMA, IRError, Node, Op, Program, TensorType


def verify(program: Program) -> Program:
    """Check a program's structure and types; raise IRError naming the node. Returns the program."""
    if not program.is_acyclic():
        raise IRError(f"program {program.name!r}: the graph has a cycle")
    for out in program.outputs:
        if out not in program.defs:
            raise IRError(f"program {program.name!r}: output {out!r} is not defined")
    for node in program.nodes():
        spec = SCHEMA[node.op]
        if len(node.inputs) != spec.arity:
            raise IRError(f"node {node.name!r} ({node.op.value}): expects {spec.arity} inputs")
        if [a for a, _ in node.attrs] != [a.name for a in spec.attrs]:
            raise IRError(f"node {node.name!r} ({node.op.value}): attributes must be {[a.name for a in spec.attrs]}")
        if node.type.dtype not in DTYPES:
            raise IRError(f"node {node.name!r}: unknown dtype {node.type.dtype!r}")
        ins = [program.node(i).type for i in node.inputs]
        expected = _infer_shape(node, ins)
        if expected != node.type.shape:
            raise IRError(
                f"node {node.name!r} ({node.op.value}): declared shape [{', '.join(node.type.shape)}], "
                f"expected [{', '.join(expected)}]"
            )
        if node.op is Op.SOFTMAX and node.attr("axis") != node.type.shape[-1]:
            raise IRError(
                f"node {node.name!r} (softmax): axis must be the last dimension "
                f"{node.type.shape[-1]!r}, got {node.attr('axis')!r}"
            )
    return program


def _infer_shape(node: Node, ins: list[TensorType]) -> tuple[str, ...]:
    if node.op is Op.INPUT:
        if len(node.type.shape) < 2:
            raise IRError(f"node {node.name!r} (input): expected at least 2 dimensions")
        return node.type.shape
    if node.op is Op.MATMUL:
        a, b = ins[0].shape, ins[1].shape
        if len(a) != len(b) or len(a) < 2 or a[:-2] != b[:-2]:
            raise IRError(
                f"node {node.name!r} (matmul): operand shapes [{', '.join(a)}] and "
                f"[{', '.join(b)}] have different batch dimensions"
            )
        rows_b, cols_b = (b[-1], b[-2]) if node.attr("transpose_b") else (b[-2], b[-1])
        if a[-1] != rows_b:
            raise IRError(f"node {node.name!r} (matmul): contraction dims {a[-1]!r} and {rows_b!r} differ")
        return a[:-1] + (cols_b,)
    if node.op in POINTWISE or node.op is Op.SOFTMAX:
        return ins[0].shape
    if node.op is Op.ONLINE_SOFTMAX:
        q, k, v = (t.shape for t in ins)
        if not (len(q) == len(k) == len(v) and q[:-2] == k[:-2] == v[:-2] and q[-1] == k[-1] and k[-2] == v[-2]):
            raise IRError(
                f"node {node.name!r} (online_softmax): q, k, v shapes do not fit [.., M, D], [.., N, D], [.., N, Dv]"
            )
        return q[:-1] + (v[-1],)
    if node.op is Op.ROW_DOT:
        if ins[0].shape != ins[1].shape:
            raise IRError(
                f"node {node.name!r} (row_dot): operands [{', '.join(ins[0].shape)}] and "
                f"[{', '.join(ins[1].shape)}] differ"
            )
        return ins[0].shape[:-1]
    if node.op is Op.ONLINE_SOFTMAX_GRAD:
        return _grad_shape(node, ins)
    raise IRError(f"node {node.name!r}: unknown op {node.op}")


def _grad_shape(node: Node, ins: list[TensorType]) -> tuple[str, ...]:
    """online_softmax_grad(q, k, v, do, lse, delta, wrt=...): the shape of the gradient `wrt` selects."""
    q, k, v, do, lse, delta = (t.shape for t in ins)
    where = f"node {node.name!r} (online_softmax_grad)"
    if not (len(q) == len(k) == len(v) and q[:-2] == k[:-2] == v[:-2] and q[-1] == k[-1] and k[-2] == v[-2]):
        raise IRError(f"{where}: q, k, v shapes do not fit [.., M, D], [.., N, D], [.., N, Dv]")
    if do != q[:-1] + (v[-1],):
        raise IRError(f"{where}: do must have the output's shape [{', '.join(q[:-1] + (v[-1],))}]")
    if lse != q[:-1] or delta != q[:-1]:
        raise IRError(f"{where}: lse and delta must be one value per query row, [{', '.join(q[:-1])}]")
    wrt = node.attr("wrt")
    if wrt in ("q", "k", "v"):
        return dict(q=q, k=k, v=v)[wrt]
    reads = [r for r in sorted(node.attr("score").atoms(sp.Indexed), key=str) if str(r.base.label) == wrt]
    if exprs.slot_index(reads) is not None:  # a per-head / per-batch vector, or [B, H]
        return tuple(str(i).upper() for i in reads[0].indices)
    if reads:
        return ()  # a gathered tensor: its gradient has the tensor's own shape, known at call time
    raise IRError(
        f"{where}: wrt={wrt!r} is neither q, k, v nor a tensor the score reads "
        f"({', '.join(exprs.tensors_in(node.attr('score'))) or 'none'})"
    )
