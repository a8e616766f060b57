"""Backward ms (kern.backward: preprocess, main, dQ convert) of the fagen tree argv[1] (tag argv[2]), bf16, 16k tokens."""
import sys, os, tempfile
sys.path.insert(0, sys.argv[1])
os.environ.setdefault("FAGEN_CACHE_DIR", tempfile.mkdtemp())
import torch, fagen
from fagen.tools import testing, bench
assert os.path.realpath(fagen.__file__).startswith(os.path.realpath(sys.argv[1])), fagen.__file__
timer = bench._timer(torch)
row = [f"{sys.argv[2]:5s}"]
for D in (64, 128):
    for causal in (True, False):
        kern = fagen.compile(dim=D, dtype="bf16", causal=causal)
        for N in (2048, 8192):
            B, H = max(1, 16384 // N), 2048 // D
            torch.manual_seed(0)
            q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
            do = torch.randn_like(q)
            o, lse = kern(q, k, v, return_lse=True)
            ms = timer(lambda: kern.backward(q, k, v, o, lse, do))
            row.append(f"d{D}{'c' if causal else 'f'} {N//1024}k {ms*1000:.1f}us")
print(" | ".join(row), flush=True)
