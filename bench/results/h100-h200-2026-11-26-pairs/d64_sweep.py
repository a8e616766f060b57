"""d64 causal forward ÷ cuDNN (same process), persistent tile configs, tree argv[1]."""
import sys, os, tempfile
sys.path.insert(0, sys.argv[1])
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import fagen
from fagen import pipeline
from fagen.tools import testing, bench
timer = bench._timer(torch)
arch = pipeline.detect_arch()
program = pipeline.load_program(causal=True)
steps = pipeline.lower(program, "bf16")
cfgs = [None] + [dict(block_m=bm, block_n=bn, num_warps=4 * (bm // 64 + 1), stages=st, persistent=True)
                 for bm, bn, st in [(192, 128, 2), (192, 96, 2), (192, 128, 3), (128, 128, 2), (128, 176, 2), (128, 192, 2), (128, 128, 3)]]
kerns = []
for cfg in cfgs:
    k = pipeline.build_kernel(steps[-1].program, program.name, 64, "bf16", arch, "wgmma", config=cfg, key_range=steps[-1].facts.get("key_range"))
    chk = [testing.check_kernel(k, B=b, H=h, M=m, N=n) for b, h, m, n in ((1, 2, 333, 517), (3, 5, 2048, 2048))]
    assert all(c.ok for c in chk), (k.name, chk)
    kerns.append(k)
for r in range(2):
    for N in (1024, 2048, 4096, 8192):
        B, H = max(1, 16384 // N), 2048 // 64
        torch.manual_seed(0)
        q, kk, v = testing.random_qkv(B, H, N, N, 64, "bf16")
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cud = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True))
        row = [f"r{r} d64 {N // 1024}k cudnn {cud * 1000:6.1f}"]
        for k in (kerns if r == 0 else kerns[::-1]):
            ms = timer(lambda: k(q, kk, v))
            row.append(f"{k.name.split('wgmma_')[1]} {ms * 1000:6.1f} {cud / ms:.3f}")
        print(" | ".join(row), flush=True)
