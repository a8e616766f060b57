import sys, time, faulthandler
faulthandler.dump_traceback_later(20, exit=True)
sys.path.insert(0, sys.argv[1])
import torch, fagen
from fagen.tools import testing
D = 128
kern = fagen.compile(dim=D, dtype="bf16", causal=True)
kern.backward_plan
for B, H, N in ((1, 1, 2048), (1, 16, 2048), (4, 16, 2048), (8, 16, 2048), (8, 16, 2048)):
    q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
    do = torch.randn_like(q)
    o, lse = kern(q, k, v, return_lse=True)
    t = time.time()
    for i in range(3):
        g = kern.backward(q, k, v, o, lse, do); torch.cuda.synchronize()
    print(sys.argv[1], B, H, N, f"{(time.time() - t) / 3 * 1e3:.2f} ms", flush=True)
