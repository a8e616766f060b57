"""The IR's core: an `Op` enum, frozen `Node` payloads, each op's schema, and `Program`, a graph of nodes (each
node names its inputs; the order is a topological one from the standard library's graphlib). Programs are
immutable: passes build new ones."""

from __future__ import annotations

import enum
import functools
import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter
from types import MappingProxyType
from typing import Any

from . import exprs


class IRError(ValueError):
    """A malformed program: names the line or node and what was expected."""


class Op(enum.Enum):
    INPUT = "input"
    MATMUL = "matmul"
    SCALE = "scale"
    SCORE_MOD = "score_mod"
    MASK = "mask"
    SOFTMAX = "softmax"
    ONLINE_SOFTMAX = "online_softmax"
    ROW_DOT = "row_dot"
    ONLINE_SOFTMAX_GRAD = "online_softmax_grad"


POINTWISE = frozenset({Op.SCALE, Op.SCORE_MOD, Op.MASK})
DTYPES = ("T", "f16", "bf16", "f32")
DIM_NAMES = tuple(exprs.DIMS)


@dataclass(frozen=True)
class TensorType:
    dtype: str
    shape: tuple[str, ...]

    def __str__(self):
        return f"{self.dtype}[{', '.join(self.shape)}]"


# Attribute kinds: how a value is parsed from text and printed back.
BOOL, DIM, EXPR, COND, NAME = "bool", "dim", "expr", "cond", "name"  # NAME: an identifier (a node or tensor)


@dataclass(frozen=True)
class AttrSpec:
    name: str
    kind: str
    names: tuple = ()  # for EXPR/COND: the symbols the expression may use
    default: Any = None  # None: required
    tensors: bool = False  # the expression may read call-time tensors (name[h], name[b])


@dataclass(frozen=True)
class OpSpec:
    arity: int
    attrs: tuple[AttrSpec, ...]


_SCALE = tuple(exprs.SCALE_NAMES.items())
_MASK = tuple(exprs.MASK_NAMES.items())
_SCORE = tuple(exprs.SCORE_NAMES.items())

SCHEMA: dict[Op, OpSpec] = {
    Op.INPUT: OpSpec(0, ()),
    Op.MATMUL: OpSpec(2, (AttrSpec("transpose_b", BOOL, default=False),)),
    Op.SCALE: OpSpec(1, (AttrSpec("factor", EXPR, _SCALE),)),
    Op.SCORE_MOD: OpSpec(1, (AttrSpec("fn", EXPR, _SCORE, tensors=True),)),
    Op.MASK: OpSpec(1, (AttrSpec("keep", COND, _MASK, tensors=True),)),
    Op.SOFTMAX: OpSpec(1, (AttrSpec("axis", DIM),)),
    # The fused node: O = softmax(score(scale * Q Kᵀ), masked by keep) V, plus the row log-sum-exp.
    Op.ONLINE_SOFTMAX: OpSpec(
        3,
        (
            AttrSpec("scale", EXPR, _SCALE),
            AttrSpec("score", EXPR, _SCORE, tensors=True),
            AttrSpec("keep", COND, _MASK, tensors=True),
        ),
    ),
    # D = rowsum(a ∘ b) over the last dimension (the backward's D_i = dO_i · O_i).
    Op.ROW_DOT: OpSpec(2, ()),
    # The fused backward of an online_softmax node (fagen.passes.backward): inputs q, k, v, dO, lse, D and the
    # forward's attributes; `wrt` selects the gradient this node names (q, k, v or a call-time tensor the score
    # reads). The nodes of one backward share inputs and attributes: one kernel computes them all.
    Op.ONLINE_SOFTMAX_GRAD: OpSpec(
        6,
        (
            AttrSpec("scale", EXPR, _SCALE),
            AttrSpec("score", EXPR, _SCORE, tensors=True),
            AttrSpec("keep", COND, _MASK, tensors=True),
            AttrSpec("wrt", NAME),
        ),
    ),
}
GRAD_INPUTS = ("q", "k", "v", "do", "lse", "delta")  # the roles of online_softmax_grad's inputs, in order


