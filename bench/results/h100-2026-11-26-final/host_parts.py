"""Host cost per call, by part (fagen forward, B=1 H=1 M=N=128 D=128 bf16), and a cProfile of the calls."""
import time, cProfile, pstats, io, os, tempfile
os.environ.setdefault("FAGEN_CACHE_DIR", tempfile.mkdtemp())
import torch, fagen
from fagen.runtime import kernel as K
from fagen.tools import testing
q, k, v = testing.random_qkv(1, 1, 128, 128, 128, "bf16")
kern = fagen.compile(128, dtype="bf16")
for _ in range(200): kern(q, k, v)
torch.cuda.synchronize()
entry = next(iter(kern._calls.values()))
stream = entry.stream()
ptrs = [K._ptr(x) for x in (q, k, v)]
o0 = entry.new_o()
def per(fn, n=5000):
    for _ in range(100): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
F = torch.nn.functional
parts = {
    "full call": lambda: kern(q, k, v),
    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
    "_call_key": lambda: K._call_key(q, k, v, None, None, {}),
    "new_o (torch.empty)": entry.new_o,
    "stream()": entry.stream,
    "_capturing": lambda: K._capturing(stream),
    "_ptr x5": lambda: [K._ptr(x) for x in (q, k, v, o0, o0)],
    "entry.run (fixed ptrs)": lambda: entry.run(ptrs[0], ptrs[1], ptrs[2], K._ptr(o0), K._ptr(entry.scratch_lse), 0.1, [], ()),
    "launch alone": lambda: entry.launch.function.launch(entry.device, stream, entry.grid, entry.launch.threads, entry.pack, entry.check_arch),
}
for name, fn in parts.items():
    print(f"{name:24s} {per(fn):6.2f} us", flush=True)
pr = cProfile.Profile(); pr.enable()
for _ in range(3000): kern(q, k, v)
torch.cuda.synchronize(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22); print(s.getvalue()[:6000])
