"""Decode q_len 1 and 4, B 8, GQA 32/8, d128: time ÷ copy for num_splits in a list (contiguous, paged 16, 256)."""
import sys
sys.path.insert(0, ".")
import torch
from fagen import pipeline
from fagen.tools import bench

timer = bench._timer(torch)
kern = pipeline.compile(128, causal=True, decode=True, dtype="bf16")
print("plan blocks_per_sm", kern.plan.blocks_per_sm)
B, Hkv, H, D = 8, 8, 32, 128
for L in (8192, 16384, 32768):
    kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    nbytes = 2 * kc.numel() * 2
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16); dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src)); copy_bw = 2 * nbytes / (copy_ms * 1e-3)
    del src, dst
    caches = {"contig": (kc, vc, None)}
    for page in (16, 256):
        per = -(-L // page)
        order = torch.randperm(B * per, device="cuda")
        table = order.view(B, per).to(torch.int32)
        pk = torch.empty(B * per, page, Hkv, D, device="cuda", dtype=torch.bfloat16); pv = torch.empty_like(pk)
        pk[order] = kc.view(B * per, page, Hkv, D); pv[order] = vc.view(B * per, page, Hkv, D)
        caches[f"page{page}"] = (pk, pv, table)
    for M in (1, 4):
        q = torch.randn(B, M, H, D, device="cuda", dtype=torch.bfloat16)
        for name, (k_, v_, t) in caches.items():
            row = []
            for S in (None, 2, 3, 4, 6, 8):
                ms = timer(lambda: kern.decode(q, k_, v_, lens, block_table=t, num_splits=S))
                row.append(f"{S or 'auto'}:{nbytes / (ms * 1e-3) / copy_bw:.3f}")
            print(f"L={L} M={M} {name:7s} " + " ".join(row), flush=True)
