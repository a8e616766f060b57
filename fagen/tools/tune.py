"""`fagen tune`: time candidate tile configurations of a tier on the GPU and record the winners.

Candidates come from the tier (`Tier.candidates`: valid, fitting shared memory); each is built through the
same pipeline as `fagen.compile` (with its tiles given), skipped if it spills, checked for correctness, then
timed at the benchmark convention's shape (16k tokens, heads × dim = 2048). The table `fagen/tuned.json`
records the fastest per (arch, dtype, head dim, causal) with every time measured, the device and the date;
the tier prefers it over its rules.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

from .. import pipeline
from ..backend import plan, tiers, tuned
from ..backend.contract import Kind
from ..backend.spec import SpecError


def default_tier(arch: str) -> str:
    """The tier the planner picks by default for a plain bf16 kernel on `arch`: the one worth tuning."""
    return plan.choose("full", 128, "bf16", arch).spec.tier


def compiled_candidates(head_dim, dtype, arch, causal, *, tier, cache_dir=None, log=sys.stderr):
    """(config, kernel) for each candidate of `tier` that compiles without spills."""
    program = pipeline.load_program(causal=causal)
    steps = pipeline.lower(program, dtype)
    out = []
    for cfg in tiers.get(tier).candidates(Kind.FORWARD, head_dim, dtype, arch):
        try:
            kern = pipeline.build_kernel(
                steps[-1].program,
                program.name,
                head_dim,
                dtype,
                arch,
                tier,
                config=cfg,
                cache_dir=cache_dir,
                key_range=steps[-1].facts.get("key_range"),
            )
        except SpecError as e:
            print(f"  skip {cfg}: {e}", file=log)
            continue
        if kern.resources.spills:
            print(f"  skip {kern.name}: {kern.resources}", file=log)
            continue
        out.append((cfg, kern))
    return out


def tune(
    dims=(64, 96, 128, 256),
    causal=(False, True),
    dtypes=("bf16",),
    arch=None,
    *,
    tier=None,
    seqlen=4096,
    log=sys.stderr,
) -> dict:
    from . import bench, testing

    torch = testing._torch()
    timer = bench._timer(torch)
    arch = arch or pipeline.detect_arch()
    tier = tier or default_tier(arch)
    measured, configs = {}, {}
    for dtype in dtypes:
        for D in dims:
            for c in causal:
                key = tuned.tuned_key(tier, arch, D, dtype, c)
                B, H = max(1, 16384 // seqlen), max(1, 2048 // D)
                q, k, v = testing.random_qkv(B, H, seqlen, seqlen, D, dtype)
                results = []
                for cfg, kern in compiled_candidates(D, dtype, arch, c, tier=tier, log=log):
                    check = testing.check_kernel(kern, B=1, H=2, M=333, N=517)
                    if not check.ok:
                        print(f"  {kern.name}: FAILED check (err {check.err:.2e} > {check.bound:.2e})", file=log)
                        continue
                    ms = timer(lambda: kern(q, k, v))
                    results.append(dict(cfg, ms=round(ms, 4), registers=kern.resources.registers))
                    print(f"  {key} {kern.name}: {ms:.3f} ms", file=log)
                results.sort(key=lambda r: r["ms"])
                measured[key] = results
                if results:
                    configs[key] = {f: results[0][f] for f in ("block_m", "block_n", "num_warps", "stages")}
    return dict(
        tier=tier,
        device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        shape=f"seqlen {seqlen}, 16k tokens, heads x dim = 2048",
        configs=configs,
        measured=measured,
    )


def merge(table: dict, path: Path | None = None) -> dict:
    """Add a tuning run's winners to the shipped table (entries for other keys are kept)."""
    path = path or Path(str(tuned._file()))
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        old = {"configs": {}, "runs": []}
    old.setdefault("configs", {}).update(table["configs"])
    old.setdefault("runs", []).append({k: table[k] for k in ("tier", "device", "date", "shape", "measured")})
    path.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")
    tuned.tuned_table.cache_clear()
    return old
