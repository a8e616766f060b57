"""Hopper forward ms against cuDNN in this process, for the fagen tree in argv[1] (tag argv[2]); argv[3] dims."""
import sys, tempfile, os
sys.path.insert(0, sys.argv[1])
os.environ.setdefault("FAGEN_CACHE_DIR", tempfile.mkdtemp())
import torch, fagen
from torch.nn.attention import SDPBackend, sdpa_kernel
from fagen.tools import testing, bench
assert os.path.realpath(fagen.__file__).startswith(os.path.realpath(sys.argv[1])), fagen.__file__
timer = bench._timer(torch)
dims = [int(x) for x in sys.argv[3].split(",")]
seqs = [int(x) for x in sys.argv[4].split(",")]
for D in dims:
    for causal in ((True,) if os.environ.get("CAUSAL_ONLY") else (False,) if os.environ.get("FULL_ONLY") else (True, False)):
        kern = fagen.compile(dim=D, dtype="bf16", causal=causal)
        chk = [testing.check_kernel(kern, B=1, H=2, M=m, N=n) for m, n in ((333, 517), (1000, 1000))]
        row = [f"{sys.argv[2]:5s} d{D} {'causal' if causal else 'full  '} [{kern.spec.name.split('wgmma_')[1]} {kern.resources.registers}r {kern.resources.stack_frame}B ok={all(c.ok for c in chk)}]"]
        for N in seqs:
            B, H = max(1, 16384 // N), 2048 // D
            torch.manual_seed(0)
            q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                cud = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
            ms = timer(lambda: kern(q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                cud2 = timer(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
            c = (cud + cud2) / 2
            row.append(f"{N//1024}k {ms*1000:.1f}us {c/ms:.3f}x")
        print(" | ".join(row), flush=True)
