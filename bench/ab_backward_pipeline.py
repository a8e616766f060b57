"""A/B of the wgmma backward's step orders (fagen.backend.tiers.wgmma.BWD_PIPELINE: serial, overlap_dq, overlap) on
one GPU, in one process: each order's kernels are built afresh (use_cache=False: the compile cache's key does not
hold the order), then timed in turn, rounds rotated, at FlashAttention's benchmark shapes (bf16, B·N = 16384
tokens, H·D = 2048). Prints the backward (preprocess, main kernel, convert) in µs, median of the rounds, and each
order's check against float64 (FlashAttention's rule, a small odd shape).

    python3 bench/ab_backward_pipeline.py             # d64, d96, d128, causal and not, 2k and 8k
    python3 bench/ab_backward_pipeline.py 128 8192     # one head dim and length"""

from __future__ import annotations

import statistics
import sys

import torch
from ab_tools import timed_us

import fagen
from fagen.backend.tiers import wgmma
from fagen.tools import testing


def case(D: int, causal: bool, N: int, rounds: int = 5) -> None:
    B, H = 16384 // N, 2048 // D
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    runs, checks = {}, {}
    default = wgmma.BWD_PIPELINE
    for name in wgmma.BWD_PIPELINES:
        wgmma.BWD_PIPELINE = name
        kern = fagen.compile(D, causal=causal, dtype="bf16", use_cache=False)
        o, lse = kern(q, k, v, return_lse=True)
        main = kern.backward_plan.main.spec  # built now, under this order
        checks[name] = testing.check_backward(kern, B=2, H=2, M=300, N=257)
        runs[name] = (main.name, lambda kern=kern, o=o, lse=lse: kern.backward(q, k, v, o, lse, do))
    wgmma.BWD_PIPELINE = default
    times: dict[str, list[float]] = {n: [] for n in runs}
    for r in range(rounds):
        names = list(runs)[r % len(runs) :] + list(runs)[: r % len(runs)]
        for n in names:
            times[n].append(timed_us(runs[n][1]))
    base = statistics.median(times["serial"])
    mask = "causal" if causal else "full"
    for n, (spec, _) in runs.items():
        t = statistics.median(times[n])
        ok = "ok" if checks[n].ok else "FAILED"
        print(f"d{D} {mask:6} N={N:5}  {n:10} {t:8.0f} us  {base / t:5.3f}x serial  {ok}  {spec}", flush=True)


if __name__ == "__main__":
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fagen {fagen.__version__}")
    dims = [int(sys.argv[1])] if len(sys.argv) > 1 else [64, 96, 128]
    lengths = [int(sys.argv[2])] if len(sys.argv) > 2 else [2048, 8192]
    for D in dims:
        for causal in (False, True):
            for N in lengths:
                case(D, causal, N)
