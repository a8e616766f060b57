"""What the A/B scripts of bench/ share: the fagen of `--root` (each script puts that tree first on the path before
it imports anything; checked here) and the plain timer their figures have always used (the mean of 20 calls by CUDA
events, after one), so that today's numbers compare with the ones in the changelog; and, for the SASS scripts
(sass_step.py, sass_diff.py), nvdisasm and a cubin's disassembly; for ab_bwd_main.py and trace_bwd.py, a
`--set` of a wgmma setting and the cases they name; and, for the tracers (trace_bwd.py, trace_blocks.py), an edit of
the backward main kernel's source on its way to NVRTC and the device array the edited kernel writes."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


def nvdisasm_from(argv: list[str]) -> str:
    """`--nvdisasm PATH`, else nvdisasm on PATH (a SystemExit saying so where there is none)."""
    nvdisasm = argv[argv.index("--nvdisasm") + 1] if "--nvdisasm" in argv else shutil.which("nvdisasm")
    if nvdisasm is None:
        raise SystemExit("no nvdisasm on PATH: --nvdisasm PATH")
    return nvdisasm


def disassemble(cubin: bytes, nvdisasm: str) -> str:
    """`nvdisasm -c`'s text of `cubin`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True, check=True).stdout


def fagen_at_root(argv: list[str]):
    """fagen, imported from the `--root` tree where one is given (else a SystemExit naming where it came from)."""
    import fagen

    root = Path(argv[argv.index("--root") + 1]).resolve() if "--root" in argv else None
    where = Path(fagen.__file__).resolve()
    if root is not None and root not in where.parents:
        raise SystemExit(f"--root {root}: imported fagen from {where}")
    return fagen


def set_wgmma(setting: str):
    """`NAME=VALUE` (a `--set` argument): the wgmma tier's module setting NAME set to VALUE, read as the setting's own
    type (a string, int or bool; a tuple of ints written 96:128, empty for none). Returns the value set."""
    from fagen.backend.tiers import wgmma

    name, value = setting.split("=", 1)
    old = getattr(wgmma, name)  # (an unknown name stops here)
    if isinstance(old, tuple):
        new = tuple(int(x) for x in value.split(":") if x)
    else:
        new = type(old)(value == "True" if isinstance(old, bool) else value)
    setattr(wgmma, name, new)
    return new


@dataclass(frozen=True)
class Case:
    """A case DIM-MASK-N[-gqaG][-hH] at FlashAttention's benchmark shapes (bf16, B·N = 16384 tokens, H·D = 2048 unless
    -hH): head dim D, sequence length N, batch B, query heads H, G of them a KV head, and the fagen.compile options of
    MASK: full, causal, softcap (30, no mask) or windowW (causal, W keys; `window` alone: 1024)."""

    D: int
    N: int
    B: int
    H: int
    G: int
    options: dict = field(hash=False)


CASE = re.compile(
    r"d([1-9][0-9]*)-(full|causal|softcap|window([1-9][0-9]*)?)-([1-9][0-9]*)(?:-gqa([1-9][0-9]*))?(?:-h([1-9][0-9]*))?"
)


def parse_case(case: str) -> Case:
    """The Case `case` names; a ValueError for any other form or mask, or a G that does not divide the heads."""
    found = CASE.fullmatch(case)
    dim, mask, window, n, gqa, heads = found.groups() if found else ("1", "", None, "1", None, None)
    D, G = int(dim), int(gqa or 1)
    H = int(heads or 2048 // D)
    if not found or H % G:
        raise ValueError(
            f"case {case!r}: expected dDIM-MASK-N[-gqaG][-hH], MASK full, causal, softcap (30, no mask) or windowW, "
            "G query heads a KV head dividing the heads"
        )
    options = {"full": {}, "causal": {"causal": True}, "softcap": {"softcap": 30.0}}.get(mask)
    if options is None:
        options = {"causal": True, "window": int(window or 1024)}
    return Case(D, int(n), 16384 // int(n), H, G, options)


def timed_us(fn, reps: int = 20) -> float:
    """Mean µs of `fn` over `reps` calls, by CUDA events (after one call)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def edit_backward_main(edit) -> None:
    """From now on, `edit(source)` is what NVRTC compiles for each wgmma backward main kernel (not the convert or the
    other passes): a tracer's stamps. The product's kernel is not changed; build with use_cache=False."""
    from fagen.backend import build

    original = build._nvrtc

    def edited(source, name, opts, *, ptx=False):
        if name.startswith("flash_bwd_") and "_wgmma_" in name and "convert" not in name:
            source = edit(source)
        return original(source, name, opts, ptx=ptx)

    build._nvrtc = edited


def kernel_global(kernel: str, symbol: str, shape: tuple, dtype: str):
    """The __device__ array `symbol` of the loaded kernel named `kernel`, as a CuPy array of `shape` (the kernel must
    have run once, so that its module is loaded)."""
    import gc
    from math import prod

    import cupy
    from cupy.cuda import driver

    from fagen.runtime.launch import Function

    fns = [o for o in gc.get_objects() if isinstance(o, Function) and o.name == kernel and o._handles]
    module = next(iter(fns[0]._handles.values()))[0]
    ptr = driver.moduleGetGlobal(module, symbol)  # (cupy's: the address alone)
    size = prod(shape) * cupy.dtype(dtype).itemsize
    mem = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, size, fns[0]), 0)
    return cupy.ndarray(shape, dtype=dtype, memptr=mem)
