"""One forward case (argv: dim, causal 0/1, seqlen), 16k tokens, heads x dim = 2048: fagen's kernel and SDPA's cuDNN
kernel, twice each (ncu profiles the second pair)."""
import sys
sys.path.insert(0, ".")
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import fagen
from fagen.tools import testing
D, causal, N = int(sys.argv[1]), bool(int(sys.argv[2])), int(sys.argv[3])
B, H = max(1, 16384 // N), 2048 // D
kern = fagen.compile(dim=D, dtype="bf16", causal=causal)
q, k, v = testing.random_qkv(B, H, N, N, D, "bf16")
for _ in range(2):
    kern(q, k, v)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
torch.cuda.synchronize()
print(kern.name)
