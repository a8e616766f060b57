"""Where the backward's time goes: each kernel of fagen's backward plan (preprocess, main, convert) and of SDPA's
FlashAttention-2 backward, by the torch profiler (CUPTI sees NVRTC launches too), at the benchmark convention's
shapes (B·N = 16384 tokens, H·D = 2048). Usage: python bench/profile_backward.py [--ncu | --ab] (--ncu: one
fagen and one FA2 backward at d128 and d64 non-causal 4k, for Nsight Compute to profile; --ab: the main kernel
at each query-row count the mma tier's backward can take, block_m = 32, 64 and 128, the rule's choice marked)."""

from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import fagen
from fagen.tools import testing


def case(D, causal, N, reps=10, ncu=False):
    B, H = 16384 // N, 2048 // D
    kern = fagen.compile(D, causal=causal, dtype="bf16")
    q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
    do = torch.randn_like(q)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def ours():
        o, lse = kern(q, k, v, return_lse=True)
        return kern.backward(q, k, v, o, lse, do)

    def fa2():
        qg.grad = kg.grad = vg.grad = None
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(do)

    for f in (ours, fa2):
        f()
    torch.cuda.synchronize()
    if ncu:
        return
    flops = 4 * B * H * N * N * D / (2 if causal else 1)
    for name, f in (("fagen", ours), ("fa2", fa2)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                f()
            torch.cuda.synchronize()
        total = 0.0
        rows = []
        for e in prof.key_averages():
            t = e.device_time_total / reps  # µs per call
            if t <= 0:
                continue
            total += t
            rows.append((t, e.key[:70]))
        mask = "causal" if causal else "full"
        print(f"\n{name} d{D} {mask} N={N}: {total:.0f} us fwd+bwd, {3.5 * flops / total / 1e6:.0f} TF/s")
        for t, key in sorted(rows, reverse=True)[:6]:
            print(f"  {t:8.1f} us {100 * t / total:5.1f}%  {key}")


def ab(reps=20):
    """The main kernel's time at 32, 64 and 128 query rows a step (the rule's tiles, block_m replaced), same run."""
    from fagen.backend.tiers import mma

    rule = mma.backward_rule
    for D in (64, 128):
        for causal in (False, True):
            N = 8192
            B, H = 16384 // N, 2048 // D
            kern = fagen.compile(D, causal=causal, dtype="bf16")
            q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
            do = torch.randn_like(q)
            o, lse = kern(q, k, v, return_lse=True)
            chosen = kern.backward_plan.main.spec.block_m
            line = []
            for block_m in (32, 64, 128) if D == 64 else (32, 64):  # 128 rows at d128 exceed shared memory
                mma.backward_rule = lambda d, arch, block_m=block_m: dict(rule(d, arch), block_m=block_m)
                kern._backward_plan = None
                kern._calls.clear()
                name = kern.backward_plan.main.spec.name
                kern.backward(q, k, v, o, lse, do)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    kern.backward(q, k, v, o, lse, do)
                end.record()
                torch.cuda.synchronize()
                mark = "*" if kern.backward_plan.main.spec.block_m == chosen else " "
                line.append(f"{mark}{name.split('_mma_')[-1]} {start.elapsed_time(end) / reps:7.3f} ms")
            mma.backward_rule = rule
            kern._backward_plan = None
            kern._calls.clear()
            print(f"backward d{D} {'causal' if causal else 'full'} N={N}: " + "  ".join(line))


if __name__ == "__main__":
    if "--ab" in sys.argv:
        ab()
    elif "--ncu" in sys.argv:
        case(128, False, 4096, ncu=True)
        case(64, False, 4096, ncu=True)
    else:
        print(torch.cuda.get_device_name())
        for D in (64, 128):
            for causal in (False, True):
                for N in (2048, 8192):
                    case(D, causal, N)
