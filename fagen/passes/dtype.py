"""bind_dtype: the storage type parameter T becomes a concrete dtype (a pure pass, IR -> IR)."""

from __future__ import annotations

from ..ir import IRError, Node, Program, TensorType


def bind_dtype(program: Program, dtype: str) -> Program:
    """Replace the storage type parameter T by a concrete dtype."""
    if dtype not in ("f16", "bf16", "f32"):
        raise IRError(f"dtype: expected f16, bf16 or f32, got {dtype!r}")
    nodes = [
        Node(n.name, n.op, n.inputs, TensorType(dtype if n.type.dtype == "T" else n.type.dtype, n.type.shape), n.attrs)
        for n in program.nodes()
    ]
    return Program.build(program.name, nodes, program.outputs)
