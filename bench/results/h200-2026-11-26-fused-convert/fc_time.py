"""Backward ms (one line) of full and causal d64/d128 2k (B=8) for the tree given."""
import sys
sys.path.insert(0, sys.argv[1])
import torch, fagen
from fagen.tools import testing
out = []
for D in (64, 128):
    for name, kw in (("full", {}), ("causal", dict(causal=True))):
        kern = fagen.compile(dim=D, dtype="bf16", **kw)
        B, H, N = 8, 2048 // D, 2048
        q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
        do = torch.randn_like(q)
        o, lse = kern(q, k, v, return_lse=True)
        for _ in range(3):
            kern.backward(q, k, v, o, lse, do)
        ts = []
        for i in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); kern.backward(q, k, v, o, lse, do); e.record(); torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        ts.sort()
        out.append(f"{name} d{D} {ts[len(ts) // 2]:.3f}")
print(sys.argv[1], " | ".join(out), flush=True)
