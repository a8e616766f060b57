"""FlashAttention's own tests/test_flash_attn.py, run unmodified against fagen (issue 40's target: it passes in
full, dropout aside, and dropout cases are refused with fagen's message).

Where the file is: $FAGEN_FA_TESTS (the file, or a flash-attention checkout), else the checkout of
$FAGEN_FLASH_ATTENTION_SRC or $FAGEN_CATALOGS/flash-attention (as tests/catalogs.py reads FlashAttention-4's
catalogs). Nothing of it is vendored.

How it runs (tests/gpu/test_fa_suite_gpu.py; docs/fa_suite.md gives the command):
- `flash_attn` is the shim under shim/, first on sys.path while the file is imported (`shimmed`; the rest of the
  session never sees it): the public functions are fagen's, bert_padding's pad_input / unpad_input and
  layers.rotary's apply_rotary_emb are ours in plain PyTorch, and _get_block_size_n / USE_TRITON_ROCM are the
  constants the tests read;
- einops, which the file imports, is the installed one, else a wheel in .wheels/ at the repository's root (a wheel
  is a zip: it goes on sys.path as it is);
- each test function is wrapped so that fagen's refusal of dropout (NotImplementedError, the message of
  fagen.flash_attn's check) becomes a skip giving that message; any other exception fails the case;
- PRIVATE's tests, which call FlashAttention's private C++ entry points and not its interface, are skipped with
  that reason;
- FAGEN_FA_SAMPLE=N keeps a seeded random sample of N of the file's cases (about half a million: collecting them
  all takes a minute and gigabytes per process), chosen before pytest collects, with pytest's own ids: uniform over
  all cases, or with FAGEN_FA_PER_TEST=1 split evenly among the test functions (FAGEN_FA_SEED, default 0: the same
  sample on every xdist worker). Unset, all run.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import math
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).resolve().parent / "shim"
WHEELS = ROOT / ".wheels"
REL = Path("tests/test_flash_attn.py")
MODULE = "fa_test_flash_attn"
PRIVATE = {
    "test_flash_attn_varlen_paged_kv_num_splits": "flash_attn_interface._flash_attn_varlen_forward",
    "test_flash_attn_generator_arg_must_be_none": "flash_attn_interface.flash_attn_gpu (fwd, bwd, varlen_fwd/bwd)",
}


def locate() -> Path | None:
    """test_flash_attn.py, or None where no environment variable leads to it."""
    candidates = []
    if os.environ.get("FAGEN_FA_TESTS"):
        given = Path(os.environ["FAGEN_FA_TESTS"])
        candidates += [given, given / REL]
    if os.environ.get("FAGEN_FLASH_ATTENTION_SRC"):
        candidates.append(Path(os.environ["FAGEN_FLASH_ATTENTION_SRC"]) / REL)
    if os.environ.get("FAGEN_CATALOGS"):
        candidates.append(Path(os.environ["FAGEN_CATALOGS"]) / "flash-attention" / REL)
    return next((p for p in candidates if p.is_file()), None)


def missing() -> str:
    return (
        f"FlashAttention's {REL} not found: set FAGEN_FA_TESTS to the file or to a flash-attention checkout "
        "(or FAGEN_FLASH_ATTENTION_SRC / FAGEN_CATALOGS as for tests/catalogs.py)"
    )


def ensure_einops() -> None:
    """einops importable: the installed one, else the newest .wheels/einops-*.whl put on sys.path."""
    try:
        import einops  # noqa: F401

        return
    except ImportError:
        pass
    wheels = sorted(WHEELS.glob("einops-*.whl"))
    if not wheels:
        raise ImportError(
            f"einops (imported by FlashAttention's tests) is not installed and no einops wheel is in {WHEELS} "
            "(pip download einops --no-deps -d .wheels)"
        )
    sys.path.insert(0, str(wheels[-1]))
    import einops  # noqa: F401


def _flash_attn_modules() -> dict:
    return {n: m for n, m in sys.modules.items() if n == "flash_attn" or n.startswith("flash_attn.")}


@contextlib.contextmanager
def shimmed():
    """A context in which `flash_attn` is the shim (a flash_attn imported before, FlashAttention's own, set aside).
    After it, sys.path and sys.modules are as they were: code that imported the shim's names keeps them, and the
    rest of the session (tests/catalogs.py's stand-ins for FlashAttention-4's package) never sees the shim."""
    saved = _flash_attn_modules()
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(SHIM))
    try:
        import flash_attn

        if not str(flash_attn.__file__).startswith(str(SHIM)):
            raise ImportError(f"flash_attn resolves to {flash_attn.__file__}, not to the shim in {SHIM}")
        yield flash_attn
    finally:
        sys.path.remove(str(SHIM))
        for name in _flash_attn_modules():
            del sys.modules[name]
        sys.modules.update(saved)


def load(path: Path):
    """FlashAttention's test module, imported as it is through the shim (the module, named MODULE)."""
    ensure_einops()
    spec = importlib.util.spec_from_file_location(MODULE, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    with shimmed():
        spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=1)
def refusal_prefix() -> str:
    """The start of fagen's dropout refusal, as fagen.flash_attn's check words it (up to the value it quotes)."""
    from fagen import flash_attn

    try:
        flash_attn._refuse(0.5, False)
    except NotImplementedError as e:
        return str(e).split("(got", 1)[0]
    raise AssertionError("fagen.flash_attn accepts dropout_p=0.5: the suite's refusal rule no longer applies")


def is_refusal(exc: BaseException) -> bool:
    """Whether `exc` is fagen's refusal of dropout, and nothing else."""
    return type(exc) is NotImplementedError and str(exc).startswith(refusal_prefix())


def wrap(fn):
    """fn (a test function, its parametrize marks kept) with fagen's dropout refusal made a skip giving the
    message, and PRIVATE's tests skipped with their reason."""
    private = PRIVATE.get(fn.__name__)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if private:
            import pytest

            pytest.skip(f"calls FlashAttention's private entry point {private}, not its interface")
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:
            if not is_refusal(e):
                raise
            import pytest

            pytest.skip(f"refused by fagen: {e}")

    return run


def tests_of(module) -> dict:
    """The module's test functions, wrapped (`wrap`), by name."""
    return {name: wrap(fn) for name, fn in vars(module).items() if name.startswith("test") and callable(fn)}


def _idval(value, argname: str, index: int) -> str:
    """A parameter's part of a case id, as pytest writes it: numbers, bools, None and strings as themselves, other
    objects (torch dtypes) as the argument's name and the value's index in its parametrize mark."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    return f"{argname}{index}"


def cases(fn) -> list[tuple[dict, str]]:
    """The (parameters, id) of each case of a test function's stacked parametrize marks: their product, in
    pytest's order and with pytest's ids (the first mark in `pytestmark`, the decorator nearest the function,
    first in the id; the last one varying fastest)."""
    sets: list[tuple[dict, str]] = [({}, "")]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else list(mark.args[0])
        rows = []
        for index, values in enumerate(mark.args[1]):
            values = tuple(values) if len(names) > 1 else (values,)
            part = "-".join(_idval(v, n, index) for n, v in zip(names, values))
            rows.append((dict(zip(names, values)), part))
        sets = [({**p, **q}, f"{i}-{j}" if i else j) for p, i in sets for q, j in rows]
    return sets


def is_dropout(params: dict) -> bool:
    return float(params.get("dropout_p", 0.0)) > 0.0


def choose(sizes: dict, n: int, seed: int, per_test: bool) -> dict:
    """{name: sorted case indices}: a seeded random sample of n cases of the tests of `sizes` ({name: cases}),
    uniform over all cases, or with `per_test` n split evenly among the tests (one with fewer cases gives the
    rest to the others). The same on every process (xdist's workers must collect the same items)."""
    if not per_test:
        starts, at = {}, 0
        for name, size in sizes.items():
            starts[name], at = at, at + size
        picked = sorted(random.Random(seed).sample(range(at), min(n, at)))
        return {name: [i - at for i in picked if at <= i < at + sizes[name]] for name, at in starts.items()}
    quota, left = {}, n
    order = sorted(sizes, key=lambda name: sizes[name])
    for done, name in enumerate(order):
        quota[name] = min(sizes[name], left // (len(order) - done))
        left -= quota[name]
    return {name: sorted(random.Random(f"{seed}:{name}").sample(range(sizes[name]), quota[name])) for name in sizes}


def sampled(tests: dict, n: int | None, seed: int, per_test: bool, keep=None) -> dict:
    """The tests (wrapped, by name) with only the sampled cases (`choose`; n None: all) of those `keep(params)`
    accepts (None: all) left: each function's parametrize marks replaced by one of its cases left, with pytest's
    ids; a test with none left is left out."""
    import pytest

    all_cases = {name: [c for c in cases(fn) if keep is None or keep(c[0])] for name, fn in tests.items()}
    sizes = {name: len(c) for name, c in all_cases.items()}
    chosen = choose(sizes, n, seed, per_test) if n is not None else {name: range(k) for name, k in sizes.items()}
    out = {}
    for name, fn in tests.items():
        if not chosen[name]:
            continue
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name != "parametrize"]
        picked = [all_cases[name][i] for i in chosen[name]]
        if picked[0][0]:
            names = list(picked[0][0])
            params = [pytest.param(*(p[a] for a in names), id=case_id) for p, case_id in picked]
            marks.append(pytest.mark.parametrize(names, params))
        fn.pytestmark = marks  # a list of its own (functools.wraps shares the original's)
        out[name] = fn
    return out


KEEP = None  # a filter of the cases, params -> bool, applied before the sample (tests/fa_suite/cpu.py sets one)


def collected(module) -> dict:
    """The runner's test functions: `tests_of(module)`, sampled where FAGEN_FA_SAMPLE=N is set (FAGEN_FA_SEED,
    default 0; FAGEN_FA_PER_TEST=1 splits N evenly among the test functions), of the cases KEEP accepts."""
    tests = tests_of(module)
    if not os.environ.get("FAGEN_FA_SAMPLE") and KEEP is None:
        return tests
    try:
        n = int(os.environ["FAGEN_FA_SAMPLE"]) if os.environ.get("FAGEN_FA_SAMPLE") else None
        seed = int(os.environ.get("FAGEN_FA_SEED", "0"))
    except ValueError:
        raise ValueError("FAGEN_FA_SAMPLE, FAGEN_FA_SEED: expected integers") from None
    if n is not None and n < 0:
        raise ValueError(f"FAGEN_FA_SAMPLE: expected a number of cases >= 0, got {n}")
    return sampled(tests, n, seed, os.environ.get("FAGEN_FA_PER_TEST", "") not in ("", "0"), KEEP)


@contextlib.contextmanager
def fake_cuda(total_memory: int = 80 * 2**30, capability=(9, 0)):
    """torch.cuda as the test module reads it at import and in its skips (capability, memory), with no GPU: for
    importing and collecting the file on a CPU machine."""
    import torch

    saved = {n: getattr(torch.cuda, n) for n in ("is_available", "get_device_capability", "get_device_properties")}
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: capability
    torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(total_memory=total_memory)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


def counts(module) -> dict:
    """{test name: (cases, dropout cases)} of the module's test functions."""
    out = {}
    for name, fn in vars(module).items():
        if name.startswith("test") and callable(fn):
            sets = cases(fn)
            out[name] = (len(sets), sum(is_dropout(p) for p, _ in sets))
    return out


def total(table: dict) -> tuple[int, int]:
    return sum(c for c, _ in table.values()), sum(d for _, d in table.values())


def describe(table: dict) -> str:
    width = max(map(len, table))
    lines = [f"{name:<{width}}  {c:>6} cases  {d:>6} dropout" for name, (c, d) in table.items()]
    c, d = total(table)
    return "\n".join([*lines, f"{'total':<{width}}  {c:>6} cases  {d:>6} dropout ({math.floor(100 * d / c)} %)"])
