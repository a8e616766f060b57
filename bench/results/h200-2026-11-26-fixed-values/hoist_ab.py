"""ALiBi causal forward / backward ms, d64/d128, 2k/8k; argv[1] 'on' installs hoist_edit's hand edits."""
import sys, tempfile, os
sys.path.insert(0, ".")
sys.path.insert(0, "scratch")
os.environ["FAGEN_CACHE_DIR"] = tempfile.mkdtemp()
import torch, fagen
from fagen.backend import codegen
from fagen.tools import testing, bench

if sys.argv[1] == "on":
    import hoist_edit
    hoist_edit.install(codegen)
timer = bench._timer(torch)
out, sums = [], []
for D in (64, 128):
    kern = fagen.compile(dim=D, dtype="bf16", causal=True, alibi=True)
    for N in (2048, 8192):
        B, H = max(1, 16384 // N), 2048 // D
        torch.manual_seed(0)
        q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
        do = torch.randn_like(q)
        t = dict(slopes=torch.rand(H, device="cuda") * 0.1)
        o, lse = kern(q, k, v, return_lse=True, **t)
        g = kern.backward(q, k, v, o, lse, do, tensor_grads=False, **t)
        sums.append(f"{float(o.double().abs().sum()):.6e}/{float(g[0].double().abs().sum()):.6e}/{float(g[1].double().abs().sum()):.6e}")
        f = timer(lambda: kern(q, k, v, **t))
        bw = timer(lambda: kern.backward(q, k, v, o, lse, do, tensor_grads=False, **t))
        out.append(f"d{D} {N // 1024}k {f:.3f}/{bw:.3f}")
print(sys.argv[1], " | ".join(out), flush=True)
print(sys.argv[1], "sums", " ".join(sums), flush=True)
