"""Per-kernel GPU time (torch profiler) of 10 backward calls, d128 causal and d64 full at 2k, B*N = 16k, for a tree."""
import sys
sys.path.insert(0, sys.argv[1])
import torch, fagen
from torch.profiler import ProfilerActivity, profile
from fagen.tools import testing
for D, kw in ((128, dict(causal=True)), (64, {})):
    kern = fagen.compile(dim=D, dtype="bf16", **kw)
    B, H, N = 8, 2048 // D, 2048
    q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
    do = torch.randn_like(q)
    o, lse = kern(q, k, v, return_lse=True)
    for _ in range(3):
        kern.backward(q, k, v, o, lse, do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            kern.backward(q, k, v, o, lse, do)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / 10) for e in prof.key_averages() if e.device_time_total > 0]
    print(sys.argv[1], D, kw, " | ".join(f"{n[:28]} {t:.0f}us" for n, t in sorted(rows, key=lambda r: -r[1])[:4]), flush=True)
