"""Causal forward, the default tiles: fagen ÷ cuDNN per (dim, N); the tree (argv[1]) and FAGEN_SECTION_BYTES set the
block order. Prints one JSON line per case."""
import sys, json, os
sys.path.insert(0, sys.argv[1])
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import fagen
from fagen.tools import testing, bench

timer = bench._timer(torch)
tag = sys.argv[2]
dims = [int(x) for x in sys.argv[3].split(",")]
seqlens = [int(x) for x in sys.argv[4].split(",")]
for D in dims:
    k = fagen.compile(D, causal=True, dtype="bf16")
    chk = [testing.check_kernel(k, B=b, H=h, M=m, N=n) for b, h, m, n in ((3, 5, 333, 517), (2, 7, 1000, 1000), (1, 3, 4097, 4097))]
    assert all(c.ok for c in chk), (k.name, chk)
    for N in seqlens:
        B, H = max(1, 16384 // N), 2048 // D
        q, kk, v = testing.random_qkv(B, H, N, N, D, "bf16")
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            f = lambda: torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True)
            ref = f(); cud = timer(f)
        o = k(q, kk, v)
        err = float((o.float() - ref.float()).abs().max())
        ms = timer(lambda: k(q, kk, v))
        print(json.dumps(dict(tag=tag, D=D, N=N, kernel=k.name, ms=ms, cudnn=cud, ratio=cud / ms, err=err)), flush=True)
