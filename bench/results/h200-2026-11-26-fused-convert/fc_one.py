import sys, time, faulthandler
faulthandler.dump_traceback_later(25, exit=True)
sys.path.insert(0, sys.argv[1])
import torch, fagen
from fagen.tools import testing
D = int(sys.argv[2]); kw = dict(causal=True) if sys.argv[3] == "causal" else {}
kern = fagen.compile(dim=D, dtype="bf16", **kw)
B, H, N = 8, 2048 // D, 2048
q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
do = torch.randn_like(q)
o, lse = kern(q, k, v, return_lse=True)
kern.backward_plan  # compile first
g = kern.backward(q, k, v, o, lse, do); torch.cuda.synchronize()
ts = []
for i in range(20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); kern.backward(q, k, v, o, lse, do); e.record(); torch.cuda.synchronize()
    ts.append(s.elapsed_time(e))
ts.sort()
print(sys.argv[1:], f"median {ts[10]:.3f} min {ts[0]:.3f} max {ts[-1]:.3f}", flush=True)
