"""A/B of the backward at d192 and d256 on one GPU, in one process: the wgmma backward that splits dK, dV by head-dim
columns (fagen.backend.tiers.wgmma.BWD_WIDE = True, the default) against the simt backward those head dims took
before (BWD_WIDE = False). Each path's kernels are built afresh (use_cache=False), bf16, B·N = 16384 tokens (8k: batch
2), H·D ≈ 2048, causal and not; triton's do_bench (L2 flushed between runs, median), rounds rotated. Prints the
forward + backward and the backward alone (preprocess, main kernel, convert) in µs.

    python3 bench/ab_bwd_wide.py              # d192 and d256, 8k, causal and not
    python3 bench/ab_bwd_wide.py 256 2048     # one head dim and length"""

from __future__ import annotations

import statistics
import sys

import torch

import fagen
from fagen.backend.tiers import wgmma

try:
    from triton.testing import do_bench
except ImportError:  # without triton: CUDA events, the median of 20 runs after a warm-up (no L2 flush)

    def do_bench(f, reps: int = 20) -> float:
        f()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            f()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def build(D: int, causal: bool, wide: bool):
    """A kernel whose backward plan is built under BWD_WIDE = `wide` (the plan is made on first use)."""
    wgmma.BWD_WIDE = wide
    try:
        kern = fagen.compile(D, causal=causal, dtype="bf16", use_cache=False)
        main = kern.backward_plan.main.spec
    finally:
        wgmma.BWD_WIDE = True
    return kern, main


def case(D: int, causal: bool, N: int, rounds: int = 3) -> None:
    B, H = 16384 // N, max(1, 2048 // D)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    runs = {}
    for name, wide in (("wgmma", True), ("simt", False)):
        kern, main = build(D, causal, wide)
        o, lse = kern(q, k, v, return_lse=True)

        def fwd_bwd(kern=kern):
            o, lse = kern(q, k, v, return_lse=True)
            kern.backward(q, k, v, o, lse, do)

        def bwd(kern=kern, o=o, lse=lse):
            kern.backward(q, k, v, o, lse, do)

        runs[name] = (main.name, fwd_bwd, bwd)
    times: dict[str, dict[str, list[float]]] = {n: {"fwd+bwd": [], "bwd": []} for n in runs}
    for r in range(rounds):
        names = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]
        for n in names:
            times[n]["fwd+bwd"].append(do_bench(runs[n][1]) * 1000)
            times[n]["bwd"].append(do_bench(runs[n][2]) * 1000)
    mask = "causal" if causal else "full"
    base = {what: statistics.median(times["simt"][what]) for what in ("fwd+bwd", "bwd")}
    for n, (spec, _, _) in runs.items():
        t = {what: statistics.median(times[n][what]) for what in ("fwd+bwd", "bwd")}
        both, alone = t["fwd+bwd"], t["bwd"]
        print(
            f"d{D} {mask:6} N={N:5} B={B} H={H}  {n:5}  fwd+bwd {both:8.0f} us ({base['fwd+bwd'] / both:5.2f}x simt)"
            f"  bwd {alone:8.0f} us ({base['bwd'] / alone:5.2f}x)   {spec}",
            flush=True,
        )


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fagen {fagen.__version__}")
    dims = [int(sys.argv[1])] if len(sys.argv) > 1 else [192, 256]
    lengths = [int(sys.argv[2])] if len(sys.argv) > 2 else [8192]
    for D in dims:
        for causal in (False, True):
            for N in lengths:
                case(D, causal, N)
