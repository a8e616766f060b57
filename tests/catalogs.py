"""The public mask and score catalogs of issue 40, read at run time from checkouts (nothing of them is vendored):

    pytorch          test/inductor/test_flex_attention.py      FlexAttention's own tests (pytorch/pytorch)
    fa4-mask         tests/cute/mask_mod_definitions.py        FlashAttention-4's masks (Dao-AILab/flash-attention)
    fa4-score        tests/cute/score_mod_definitions.py       FlashAttention-4's score functions, eager

Where they are: $FAGEN_CATALOGS=DIR (DIR/pytorch/... and DIR/flash-attention/..., the paths above under each), or
$FAGEN_PYTORCH_SRC / $FAGEN_FLASH_ATTENTION_SRC (a checkout each); a relative path is taken from the repository's
root (FAGEN_CATALOGS=.catalogs, a copy carried into the tree, which git ignores). Absent, `missing` says what to
set.

A catalog file is executed a top-level statement at a time (one that fails, an import of a GPU-only package, say,
loses only its names; CuTe's and FlashAttention's packages, where not installed, are stand-ins whose decorators
return the function: only the eager functions are collected). Its entries, by signature:
- mask(b, h, q_idx, kv_idx[, tensors...]) and score(score, b, h, q_idx, kv_idx[, tensors...]) at module level, and
  those in module-level lists and dicts (FlexAttention's `test_score_mods`, `test_score_mask_mod_map`);
- those a module-level factory builds (`_generate_alibi_bias(num_heads)`, `get_flex_sliding_window_mask(...)`,
  `batch_bias_factory(bias_tensor)`), called with the defaults of `_default`: small ints, and tensors of small
  realistic values (cumulative lengths, document ids, biases);
- those a test method defines (FlexAttention's tests define most of theirs so): the method's top-level assignments,
  loops and definitions run in a namespace of their own (with `self` a stand-in, `dtype` float32 and `params`
  FlexAttention's Params of small sizes; statements that run attention, compile or build block masks are left
  out), and the functions of mask or score signature it holds after each are entries, named Class.method.function
  (one that reads a name no statement set is a note, not an entry).
"cuda" in a catalog's source (and `.cuda()`) reads as the device asked for (CPU here: the captured tensors' values
and sizes are not part of a kernel); a module constant S (sequence length) over 256 reads as 256, so captured S x S
tensors stay small.
Tensor parameters past the signature's (FA4's `doc_id`, `bias`) are bound in a closure, as a FlexAttention user
would capture them, to tensors of the rank the function reads (`bind`).

`run_entry` traces an entry (fagen.ir.variants), then compiles it with NVRTC for sm_90a (no GPU): accepted, refused
(fagen's own error: the construct named) or crashed (any other exception: a defect)."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import os
import re
import sys
import textwrap
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CATALOGS = {
    "pytorch": ("pytorch", "FAGEN_PYTORCH_SRC", "test/inductor/test_flex_attention.py"),
    "fa4-mask": ("flash-attention", "FAGEN_FLASH_ATTENTION_SRC", "tests/cute/mask_mod_definitions.py"),
    "fa4-score": ("flash-attention", "FAGEN_FLASH_ATTENTION_SRC", "tests/cute/score_mod_definitions.py"),
}
MASK_FIRST = ("b", "batch", "b_idx", "batch_idx", "bsz")
HEADS = ("h", "head", "h_idx", "head_idx")
NOT_EAGER = {"seqlen_info", "aux_tensors", "grad", "tSrS_ssa"}  # CuTe's signatures and backward score functions
STUBBED = ("cutlass", "flash_attn")  # CuTe DSL and FlashAttention-4's package: stand-ins where not installed
SKIPPED_IN_TESTS = re.compile(
    r"\bself\.(?!device\b)|torch\.compile|flex_attention\(|create_block_mask\(|\.backward\(|autograd\.grad|make_fx|"
    r"run_and_get_code|PagedAttention|\bassert"
)
MAX_S = 256
B, H = 2, 8  # the GPU tier's batch and heads, and those of a test method's Params (a buffer it sizes by them)
DIM, ARCH = 64, "sm_90a"


REPO_ROOT = Path(__file__).resolve().parents[1]


def _path(value: str) -> Path:
    """A path from the environment: absolute, or relative to the repository's root (FAGEN_CATALOGS=.catalogs)."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def locate(name: str) -> Path | None:
    """The catalog's file, or None where neither environment variable leads to it."""
    repo, env, rel = CATALOGS[name]
    roots = []
    if os.environ.get("FAGEN_CATALOGS"):
        base = _path(os.environ["FAGEN_CATALOGS"])
        roots += [base / repo, base]
    if os.environ.get(env):
        roots.append(_path(os.environ[env]))
    return next((r / rel for r in roots if (r / rel).is_file()), None)


