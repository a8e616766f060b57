"""d64 causal forward, 16k tokens, heads x dim = 2048: fagen's kernel and SDPA's cuDNN kernel, twice each (ncu
profiles the second pair)."""
import sys
sys.path.insert(0, ".")
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import fagen
from fagen.tools import testing
N = int(sys.argv[1])
B, H = max(1, 16384 // N), 32
kern = fagen.compile(dim=64, dtype="bf16", causal=True)
q, k, v = testing.random_qkv(B, H, N, N, 64, "bf16")
for _ in range(2):
    kern(q, k, v)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
torch.cuda.synchronize()
print(kern.name)
