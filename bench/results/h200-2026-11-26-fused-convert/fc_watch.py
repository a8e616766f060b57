import sys, time, faulthandler
faulthandler.dump_traceback_later(35, exit=True)
sys.path.insert(0, sys.argv[1])
import torch, fagen
from fagen.tools import testing
for D, kw in ((64, {}), (128, dict(causal=True))):
    kern = fagen.compile(dim=D, dtype="bf16", **kw)
    B, H, N = 8, 2048 // D, 2048
    q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
    do = torch.randn_like(q)
    o, lse = kern(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    print("forward done", D, flush=True)
    ts = []
    t0 = time.time()
    for i in range(30):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); kern.backward(q, k, v, o, lse, do); e.record()
        if i < 3: print("launched", i, flush=True)
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    print(sys.argv[1], D, kw, " ".join(f"{t:.2f}" for t in ts), f"wall {time.time() - t0:.1f}s", flush=True)
