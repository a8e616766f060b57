"""The attention IR: an `Op` enum, frozen `Node` payloads, and `Program`, the graph that holds them.

A program is text like this (`ir/causal.ir`)::

    program causal
    q: T[B, H, M, D] = input()
    k: T[B, H, N, D] = input()
    v: T[B, H, N, D] = input()
    s: f32[B, H, M, N] = matmul(q, k, transpose_b=True)
    t: f32[B, H, M, N] = scale(s, factor=1/sqrt(D))
    u: f32[B, H, M, N] = mask(t, keep=k <= q)
    p: f32[B, H, M, N] = softmax(u, axis=N)
    o: T[B, H, M, D] = matmul(p, v)
    output(o)

Each statement is read with Python's `ast` parser (it is valid annotated-assignment syntax) and checked
against a whitelist; nothing is executed. `T` is the kernel's storage type, bound by `bind_dtype`.
Programs are immutable: passes build new ones.
"""

from .core import POINTWISE, SCHEMA, IRError, Node, Op, Program, TensorType, print_program
from .text import parse_program
from .verify import verify

__all__ = [
    "IRError",
    "Node",
    "Op",
    "POINTWISE",
    "Program",
    "SCHEMA",
    "TensorType",
    "parse_program",
    "print_program",
    "verify",
]
