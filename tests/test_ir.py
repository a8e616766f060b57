"""The IR: text round-trips, the verifier catches malformed programs, errors name the line."""

import pytest

from fagen import resources
from fagen.ir import IRError, Node, Op, Program, TensorType, parse_program, print_program, verify
from fagen.passes.dtype import bind_dtype

SHIPPED = resources.shipped_programs()


def test_shipped_programs_exist():
    assert {"full", "causal", "causal_br"} <= set(SHIPPED)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_round_trip(name):
    p = parse_program(SHIPPED[name].read_text(), source=name)
    assert parse_program(print_program(p)) == p
    assert print_program(parse_program(print_program(p))) == print_program(p)


def test_bind_dtype_before_expected():
    """bind_dtype replaces T and leaves f32 intermediates alone."""
    p = parse_program(SHIPPED["full"].read_text())
    got = bind_dtype(p, "bf16")
    assert [n.type.dtype for n in got.nodes()] == ["bf16", "bf16", "bf16", "f32", "f32", "f32", "bf16"]
    assert [n.type.dtype for n in p.nodes()][0] == "T"  # the input program is untouched


PLAIN = """program t
q: T[B, H, M, D] = input()
k: T[B, H, N, D] = input()
v: T[B, H, N, D] = input()
s: f32[B, H, M, N] = matmul(q, k, transpose_b=True)
p: f32[B, H, M, N] = softmax(s, axis=N)
o: T[B, H, M, D] = matmul(p, v)
output(o)
"""


@pytest.mark.parametrize(
    "old, new, fragment",
    [
        ("program t", "prog t", "expected 'program NAME'"),
        ("softmax(s, axis=N)", "softmax2(s, axis=N)", "unknown op 'softmax2'"),
        ("f32[B, H, M, N] = softmax", "f64[B, H, M, N] = softmax", "unknown dtype 'f64'"),
        ("softmax(s, axis=N)", "softmax(s, axis=M)", "axis must be the last dimension"),
        ("softmax(s, axis=N)", "softmax(s)", "needs the attribute 'axis'"),
        ("softmax(s, axis=N)", "softmax(s, axis=N, temperature=2)", "has no attribute 'temperature'"),
        ("matmul(p, v)", "matmul(p, w)", "input 'w' is not defined"),
        ("matmul(p, v)", "matmul(p)", "takes 2 input(s)"),
        ("o: T[B, H, M, D] = matmul(p, v)", "o: T[B, H, M, N] = matmul(p, v)", "declared shape"),
        ("transpose_b=True", "transpose_b=1", "expected True or False"),
        ("output(o)", "", "missing output"),
        ("output(o)", "output(z)", "output 'z' is not defined"),
        ("v: T[B, H, N, D] = input()", "v: T[B, H, N, D] = input()\nv: T[B, H, N, D] = input()", "defined twice"),
        ("s: f32[B, H, M, N] = matmul(q, k, transpose_b=True)", "s = matmul(q, k)", "expected 'NAME: TYPE = op(...)'"),
        ("k: T[B, H, N, D] = input()", "k: T[B, H, N, Q] = input()", "dimensions must be among"),
    ],
)
def test_parse_errors_name_the_problem(old, new, fragment):
    assert old in PLAIN
    with pytest.raises(IRError) as e:
        parse_program(PLAIN.replace(old, new), source="bad.ir")
    assert fragment in str(e.value)


def test_parse_error_names_the_line():
    with pytest.raises(IRError, match=r"bad.ir:6"):
        parse_program(PLAIN.replace("softmax(s, axis=N)", "softmax(s, axis=N, x=1)"), source="bad.ir")


def test_attribute_expressions_are_parsed_not_evaluated():
    text = PLAIN.replace(
        "p: f32[B, H, M, N] = softmax(s, axis=N)",
        "u: f32[B, H, M, N] = mask(s, keep=__import__('os'))\np: f32[B, H, M, N] = softmax(u, axis=N)",
    )
    with pytest.raises(IRError, match="function '__import__' is not allowed"):
        parse_program(text)


def test_verifier_checks_matmul_contraction():
    t = TensorType
    nodes = [
        Node("a", Op.INPUT, (), t("f32", ("B", "M", "D"))),
        Node("b", Op.INPUT, (), t("f32", ("B", "N", "D"))),
        Node("c", Op.MATMUL, ("a", "b"), t("f32", ("B", "M", "D")), (("transpose_b", False),)),
    ]
    with pytest.raises(IRError, match="contraction dims 'D' and 'N' differ"):
        verify(Program.build("x", nodes, ("c",)))


def test_order_is_topological_then_definition_order():
    t = TensorType("f32", ("B", "M", "D"))
    scale = (("factor", 1),)
    c = Node("c", Op.SCALE, ("a",), t, scale)  # defined before its input
    a = Node("a", Op.SCALE, ("b",), t, scale)
    b = Node("b", Op.INPUT, (), t)
    d = Node("d", Op.INPUT, (), t)
    program = Program.build("x", [c, a, d, b], ("c",))
    assert [n.name for n in program.nodes()] == ["d", "b", "a", "c"]
    assert [n.name for n in program.consumers("b")] == ["a"] and program.consumers("c") == []
    loop = Program.build("y", [Node("a", Op.SCALE, ("b",), t, scale), Node("b", Op.SCALE, ("a",), t, scale)], ("a",))
    with pytest.raises(IRError, match="the graph has a cycle"):
        verify(loop)


@pytest.mark.parametrize("name", sorted(resources.shipped_programs()))
def test_graph_for_networkx_agrees_with_the_program(name):
    nx = pytest.importorskip("networkx")
    program = parse_program(resources.shipped_programs()[name].read_text())
    g = program.graph
    order = nx.lexicographical_topological_sort(g, key=lambda n: g.nodes[n]["order"])
    assert [g.nodes[n]["node"] for n in order] == program.nodes()
    assert all(g.edges[src, n.name]["pos"] == i for n in program.nodes() for i, src in enumerate(n.inputs))
