"""The attention IR: an `Op` enum, frozen `Node` payloads, and a networkx graph as the container.

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
from __future__ import annotations

import ast
import enum
import re
from dataclasses import dataclass
from typing import Any, Iterable

import networkx as nx
import sympy as sp

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
BOOL, DIM, EXPR, COND = "bool", "dim", "expr", "cond"


@dataclass(frozen=True)
class AttrSpec:
    name: str
    kind: str
    names: tuple = ()        # for EXPR/COND: the symbols the expression may use
    default: Any = None      # None: required
    tensors: bool = False    # the expression may read call-time tensors (name[h], name[b])


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
    Op.ONLINE_SOFTMAX: OpSpec(3, (AttrSpec("scale", EXPR, _SCALE), AttrSpec("score", EXPR, _SCORE, tensors=True),
                                  AttrSpec("keep", COND, _MASK, tensors=True))),
}


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
    """A named graph of nodes with designated outputs. Treat as immutable."""
    name: str
    graph: nx.DiGraph
    outputs: tuple[str, ...]

    @staticmethod
    def build(name: str, nodes: Iterable[Node], outputs: Iterable[str]) -> "Program":
        g = nx.DiGraph()
        for node in nodes:
            if node.name in g:
                raise IRError(f"node {node.name!r} is defined twice")
            g.add_node(node.name, node=node, order=len(g))
        for node in (g.nodes[n]["node"] for n in list(g.nodes)):
            for pos, src in enumerate(node.inputs):
                if src not in g:
                    raise IRError(f"node {node.name!r}: input {src!r} is not defined")
                g.add_edge(src, node.name, pos=pos)
        return Program(name, g, tuple(outputs))

    def nodes(self) -> list[Node]:
        """Nodes in a stable topological order (definition order where free)."""
        order = nx.lexicographical_topological_sort(self.graph, key=lambda n: self.graph.nodes[n]["order"])
        return [self.graph.nodes[n]["node"] for n in order]

    def node(self, name: str) -> Node:
        return self.graph.nodes[name]["node"]

    def consumers(self, name: str) -> list[Node]:
        return [self.node(n) for n in sorted(self.graph.successors(name),
                                             key=lambda n: self.graph.nodes[n]["order"])]

    def find(self, op: Op) -> list[Node]:
        return [n for n in self.nodes() if n.op is op]

    def __eq__(self, other):
        return (isinstance(other, Program) and self.name == other.name
                and self.outputs == other.outputs and self.nodes() == other.nodes())

    def __hash__(self):
        return hash(print_program(self))

    def __str__(self):
        return print_program(self)


# --- Printing ---------------------------------------------------------------------------------------------
def _print_attr(kind, value):
    if kind == BOOL:
        return "True" if value else "False"
    if kind == DIM:
        return value
    return exprs.to_text(value)


def print_program(program: Program) -> str:
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


# --- Parsing ---------------------------------------------------------------------------------------------
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_OPS = {op.value: op for op in Op}
MAX_LINE = 4000          # characters in one statement
MAX_NODES = 256          # statements in one program


def parse_program(text: str, *, source: str = "<ir>") -> Program:
    """Parse program text. Errors name the source, the line and what was expected."""
    if not isinstance(text, str):
        raise IRError(f"{source}: expected program text (str), got {type(text).__name__}")
    name, nodes, outputs = None, [], None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        if name is None:
            m = re.fullmatch(r"program\s+([A-Za-z_][A-Za-z0-9_]*)", line)
            if not m:
                raise IRError(f"{where}: expected 'program NAME' as the first statement, got {line!r}")
            name = m.group(1)
            continue
        if outputs is not None:
            raise IRError(f"{where}: nothing may follow output(...)")
        if len(line) > MAX_LINE:
            raise IRError(f"{where}: statement of {len(line)} characters (at most {MAX_LINE})")
        if len(nodes) >= MAX_NODES:
            raise IRError(f"{where}: more than {MAX_NODES} statements")
        try:
            stmt = ast.parse(line, mode="exec").body
        except SyntaxError as e:
            raise IRError(f"{where}: cannot parse {line[:80]!r}{'...' if len(line) > 80 else ''}: {e.msg}") from None
        except (RecursionError, MemoryError):
            raise IRError(f"{where}: statement nested too deeply to parse") from None
        if len(stmt) != 1:
            raise IRError(f"{where}: expected one statement per line")
        stmt = stmt[0]
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) \
                and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id == "output":
            outputs = tuple(_name(a, where, "output") for a in stmt.value.args)
            if not outputs or stmt.value.keywords:
                raise IRError(f"{where}: output(...) takes one or more node names")
            continue
        try:
            nodes.append(_parse_node(stmt, line, where))
        except RecursionError:
            raise IRError(f"{where}: expression nested too deeply") from None
    if name is None:
        raise IRError(f"{source}: empty program (expected 'program NAME')")
    if outputs is None:
        raise IRError(f"{source}: missing output(...) statement")
    program = Program.build(name, nodes, outputs)
    verify(program)
    return program


def _name(node, where, what):
    if not isinstance(node, ast.Name):
        raise IRError(f"{where}: {what}: expected a node name")
    return node.id


def _parse_type(node, where) -> TensorType:
    if not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)):
        raise IRError(f"{where}: expected a type like f32[B, H, M, N]")
    dtype = node.value.id
    if dtype not in DTYPES:
        raise IRError(f"{where}: unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    dims = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    shape = []
    for d in dims:
        if not (isinstance(d, ast.Name) and d.id in DIM_NAMES):
            raise IRError(f"{where}: dimensions must be among {', '.join(DIM_NAMES)}")
        shape.append(d.id)
    return TensorType(dtype, tuple(shape))


def _parse_node(stmt, line, where) -> Node:
    if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None):
        raise IRError(f"{where}: expected 'NAME: TYPE = op(...)', got {line!r}")
    call = stmt.value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
        raise IRError(f"{where}: expected an op call after '='")
    op = _OPS.get(call.func.id)
    if op is None:
        raise IRError(f"{where}: unknown op {call.func.id!r} (expected one of {', '.join(_OPS)})")
    spec = SCHEMA[op]
    inputs = tuple(_name(a, where, f"{op.value} input") for a in call.args)
    if len(inputs) != spec.arity:
        raise IRError(f"{where}: {op.value} takes {spec.arity} input(s), got {len(inputs)}")
    given = {}
    for kw in call.keywords:
        if kw.arg is None or kw.arg in given:
            raise IRError(f"{where}: bad or repeated attribute")
        given[kw.arg] = kw.value
    known = {a.name for a in spec.attrs}
    for key in given:
        if key not in known:
            raise IRError(f"{where}: {op.value} has no attribute {key!r} (expected {', '.join(sorted(known)) or 'none'})")
    attrs = []
    for a in spec.attrs:
        if a.name not in given:
            if a.default is None:
                raise IRError(f"{where}: {op.value} needs the attribute {a.name!r}")
            attrs.append((a.name, a.default))
            continue
        value = given[a.name]
        what = f"{where}: {op.value} attribute {a.name!r}"
        if a.kind == BOOL:
            if not (isinstance(value, ast.Constant) and isinstance(value.value, bool)):
                raise IRError(f"{what}: expected True or False")
            attrs.append((a.name, value.value))
        elif a.kind == DIM:
            if not (isinstance(value, ast.Name) and value.id in DIM_NAMES):
                raise IRError(f"{what}: expected a dimension name ({', '.join(DIM_NAMES)})")
            attrs.append((a.name, value.id))
        else:
            text = ast.get_source_segment(line, value)
            try:
                expr = exprs.parse_expr(text, dict(a.names), what=what, tensors=a.tensors)
            except exprs.ExprError as e:
                raise IRError(str(e)) from None
            is_cond = isinstance(expr, sp.logic.boolalg.Boolean) and not isinstance(expr, sp.Expr)
            if (a.kind == COND) != is_cond:
                raise IRError(f"{what}: expected {'a condition' if a.kind == COND else 'a number'}")
            attrs.append((a.name, expr))
    return Node(stmt.target.id, op, inputs, _parse_type(stmt.annotation, where), tuple(attrs))


# --- Verifier --------------------------------------------------------------------------------------------
def verify(program: Program) -> Program:
    """Check a program's structure and types; raise IRError naming the node. Returns the program."""
    g = program.graph
    if not nx.is_directed_acyclic_graph(g):
        raise IRError(f"program {program.name!r}: the graph has a cycle")
    for out in program.outputs:
        if out not in g:
            raise IRError(f"program {program.name!r}: output {out!r} is not defined")
    for node in program.nodes():
        spec = SCHEMA[node.op]
        if len(node.inputs) != spec.arity:
            raise IRError(f"node {node.name!r} ({node.op.value}): expects {spec.arity} inputs")
        if [a for a, _ in node.attrs] != [a.name for a in spec.attrs]:
            raise IRError(f"node {node.name!r} ({node.op.value}): attributes must be "
                          f"{[a.name for a in spec.attrs]}")
        if node.type.dtype not in DTYPES:
            raise IRError(f"node {node.name!r}: unknown dtype {node.type.dtype!r}")
        ins = [program.node(i).type for i in node.inputs]
        expected = _infer_shape(node, ins)
        if expected != node.type.shape:
            raise IRError(f"node {node.name!r} ({node.op.value}): declared shape [{', '.join(node.type.shape)}], "
                          f"expected [{', '.join(expected)}]")
        if node.op is Op.SOFTMAX and node.attr("axis") != node.type.shape[-1]:
            raise IRError(f"node {node.name!r} (softmax): axis must be the last dimension "
                          f"{node.type.shape[-1]!r}, got {node.attr('axis')!r}")
    return program


