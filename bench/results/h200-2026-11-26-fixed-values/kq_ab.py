"""ALiBi causal forward ms (and fwd+bwd), d64/d128, 2k/8k; argv[1] 'on' installs kq_edit for the dims in argv[2]."""
import sys, tempfile, os
sys.path.insert(0, ".")
os.environ["FAGEN_CACHE_DIR"] = tempfile.mkdtemp()
import torch, fagen
from fagen.backend import codegen
from fagen.tools import testing, bench
if sys.argv[1] == "on":
    sys.path.insert(0, "scratch")
    import kq_edit
    kq_edit.install(codegen, [int(d) for d in sys.argv[2].split(",")])
timer = bench._timer(torch)
out = []
for D in (64, 128):
    kern = fagen.compile(dim=D, dtype="bf16", causal=True, alibi=True)
    ref = None
    for N in (2048, 8192):
        B, H = max(1, 16384 // N), 2048 // D
        torch.manual_seed(0)
        q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
        t = dict(slopes=torch.rand(H, device="cuda") * 0.1)
        f = timer(lambda: kern(q, k, v, **t))
        out.append(f"d{D} {N // 1024}k {f:.4f}")
    out.append(f"[{kern.spec.name[-20:]} {kern.resources.registers}r {kern.resources.stack_frame}B]")
print(sys.argv[1], " | ".join(out), flush=True)