def missing(name: str) -> str:
    repo, env, rel = CATALOGS[name]
    return (
        f"catalog {name!r} ({rel} of a {repo} checkout) not found: set FAGEN_CATALOGS=DIR with DIR/{repo}/{rel}, "
        f"or {env}=<{repo} checkout>"
    )


@dataclass
class Entry:
    catalog: str
    name: str
    kind: str  # "mask" or "score"
    fn: Callable
    extra: tuple = ()  # tensor parameters past the signature's


@dataclass
class Outcome:
    entry: Entry
    status: str  # "accepted", "refused" or "crashed"
    message: str = ""
    fn: object = None  # what FlexAttention is given: the entry, its tensor parameters bound


@dataclass
class Loaded:
    entries: list[Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # statements that did not run, factories not built


# --- reading a catalog ------------------------------------------------------------------------------------------
class _Stub(types.ModuleType):
    """A stand-in package: every attribute is a stand-in; called on a function (a decorator), it returns it."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self

    def __getitem__(self, key):
        return self


class _StubFinder:
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in STUBBED and fullname not in sys.modules:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []  # a package: submodules import
        return module

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def _stubs():
    """CuTe's and FlashAttention's packages as stand-ins where they are not installed; sys.modules as it was after."""
    real = {p for p in STUBBED if importlib.util.find_spec(p) is not None}
    finder = _StubFinder()
    if len(real) < len(STUBBED):
        sys.meta_path.insert(0, finder)
    before = set(sys.modules)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for name in set(sys.modules) - before:
            if isinstance(sys.modules[name], _Stub):
                del sys.modules[name]


class _Device(ast.NodeTransformer):
    def __init__(self, device: str):
        self.device = device

    def visit_Constant(self, node):
        return ast.Constant(self.device) if node.value == "cuda" else node

    def visit_Call(self, node):  # x.cuda() -> x.to(device)
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "cuda" and not node.args and not node.keywords:
            node.func.attr, node.args = "to", [ast.Constant(self.device)]
        return node


def _statements(path: Path, device: str) -> list[ast.stmt]:
    tree = ast.parse(path.read_text(), str(path))
    return ast.fix_missing_locations(_Device(device).visit(tree)).body


def _run(stmt: ast.stmt, ns: dict, path: Path, notes: list[str]) -> None:
    try:
        exec(compile(ast.Module([stmt], []), str(path), "exec"), ns)
    except Exception as e:
        notes.append(f"line {stmt.lineno}: not run ({type(e).__name__}: {str(e)[:120]})")


def _kind(fn) -> tuple[str, tuple] | None:
    """("mask" | "score", extra parameters) of a function of mask or score signature, else None."""
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None or code.co_flags & 0x0C:  # *args / **kwargs
        return None
    names = code.co_varnames[: code.co_argcount]
    if NOT_EAGER & set(names) or len(names) < 4:
        return None
    if names[0] in MASK_FIRST and names[1] in HEADS:
        return "mask", names[4:]
    return ("score", names[5:]) if len(names) >= 5 and names[2] in HEADS else None


def _is_factory(fn, path: Path) -> bool:
    """A function of the catalog's file that defines a function (the mask or score it builds)."""
    if not isinstance(fn, types.FunctionType):
        return False
    code = fn.__code__
    return code.co_filename == str(path) and any(
        isinstance(c, types.CodeType) and not c.co_name.startswith("<") for c in code.co_consts
    )


def load(name: str, path: Path, device: str = "cpu") -> Loaded:
    """The catalog's entries (see the module's notes)."""
    out = Loaded()
    ns: dict = {"__name__": f"fagen_catalog_{name.replace('-', '_')}", "__file__": str(path)}
    body = _statements(path, device)
    with _stubs():
        for stmt in body:
            if not isinstance(stmt, (ast.If, ast.ClassDef, ast.Expr, ast.With, ast.Try)):
                _run(stmt, ns, path, out.notes)
            if isinstance(stmt, ast.Assign) and isinstance(ns.get("S"), int) and ns["S"] > MAX_S:
                ns["S"] = MAX_S
        # no __name__ past the module's statements: dynamo (torch's flex_attention, eager too, traces the function
        # with it) imports the module a function's globals name, and the catalog is no module (nor is a test
        # method's namespace, a copy); without one it reads the function's globals dict itself
        ns.pop("__name__")
        found: dict = {}
        _collect_module(ns, path, device, found, out.notes)
        for stmt in body:
            if isinstance(stmt, ast.ClassDef):
                _collect_methods(stmt, ns, path, device, found, out.notes)
    for label, fn in found.values():
        kind, extra = _kind(fn) or ("", ())
        out.entries.append(Entry(name, label, kind, fn, extra))
    return out


def _key(fn):
    """One entry for one function: its source (its name aside) and what its closure holds (a tensor by shape)."""
    try:
        src = textwrap.dedent(inspect.getsource(fn)).replace(f"def {fn.__name__}(", "def _(", 1)
    except (OSError, TypeError):
        src = id(fn)
    return src, tuple(_show(c.cell_contents) for c in fn.__closure__ or ())


def _add(found: dict, label: str, fn) -> None:
    if _kind(fn) is not None and _key(fn) not in found:
        found[_key(fn)] = (label, fn)


def _collect_module(ns: dict, path: Path, device: str, found: dict, notes: list[str]) -> None:
    for var, value in list(ns.items()):
        if var.startswith("__"):
            continue
        if getattr(getattr(value, "__code__", None), "co_filename", None) == str(path):
            _add(found, var, value)
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                _add(found, f"{var}[{i}]", item)
        if isinstance(value, dict):
            for i, (k, v) in enumerate(value.items()):
                _add(found, f"{var}[{i}].key", k)
                _add(found, f"{var}[{i}].value", v)
    for var, value in list(ns.items()):
        if _kind(value) is None and _is_factory(value, path):
            _build(var, value, path, device, found, notes, depth=0)


def _build(label: str, factory, path: Path, device: str, found: dict, notes: list[str], depth: int) -> None:
    """The functions a factory builds, called with `_default` arguments (a factory of factories: twice)."""
    code = factory.__code__
    names = code.co_varnames[: code.co_argcount]
    defaults = dict(zip(names[len(names) - len(factory.__defaults__ or ()) :], factory.__defaults__ or ()))
    args = {}
    for p in names:
        value = _default(p, device) if p not in defaults else defaults[p]
        if value is None:
            notes.append(f"{label}: not built (no default for its parameter {p!r})")
            return
        args[p] = value
    try:
        with _stubs():
            built = factory(**args)
    except Exception as e:
        notes.append(f"{label}: not built ({type(e).__name__}: {str(e)[:120]})")
        return
    shown = f"{label}({', '.join(f'{p}={_show(v)}' for p, v in args.items() if p not in defaults)})"
    if _kind(built) is not None:
        _add(found, shown, built)
    elif depth == 0 and _is_factory(built, path):
        _build(shown, built, path, device, found, notes, depth=1)


def _show(v) -> str:
    return f"<{'x'.join(map(str, v.shape))} {str(v.dtype).replace('torch.', '')}>" if hasattr(v, "shape") else repr(v)


INT_DEFAULTS = {
    "offset": 0,
    "num_heads": 8,
    "window_left": 64,
    "window_right": 64,
    "window_size": 64,
    "seq_idx": 0,
    "sq": MAX_S,
    "sk": MAX_S,
}


def _default(param: str, device: str):
    """A factory argument by its name: a small int, float32 as dtype, or a tensor of realistic values (cumulative
    lengths for cu_seqlens*, document ids and thresholds as ints, biases and scales as small floats); None where
    the name says nothing."""
    import torch

    if param in INT_DEFAULTS:
        return INT_DEFAULTS[param]
    if param == "dtype":
        return torch.float32
    if param.startswith("orig") or param.endswith("_mod") or param.endswith("fn"):
        return None
    g = torch.Generator().manual_seed(sum(map(ord, param)))
    if "cu_seqlens" in param:
        return (torch.arange(5, dtype=torch.int32) * MAX_S).to(device)
    if any(w in param for w in ("doc", "threshold", "window", "ids", "idx")):
        return (torch.arange(4 * MAX_S, dtype=torch.int32) // 100).to(device)
    if any(w in param for w in ("bias", "scale", "buffer", "tensor")):
        return (torch.randn(4 * MAX_S, generator=g) * 0.5).to(device)
    return None


RUN_IN_TESTS = (ast.FunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.If)


def _runnable(stmt: ast.stmt) -> ast.stmt | None:
    """A test method's statement as the tier runs it: None where it runs attention, compiles, asserts (or is of
    another kind); a loop or if keeps the statements of its body that run (a loop that builds a mask per iteration
    still defines the mask)."""
    if not isinstance(stmt, RUN_IN_TESTS):
        return None
    if isinstance(stmt, (ast.For, ast.If)):
        if SKIPPED_IN_TESTS.search(ast.unparse(stmt.iter if isinstance(stmt, ast.For) else stmt.test)):
            return None
        body = [r for r in map(_runnable, stmt.body) if r is not None]
        orelse = [r for r in map(_runnable, stmt.orelse) if r is not None]
        if not body:
            return None
        import copy

        stmt = copy.copy(stmt)
        stmt.body, stmt.orelse = body, orelse
        return stmt
    return None if SKIPPED_IN_TESTS.search(ast.unparse(stmt)) else stmt


def _lambdas(stmt: ast.stmt) -> list[ast.Lambda]:
    """The lambdas of mask or score arity a statement writes (a mask passed inline to create_block_mask), those
    inside a function or class it defines aside (their names are that function's)."""
    found: list[ast.Lambda] = []
    todo: list[ast.AST] = [stmt]
    while todo:
        node = todo.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child is not stmt:
                continue
            if isinstance(child, ast.Lambda) and len(child.args.args) in (4, 5) and not child.args.vararg:
                found.append(child)
            todo.append(child)
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _collect_methods(cls: ast.ClassDef, ns: dict, path: Path, device: str, found: dict, notes: list[str]) -> None:
    import torch

    # a test method's parameters: dtype, and FlexAttention's Params (batch_size, num_heads, seq_length, ...)
    params = types.SimpleNamespace(batch_size=B, num_heads=H, seq_length=MAX_S, head_dim=16, dtype=torch.float32)
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef):
            continue
        if not any(isinstance(n, (ast.FunctionDef, ast.Lambda)) for s in method.body for n in ast.walk(s)):
            continue
        local = dict(ns, self=types.SimpleNamespace(device=device), dtype=torch.float32, params=params)
        where = f"{cls.name}.{method.name}"
        for stmt in method.body:
            known = {k: id(v) for k, v in local.items()}
            if (runnable := _runnable(stmt)) is not None:
                _run(ast.fix_missing_locations(runnable), local, path, notes)
            if isinstance(local.get("S"), int) and local["S"] > MAX_S:
                local["S"] = MAX_S
            for var, value in local.items():  # after each statement: a later definition may reuse the name
                if known.get(var) != id(value) and _kind(value) is not None:
                    _add_method_fn(found, notes, f"{where}.{var}", value, local)
            for lam in _lambdas(stmt):
                try:
                    fn = eval(compile(ast.Expression(lam), str(path), "eval"), dict(local))
                except Exception as e:
                    notes.append(f"{where}: the lambda of line {lam.lineno} not built ({type(e).__name__})")
                    continue
                _add_method_fn(found, notes, f"{where}.<lambda line {lam.lineno}>", fn, local)


def _add_method_fn(found: dict, notes: list[str], label: str, value, local: dict) -> None:
    """A test method's function, with its globals as the method's namespace is now (a later statement may rebind a
    name it reads); one that reads a name no statement set is a note."""
    if _kind(value) is None:
        return
    if unresolved := _unresolved(value):
        notes.append(f"{label}: not built (names unset: {unresolved})")
        return
    code, defaults, closure = value.__code__, value.__defaults__, value.__closure__
    _add(found, label, types.FunctionType(code, dict(local), value.__name__, defaults, closure))


def _unresolved(fn) -> list[str]:
    """The global names a function reads that its namespace lacks (a statement of its test that did not run)."""
    import builtins
    import dis

    return [
        i.argval
        for i in dis.get_instructions(fn)
        if i.opname == "LOAD_GLOBAL" and i.argval not in fn.__globals__ and not hasattr(builtins, i.argval)
    ]


# --- tracing and compiling an entry ---------------------------------------------------------------------------------
def refusals() -> tuple[type[Exception], ...]:
    """fagen's own errors: a construct refused with a message naming it (any other exception is a defect)."""
    from fagen.backend.spec import SpecError
    from fagen.ir import IRError
    from fagen.ir.exprs import ExprError
    from fagen.math.online_softmax import ProofError
    from fagen.passes.fuse import FusionError

    return (ExprError, IRError, FusionError, ProofError, SpecError)


def bind(entry: Entry, device: str = "cpu"):
    """The entry as FlexAttention is given it: its tensor parameters past the signature (FA4's doc_id, bias)
    bound in a closure to tensors of the rank it reads them with (a dimension read by b or h: 4 or 16 long, any
    other: 4 * MAX_S), of the name's values (`_default`; an int tensor's ids are position // 100)."""
    if not entry.extra:
        return entry.fn
    import torch

    from fagen.ir import variants

    expr = (variants.trace_mask if entry.kind == "mask" else variants.trace_score)(entry.fn)
    reads = {str(r.base.label): r.indices for r in expr.atoms(__import__("sympy").Indexed)}
    tensors = {}
    for p in entry.extra:
        idx = reads.get(p, (None,))
        shape = tuple({"b": 4, "h": 16}.get(str(i), 4 * MAX_S) for i in idx)
        flat = _default(p, "cpu")
        flat = flat if flat is not None else torch.randn(4 * MAX_S) * 0.5
        n = shape[-1]
        row = flat[:n] if flat.numel() >= n else flat.repeat(n // flat.numel() + 1)[:n]
        tensors[p] = row.expand(shape).contiguous().to(device)
    lead = "b, h, q_idx, kv_idx" if entry.kind == "mask" else "score, b, h, q_idx, kv_idx"
    params = ", ".join(entry.extra)
    src = f"def make({params}):\n    def bound({lead}):\n        return fn({lead}, {params})\n    return bound\n"
    scope = {"fn": entry.fn}
    exec(src, scope)
    return scope["make"](**tensors)


def to_device(fn, device: str):
    """A copy of the function with every tensor it reaches on `device`, values as they are: its closure cells,
    defaults, and globals (those of no imported module: the catalog's namespace, a test method's, bind's), and the
    same of the functions, lists, tuples and dicts it reaches there. The GPU tier loads and binds the catalogs on
    the CPU (where an index out of range raises) and runs the copy on the GPU."""
    import torch

    memo: dict[int, object] = {}

    def move(v):
        if id(v) in memo:
            return memo[id(v)]
        if isinstance(v, torch.Tensor):  # a leaf stays a leaf (a bias that requires grad, as the test made it)
            memo[id(v)] = v.detach().to(device).requires_grad_(v.requires_grad) if v.is_leaf else v.to(device)
        elif isinstance(v, types.FunctionType):
            cells = tuple(types.CellType() for _ in v.__closure__ or ())
            g = v.__globals__
            module = sys.modules.get(g.get("__name__", ""))
            scope = g if module is not None and module.__dict__ is g else move(g)
            memo[id(v)] = out = types.FunctionType(v.__code__, scope, v.__name__, None, cells or None)
            out.__defaults__ = move(v.__defaults__)
            out.__kwdefaults__ = move(v.__kwdefaults__)
            for cell, old in zip(cells, v.__closure__ or ()):
                with contextlib.suppress(ValueError):  # an empty cell (a name not yet bound) stays empty
                    cell.cell_contents = move(old.cell_contents)
        elif isinstance(v, dict):
            memo[id(v)] = out = {}
            out.update({k: x if k == "__builtins__" else move(x) for k, x in v.items()})
        elif isinstance(v, list):
            memo[id(v)] = out = []
            out.extend(move(x) for x in v)
        elif isinstance(v, tuple) and type(v) is tuple:
            memo[id(v)] = tuple(move(x) for x in v)
        else:
            return v
        return memo[id(v)]

    return move(fn)


def run_entry(entry: Entry, cache_dir, device: str = "cpu") -> Outcome:
    """Trace the entry (trace_mask / trace_score_and_mask), then build and compile its kernel (d64, sm_90a)."""
    import fagen
    from fagen.ir import variants

    try:
        fn = bind(entry, device)
        if entry.kind == "mask":
            variants.trace_mask(fn)
            fagen.compile(DIM, mask=fn, arch=ARCH, cache_dir=cache_dir)
        else:
            variants.trace_score_and_mask(fn)
            fagen.compile(DIM, score_mod=fn, arch=ARCH, cache_dir=cache_dir)
    except refusals() as e:
        return Outcome(entry, "refused", f"{type(e).__name__}: {e}")
    except Exception as e:
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        return Outcome(entry, "crashed", f"{type(e).__name__}: {e}\n{''.join(tb[-4:])}")
    return Outcome(entry, "accepted", fn=fn)


def run_catalog(name: str, path: Path, cache_dir) -> tuple[Loaded, list[Outcome]]:
    loaded = load(name, path)
    return loaded, [run_entry(e, cache_dir) for e in loaded.entries]


def rate(outcomes: list[Outcome]) -> float:
    return sum(o.status == "accepted" for o in outcomes) / max(len(outcomes), 1)


def markdown(results: dict[str, tuple[Path, Loaded, list[Outcome]]]) -> str:
    """The acceptance per catalog, then every entry with its status (and a refusal's or crash's message)."""
    lines = [
        "| catalog | file | entries | accepted | refused | crashed | acceptance |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (path, _, outs) in results.items():
        n = {s: sum(o.status == s for o in outs) for s in ("accepted", "refused", "crashed")}
        lines.append(
            f"| {name} | {path} | {len(outs)} | {n['accepted']} | {n['refused']} | {n['crashed']} | "
            f"{100 * rate(outs):.1f} % |"
        )
    lines += ["", "| catalog | entry | kind | status | message |", "|---|---|---|---|---|"]
    for name, (_, _, outs) in results.items():
        for o in outs:
            msg = (o.message.splitlines()[0] if o.message else "").replace("|", "\\|")
            lines.append(f"| {name} | `{o.entry.name}` | {o.entry.kind} | {o.status} | {msg} |")
    return "\n".join(lines) + "\n"
