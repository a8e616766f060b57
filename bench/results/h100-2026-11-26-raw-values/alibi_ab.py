"""Forward and backward ms of causal ALiBi (no slopes gradient), d64 / d128, 2k / 8k, for the fagen tree given."""
import sys
sys.path.insert(0, sys.argv[1])
import torch
import fagen
from fagen.tools import testing, bench

timer = bench._timer(torch)
out = []
for D in (64, 128):
    for N in (2048, 8192):
        B, H = max(1, 16384 // N), 2048 // D
        q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
        do = torch.randn_like(q)
        kern = fagen.compile(dim=D, causal=True, dtype="bf16", alibi=True)
        t = dict(slopes=torch.rand(H, device="cuda") * 0.1)
        o, lse = kern(q, k, v, return_lse=True, **t)
        fwd = timer(lambda: kern(q, k, v, **t))
        bwd = timer(lambda: kern.backward(q, k, v, o, lse, do, tensor_grads=False, **t))
        out.append(f"d{D} N={N} fwd {fwd:.3f} bwd {bwd:.3f}")
print(" | ".join(out), flush=True)
