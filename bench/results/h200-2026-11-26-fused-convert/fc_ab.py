"""Backward ms (tensor_grads=False) of plain causal, full and ALiBi, d64/d128, 2k/8k, for the fagen tree given."""
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
        for name, kw in (("causal", dict(causal=True)), ("full", {}), ("alibi", dict(causal=True, alibi=True))):
            kern = fagen.compile(dim=D, dtype="bf16", **kw)
            t = dict(slopes=torch.rand(H, device="cuda") * 0.1) if "alibi" in kw else {}
            o, lse = kern(q, k, v, return_lse=True, **t)
            ms = timer(lambda: kern.backward(q, k, v, o, lse, do, tensor_grads=False, **t))
            out.append(f"{name} d{D} {N // 1024}k {ms:.3f}")
print(" | ".join(out), flush=True)
