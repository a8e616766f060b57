"""The IR's text form: `parse_program`, the inverse of `print_program` (fagen.ir.core, beside the nodes it prints).

Each statement is read with Python's `ast` parser (it is valid annotated-assignment syntax) and checked
against a whitelist; nothing is executed.
"""

from __future__ import annotations

import ast
import re

import sympy as sp

from . import exprs
from .core import BOOL, COND, DIM, DIM_NAMES, DTYPES, NAME, SCHEMA, IRError, Node, Op, Program, TensorType
from .verify import verify

# --- Parsing ---------------------------------------------------------------------------------------------
_OPS = {op.value: op for op in Op}
MAX_LINE = 4000  # characters in one statement
MAX_NODES = 256  # statements in one program


def parse_program(text: str, *, source: str = "<ir>") -> Program:
    """Parse program text. Errors name the source, the line and what was expected."""
    if not isinstance(text, str):
        raise IRError(f"{source}: expected program text (str), got {type(text).__name__}")
    name: str | None = None
    nodes: list[Node] = []
    outputs: tuple[str, ...] | None = None
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
            body = ast.parse(line, mode="exec").body
        except SyntaxError as e:
            raise IRError(f"{where}: cannot parse {line[:80]!r}{'...' if len(line) > 80 else ''}: {e.msg}") from None
        except (RecursionError, MemoryError):
            raise IRError(f"{where}: statement nested too deeply to parse") from None
        if len(body) != 1:
            raise IRError(f"{where}: expected one statement per line")
        stmt = body[0]
        if (
            isinstance(stmt, ast.Expr)
            and isinstance(stmt.value, ast.Call)
            and isinstance(stmt.value.func, ast.Name)
            and stmt.value.func.id == "output"
        ):
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
            raise IRError(
                f"{where}: {op.value} has no attribute {key!r} (expected {', '.join(sorted(known)) or 'none'})"
            )
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
        elif a.kind == NAME:
            if not isinstance(value, ast.Name):
                raise IRError(f"{what}: expected a name (an input of the node or a call-time tensor)")
            attrs.append((a.name, value.id))
        else:
            text = ast.get_source_segment(line, value) or ""  # (the value was parsed from the line)
            try:
                expr = exprs.parse_expr(text, dict(a.names), what=what, tensors=a.tensors)
            except exprs.ExprError as e:
                raise IRError(str(e)) from None
            is_cond = isinstance(expr, sp.logic.boolalg.Boolean) and not isinstance(expr, sp.Expr)
            if (a.kind == COND) != is_cond:
                raise IRError(f"{what}: expected {'a condition' if a.kind == COND else 'a number'}")
            attrs.append((a.name, expr))
    return Node(stmt.target.id, op, inputs, _parse_type(stmt.annotation, where), tuple(attrs))
