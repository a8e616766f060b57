"""A/B of two source trees' backward main kernel on one GPU: the fagen at `--root` (imported ahead of everything
else), its backward checked against float64 (FlashAttention's rule, a small shape), then timed at FlashAttention's
benchmark shapes (bf16, B·N = 16384 tokens, H·D = 2048), d64 and d128, causal and not, 2k and 8k: the main kernel
alone (its device time by the torch profiler, which sees NVRTC's launches) and the whole backward (preprocess, main
kernel, convert; CUDA events), each the median of `--rounds` rounds. One JSON line per case.

    python3 bench/ab_bwd_main.py --root .gpu/base > base.jsonl     # a copy of the tree before the change
    python3 bench/ab_bwd_main.py --root . > new.jsonl
    python3 bench/ab_bwd_main.py --root .gpu/base > base2.jsonl    # again, in turn: a process's cells move by a
    python3 bench/ab_bwd_main.py --root . > new2.jsonl             # few percent
    python3 bench/ab_bwd_main.py --compare base.jsonl new.jsonl

`--cases d128-causal-8192,...` picks cases (DIM-MASK-N, MASK full, causal, softcap: 30, no mask, or window: causal, 1024
keys, windowW: W keys; a suffix -gqaG: G query heads a KV head, as d128-causal-8192-gqa4, G dividing the heads; -hH: H
query heads, not 2048 / DIM, as d128-causal-8192-gqa4-h32, `fagen bench`'s GQA case; default: every one above but
softcap, window and GQA). Kernels are built afresh (use_cache=False), so that each tree
runs its own sources. `--set BWD_NARROW_KV=False` sets one of the wgmma tier's module settings first (a string, or an
int or bool where the setting is one; `--set` again for another), for an A/B of two settings on one tree (a tuple of
ints written 96:128, e.g. `--set ROWS80_HEAD_DIMS=96:128`, empty for none). `--deterministic` times (and checks) the
backward with deterministic=True."""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

if "--root" in sys.argv:  # the tree whose fagen is timed, ahead of everything else on the path
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--root") + 1]).resolve()))

from ab_tools import fagen_at_root, set_wgmma, timed_us  # noqa: E402

DEFAULT = [f"d{d}-{m}-{n}" for d in (64, 128) for m in ("full", "causal") for n in (2048, 8192)]


def kernel_us(fn, name: str, reps: int = 10) -> float:
    """Mean device µs per call of `fn` spent in the kernel called `name` (torch profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times = [e.device_time_total for e in prof.key_averages() if e.key == name]
    if not times:
        raise RuntimeError(f"the profiler saw no kernel {name}")
    return sum(times) / reps


def run(case: str, rounds: int, deterministic: bool = False) -> dict:
    import torch

    import fagen
    from fagen.tools import testing

    dim, mask, n, *more = case.split("-")
    window = int(mask[6:] or 1024) if re.fullmatch(r"window[0-9]*", mask) else None
    mask = "window" if window else mask
    D, causal, N = int(dim[1:]), mask in ("causal", "window"), int(n)
    suffix = re.fullmatch(r"(?:-gqa([1-9][0-9]*))?(?:-h([1-9][0-9]*))?", "".join("-" + m for m in more))
    B, H = 16384 // N, int(suffix.group(2)) if suffix and suffix.group(2) else 2048 // D
    G = int(suffix.group(1)) if suffix and suffix.group(1) else 1
    if mask not in ("full", "causal", "softcap", "window") or not suffix or H % G:
        raise ValueError(
            f"case {case!r}: expected dDIM-MASK-N[-gqaG][-hH], MASK full, causal, softcap (30, no mask) or window, "
            f"G query heads a KV head dividing the {H} heads"
        )
    options = {"softcap": dict(softcap=30.0), "window": dict(window=window)}.get(mask, {})
    kern = fagen.compile(D, causal=causal, dtype="bf16", use_cache=False, **options)
    check = testing.check_backward(kern, B=2, H=2 * G, Hkv=2, M=300, N=257, deterministic=deterministic)
    q, k, v = testing.random_qkv(B, H, N, N, D, "bf16", Hkv=H // G)
    do = torch.randn_like(q)
    o, lse = kern(q, k, v, return_lse=True)
    main = kern.backward_plan.main.spec.name

    def backward():
        return kern.backward(q, k, v, o, lse, do, deterministic=deterministic)

    mains, wholes = [], []
    for _ in range(rounds):
        mains.append(kernel_us(backward, main))
        wholes.append(timed_us(backward))
    return dict(
        case=case,
        kernel=main,
        ok=bool(check.ok),
        check=str(check),
        main_us=statistics.median(mains),
        bwd_us=statistics.median(wholes),
    )


def compare(old_path: str, new_path: str) -> None:
    def read(path):
        return {r["case"]: r for r in map(json.loads, Path(path).read_text().splitlines()) if "case" in r}

    old, new = read(old_path), read(new_path)
    head = ("case", "main old", "main new", "old/new", "bwd old", "bwd new", "old/new")
    print(f"{head[0]:18} " + " ".join(f"{h:>9}" for h in head[1:]) + "  ok")
    for case, n in new.items():
        o = old.get(case, {})
        if "error" in n or "main_us" not in o:
            print(f"{case:18} {n.get('error', 'not in ' + old_path)[:100]}")
            continue
        print(
            f"{case:18} {o['main_us']:9.0f} {n['main_us']:9.0f} {o['main_us'] / n['main_us']:9.3f} "
            f"{o['bwd_us']:9.0f} {n['bwd_us']:9.0f} {o['bwd_us'] / n['bwd_us']:9.3f}  "
            f"{'ok' if n['ok'] and o['ok'] else 'FAIL'}"
        )


def main(argv: list[str]) -> int:
    if "--compare" in argv:
        i = argv.index("--compare")
        compare(argv[i + 1], argv[i + 2])
        return 0
    fagen = fagen_at_root(argv)
    where = Path(fagen.__file__).resolve()
    import torch

    print(json.dumps(dict(fagen=str(where.parent), version=fagen.__version__, device=torch.cuda.get_device_name())))
    for i in [i for i, a in enumerate(argv) if a == "--set"]:
        value = set_wgmma(argv[i + 1])
        print(json.dumps(dict(setting=argv[i + 1].split("=", 1)[0], value=value)))
    cases = argv[argv.index("--cases") + 1].split(",") if "--cases" in argv else DEFAULT
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 3
    for case in cases:
        try:
            print(json.dumps(run(case, rounds, "--deterministic" in argv)), flush=True)
        except Exception as e:  # a case that fails says so, and the others still run
            print(json.dumps(dict(case=case, error=f"{type(e).__name__}: {e}")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
