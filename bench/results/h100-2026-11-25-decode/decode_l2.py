"""Decode B 8, GQA 32/8, d128, bf16: the call ÷ copy, timed as the bench does (do_bench: L2 flushed before each
call) and back to back (30 calls between two events, no flush). argv[1]: the fagen tree."""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from fagen import pipeline
from fagen.tools import bench

flushed = bench._timer(torch)
def b2b(fn, n=30):
    for _ in range(5): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(5):
        s.record()
        for _ in range(n): fn()
        e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / n)
    return sorted(ts)[2]
kern = pipeline.compile(128, causal=True, decode=True, dtype="bf16")
B, Hkv, H, D = 8, 8, 32, 128
for L in (8192, 32768):
    kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    nbytes = 2 * kc.numel() * 2
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16); dst = torch.empty_like(src)
    cf = flushed(lambda: dst.copy_(src)); cb = b2b(lambda: dst.copy_(src))
    del src, dst
    print(f"L={L} copy us: flushed {cf*1e3:.1f} back-to-back {cb*1e3:.1f}")
    caches = {"contig": (kc, vc, None)}
    for page in (16, 256):
        per = -(-L // page)
        g = torch.Generator(device="cuda"); g.manual_seed(0)
        order = torch.randperm(B * per, device="cuda", generator=g)
        table = order.view(B, per).to(torch.int32)
        pk = torch.empty(B * per, page, Hkv, D, device="cuda", dtype=torch.bfloat16); pv = torch.empty_like(pk)
        pk[order] = kc.view(B * per, page, Hkv, D); pv[order] = vc.view(B * per, page, Hkv, D)
        caches[f"page{page}"] = (pk, pv, table)
    for M in ((1, 4) if L == 8192 else (1,)):
        q = torch.randn(B, M, H, D, device="cuda", dtype=torch.bfloat16)
        ref = None
        for name, (k_, v_, t) in caches.items():
            fn = lambda: kern.decode(q, k_, v_, lens, block_table=t)
            out = fn()
            ref = out if ref is None else ref
            err = (out.float() - ref.float()).abs().max().item()
            f = flushed(fn); bb = b2b(fn)
            print(f"L={L} M={M} {name:7s} flushed {f*1e3:6.1f}us {cf/(2*f):.3f}  back-to-back {bb*1e3:6.1f}us {cb/(2*bb):.3f}  diff {err:.2e}", flush=True)
    del caches, kc, vc
