"""`fagen tune`: time candidate tile configurations of the mma tier on the GPU and record the winners.

Candidates are every (block_m, block_n, num_warps, stages) from small sets that makes a valid spec, fits
the architecture's shared memory and compiles without spilling. Each is checked for correctness, then
timed at the benchmark convention's shape (16k tokens, heads × dim = 2048). The table `fagen/tuned.json`
records the fastest per (arch, dtype, head dim, causal) with every time measured, the device and the date;
`plan.choose` prefers it over the rules.
"""
from __future__ import annotations

import datetime
import itertools
import json
import math
import sys
from pathlib import Path

from . import build, codegen, pipeline, plan
from .spec import KernelSpec, SpecError

GRID = dict(block_m=(64, 128, 256), block_n=(32, 64, 128), num_warps=(4, 8), stages=(2, 3, 4))


def candidates(head_dim: int, dtype: str, arch: str, variant: str = "full") -> list[KernelSpec]:
    out = []
    for bm, bn, w, st in itertools.product(*GRID.values()):
        try:
            spec = KernelSpec(variant, head_dim, dtype, arch, "mma", bm, bn, w, st)
        except SpecError:
            continue
        if bm // (16 * w) > 2 or plan.mma_smem_bytes(head_dim, bm, bn, st) > plan.SMEM_LIMIT[arch]:
            continue
        out.append(spec)
    return out


def _program(causal: bool, dtype: str):
    return pipeline.lower(pipeline.load_program(causal=causal), dtype)[-1].program


def compiled_candidates(head_dim, dtype, arch, causal, *, cache_dir=None, log=sys.stderr):
    """(spec, source, binary) for each candidate that compiles without spills."""
    program = _program(causal, dtype)
    out = []
    for spec in candidates(head_dim, dtype, arch, program.name):
        source = codegen.render(spec, program)
        binary = build.compile_cubin(source, spec, cache_dir=cache_dir)
        r = binary.resources
        if r.spills:
            print(f"  skip {spec.name}: {r}", file=log)
            continue
        out.append((spec, program, source, binary))
    return out


def tune(dims=(64, 96, 128, 256), causal=(False, True), dtypes=("bf16",), arch=None, *, seqlen=4096,
         log=sys.stderr) -> dict:
    from . import bench, testing
    from .kernel import Kernel
    torch = testing._torch()
    timer = bench._timer(torch)
    arch = arch or pipeline.detect_arch()
    measured, configs = {}, {}
    for dtype in dtypes:
        for D in dims:
            for c in causal:
                key = plan.tuned_key(arch, D, dtype, c)
                B, H = max(1, 16384 // seqlen), max(1, 2048 // D)
                q, k, v = testing.random_qkv(B, H, seqlen, seqlen, D, dtype)
                results = []
                for spec, program, source, binary in compiled_candidates(D, dtype, arch, c, log=log):
                    kern = Kernel(spec, program, source, binary, default_scale=1 / math.sqrt(D),
                                  smem_bytes=plan.smem_bytes(spec))
                    check = testing.check_kernel(kern, B=1, H=2, M=333, N=517)
                    if not check.ok:
                        print(f"  {spec.name}: FAILED check (err {check.err:.2e} > {check.bound:.2e})", file=log)
                        continue
                    ms = timer(lambda: kern(q, k, v))
                    cfg = dict(block_m=spec.block_m, block_n=spec.block_n, num_warps=spec.num_warps,
                               stages=spec.stages)
                    results.append(dict(cfg, ms=round(ms, 4), registers=binary.resources.registers))
                    print(f"  {key} {spec.name}: {ms:.3f} ms", file=log)
                results.sort(key=lambda r: r["ms"])
                measured[key] = results
                if results:
                    configs[key] = {f: results[0][f] for f in ("block_m", "block_n", "num_warps", "stages")}
    return dict(device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(),
                shape=f"seqlen {seqlen}, 16k tokens, heads x dim = 2048", configs=configs, measured=measured)


def merge(table: dict, path: Path = plan.TUNED) -> dict:
    """Add a tuning run's winners to the shipped table (entries for other keys are kept)."""
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {"configs": {}, "runs": []}
    old.setdefault("configs", {}).update(table["configs"])
    old.setdefault("runs", []).append({k: table[k] for k in ("device", "date", "shape", "measured")})
    path.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    plan.tuned_table.cache_clear()
    return old