@dataclass(frozen=True)
class Node:
    name: str
    op: Op
    inputs: tuple[str, ...]
    type: TensorType
    attrs: tuple[tuple[str, Any], ...] = ()

    def attr(self, key):
        for k, v in self.attrs:
            if k == key:
                return v
        raise KeyError(f"node {self.name!r} ({self.op.value}) has no attribute {key!r}")


@dataclass(frozen=True, eq=False)
class Program:
    """A named graph of nodes with designated outputs. Treat as immutable.

    `defs` holds the nodes by name in definition order; a node's `inputs` are its edges. Compiling a program
    needs no graph library (importing networkx costs more than a compile's own graph work): `graph` builds a
    networkx DiGraph of the program for code that wants a graph algorithm."""

    name: str
    defs: Mapping[str, Node]
    outputs: tuple[str, ...]

    @staticmethod
    def build(name: str, nodes: Iterable[Node], outputs: Iterable[str]) -> Program:
        defs: dict[str, Node] = {}
        for node in nodes:
            if node.name in defs:
                raise IRError(f"node {node.name!r} is defined twice")
            defs[node.name] = node
        for node in defs.values():
            for src in node.inputs:
                if src not in defs:
                    raise IRError(f"node {node.name!r}: input {src!r} is not defined")
        return Program(name, MappingProxyType(defs), tuple(outputs))

    @functools.cached_property
    def _order(self) -> tuple[str, ...] | None:
        """The names in a stable topological order: the earliest-defined ready node first (networkx's
        lexicographical_topological_sort keyed by definition order); None where the graph has a cycle."""
        rank = {n: i for i, n in enumerate(self.defs)}
        sorter = TopologicalSorter({n: node.inputs for n, node in self.defs.items()})
        try:
            sorter.prepare()
        except CycleError:
            return None
        ready = [(rank[n], n) for n in sorter.get_ready()]
        heapq.heapify(ready)
        order = []
        while ready:
            _, n = heapq.heappop(ready)
            order.append(n)
            sorter.done(n)
            for m in sorter.get_ready():
                heapq.heappush(ready, (rank[m], m))
        return tuple(order)

    def is_acyclic(self) -> bool:
        return self._order is not None

    def nodes(self) -> list[Node]:
        """Nodes in a stable topological order (definition order where free)."""
        if self._order is None:
            raise IRError(f"program {self.name!r}: the graph has a cycle")
        return [self.defs[n] for n in self._order]

    def node(self, name: str) -> Node:
        return self.defs[name]

    def consumers(self, name: str) -> list[Node]:
        """The nodes that read `name`, in definition order (each once)."""
        return [node for node in self.defs.values() if name in node.inputs]

    @functools.cached_property
    def graph(self):
        """The program as a networkx DiGraph (imports networkx): node attributes `node` (the Node) and `order`
        (its definition index), edge attribute `pos` (the input's position)."""
        import networkx as nx

        g = nx.DiGraph()
        for i, (n, node) in enumerate(self.defs.items()):
            g.add_node(n, node=node, order=i)
        for node in self.defs.values():
            for pos, src in enumerate(node.inputs):
                g.add_edge(src, node.name, pos=pos)
        return g

    def find(self, op: Op) -> list[Node]:
        return [n for n in self.nodes() if n.op is op]

    def __eq__(self, other):
        return (
            isinstance(other, Program)
            and self.name == other.name
            and self.outputs == other.outputs
            and self.nodes() == other.nodes()
        )

    def __hash__(self):
        return hash(str(self))

    def __str__(self):
        return print_program(self)


# --- Printing (the text form; fagen.ir.text parses it back) ----------------------------------------------------
def _print_attr(kind, value):
    if kind == BOOL:
        return "True" if value else "False"
    if kind in (DIM, NAME):
        return value
    return exprs.to_text(value)


def print_program(program: Program) -> str:
    """The program as text, one statement a line (attributes at their default left out)."""
    lines = [f"program {program.name}"]
    for node in program.nodes():
        spec = SCHEMA[node.op]
        args = list(node.inputs)
        for a in spec.attrs:
            value = node.attr(a.name)
            if a.default is not None and value == a.default:
                continue
            args.append(f"{a.name}={_print_attr(a.kind, value)}")
        lines.append(f"{node.name}: {node.type} = {node.op.value}({', '.join(args)})")
    lines.append(f"output({', '.join(program.outputs)})")
    return "\n".join(lines) + "\n"
