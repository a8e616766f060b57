"""Causal forward ÷ cuDNN (same process) for the tree in argv[1] (tag argv[2]): shipped tiles and persistent variants."""
import sys, os, tempfile
sys.path.insert(0, sys.argv[1])
os.environ.setdefault("FAGEN_CACHE_DIR", tempfile.mkdtemp())
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import fagen
from fagen import pipeline
from fagen.tools import testing, bench
assert os.path.realpath(fagen.__file__).startswith(os.path.realpath(sys.argv[1]))
timer = bench._timer(torch)
arch = pipeline.detect_arch()
program = pipeline.load_program(causal=True)
steps = pipeline.lower(program, "bf16")
CFGS = {64: [None, dict(block_m=192, block_n=128, num_warps=16, stages=2, persistent=True)], 128: [None]}
for D in (64, 128):
    kerns = []
    for cfg in CFGS[D]:
        k = pipeline.build_kernel(steps[-1].program, program.name, D, "bf16", arch, "wgmma", config=cfg,
                                  key_range=steps[-1].facts.get("key_range"))
        chk = [testing.check_kernel(k, B=b, H=h, M=m, N=n) for b, h, m, n in ((1, 2, 333, 517), (1, 2, 1000, 1000), (3, 5, 2048, 2048))]
        assert all(c.ok for c in chk), (k.name, chk)
        kerns.append(k)
    for N in (1024, 2048, 4096, 8192, 16384):
        B, H = max(1, 16384 // N), 2048 // D
        torch.manual_seed(0)
        q, kk, v = testing.random_qkv(B, H, N, N, D, "bf16")
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            cud = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True))
        row = [f"{sys.argv[2]:4s} d{D} {N // 1024:2d}k cudnn {cud * 1000:7.1f}us"]
        for k in kerns:
            ms = timer(lambda: k(q, kk, v))
            row.append(f"{k.name.split('wgmma_')[1]:15s} {ms * 1000:7.1f}us {cud / ms:.3f}x")
        print(" | ".join(row), flush=True)
