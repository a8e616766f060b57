"""Decode at q_len 1: the whole call, the split kernel alone, the combine alone, and the D2D copy (us)."""
import sys, types
sys.path.insert(0, ".")
import torch
from fagen import pipeline
from fagen.runtime.kernel import _DecodeCall
from fagen.tools import bench

timer = bench._timer(torch)
kern = pipeline.compile(128, causal=True, decode=True, dtype="bf16")
B, Hkv, H, D = 8, 8, 32, 128
for L in (8192, 32768):
    kc = torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16); vc = torch.randn_like(kc)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    nbytes = 2 * kc.numel() * 2
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16); dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src)); copy_bw = 2 * nbytes / (copy_ms * 1e-3)
    del src, dst
    kern.decode(q, kc, vc, lens)
    entry = [e for e in kern._calls.values() if isinstance(e, _DecodeCall)][-1]
    full = timer(lambda: kern.decode(q, kc, vc, lens))
    real_split, real_combine = entry.split, entry.combine
    noop = types.SimpleNamespace(function=types.SimpleNamespace(launch=lambda *a: None), threads=real_combine.threads)
    entry.combine = noop
    split = timer(lambda: kern.decode(q, kc, vc, lens))
    entry.combine, entry.split = real_combine, noop
    comb = timer(lambda: kern.decode(q, kc, vc, lens))
    entry.split = real_split
    empty = types.SimpleNamespace(function=types.SimpleNamespace(launch=lambda *a: None), threads=1)
    entry.split, entry.combine = empty, empty
    host = timer(lambda: kern.decode(q, kc, vc, lens))
    entry.split, entry.combine = real_split, real_combine
    bw = lambda ms: nbytes / (ms * 1e-3) / copy_bw
    print(f"L={L} S={entry.num_splits} copy {copy_ms*1e3:.1f}us | full {full*1e3:.1f}us ({bw(full):.3f} of copy) | split {split*1e3:.1f}us ({bw(split):.3f}) | combine {comb*1e3:.1f}us | no kernels {host*1e3:.1f}us")