def _infer_shape(node: Node, ins: list[TensorType]) -> tuple[str, ...]:
    if node.op is Op.INPUT:
        if len(node.type.shape) < 2:
            raise IRError(f"node {node.name!r} (input): expected at least 2 dimensions")
        return node.type.shape
    if node.op is Op.MATMUL:
        a, b = ins[0].shape, ins[1].shape
        if len(a) != len(b) or len(a) < 2 or a[:-2] != b[:-2]:
            raise IRError(f"node {node.name!r} (matmul): operand shapes [{', '.join(a)}] and "
                          f"[{', '.join(b)}] have different batch dimensions")
        rows_b, cols_b = (b[-1], b[-2]) if node.attr("transpose_b") else (b[-2], b[-1])
        if a[-1] != rows_b:
            raise IRError(f"node {node.name!r} (matmul): contraction dims {a[-1]!r} and {rows_b!r} differ")
        return a[:-1] + (cols_b,)
    if node.op in POINTWISE or node.op is Op.SOFTMAX:
        return ins[0].shape
    if node.op is Op.ONLINE_SOFTMAX:
        q, k, v = (t.shape for t in ins)
        if not (len(q) == len(k) == len(v) and q[:-2] == k[:-2] == v[:-2] and q[-1] == k[-1] and k[-2] == v[-2]):
            raise IRError(f"node {node.name!r} (online_softmax): q, k, v shapes do not fit "
                          "[.., M, D], [.., N, D], [.., N, Dv]")
        return q[:-1] + (v[-1],)
    raise IRError(f"node {node.name!r}: unknown op {node.op}")


# --- Small pure passes -----------------------------------------------------------------------------------
def bind_dtype(program: Program, dtype: str) -> Program:
    """Replace the storage type parameter T by a concrete dtype."""
    if dtype not in ("f16", "bf16", "f32"):
        raise IRError(f"dtype: expected f16, bf16 or f32, got {dtype!r}")
    nodes = [Node(n.name, n.op, n.inputs, TensorType(dtype if n.type.dtype == "T" else n.type.dtype, n.type.shape),
                  n.attrs) for n in program.nodes()]
    return Program.build(program.name, nodes, program.outputs)
