"""The README's Python examples, run as written.

Every fenced block of README.md whose info string is `python` is run, in order, in one namespace, in a
temporary folder, with the kernel cache in a temporary folder (`FAGEN_CACHE_DIR`): these blocks must not
need a GPU (compiling does not). A block fenced as `python gpu` needs a CUDA GPU (it calls kernels on
device tensors); without one it is checked, not run:

- every name it reads is defined in the block itself or by a block before it, or is a builtin;
- every call of a compiled kernel (a name bound to a `fagen.Kernel` by an earlier block) binds to the
  kernel's signature, passes by name exactly the call-time tensors the kernel's program reads, and every
  attribute it uses on a kernel exists.

With a GPU (`run_all(..., gpu=True)`) the `python gpu` blocks run too. Any other info string on a block that
starts with `python` is an error, so a block cannot drop out of the test by a typo.

    python tests/readme_examples.py [README.md] [--gpu]

runs them outside pytest (`.ci/run` does, with the python of a virtual environment that has only the
installed wheel). This file imports nothing from the source tree but `fagen` itself.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import inspect
import io
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
KINDS = {"python": "cpu", "python gpu": "gpu"}
_FENCE = re.compile(r"^```(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    kind: str  # "cpu": runs anywhere; "gpu": needs a CUDA GPU
    code: str
    line: int  # README line of the block's first code line

    def compiled(self, filename: str):
        # pad with newlines so a traceback names the README's own line numbers
        return compile("\n" * (self.line - 1) + self.code, filename, "exec")


def fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """Every fenced block of a Markdown text, in order: (info string, README line of its first line, its lines)."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = _FENCE.match(lines[i].rstrip())
        if not m:
            i += 1
            continue
        start = end = i + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"README line {i + 1}: code block not closed")
        out.append((m["info"].strip(), start + 1, lines[start:end]))
        i = end + 1
    return out


def blocks(text: str) -> list[Block]:
    """The ```python and ```python gpu blocks of a Markdown text, in order."""
    out = []
    for info, first, lines in fenced_blocks(text):
        if info.split(" ")[0] == "python":
            if info not in KINDS:
                raise ValueError(
                    f"README line {first - 1}: unknown python block kind {info!r} (expected one of {sorted(KINDS)})"
                )
            out.append(Block(KINDS[info], "\n".join(lines) + "\n", first))
    return out


def _names_read(tree: ast.AST) -> list[tuple[str, int]]:
    """Names a block reads before (or without) defining them, with their lines; a deliberately simple
    flow-insensitive reading: a name assigned anywhere in the block counts as defined by it."""
    defined, read = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            read.append((node.id, node.lineno))
        elif isinstance(node, ast.Name):
            defined.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
    return [(n, line) for n, line in read if n not in defined]


def check_gpu_block(block: Block, namespace: dict) -> None:
    """Check a `python gpu` block without running it (see the module docstring); raises AssertionError."""
    import fagen

    tree = ast.parse(block.code)
    where = f"README line {block.line} (python gpu block)"
    for name, line in _names_read(tree):
        assert name in namespace or hasattr(builtins, name), (
            f"{where}, line {block.line + line - 1}: {name!r} is not defined by this block or one before it"
        )
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and isinstance(namespace.get(node.value.id), fagen.Kernel)
        ):
            assert hasattr(namespace[node.value.id], node.attr), (
                f"{where}: kernel {node.value.id} has no attribute {node.attr!r}"
            )
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and isinstance(namespace.get(func.id), fagen.Kernel):
            kernel, method, label = namespace[func.id], "__call__", func.id
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and isinstance(namespace.get(func.value.id), fagen.Kernel)
            and func.attr == "varlen"
        ):
            kernel, method, label = namespace[func.value.id], "varlen", f"{func.value.id}.varlen"
        else:
            continue
        line = block.line + node.lineno - 1
        assert not any(isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords), (
            f"{where}, line {line}: write the arguments of {label}(...) out (no * or **)"
        )
        signature = inspect.signature(getattr(kernel, method))
        try:
            bound = signature.bind(*node.args, **{k.arg: k.value for k in node.keywords})
        except TypeError as e:
            raise AssertionError(f"{where}, line {line}: {label}(...) does not fit {signature}: {e}") from None
        extra = set(bound.arguments.get("tensors", {}))
        assert extra == set(kernel.tensors), (
            f"{where}, line {line}: {label}(...) passes tensors {sorted(extra)}, its program reads "
            f"{sorted(kernel.tensors)}"
        )


@contextlib.contextmanager
def _isolated(folder: Path):
    """Run in `folder` (files the examples write land there), with the kernel cache under it."""
    old_cwd, old_cache = os.getcwd(), os.environ.get("FAGEN_CACHE_DIR")
    os.chdir(folder)
    os.environ["FAGEN_CACHE_DIR"] = str(folder / "cache")
    try:
        yield
    finally:
        os.chdir(old_cwd)
        if old_cache is None:
            os.environ.pop("FAGEN_CACHE_DIR", None)
        else:
            os.environ["FAGEN_CACHE_DIR"] = old_cache


def run_all(readme: Path, folder: Path, *, gpu: bool = False, log=None) -> dict:
    """Run the README's blocks in `folder`: the plain python ones, and the gpu ones with `gpu`, else check
    those. Returns the namespace."""
    found = blocks(readme.read_text(encoding="utf-8"))
    assert any(b.kind == "cpu" for b in found), f"{readme}: no ```python block"
    namespace: dict = {"__name__": "__readme__"}
    with _isolated(folder):
        for b in found:
            what = f"README line {b.line} ({'python gpu' if b.kind == 'gpu' else 'python'} block)"
            if b.kind == "cpu" or gpu:
                printed = io.StringIO()  # what the example prints (a whole .cu file) is not the log's
                with contextlib.redirect_stdout(printed):
                    exec(b.compiled(str(readme)), namespace)  # noqa: S102 - running the examples is the point
                status = f"ran, printed {len(printed.getvalue().splitlines())} lines"
            else:
                check_gpu_block(b, namespace)
                status = "checked (needs a GPU to run)"
            if log:
                log(f"{what}: {status}")
    return namespace


def main(argv: list[str]) -> int:
    gpu = "--gpu" in argv
    paths = [a for a in argv if not a.startswith("--")]
    readme = Path(paths[0]) if paths else README
    import fagen

    print(f"fagen {fagen.__version__} from {Path(fagen.__file__).parent}")
    with tempfile.TemporaryDirectory(prefix="fagen-readme-") as folder:
        run_all(readme, Path(folder), gpu=gpu, log=print)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
