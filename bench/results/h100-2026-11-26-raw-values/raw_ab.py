"""Forward ms of score programs affine in q.k (ALiBi: fagen's and FlashAttention's, a gathered relative bias) and
plain causal, d64 / d128, 2k / 8k, for the fagen tree given; each kernel checked against float64 first."""
import sys, json
sys.path.insert(0, sys.argv[1])
import torch
import fagen
from fagen.ir.variants import flash_attn_program
from fagen.tools import testing, bench

timer = bench._timer(torch)
rel = torch.randn(32, 16384, device="cuda") * 0.1
PROGRAMS = {
    "alibi": lambda D: fagen.compile(D, causal=True, dtype="bf16", alibi=True),
    "flash_alibi": lambda D: fagen.compile(D, ir=flash_attn_program(causal=True, alibi=True), dtype="bf16"),
    "relbias": lambda D: fagen.compile(D, causal=True, dtype="bf16", score_mod=lambda s, b, h, q, k: s + rel[h, q - k + 8192]),
    "causal": lambda D: fagen.compile(D, causal=True, dtype="bf16"),
}
for D in (64, 128):
    for name, make in PROGRAMS.items():
        k = make(D)
        chk = [testing.check_kernel(k, B=2, H=3, M=m, N=n) for m, n in ((333, 517), (1000, 1000))]
        assert all(c.ok for c in chk), (k.name, chk)
        for N in (2048, 8192):
            B, H = max(1, 16384 // N), 2048 // D
            q, kk, v = testing.random_qkv(B, H, N, N, D, "bf16")
            t = testing.call_tensors(k, B, H, N, N)
            ms = timer(lambda: k(q, kk, v, **t))
            print(json.dumps(dict(tree=sys.argv[2], D=D, N=N, prog=name, kernel=k.name.split("_bf16_")[1], ms=round(ms, 4))), flush=True)
