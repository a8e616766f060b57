"""Where the backward's time goes: each kernel of fagen's forward + backward and of SDPA's FlashAttention-2, by the
torch profiler (CUPTI sees fagen's NVRTC launches too), at FlashAttention's benchmark shapes (bf16, B·N = 16384
tokens, H·D = 2048), d64 and d128, causal and not, 2k and 8k.

    python3 bench/profile_backward.py          # the table of kernels, their share of each case
    python3 bench/profile_backward.py --ncu    # one fagen and one FA2 forward + backward at d128 and d64
                                               # non-causal 4k, for Nsight Compute to profile"""

from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import fagen


def case(D: int, causal: bool, N: int, reps: int = 10, ncu: bool = False) -> None:
    B, H = 16384 // N, 2048 // D
    kern = fagen.compile(D, causal=causal, dtype="bf16")
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def ours():
        o, lse = kern(q, k, v, return_lse=True)
        return kern.backward(q, k, v, o, lse, do)

    def fa2():
        qg.grad = kg.grad = vg.grad = None
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(do)

    for f in (ours, fa2):  # the first calls compile and allocate: not profiled
        f()
    torch.cuda.synchronize()
    if ncu:
        return
    flops = 3.5 * 4 * B * H * N * N * D / (2 if causal else 1)
    for name, f in (("fagen", ours), ("fa2", fa2)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                f()
            torch.cuda.synchronize()
        rows = [(e.device_time_total / reps, e.key[:70]) for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(t for t, _ in rows)  # µs per forward + backward
        mask = "causal" if causal else "full"
        print(f"\n{name} d{D} {mask} N={N}: {total:.0f} us fwd+bwd, {flops / total / 1e6:.0f} TF/s")
        for t, key in sorted(rows, reverse=True)[:6]:
            print(f"  {t:8.1f} us {100 * t / total:5.1f}%  {key}")


if __name__ == "__main__":
    if "--ncu" in sys.argv:
        case(128, False, 4096, ncu=True)
        case(64, False, 4096, ncu=True)
    else:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fagen {fagen.__version__}")
        for D in (64, 128):
            for causal in (False, True):
                for N in (2048, 8192):
                    case(D, causal, N)
