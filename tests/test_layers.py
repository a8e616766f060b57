"""Imports run one way: the module graph of fagen/ (every import at any depth, function-local and TYPE_CHECKING ones
included, relative ones resolved) has no cycle and no import from a lower layer to a higher one."""

import ast
from pathlib import Path

import networkx as nx

import fagen

ROOT = Path(fagen.__file__).resolve().parent
# The layers, lowest first. Ground modules import no other layer; every other module directly in fagen/ (pipeline,
# cache, api, flash_attn, kvcache, flex, hf, the package itself) is a front-end; __main__ is a tool.
LAYERS = ("ground", "ir", "math", "passes", "backend", "runtime", "front-end", "tools")
GROUND = {"fagen.version", "fagen.resources", "fagen.store"}
FOLDERS = ("ir", "math", "passes", "backend", "runtime", "tools")


def layer(module: str) -> int:
    """The layer of a module of fagen, as an index into LAYERS."""
    parts = module.split(".")
    if module in GROUND:
        return LAYERS.index("ground")
    if len(parts) > 1 and parts[1] in FOLDERS:  # a module of a layer's folder, or its package (fagen/ir/__init__.py)
        return LAYERS.index(parts[1])
    if parts[1:] == ["__main__"]:
        return LAYERS.index("tools")
    return LAYERS.index("front-end")


def modules() -> dict[str, Path]:
    """Every module of fagen by its dotted name (a package by its own name)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, text: str, known, package: bool = False) -> set[tuple[str, int]]:
    """(module of fagen, line) of every import in `text`, the source of module `name` (a package's __init__ where
    `package`), at any depth; relative imports resolved, and `from package import name` taken as an import of the
    submodule where `known` (the modules' names) has one, else of the package."""
    here = name if package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found |= {(a.name, node.lineno) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here.split(".")[: len(here.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{target}.{a.name}" for a in node.names} & set(known)
            found |= {(m, node.lineno) for m in subs} or {(target, node.lineno)}
    return {(m, line) for m, line in found if m.split(".")[0] == "fagen" and m != name}


def graph() -> tuple[nx.DiGraph, list[str]]:
    """The import graph of fagen's modules, and each import that goes up a layer ('module:line -> module')."""
    known = modules()
    g = nx.DiGraph()
    g.add_nodes_from(known)
    upward = []
    for name, path in known.items():
        for target, line in sorted(imports(name, path.read_text(), known, path.name == "__init__.py")):
            if target == "fagen":
                continue  # `import fagen`: the package's lazy public names (importlib), not a module of a layer
            g.add_edge(name, target)
            if layer(target) > layer(name):
                upward.append(f"{name}:{line} ({LAYERS[layer(name)]}) -> {target} ({LAYERS[layer(target)]})")
    return g, upward


def test_the_layers_are_in_order():
    assert set(modules()) >= {"fagen.store", "fagen.ir.core", "fagen.pipeline", "fagen.cache", "fagen.__main__"}
    order = ["fagen.store", "fagen.ir", "fagen.ir.core", "fagen.math.bounds", "fagen.passes.fuse"]
    order += ["fagen.backend.tiers.base", "fagen.runtime.kernel", "fagen.pipeline", "fagen.tools.cli"]
    assert [layer(m) for m in order] == sorted(layer(m) for m in order)
    assert layer("fagen.ir") < layer("fagen.math") and layer("fagen.pipeline") == layer("fagen.cache") == layer("fagen")
    assert layer("fagen.__main__") == layer("fagen.tools") == layer("fagen.tools.cli") > layer("fagen.hf")


def test_the_scan_sees_every_kind_of_import():
    """Imports inside functions and TYPE_CHECKING blocks, relative ones at any level, `from package import module`
    and `from package import name` are all seen."""
    text = (
        "from typing import TYPE_CHECKING\n"
        "from ..ir import Program\n"
        "if TYPE_CHECKING:\n    from ...fagen.runtime.arrays import Array\n"
        "def f():\n    from .. import cache\n    from . import bounds\n    import fagen.backend.printer\n"
    )
    found = {m for m, _ in imports("fagen.math.probe", text, modules())}
    assert found == {"fagen.ir", "fagen.runtime.arrays", "fagen.cache", "fagen.math.bounds", "fagen.backend.printer"}


def test_no_import_cycle():
    g, _ = graph()
    cycles = sorted((" -> ".join(c) for c in nx.simple_cycles(g)), key=len)
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles[:20])


def test_no_import_goes_up_a_layer():
    _, upward = graph()
    assert not upward, "imports from a lower layer to a higher one:\n  " + "\n  ".join(upward)


# --- sizes a reader can hold -------------------------------------------------------------------------------------
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = {"fagen/pipeline.py": 500, "fagen/runtime/kernel.py": 500}


def test_no_function_is_over_80_lines():
    """Every function and method of fagen/, docstring included, fits in 80 lines."""
    long = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name} ({path.name}:{node.lineno}): {lines} lines")
    assert not long, "functions over 80 lines:\n  " + "\n  ".join(long)


def test_the_driver_and_the_kernel_stay_short():
    for rel, most in MAX_MODULE_LINES.items():
        lines = len((ROOT.parent / rel).read_text().splitlines())
        assert lines < most, f"{rel}: {lines} lines (at most {most - 1})"
