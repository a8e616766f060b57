"""Backward time (ms) of ALiBi (slopes' gradient asked for or not) and plain causal, for the fagen tree given."""
import inspect
import sys
sys.path.insert(0, sys.argv[1])
import torch
import fagen
from fagen.tools import testing, bench

timer = bench._timer(torch)
out = []
for D in (64, 128):
    for N in (2048, 8192):
        B, H = max(1, 16384 // N), 2048 // D
        q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
        do = torch.randn_like(q)
        for name, kw in (("alibi", dict(alibi=True)), ("causal", {})):
            kern = fagen.compile(dim=D, causal=True, dtype="bf16", **kw)
            t = dict(slopes=torch.rand(H, device="cuda") * 0.1) if kw else {}
            o, lse = kern(q, k, v, return_lse=True, **t)
            has = "tensor_grads" in inspect.signature(kern.backward).parameters
            for tg in ((True, False) if kw and has else (None,)):
                extra = {} if tg is None else dict(tensor_grads=tg)
                ms = timer(lambda: kern.backward(q, k, v, o, lse, do, **extra, **t))
                out.append(f"{name}{'' if tg is None else ('+g' if tg else '-g')} d{D} N={N} {ms:.3f}")
print(" | ".join(out))
