"""Where the backward's time goes: each kernel of fagen's forward + backward and of SDPA's FlashAttention-2, by the
torch profiler (CUPTI sees fagen's NVRTC launches too), at FlashAttention's benchmark shapes (bf16, B·N = 16384
tokens, H·D = 2048), d64 and d128, causal and not, 2k and 8k; and FlashAttention-4's (`flash_attn.cute`) where it
imports.

    python3 bench/profile_backward.py          # the table of kernels, their share of each case
    python3 bench/profile_backward.py 96,128 8192   # head dims and sequence lengths of your choice
    python3 bench/profile_backward.py 128 4096 --window=256   # a causal sliding window of 256 keys (Flex, no FA2)
    python3 bench/profile_backward.py --ncu    # one fagen and one FA2 forward + backward at d128 and d64
                                               # non-causal 4k, for Nsight Compute to profile"""

from __future__ import annotations

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

import fagen


def case(D: int, causal: bool, N: int, reps: int = 10, ncu: bool = False, window: int | None = None) -> None:
    B, H = 16384 // N, 2048 // D
    kern = fagen.compile(D, causal=causal, dtype="bf16", **({"window": (window, 0)} if window else {}))
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

    peers = [("fagen", ours)] + ([("fa2", fa2)] if window is None else [])
    if window:  # compiled FlexAttention with the window's block mask (`fagen bench`'s peer)
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block_mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= window), None, None, N, N)
        flex_c = torch.compile(flex_attention, dynamic=False)

        def flex():
            qg.grad = kg.grad = vg.grad = None
            flex_c(qg, kg, vg, block_mask=block_mask).backward(do)

        peers.append(("flex", flex))
    try:
        from flash_attn import cute

        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2).contiguous()

        def fa4():
            qt.grad = kt.grad = vt.grad = None
            o = cute.flash_attn_func(qt, kt, vt, causal=causal, **({"window_size": (window, 0)} if window else {}))
            (o[0] if isinstance(o, tuple) else o).backward(dot)

        peers.append(("fa4", fa4))
    except ImportError:
        pass
    for _, f in peers:  # the first calls compile and allocate: not profiled
        f()
    torch.cuda.synchronize()
    if ncu:
        return
    flops = 3.5 * 4 * B * H * N * (min(N, window) if window else N / (2 if causal else 1)) * D
    for name, f in peers:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                f()
            torch.cuda.synchronize()
        rows = [(e.device_time_total / reps, e.key[:70]) for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(t for t, _ in rows)  # µs per forward + backward
        mask = f"window {window}" if window else "causal" if causal else "full"
        print(f"\n{name} d{D} {mask} N={N}: {total:.0f} us fwd+bwd, {flops / total / 1e6:.0f} TF/s")
        for t, key in sorted(rows, reverse=True)[:6]:
            print(f"  {t:8.1f} us {100 * t / total:5.1f}%  {key}")


if __name__ == "__main__":
    if "--ncu" in sys.argv:
        case(128, False, 4096, ncu=True)
        case(64, False, 4096, ncu=True)
    else:
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, fagen {fagen.__version__}")
        args = [a for a in sys.argv[1:] if not a.startswith("-")]
        dims = [int(x) for x in args[0].split(",")] if args else [64, 128]
        lengths = [int(x) for x in args[1].split(",")] if len(args) > 1 else [2048, 8192]
        window = next((int(a.split("=")[1]) for a in sys.argv if a.startswith("--window=")), None)
        for D in dims:
            for causal in (True,) if window else (False, True):
                for N in lengths:
                    case(D, causal, N, window=window)
