"""fagen: a compiler from small attention programs to FlashAttention CUDA kernels.

    import fagen
    attn = fagen.compile(dim=128, causal=True, dtype="bf16")
    o = attn(q, k, v)                      # CuPy arrays or PyTorch CUDA tensors, [B, H, N, D]
    o, lse = attn(q, k, v, return_lse=True)
"""
__version__ = "0.1.0"

from .build import CompileError  # noqa: E402
from .exprs import ExprError  # noqa: E402
from .fusion import FusionError, ProofError  # noqa: E402
from .ir import IRError, Program, parse_program  # noqa: E402
from .runtime.kernel import Kernel  # noqa: E402
from .pipeline import compile, lower  # noqa: E402
from .backend.spec import KernelSpec, SpecError  # noqa: E402
from .variants import alibi_slopes, eq, exp, log, maximum, minimum, ne, sigmoid, tanh, where  # noqa: E402

__all__ = ["compile", "lower", "Kernel", "KernelSpec", "Program", "parse_program", "CompileError", "ExprError",
           "FusionError", "IRError", "ProofError", "SpecError", "__version__",
           "where", "minimum", "maximum", "tanh", "exp", "log", "sigmoid", "eq", "ne", "alibi_slopes"]
