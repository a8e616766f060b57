"""fagen's default forward against SDPA's cuDNN and FlashAttention-2 backends, in one process, in rounds.

Each (head dim, mask) compiles `fagen.compile(D, causal=..., dtype="bf16")`, checks it against float64 (M = N = 1000,
FlashAttention's rule), then at each length of the benchmark convention (16k tokens, heads x dim = 2048) compares its
output with cuDNN's and times the three: ROUNDS passes, the order reversed every other pass, each time
`do_bench`'s median, the figure the median over the passes. Single cells move by several percent between passes on
the lent H100s; rounds in alternating order keep the drift from favouring whoever runs first.

Usage (on a GPU, from the source tree): PYTHONPATH=. python3 bench/forward_rounds.py [64:causal,128:full,...] [ROUNDS]
"""

import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import fagen
from fagen.tools import bench, testing

F = torch.nn.functional.scaled_dot_product_attention


def main(argv):
    cases = [(int(d), m == "causal") for d, m in (x.split(":") for x in argv[0].split(","))] if argv else None
    cases = cases or [(d, c) for d in (64, 128, 256) for c in (True, False)]
    rounds = int(argv[1]) if len(argv) > 1 else 2
    timer = bench._timer(torch)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {rounds} rounds", flush=True)
    for D, causal in cases:
        k = fagen.compile(D, causal=causal, dtype="bf16")
        check = testing.check_kernel(k, B=1, H=2, M=1000, N=1000)
        for N in (2048, 4096, 8192, 16384):
            B, H = 16384 // N, 2048 // D
            q, kk, v = testing.random_qkv(B, H, N, N, D, "bf16")

            def sdpa(backend):
                def run():
                    with sdpa_kernel([backend]):
                        return F(q, kk, v, is_causal=causal)

                return run

            fns = {
                "fagen": lambda: k(q, kk, v),
                "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
                "fa2": sdpa(SDPBackend.FLASH_ATTENTION),
            }
            agree = float((fns["fagen"]().float() - fns["cudnn"]().float()).abs().max())
            times = {n: [] for n in fns}
            for r in range(rounds):
                for n in list(fns) if r % 2 == 0 else list(fns)[::-1]:
                    times[n].append(timer(fns[n]))
            ms = {n: statistics.median(t) for n, t in times.items()}
            flop = bench.flops(B, H, N, D, causal)
            tf = {n: flop / t / 1e9 for n, t in ms.items()}
            print(
                f"d{D} {'causal' if causal else 'full'} {N} {k.name}: fagen {tf['fagen']:.0f} cudnn {tf['cudnn']:.0f} "
                f"fa2 {tf['fa2']:.0f} TF/s; fagen/cudnn {ms['cudnn'] / ms['fagen']:.3f} "
                f"fagen/fa2 {ms['fa2'] / ms['fagen']:.3f}"
                f"; check {'ok' if check.ok else 'FAILED'}, |o - cudnn| {agree:.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
