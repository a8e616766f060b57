"""`fagen tune`: time candidate tile configurations of a tier on the GPU and record the winners.

Candidates come from the tier (`Tier.candidates`: valid, fitting shared memory); each is built through the
same pipeline as `fagen.compile` (with its tiles given), skipped if it spills, checked for correctness, then
timed at the benchmark convention's shape (16k tokens, heads × dim = 2048) at one sequence length or several. The
table `fagen/tuned.json` records the fastest per (arch, dtype, head dim, causal) with every time measured, the device
and the date; the tier prefers it over its rules. Over several lengths the fastest is the one whose time is least
above each length's best, on the geometric mean (`rank`): a tile that wins at 4k and loses at 2k is weighed at both.
Candidates are timed in rounds (`bench.timing.time_in_rounds`), each a pass over all of them in a rotated order, and
each time is the median over the rounds: the GPU's clock drifts over a minute of timing, and a candidate timed once,
at one point of that drift, was 10% off its own time beside another (H100, 2026-11-25).
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

from .. import builders, pipeline, request
from ..backend import plan, tiers, tuned
from ..backend.contract import Kind
from ..backend.spec import SpecError, kernel_head_dim


def default_tier(arch: str) -> str:
    """The tier the planner picks by default for a plain bf16 kernel on `arch`: the one worth tuning."""
    return plan.choose("full", 128, "bf16", arch).spec.tier


def compiled_candidates(head_dim, dtype, arch, causal, *, tier, cache_dir=None, log=sys.stderr):
    """(config, kernel) for each candidate of `tier` that compiles without spills."""
    program = pipeline.load_program(causal=causal)
    steps = pipeline.lower(program, dtype)
    out = []
    for cfg in tiers.get(tier).candidates(Kind.FORWARD, kernel_head_dim(head_dim), dtype, arch):  # the padded dim
        try:
            kern = builders.build_kernel(
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


def rank(results: list[dict]) -> list[dict]:
    """`results` (each a config with `ms`, its time at one length, or `ms_by_seqlen`, its times at several), fastest
    first. Over several lengths each result gets `score`: the geometric mean over the lengths of its time over the
    best time at that length (1.0 for a config fastest at every length); a length some config did not time is left
    out of every score. A pure function: `tune` gives it what it timed."""
    if not results or "ms_by_seqlen" not in results[0]:
        return sorted(results, key=lambda r: r["ms"])
    lengths = set.intersection(*(set(r["ms_by_seqlen"]) for r in results))
    best = {n: min(r["ms_by_seqlen"][n] for r in results) for n in lengths}
    out = []
    for r in results:
        ratios = [r["ms_by_seqlen"][n] / best[n] for n in sorted(lengths)]
        out.append(dict(r, score=round(math.prod(ratios) ** (1 / len(ratios)), 4) if ratios else float("inf")))
    return sorted(out, key=lambda r: r["score"])


def tune(
    dims=(64, 96, 128, 256),
    causal=(False, True),
    dtypes=("bf16",),
    arch=None,
    *,
    tier=None,
    seqlen=4096,
    rounds=3,
    log=sys.stderr,
) -> dict:
    """Time every candidate at `seqlen` (a length, or a tuple of lengths: then ranked by `rank`'s score), the median
    of `rounds` rounds."""
    seqlens = tuple(seqlen) if isinstance(seqlen, (tuple, list)) else (seqlen,)
    from . import testing
    from .bench import timing

    torch = testing._torch()
    timer = timing.timer(torch)
    arch = arch or request.detect_arch()
    tier = tier or default_tier(arch)
    measured, configs = {}, {}
    for dtype in dtypes:
        for D in dims:
            for c in causal:
                key = tuned.tuned_key(tier, arch, D, dtype, bool(c))
                inputs = {}
                for n in seqlens:
                    B, H = max(1, 16384 // n), max(1, 2048 // D)
                    inputs[n] = testing.random_qkv(B, H, n, n, D, dtype)
                checked = []
                for cfg, kern in compiled_candidates(D, dtype, arch, c, tier=tier, log=log):
                    check = testing.check_kernel(kern, B=1, H=2, M=333, N=517)
                    if not check.ok:
                        print(f"  {kern.name}: FAILED check (err {check.err:.2e} > {check.bound:.2e})", file=log)
                        continue
                    checked.append((cfg, kern))
                results = []
                medians = timing.time_in_rounds([k for _, k in checked], inputs, timer, rounds)
                for (cfg, kern), ms in zip(checked, medians):
                    times = {n: round(t, 4) for n, t in ms.items()}
                    result = dict(cfg, registers=kern.resources.registers)
                    if len(seqlens) == 1:
                        result["ms"] = times[seqlens[0]]
                    else:
                        result["ms_by_seqlen"] = times
                    results.append(result)
                    print(f"  {key} {kern.name}: " + ", ".join(f"{n}: {t:.3f} ms" for n, t in times.items()), file=log)
                inputs.clear()
                results = rank(results)
                measured[key] = results
                if results:
                    configs[key] = {f: results[0][f] for f in ("block_m", "block_n", "num_warps", "stages")}
    return dict(
        tier=tier,
        device=torch.cuda.get_device_name(),
        date=datetime.date.today().isoformat(),
        shape=f"seqlen {', '.join(map(str, seqlens))}, 16k tokens, heads x dim = 2048, median of {rounds} rounds"
        + (" (ranked by the geometric mean of each time over its length's best)" if len(seqlens) > 1 else ""),
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


def _print_table(table: dict) -> None:
    for key, cfg in table["configs"].items():
        best = table["measured"][key][0]
        if "score" in best:
            times = ", ".join(f"{n}: {t:.3f} ms" for n, t in best["ms_by_seqlen"].items())
            print(f"{key}: {cfg} {times} (score {best['score']:.3f})")
        else:
            print(f"{key}: {cfg} {best['ms']:.3f} ms")


def main(args) -> int:
    """`fagen tune`: with --compile-only, compile every candidate (no GPU); else time them and record the winners
    (in the shipped table, or in --out)."""
    from . import options

    causal = options.causal_cases(args.causal)
    seqlens = args.seqlen or (4096,)
    if args.compile_only:
        from ..backend.spec import normalize_arch

        arch = normalize_arch(args.arch or "sm_90a")
        tier = args.tier or default_tier(arch)
        for dt in args.dtype:
            for d in args.dim:
                for c in causal:
                    n = len(compiled_candidates(d, dt, arch, c, tier=tier))
                    print(f"{tier}/{arch}/{dt}/d{d}/{'causal' if c else 'full'}: {n} candidates compiled")
        return 0
    if request.detect_arch() is None:
        raise RuntimeError("no CUDA GPU found: fagen tune times kernels on a GPU (--compile-only does not)")
    seqlen = seqlens if len(seqlens) > 1 else seqlens[0]
    table = tune(args.dim, causal, args.dtype, args.arch, tier=args.tier, seqlen=seqlen, rounds=args.rounds)
    if args.out:
        args.out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    else:
        merge(table)
    _print_table(table)
    return 0
