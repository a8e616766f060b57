"""fagen: a compiler from small attention programs to FlashAttention CUDA kernels.

    import fagen
    attn = fagen.compile(dim=128, causal=True, dtype="bf16")
    o = attn(q, k, v)                      # CuPy arrays or PyTorch CUDA tensors, [B, H, N, D]
    o, lse = attn(q, k, v, return_lse=True)
    o = fagen.attention(q, k, v, causal=True)  # compiled on first use; differentiable, torch.compile-able

`import fagen` imports nothing heavy: the public names below are looked up on first use (PEP 562), so SymPy,
networkx, Jinja, NumPy and CuPy load only where a step needs them (a cache hit in `compile` needs none).
"""

from __future__ import annotations

import importlib

from .version import __version__

# FlashAttention's drop-ins (fagen.flash_attn)
_FLASH_ATTN = (
    "flash_attn_func",
    "flash_attn_varlen_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
)
# public name -> the submodule that defines it
_EXPORTS = {
    "compile": "pipeline",
    "lower": "pipeline",
    "Kernel": "runtime.kernel",
    "KernelSpec": "backend.spec",
    "SpecError": "backend.spec",
    "Program": "ir",
    "parse_program": "ir",
    "IRError": "ir",
    "CompileError": "backend.build",
    "ExprError": "ir.exprs",
    "FusionError": "passes.fuse",
    "ProofError": "math.online_softmax",
    "attention": "api",
    "ring_attention": "ring",
    "ring_attention_varlen": "ring",
    **{name: "flash_attn" for name in _FLASH_ATTN},
    **{name: "flex" for name in ("flex_attention", "create_block_mask", "BlockMask", "scaled_dot_product_attention")},
    "flash_attn_with_kvcache": "kvcache",
    **{
        name: "ir.variants"
        for name in ("where", "minimum", "maximum", "tanh", "exp", "log", "sigmoid", "eq", "ne", "alibi_slopes")
    },
}
_SUBMODULES = (
    "api",
    "backend",
    "builders",
    "cache",
    "flash_attn",
    "flex",
    "hf",
    "ir",
    "kvcache",
    "loader",
    "math",
    "ops",
    "passes",
    "pipeline",
    "request",
    "resources",
    "ring",
    "runtime",
    "store",
    "tools",
    "version",
)

__all__ = [
    "compile",
    "lower",
    "attention",
    "ring_attention",
    "ring_attention_varlen",
    "flex_attention",
    "flash_attn_with_kvcache",
    "create_block_mask",
    "BlockMask",
    "scaled_dot_product_attention",
    *_FLASH_ATTN,
    "Kernel",
    "KernelSpec",
    "Program",
    "parse_program",
    "CompileError",
    "ExprError",
    "FusionError",
    "IRError",
    "ProofError",
    "SpecError",
    "__version__",
    "where",
    "minimum",
    "maximum",
    "tanh",
    "exp",
    "log",
    "sigmoid",
    "eq",
    "ne",
    "alibi_slopes",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    if name in _SUBMODULES:  # fagen.plan etc. without an explicit import
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
